"""A synthesizer plugin: the built-in HF synthesizer, with one log record per call."""

from __future__ import annotations

from collections.abc import Sequence

from cartridges_sdk import Completion, SynthesisRequest, Synthesizer
from cartridges_sdk.hf import HFSynthesizer

from .log import LogOptions, record


class LoggingSynthesizer(Synthesizer):
    """Logs each batch of requests and each scoring call, then runs them on the HF synthesizer."""

    Options = LogOptions
    capabilities = HFSynthesizer.capabilities  # declared on the class, so the SDK checks settings before start-up

    def __init__(self, model, *, log_file: str | None = None):
        self.inner = HFSynthesizer.create(model)
        self.capabilities = self.inner.capabilities  # the instance may know more (here: the vocabulary size)
        self.log_file = log_file

    def identity(self):
        return self.inner.identity()  # the same model as the student, field by field

    def complete(self, requests: Sequence[SynthesisRequest]) -> list[Completion]:
        record(self.log_file, {"event": "complete", "requests": len(requests),
                               "groups": sorted({r.group for r in requests if r.group is not None}),
                               "prompt_tokens": sum(len(r.prompt_ids) for r in requests)})
        return self.inner.complete(requests)

    def score(self, prefix_ids, sequences, top_k):
        record(self.log_file, {"event": "score", "prefix_tokens": len(prefix_ids), "sequences": len(sequences)})
        return self.inner.score(prefix_ids, sequences, top_k)
