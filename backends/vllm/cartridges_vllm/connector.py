"""A vLLM KV connector that serves cartridges from the paged KV cache, loaded by module path into vLLM's engine.

A cartridge request's prompt starts with `p` placeholder ids and names its cartridge in ``kv_transfer_params``.
Scheduler side: the connector reports those `p` tokens as already computed (less any the engine's own prefix cache
still holds for this cartridge, which a per-cartridge ``cache_salt`` keeps apart from other cartridges) and notes the
slots vLLM allocated for them. Worker side: before the forward pass it writes the cartridge's keys and values into
those slots through each attention layer's own cache writer (``impl.do_kv_cache_update``), so every attention
backend's layout is vLLM's business. Keys are post-RoPE in the rotate-half (neox) pairing, as vLLM stores them for
Llama and Qwen2. Cartridge files come from a store folder the runtime writes, named by content fingerprint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from cartridges_sdk.kit import Recent, tensor_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

PARAMS = "cartridge"  # kv_transfer_params: {"cartridge": fingerprint, "cartridge_tokens": p}
LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass
class Load:
    fingerprint: str
    start: int  # first cartridge position to write (earlier ones are in the engine's prefix cache)
    end: int  # the cartridge's length p
    slots: torch.Tensor  # cache slots of positions start..end-1


@dataclass
class CartridgeMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


class CartridgeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.store = Path(self._kv_transfer_config.get_from_extra_config("store", ""))
        self.pending: dict[str, tuple[Request, int]] = {}  # scheduler: request id -> (request, first position to load)
        self.tensors: Recent[dict[str, torch.Tensor]] = Recent(8)  # worker: recently used cartridges

    # -- scheduler side ---------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        p = (request.kv_transfer_params or {}).get("cartridge_tokens", 0)
        return (max(p - num_computed_tokens, 0), False)

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            p = request.kv_transfer_params["cartridge_tokens"]
            self.pending[request.request_id] = (request, p - num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Slots to fill this step: for new requests, and for requests resumed after preemption (their blocks were
        freed, and vLLM again counts the cartridge's tokens as computed)."""
        meta = CartridgeMetadata()
        scheduled = [(new.req_id, new.block_ids) for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        scheduled += [(req_id, cached.new_block_ids[i]) for i, req_id in enumerate(cached.req_ids)
                      if req_id in resumed and cached.new_block_ids[i] is not None]
        for req_id, block_ids in scheduled:
            if req_id not in self.pending:
                continue
            request, start = self.pending.pop(req_id)
            p = request.kv_transfer_params["cartridge_tokens"]
            positions = torch.arange(start, p)
            blocks = torch.tensor(block_ids[0], dtype=torch.long)
            slots = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
            meta.loads.append(Load(request.kv_transfer_params[PARAMS], start, p, slots))
        return meta

    # -- worker side ------------------------------------------------------------------------------------------
    def _cartridge(self, fingerprint: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return self.tensors.get(fingerprint, lambda: load_file(str(self.store / f"{fingerprint}.safetensors")))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, CartridgeMetadata):
            return
        for load in meta.loads:
            tensors = self._cartridge(load.fingerprint)
            for name, layer in forward_context.no_compile_layers.items():
                kv_cache = getattr(layer, "kv_cache", None)
                match = LAYER_INDEX.search(name)
                if kv_cache is None or match is None or not hasattr(layer, "impl"):
                    continue
                if isinstance(kv_cache, (list, tuple)):
                    kv_cache = kv_cache[0]
                if not hasattr(layer.impl, "do_kv_cache_update"):
                    raise RuntimeError(f"Attention backend {type(layer.impl).__name__} has no do_kv_cache_update; the "
                                       "cartridge connector cannot write into its cache.")
                i = int(match.group(1))
                keys = tensors[tensor_name(i, "keys")][:, load.start : load.end].transpose(0, 1)  # [tokens, heads, dim]
                values = tensors[tensor_name(i, "values")][:, load.start : load.end].transpose(0, 1)
                layer.impl.do_kv_cache_update(
                    layer, keys.to(kv_cache.device, kv_cache.dtype).contiguous(),
                    values.to(kv_cache.device, kv_cache.dtype).contiguous(), kv_cache, load.slots.to(kv_cache.device),
                )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in `start_load_kv`, before the forward pass."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """A consumer: it never saves."""

    def wait_for_save(self) -> None:
        """A consumer: it never saves."""
