"""An append-only audit log of the server's requests: one JSON line each, saying who asked (the key's id and the
request's ``user``), what for (path, model, the cartridges that answered), and how it ended (HTTP status, and the
error of a stream that failed after it began). The question's text is written only when asked for (it may hold
what the log must not). Lines are appended with ``O_APPEND`` and flushed to disk one by one, so a crash loses the
lines of the requests still in flight and never rewrites what is there. A line that cannot be written (a full disk)
makes the server refuse requests (503) until one can: no request goes unlogged."""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any


# how much of a name the log keeps: a longer one is cut with a mark that says so, never silently
NAME_CHARS = 200


def shown(name: str) -> str:
    """`name` as the log keeps it: whole, or cut to `NAME_CHARS` with its full length said."""
    return name if len(name) <= NAME_CHARS else f"{name[:NAME_CHARS]}...[cut: {len(name)} characters]"


class AuditLog:
    """Appends request records to `path` (created if missing, never truncated)."""

    def __init__(self, path: str | os.PathLike, *, questions: bool = False):
        self.path = Path(path)
        self.questions = questions
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._lock = threading.Lock()
        self.broken: str | None = None  # why the last line could not be written (a full disk), if it could not

    def write(self, record: dict[str, Any]) -> None:
        line = {"time": datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"), **record}
        if not self.questions:
            line.pop("question", None)
        # ASCII JSON: line and paragraph separators (U+2028, U+2029, U+0085) and bidi controls (U+202E) that a
        # request carries are written escaped, so every reader, one splitting on Unicode line breaks too, sees one line
        data = (json.dumps(line, ensure_ascii=True) + "\n").encode()
        with self._lock:
            try:
                os.write(self._fd, data)  # one write of the whole line: appends never interleave
                os.fsync(self._fd)
                self.broken = None
            except OSError as err:  # the server refuses requests (503) until a line is written again
                self.broken = f"{type(err).__name__}: {err}"
                logging.getLogger("cartridges_sdk.serve").error("The audit log %s cannot be written: %s",
                                                                self.path, err)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
