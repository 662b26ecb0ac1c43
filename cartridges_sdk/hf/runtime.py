"""The built-in Hugging Face runtime: each request's cartridges become its rows' prefix in a transformers KV cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

import attrs

from ..checks import at_least_one
from ..kv import concat_layers, refuse_foreign
from ..plugins import Completion, GenerationParams, GenerationRequest, Runtime, text_deltas
from .decode import Layers, decode, row_completion

if TYPE_CHECKING:
    from ..cartridge import Cartridge
    from ..models import LM


@attrs.frozen
class HFRuntimeOptions:
    # how many distinct cartridges stay installed (on the model's device and dtype) before the least recently used goes
    max_installed: int = attrs.field(default=64, validator=at_least_one)


class HFRuntime(Runtime):
    """Runs cartridges on the transformers model inside an `LM`.

    Requests with equal generation settings are decoded as one batch, whatever their cartridges: each row gets its
    own prefix, and the attention mask hides the padding, so every answer equals the one asked alone.
    """

    Options = HFRuntimeOptions

    def __init__(self, lm: LM, *, max_installed: int = 64):
        self.lm = lm
        self.max_installed = max_installed
        self._installed: OrderedDict[str, Layers] = OrderedDict()
        self.installs = 0  # cartridges moved into the model's device and dtype (each content once while it stays)

    def _install(self, cartridge: Cartridge) -> Layers:
        key = cartridge.fingerprint
        if key in self._installed:
            self._installed.move_to_end(key)
        else:
            self._installed[key] = concat_layers(self.lm, [cartridge])
            self.installs += 1
            while len(self._installed) > self.max_installed:
                self._installed.popitem(last=False)
        return self._installed[key]

    def _prefix(self, request: GenerationRequest) -> Layers | None:
        parts = [self._install(c) for c in request.cartridges]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        import torch

        return [(torch.cat([p[i][0] for p in parts], dim=1), torch.cat([p[i][1] for p in parts], dim=1))
                for i in range(len(parts[0]))]

    def _prompt(self, request: GenerationRequest) -> list[int]:
        """Plain prefix tokens, then the chat turn by the one rule for what follows a cartridge or a document."""
        after = bool(request.cartridges or request.prefix_ids)
        return list(request.prefix_ids) + self.lm.chat_ids(request.messages, after_cartridge=after)

    def _check(self, requests: Sequence[GenerationRequest]) -> list[list[int]]:
        """The whole batch, before any decoding: every cartridge fits the model, every request fits the context.
        Returns each request's prompt ids, rendered once here for the check and for decoding."""
        refuse_foreign(self.lm, [c for r in requests for c in r.cartridges])
        prompts = [self._prompt(r) for r in requests]
        for i, (r, prompt) in enumerate(zip(requests, prompts)):
            p = sum(c.num_tokens for c in r.cartridges)
            self.lm.check_context(
                p + len(prompt) + r.params.max_new_tokens,
                f"Request {i} ({p} cartridge tokens + {len(prompt)} prompt tokens + "
                f"max_new_tokens={r.params.max_new_tokens})",
                "shorten the conversation, lower max_new_tokens or use a smaller cartridge",
            )
        return prompts

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        requests = list(requests)
        prompts = self._check(requests)
        out: list[Completion | None] = [None] * len(requests)
        batches: dict[GenerationParams, list[int]] = {}
        for i, r in enumerate(requests):
            batches.setdefault(r.params, []).append(i)
        for params, idx in batches.items():
            for state in decode(self.lm, [self._prefix(requests[i]) for i in idx], [prompts[i] for i in idx], params,
                                top_logprobs=params.top_logprobs):
                pass
            for row, i in enumerate(idx):
                out[i] = row_completion(self.lm, state, row, stop=params.stop)
        return out  # type: ignore[return-value]

    def stream(self, request: GenerationRequest) -> Generator[str, None, Completion]:
        (prompt,) = self._check([request])
        return (yield from text_deltas((row_completion(self.lm, state, 0, stop=request.params.stop),
                                        state.reasons[0] is not None)
                                       for state in decode(self.lm, [self._prefix(request)], [prompt], request.params)))

    def close(self) -> None:
        self._installed.clear()
