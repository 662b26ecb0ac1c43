"""An ASGI app (e.g. `cartridges_sdk.serve.server.create_app`'s) run by uvicorn in a thread of this process, for
tests, benchmarks and apps that embed a server."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..net import free_port


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """An ASGI app (e.g. `server.create_app`'s) served by uvicorn on 127.0.0.1 in a thread of this process, for
    tests and benchmarks; yields its ``http://127.0.0.1:PORT/v1`` base URL and stops it on exit."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not server.started:
        server.should_exit = True
        raise RuntimeError("uvicorn did not start within 60 s (see its log above).")
    try:
        yield f"http://127.0.0.1:{server.config.port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
