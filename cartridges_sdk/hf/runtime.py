"""The built-in Hugging Face runtime: each request's cartridges become its rows' prefix in a transformers KV cache."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import attrs

from ..kit import (at_least_one, check_fits, Completion, concat_layers, ContinuousRuntime, GenerationParams,
    GenerationRequest, join_layers, Layers, Recent, refuse_foreign)
from .decode import DecodeState, decode, row_completion

if TYPE_CHECKING:
    from ..kit import LM, KVPrefix


@attrs.frozen
class HFRuntimeOptions:
    # how many distinct cartridges stay installed (on the model's device and dtype) before the least recently used goes
    max_installed: int = attrs.field(default=64, validator=at_least_one)


@attrs.define
class _Decoding:
    """A batch decode under way for `add`/`step`: its steps, the handle of each row, and the rows still reported."""

    steps: Iterator[DecodeState]
    handles: list[str]
    params: GenerationParams
    open: set[str]
    state: DecodeState | None = None  # after the first step


class HFRuntime(ContinuousRuntime):
    """Runs cartridges on the transformers model inside an `LM`.

    Requests with equal generation settings are decoded as one batch, whatever their cartridges: each row gets its
    own prefix, and the attention mask hides the padding, so every answer equals the one asked alone. Through
    `add`/`step` (how `cartridges serve` drives it), the requests added while a batch decodes start together when it
    ends: a transformers batch cannot take new rows mid-way, but streams share it with the rest.
    """

    Options = HFRuntimeOptions
    lm: LM  # an `LM`, all of it (`Backend` names only what every backend's model has)

    def __init__(self, lm: LM, *, max_installed: int = 64):
        super().__init__(lm, max_installed=max_installed)
        self._installed: Recent[Layers] = Recent(self.options.max_installed)  # on the model's device and dtype, by content
        self._handles = itertools.count()
        self._waiting: OrderedDict[str, tuple[GenerationRequest, list[int]]] = OrderedDict()  # added, not started
        self._running: _Decoding | None = None
        self.widest_batch = 0  # the most requests add/step decoded together so far

    @property
    def max_installed(self) -> int:
        """How many distinct cartridges stay installed before the least recently used goes (the option)."""
        return self.options.max_installed

    def _install(self, cartridge: KVPrefix) -> Layers:
        return self._installed.get(cartridge.fingerprint, lambda: concat_layers(self.lm, [cartridge]))

    def _prefix(self, request: GenerationRequest) -> Layers | None:
        parts = [self._install(c) for c in request.cartridges]
        return join_layers(parts) if parts else None

    @property
    def installs(self) -> int:
        """Cartridges moved into the model's device and dtype so far (each content once while it stays)."""
        return self._installed.made

    def _prompt(self, request: GenerationRequest) -> list[int]:
        return self.lm.prompt_ids(request.messages, prefix_ids=request.prefix_ids, after_cartridge=bool(request.cartridges))

    def _check(self, requests: Sequence[GenerationRequest]) -> list[list[int]]:
        """The whole batch, before any decoding: every cartridge fits the model, every request fits the context.
        Returns each request's prompt ids, rendered once here for the check and for decoding."""
        refuse_foreign(self.lm, [c for r in requests for c in r.cartridges])
        prompts = [self._prompt(r) for r in requests]
        limit = self.lm.max_context
        for i, (r, prompt) in enumerate(zip(requests, prompts)):
            check_fits(r, len(prompt), limit, f"the {limit}-token context of {self.lm.name!r}", index=i)
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

    def add(self, request: GenerationRequest) -> str:
        (prompt,) = self._check([request])
        handle = f"hf-{next(self._handles)}"
        self._waiting[handle] = (request, prompt)
        return handle

    def step(self) -> list[tuple[str, Completion, bool]]:
        if self._running is None:
            if not self._waiting:
                return []
            params = next(iter(self._waiting.values()))[0].params  # the oldest request's settings, and all that share them
            handles = [h for h, (r, _) in self._waiting.items() if r.params == params]
            prefixes = [self._prefix(self._waiting[h][0]) for h in handles]  # may fail: they stay waiting then
            prompts = [self._waiting.pop(h)[1] for h in handles]
            steps = decode(self.lm, prefixes, prompts, params, top_logprobs=params.top_logprobs)
            self._running = _Decoding(steps, handles, params, set(handles))
            self.widest_batch = max(self.widest_batch, len(handles))
        run = self._running
        try:
            state = run.state = next(run.steps)
        except BaseException:
            self._running = None  # a batch that failed is over; its requests are the caller's to drop
            raise
        progress = []
        for row, handle in enumerate(run.handles):
            if handle in run.open:
                ended = state.reasons[row] is not None
                progress.append((handle, row_completion(self.lm, state, row, stop=run.params.stop), ended))
                if ended:
                    run.open.discard(handle)
        if not run.open:
            self._finish()
        return progress

    def abort(self, handle: str) -> None:
        self._waiting.pop(handle, None)
        run = self._running
        if run is not None and handle in run.open:
            run.open.discard(handle)
            if not run.open:  # nobody waits for this batch any more: stop decoding it
                self._finish()
            elif run.state is not None:  # the decode skips a row that has a reason, and soon drops it
                run.state.reasons[run.handles.index(handle)] = "aborted"

    def _finish(self) -> None:
        self._running.steps.close()  # type: ignore[union-attr]
        self._running = None

    def close(self) -> None:
        if self._running is not None:
            self._finish()
        self._waiting.clear()
        self._installed.clear()
