"""KV-cache plumbing shared by the HF runtime, scoring and training: cartridges -> a transformers cache."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .errors import IncompatibleCartridgeError
from .rope import ROTATE_HALF

if TYPE_CHECKING:
    from .cartridge import Cartridge
    from .lm import LM


def refuse_foreign(lm: LM, cartridges: Sequence[Cartridge]) -> None:
    """Raise `IncompatibleCartridgeError`, naming both models, for the first cartridge made for another model."""
    for c in cartridges:
        problem = c.misfit(lm)
        if problem:
            raise IncompatibleCartridgeError(
                f"Cartridge for model {c.meta.model.name!r} cannot run on model {lm.name!r} ({problem}). "
                f"Load it with the model it was made for."
            )


def concat_layers(lm: LM, cartridges: Sequence[Cartridge]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer keys/values of several cartridges placed one after another, on the model's device and dtype."""
    refuse_foreign(lm, cartridges)
    cartridges = [c.in_key_pairing(ROTATE_HALF) for c in cartridges]  # the layout transformers' RoPE writes
    layers = []
    for i in range(lm.num_layers):
        ks = [c.keys[i].to(lm.device, lm.dtype) for c in cartridges]
        vs = [c.values[i].to(lm.device, lm.dtype) for c in cartridges]
        layers.append((torch.cat(ks, dim=1) if len(ks) > 1 else ks[0], torch.cat(vs, dim=1) if len(vs) > 1 else vs[0]))
    return layers


def prefix_cache(lm: LM, cartridges: Sequence[Cartridge], batch_size: int, *, capacity: int | None = None):
    """A fresh transformers cache holding `cartridges` for `batch_size` rows, and its length (0 and None if empty).

    A new cache is built per call because transformers appends to caches in place. With `capacity` (total tokens
    expected, for decoding without gradients) full-attention layers get room to grow in place, instead of
    transformers re-concatenating the whole cache at every step, which dominated decode time.
    """
    if not cartridges:  # the model makes its own cache
        return None, 0
    layers = concat_layers(lm, cartridges)
    data = [(k[None].expand(batch_size, -1, -1, -1), v[None].expand(batch_size, -1, -1, -1)) for k, v in layers]
    return _cache(lm, data, capacity), layers[0][0].shape[1]


def rows_prefix_cache(lm: LM, rows: Sequence[list[tuple[torch.Tensor, torch.Tensor]] | None], *, capacity: int | None = None):
    """A cache where every row has its own prefix (per-layer KV, or None for none), right-aligned: row i's prefix
    fills the last ``len_i`` of ``width`` slots. Returns the cache (None when no row has a prefix), the width, and
    a ``[rows, width]`` mask that is 1 on real prefix slots."""
    lengths = [rows_layers[0][0].shape[1] if rows_layers else 0 for rows_layers in rows]
    width = max(lengths, default=0)
    mask = torch.zeros(len(rows), width, dtype=torch.long, device=lm.device)
    if width == 0:
        return None, 0, mask
    template = next(r for r in rows if r)
    data = []
    for layer in range(len(template)):
        k0, v0 = template[layer]
        keys = k0.new_zeros((len(rows), k0.shape[0], width, k0.shape[2]))
        values = v0.new_zeros((len(rows), v0.shape[0], width, v0.shape[2]))
        for i, r in enumerate(rows):
            if r:
                keys[i, :, width - lengths[i] :] = r[layer][0]
                values[i, :, width - lengths[i] :] = r[layer][1]
        data.append((keys, values))
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1
    return _cache(lm, data, capacity), width, mask


def _cache(lm: LM, data: list[tuple[torch.Tensor, torch.Tensor]], capacity: int | None):
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(ddp_cache_data=data, config=lm.model.config)
    if capacity is not None:
        for i, layer in enumerate(cache.layers):
            if type(layer) is DynamicLayer:
                cache.layers[i] = _preallocated_layer_class()(data[i][0], data[i][1], capacity)
    return cache


@functools.cache
def _preallocated_layer_class():
    """Defined on first use, so importing this module never imports transformers."""
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A full-attention cache layer that writes new tokens into spare room rather than concatenating."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
            super().__init__()
            b, h, n, d = keys.shape
            self.dtype, self.device = keys.dtype, keys.device
            self._k = keys.new_empty((b, h, max(capacity, n), d))
            self._v = values.new_empty((b, values.shape[1], max(capacity, n), values.shape[3]))
            self._k[:, :, :n].copy_(keys)
            self._v[:, :, :n].copy_(values)
            self._n = n
            self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            n = key_states.shape[-2]
            if self._n + n > self._k.shape[-2]:  # out of room: grow geometrically
                room = max(2 * self._k.shape[-2], self._n + n)
                k = self._k.new_empty((*self._k.shape[:2], room, self._k.shape[3]))
                v = self._v.new_empty((*self._v.shape[:2], room, self._v.shape[3]))
                k[:, :, : self._n].copy_(self._k[:, :, : self._n])
                v[:, :, : self._n].copy_(self._v[:, :, : self._n])
                self._k, self._v = k, v
            self._k[:, :, self._n : self._n + n].copy_(key_states)
            self._v[:, :, self._n : self._n + n].copy_(value_states)
            self._n += n
            self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]
            return self.keys, self.values

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            """Keep (and reorder) the batch rows `beam_idx`: decoding drops the rows that have finished."""
            self._k = self._k.index_select(0, beam_idx.to(self._k.device))
            self._v = self._v.index_select(0, beam_idx.to(self._v.device))
            self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]

    return PreallocatedLayer




ATTENTION_NAME = "cartridges_sdpa"


def _sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention, but grouped-query heads stay grouped even when a mask is given.

    Stock transformers copies every KV head once per query head whenever there is a padding mask (always, with
    a cartridge in a batch); on CPU that copy dominated decoding time. The arithmetic is the same.
    """
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > query.shape[2]:
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=is_causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model) -> bool:
    """Switch a model on stock SDPA to `_sdpa_gqa_attention` (same results, no KV-head copies). Returns if it did."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv_heads == heads:
        return False
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError:  # older transformers without these hooks: stock SDPA gives the same results, only slower
        return False
    AttentionInterface.register(ATTENTION_NAME, _sdpa_gqa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)
    return True
