"""A runtime plugin with an engine of its own (`engine.py`): what every runtime does, in the order it does it.

1. Check the whole batch before any compute: refuse cartridges made for another model (`refuse_foreign`), render
   each prompt by the one prompt rule (`LM.prompt_ids`), and check that each request fits the context
   (`check_fits`), so a bad request fails the batch before the engine has spent anything on it.
2. Per request: install its cartridges into the engine's cache (each once, keyed on its content fingerprint), one
   after another; prefill the prompt at positions ``p..``; decode token by token with the SDK's sampler
   (`sample_next`) and stop rule (`ends_answer`); answer with `Completion.from_ids` (with top-k log-probs, before
   temperature, when asked).

Requests are answered one after another (simplicity over speed); each gets its own cache, so a stream paused
half-way and a `generate` in between never see each other's tokens.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence

import torch

from cartridges_sdk import Completion, ConfigError, GenerationParams, GenerationRequest, Runtime
from cartridges_sdk.kit import (LM, Recent, check_fits, concat_layers, ends_answer, refuse_foreign, sample_next,
                                text_deltas)

from .engine import Engine, KVCache
from .log import LogOptions, record

MAX_INSTALLED = 64  # distinct cartridges kept on the engine's device and dtype


def _describe(request: GenerationRequest) -> dict:
    # fingerprints name cartridges by content, without their (private) corpus
    return {"cartridges": [c.fingerprint[:12] for c in request.cartridges], "turns": len(request.messages),
            "max_new_tokens": request.params.max_new_tokens}


class LoggingRuntime(Runtime):
    """Answers requests on the example engine, after each request's cartridges; logs each request (cartridge
    fingerprints, turns, token budget)."""

    Options = LogOptions  # the options `create` accepts; anything else is refused by name

    def __init__(self, model: LM, *, log_file: str | None = None):
        super().__init__(model, log_file=log_file)  # keeps self.lm and the validated self.options
        self.engine = Engine(model.model)  # reads the weights once; refuses a model it does not implement
        self.installed: Recent = Recent(MAX_INSTALLED)  # cartridge fingerprint -> its per-layer KV, ready to copy

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        requests = list(requests)
        prompts = self._check(requests)
        answers = []
        for request, prompt in zip(requests, prompts):
            record(self.options.log_file, {"event": "generate", **_describe(request)})
            for completion, _ in self._decode(request, prompt):
                pass
            answers.append(completion)
        return answers

    def stream(self, request: GenerationRequest) -> Generator[str, None, Completion]:
        (prompt,) = self._check([request])
        record(self.options.log_file, {"event": "stream", **_describe(request)})
        return (yield from text_deltas(self._decode(request, prompt)))

    def close(self) -> None:
        self.installed.clear()

    def _check(self, requests: Sequence[GenerationRequest]) -> list[list[int]]:
        """Every rule that can refuse a request, for the whole batch, before any compute; the prompts' ids."""
        refuse_foreign(self.lm, [c for r in requests for c in r.cartridges])
        prompts = [self.lm.prompt_ids(r.messages, prefix_ids=r.prefix_ids, after_cartridge=bool(r.cartridges))
                   for r in requests]
        limit, vocab = self.lm.max_context, self.engine.arch["vocab_size"]
        for i, (r, prompt) in enumerate(zip(requests, prompts)):
            check_fits(r, len(prompt), limit, f"the {limit}-token context of {self.lm.name!r}", index=i)
            if r.params.top_logprobs > vocab:
                raise ConfigError(f"Request {i} asks for top_logprobs={r.params.top_logprobs}, more than the "
                                  f"model's {vocab}-token vocabulary.")
        return prompts

    def _decode(self, request: GenerationRequest, prompt: list[int]) -> Iterator[tuple[Completion, bool]]:
        p = sum(c.num_tokens for c in request.cartridges)
        cache = self.engine.new_cache(p + len(prompt) + request.params.max_new_tokens)
        for c in request.cartridges:  # several are used one after another
            cache.install(self.installed.get(c.fingerprint, lambda c=c: concat_layers(self.lm, [c])))
        return decode(self.lm, self.engine, cache, prompt, request.params, eos=self.lm.eos_token_ids)


def decode(lm: LM, engine: Engine, cache: KVCache, prompt: Sequence[int], params: GenerationParams, *,
           eos: set[int], stop_ids: Sequence[int] = ()) -> Iterator[tuple[Completion, bool]]:
    """Prefill `prompt` after what `cache` holds, then sample token by token: the answer so far after each token,
    and whether it has ended (at a token in `eos`, at a ``params.stop`` string, or after ``max_new_tokens``)."""
    generator = torch.Generator(device=engine.device)
    generator.manual_seed(params.seed if params.seed is not None else torch.seed())
    k = params.top_logprobs
    ids: list[int] = []
    top: list[torch.return_types.topk] = []
    logits = engine.forward(list(prompt), cache)
    for n in range(params.max_new_tokens):
        ids.append(int(sample_next(logits[None], params, generator)[0]))
        if k:
            top.append(torch.topk(logits.log_softmax(-1), k))  # the model's own log-probs: before temperature
        reason = "stop" if ends_answer(lm, ids, params.stop, eos) else "length" if n + 1 == params.max_new_tokens \
            else None
        arrays = {}
        if k and reason:  # [tokens, k] each
            arrays = {"top_ids": torch.stack([t.indices for t in top]).cpu().numpy(),
                      "top_logprobs": torch.stack([t.values for t in top]).cpu().numpy()}
        yield Completion.from_ids(lm, ids, reason, stop=params.stop, stop_ids=stop_ids, **arrays), reason is not None
        if reason:
            return
        logits = engine.forward(ids[-1:], cache)
