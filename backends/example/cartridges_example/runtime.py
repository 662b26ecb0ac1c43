"""A runtime plugin: the built-in HF runtime, with one log record per request."""

from __future__ import annotations

from collections.abc import Generator, Sequence

from cartridges_sdk import Completion, GenerationRequest, Runtime
from cartridges_sdk.hf import HFRuntime

from .log import LogOptions, record


def _describe(request: GenerationRequest) -> dict:
    # fingerprints name cartridges by content, without their (private) corpus
    return {"cartridges": [c.fingerprint[:12] for c in request.cartridges], "turns": len(request.messages),
            "max_new_tokens": request.params.max_new_tokens}


class LoggingRuntime(Runtime):
    """Logs each request (cartridge fingerprints, turns, token budget), then answers with the HF runtime."""

    Options = LogOptions  # the options `create` accepts; anything else is refused by name

    def __init__(self, model, *, log_file: str | None = None):
        self.inner = HFRuntime.create(model)
        self.log_file = log_file

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        for r in requests:
            record(self.log_file, {"event": "generate", **_describe(r)})
        return self.inner.generate(requests)

    def stream(self, request: GenerationRequest) -> Generator[str, None, Completion]:
        record(self.log_file, {"event": "stream", **_describe(request)})
        return (yield from self.inner.stream(request))

    def close(self) -> None:
        self.inner.close()
