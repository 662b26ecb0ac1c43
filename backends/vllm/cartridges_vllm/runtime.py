"""Serving cartridges in vLLM: each request's cartridges become the first `p` positions of its sequence in vLLM's
own paged KV cache, written by `connector.CartridgeConnector`, and many users' cartridges share one batch."""

from __future__ import annotations

import itertools
import tempfile
from collections import Counter, OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cartridges_sdk import BackendError, Cartridge, Completion, GenerationRequest, UnsupportedModelError
from cartridges_sdk.kit import (atomic_write, check_fits, ContinuousRuntime, layer_tensors, Recent, refuse_foreign,
    ROTATE_HALF)

from . import engine
from .engine import EngineOptions

PLACEHOLDER_ID = 0  # the ids the cartridge's positions carry in the prompt; the connector's KV replaces their work
# families whose vLLM attention stores keys post-RoPE in the neox (rotate-half) pairing, as cartridges hold them
FAMILIES = ("llama", "qwen2")
# cartridge files kept in the store once no request in the engine reads them: a composition with passages read apart
# is new for every question (1-3 MB each with the 0.5B), so the store would otherwise grow for as long as it serves
KEPT_FILES = 64


class VLLMRuntime(ContinuousRuntime):
    """Answers heterogeneous batches in one vLLM engine. A cartridge (or a composition) is written to the store once,
    by content fingerprint, and keyed in vLLM's prefix cache by a ``cache_salt`` of the same fingerprint. The store
    keeps the `kept` most recently used files no request in the engine reads (a preempted request reads its file
    again when it resumes, so a live request's file always stays); older ones are deleted."""

    Options = EngineOptions

    def __init__(self, model, **options: Any):
        from vllm.config import KVTransferConfig

        family = model.identity.architecture.get("model_type")
        if family not in FAMILIES:
            raise UnsupportedModelError(
                f"The vLLM runtime writes cartridges for {FAMILIES} models (post-RoPE neox keys); {model.name!r} is "
                f"{family!r}. Serve it with runtime='hf'."
            )
        super().__init__(model, **options)
        self._store = tempfile.TemporaryDirectory(prefix="cartridges-vllm-")
        self.installs = 0  # cartridge contents written to the store (each once while it stays there)
        self.kept = KEPT_FILES
        self._files: OrderedDict[str, None] = OrderedDict()  # fingerprints in the store, least recently used first
        self._reading: Counter[str] = Counter()  # live requests per fingerprint: their files must stay
        self._ids = itertools.count()  # request ids of our own, unique in the engine
        self._live: dict[str, Any] = {}  # handle -> (generation params, cartridge fingerprint) of each live request
        self._composed: Recent[Cartridge] = Recent(64)  # recent compositions
        connector = KVTransferConfig(
            kv_connector="CartridgeConnector", kv_connector_module_path="cartridges_vllm.connector",
            kv_role="kv_consumer", kv_connector_extra_config={"store": self._store.name},
        )
        self.llm = engine.start(model, self.options, kv_transfer_config=connector)
        self.max_len = self.llm.llm_engine.model_config.max_model_len

    def _install(self, cartridges: Sequence[Cartridge]) -> Cartridge:
        """The request's cartridges as one (composed in order, rotate-half keys), written to the store once."""
        # vLLM's neox RoPE for Llama and Qwen2 pairs dims as rotate-half; composing (and hashing the result) happens
        # once per combination, not once per request; a single cartridge is the store's to keep or drop
        if len(cartridges) == 1:
            whole = cartridges[0].in_key_pairing(ROTATE_HALF)
        else:
            whole = self._composed.get(tuple(c.fingerprint for c in cartridges),
                                       lambda: Cartridge.compose(list(cartridges)).in_key_pairing(ROTATE_HALF))
        path = Path(self._store.name) / f"{whole.fingerprint}.safetensors"
        if not path.exists():
            from safetensors.torch import save_file

            tensors = layer_tensors(whole.keys, whole.values)
            atomic_write(path, lambda tmp: save_file(tensors, tmp))
            self.installs += 1
        self._files[whole.fingerprint] = None
        self._files.move_to_end(whole.fingerprint)
        return whole

    def _forget(self) -> None:
        """Delete the least recently used files beyond `kept` that no live request reads."""
        for fingerprint in [f for f in self._files if not self._reading[f]][:max(len(self._files) - self.kept, 0)]:
            (Path(self._store.name) / f"{fingerprint}.safetensors").unlink(missing_ok=True)
            del self._files[fingerprint]

    def _done(self, handle: str) -> None:
        _, fingerprint = self._live.pop(handle)
        if fingerprint is not None:
            self._reading[fingerprint] -= 1
            if not self._reading[fingerprint]:
                del self._reading[fingerprint]
                self._forget()

    def _prompt(self, request: GenerationRequest) -> tuple[dict[str, Any], dict[str, Any]]:
        from vllm.inputs import TokensPrompt

        chat = self.lm.prompt_ids(request.messages, prefix_ids=request.prefix_ids, after_cartridge=bool(request.cartridges))
        # vLLM would cut the answer short at its limit without saying so
        check_fits(request, len(chat), self.max_len, f"the engine's max_model_len={self.max_len}",
                   fix=", or start the runtime with a larger max_model_len")
        if not request.cartridges:
            return TokensPrompt(prompt_token_ids=chat), {}
        whole = self._install(request.cartridges)
        prompt = TokensPrompt(prompt_token_ids=[PLACEHOLDER_ID] * whole.num_tokens + chat, cache_salt=whole.fingerprint)
        return prompt, {"kv_transfer_params": {"cartridge": whole.fingerprint, "cartridge_tokens": whole.num_tokens}}

    def add(self, request: GenerationRequest) -> str:
        """Queue the request in vLLM's engine (its cartridges written to the store first); refused here if its
        cartridges are for another model or it does not fit the engine's length limit."""
        from vllm import SamplingParams

        refuse_foreign(self.lm, list(request.cartridges))
        prompt, extra = self._prompt(request)
        p = request.params
        params = SamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or -1, seed=p.seed, max_tokens=p.max_new_tokens,
            stop=list(p.stop) or None, stop_token_ids=sorted(self.lm.eos_token_ids), logprobs=p.top_logprobs or None,
            detokenize=False, extra_args=extra or None,
        )
        handle = f"cartridges-{next(self._ids)}"  # outputs and aborts use this id (add_request returns another)
        fingerprint = prompt.get("cache_salt")
        if fingerprint is not None:
            self._reading[fingerprint] += 1
        self._live[handle] = (request.params, fingerprint)
        try:
            self.llm.llm_engine.add_request(handle, prompt, params)
        except BaseException:
            self._done(handle)  # not in the engine: its file need not stay for it
            raise
        self._forget()
        return handle

    def step(self) -> list[tuple[str, Completion, bool]]:
        core = self.llm.llm_engine
        if not core.has_unfinished_requests():
            if self._live:
                lost, self._live = len(self._live), {}
                self._reading.clear()
                raise BackendError(f"vLLM's engine holds none of the {lost} requests still awaited.")
            return []
        progress = []
        for out in core.step():
            live = self._live.get(out.request_id)
            if live is None:  # one aborted meanwhile, whose last output still arrived
                continue
            params = live[0]
            if out.finished:
                self._done(out.request_id)
            progress.append((out.request_id, engine.completion(self.lm, out.outputs[0], sorted(self.lm.eos_token_ids),
                                                               params.top_logprobs, params.stop), out.finished))
        return progress

    def abort(self, handle: str) -> None:
        if handle in self._live:
            self._done(handle)
            self.llm.llm_engine.abort_request([handle])

    def close(self) -> None:
        if self.llm is not None:
            engine.stop(self.llm)
            self.llm = None
        self._store.cleanup()
