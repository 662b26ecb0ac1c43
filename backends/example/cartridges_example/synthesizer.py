"""A synthesizer plugin on the example engine (`engine.py`): it continues each request's prompt ids, and scores
given sequences after a shared prefix; one log record per call."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cartridges_sdk import Completion, GenerationParams, SynthesisRequest, Synthesizer, SynthesizerCapabilities
from cartridges_sdk.kit import LM

from .engine import Engine
from .log import LogOptions, record
from .runtime import decode


class LoggingSynthesizer(Synthesizer):
    """Samples each request alone on the example engine (no prefix reuse: simplicity over speed)."""

    Options = LogOptions
    # declared on the class, so the SDK checks settings before the engine starts
    capabilities = SynthesizerCapabilities(max_top_logprobs=20, score=True, prefix_reuse=False)

    def __init__(self, model: LM, *, log_file: str | None = None):
        super().__init__(model, log_file=log_file)
        self.engine = Engine(model.model)

    def identity(self):
        return self.lm.identity  # the student's own weights, so its identity field by field

    def complete(self, requests: Sequence[SynthesisRequest]) -> list[Completion]:
        record(self.options.log_file, {"event": "complete", "requests": len(requests),
                               "groups": sorted({r.group for r in requests if r.group is not None}),
                               "prompt_tokens": sum(len(r.prompt_ids) for r in requests)})
        answers = []
        for r in requests:
            params = GenerationParams(max_new_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed,
                                      top_logprobs=r.top_logprobs)
            cache = self.engine.new_cache(len(r.prompt_ids) + r.max_tokens)
            eos = set(r.stop_ids) or self.lm.eos_token_ids  # the request's stop ids (kept as the last token)
            for completion, _ in decode(self.lm, self.engine, cache, r.prompt_ids, params, eos=eos,
                                        stop_ids=r.stop_ids):
                pass
            answers.append(completion)
        return answers

    def score(self, prefix_ids, sequences, top_k):
        record(self.options.log_file, {"event": "score", "prefix_tokens": len(prefix_ids), "sequences": len(sequences)})
        cache = self.engine.new_cache(len(prefix_ids) + max((len(s) for s in sequences), default=0))
        if prefix_ids:
            self.engine.forward(list(prefix_ids), cache)  # the prefix once, for every sequence
        p = cache.length
        out = []
        for seq in sequences:
            cache.length = p  # rewind to the prefix: the previous sequence's slots are written over
            logp = self.engine.forward(list(seq), cache, all_logits=True)[:-1].log_softmax(-1)
            top = torch.topk(logp, top_k, dim=-1)  # predicting tokens 1.. of the sequence
            out.append((top.indices.cpu().numpy(), top.values.cpu().numpy()))
        return out
