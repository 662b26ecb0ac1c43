"""KV helpers: the wrong-model check for a batch, cartridges as per-layer KV and as a transformers cache, the grouped
SDPA the HF model runs with, and `Recent`, what engines and the store keep of what they made.

Longer than 400 lines because the batch cache layouts (one prefix for every row, a prefix per row, packed rows) and
the attention that reads them must agree on where each row's tokens sit, and are read and tested together.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from .rope import ROTATE_HALF

if TYPE_CHECKING:
    from .protocols import KVPrefix, ModelFacts, RunningModel


def refuse_foreign(lm: ModelFacts, cartridges: Sequence[KVPrefix]) -> None:
    """`Cartridge.check_model` for each of `cartridges`: the first made for another model raises
    `IncompatibleCartridgeError`, before an engine sees any of them."""
    for c in cartridges:
        c.check_model(lm)


Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [kv_heads, tokens, head_dim]


def concat_layers(lm: RunningModel, cartridges: Sequence[KVPrefix]) -> Layers:
    """Per-layer keys/values of several cartridges placed one after another, on the model's device and dtype."""
    refuse_foreign(lm, cartridges)
    cartridges = [c.in_key_pairing(ROTATE_HALF) for c in cartridges]  # the layout transformers' RoPE writes
    return join_layers([[(k.to(lm.device, lm.dtype), v.to(lm.device, lm.dtype)) for k, v in zip(c.keys, c.values)]
                        for c in cartridges])


def join_layers(parts: Sequence[Layers]) -> Layers:
    """Several per-layer KV prefixes as one, in order (the tokens of each part follow the previous part's)."""
    if len(parts) == 1:
        return list(parts[0])
    return [(torch.cat([p[i][0] for p in parts], dim=1), torch.cat([p[i][1] for p in parts], dim=1))
            for i in range(len(parts[0]))]


V = TypeVar("V")


class Recent(Generic[V]):
    """The most recently used values by key, for what an engine or a store makes once and reuses while it stays in
    use (a cartridge moved to the device, a composition, a file read): `get` makes a value only when it is not held.
    At most `size` values, and (when `budget` is given) at most `budget` of their `cost` together; the most recent
    value always stays, whatever it costs."""

    def __init__(self, size: int | None = None, *, budget: int | None = None, cost: Callable[[V], int] = len):
        self.size, self.budget, self.cost = size, budget, cost
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        # each held value's cost, taken once when it is put, and their sum: summing them again at every put cost
        # n^2 / 2 cost calls for n puts (a store that read 10,000 cartridges into memory took minutes)
        self._costs: dict[Hashable, int] = {}
        self._total = 0
        self.made = 0  # values made so far (tests count installs with it)

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = make()
        self.made += 1
        self.put(key, value)
        return value

    def put(self, key: Hashable, value: V) -> None:
        """Hold `value` as the most recently used, dropping the least recently used beyond the limits."""
        self.pop(key)
        self._items[key] = value
        if self.budget is not None:
            self._costs[key] = self.cost(value)
            self._total += self._costs[key]
        while len(self._items) > 1 and (
            (self.size is not None and len(self._items) > self.size)
            or (self.budget is not None and self._total > self.budget)
        ):
            self.pop(next(iter(self._items)))

    def pop(self, key: Hashable) -> V | None:
        self._total -= self._costs.pop(key, 0)
        return self._items.pop(key, None)

    def clear(self) -> None:
        self._items.clear()
        self._costs.clear()
        self._total = 0

    def __iter__(self) -> Iterator[Hashable]:
        """The keys held, least recently used first."""
        return iter(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


def prefix_cache(lm: RunningModel, cartridges: Sequence[KVPrefix], batch_size: int, *, capacity: int | None = None):
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


class PackedRows:
    """Rows that share one prefix, each followed by its own tokens, whose KV was computed in one packed sequence (the
    prefix, then every distinct row's tokens end to end, as `hf.decode.prefill_rows` runs them).

    In a batch cache each row is laid out as the prefix, masked padding, then its own tokens ending at the cache's
    width, so a layer is written with one broadcast copy and one gather, not two copies per row: on a GPU, 64 rows of
    a 32-layer model were 4,096 small copies per batch, each paying the host's launch cost.
    """

    def __init__(self, layers: Layers, past: int, spans: Sequence[tuple[int, int]]):
        self.layers = layers  # per layer [kv_heads, past + packed tokens, head_dim]
        self.past = past  # the shared prefix's tokens
        self.spans = list(spans)  # each row's own tokens, as [start, end) after the prefix (empty: none)
        self.longest = max((b - a for a, b in self.spans), default=0)

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def width(self) -> int:
        return self.past + self.longest

    def row(self, i: int) -> Layers:
        """Row `i`'s KV alone: the prefix, then its own tokens."""
        a, b = self.spans[i]
        p = self.past
        return [(torch.cat([k[:, :p], k[:, p + a : p + b]], dim=1), torch.cat([v[:, :p], v[:, p + a : p + b]], dim=1))
                for k, v in self.layers]

    def mask(self) -> torch.Tensor:
        """``[rows, width]``: 1 on the prefix and on each row's own tokens, 0 on the padding between them."""
        device = self.layers[0][0].device
        own = torch.tensor([b - a for a, b in self.spans], device=device)
        slots = torch.arange(self.longest, device=device)[None]
        return torch.cat([torch.ones(len(self), self.past, dtype=torch.long, device=device),
                          (slots >= self.longest - own[:, None]).long()], dim=1)

    def index(self) -> torch.Tensor:
        """``[rows, longest]`` positions in the packed sequence of each row's own tokens, right-aligned; padding
        points at position 0 (it is masked out)."""
        index = torch.zeros(len(self), self.longest, dtype=torch.long)
        for r, (a, b) in enumerate(self.spans):
            if b > a:
                index[r, self.longest - (b - a):] = torch.arange(self.past + a, self.past + b)
        return index.to(self.layers[0][0].device)


def _packed_rows_cache(lm: RunningModel, rows: PackedRows, capacity: int | None):
    """`rows_prefix_cache` for `PackedRows`: per layer, the prefix broadcast to every row and the rows' own tokens
    gathered into place."""
    cache = _empty_cache(lm, len(rows.layers))
    width, n, index = rows.width, len(rows), rows.index()
    for layer, (k, v) in enumerate(rows.layers):
        grows = capacity is not None and _grows_in_place(cache, layer)
        room = max(capacity, width) if grows else width
        keys = k.new_zeros((n, k.shape[0], room, k.shape[2]))
        values = v.new_zeros((n, v.shape[0], room, v.shape[2]))
        keys[:, :, : rows.past] = k[None, :, : rows.past]
        values[:, :, : rows.past] = v[None, :, : rows.past]
        if rows.longest:
            keys[:, :, rows.past : width] = k[:, index].transpose(0, 1)
            values[:, :, rows.past : width] = v[:, index].transpose(0, 1)
        if grows:
            cache.layers[layer] = _preallocated_layer_class().adopt(keys, values, width)
        else:
            cache.layers[layer].update(keys, values)
    return cache, width, rows.mask()


def rows_prefix_cache(lm: RunningModel, rows: Sequence[list[tuple[torch.Tensor, torch.Tensor]] | None] | PackedRows, *,
                      capacity: int | None = None):
    """A cache where every row has its own prefix (per-layer KV, or None for none), right-aligned: row i's prefix
    fills the last ``len_i`` of ``width`` slots. Returns the cache (None when no row has a prefix), the width, and
    a ``[rows, width]`` mask that is 1 on real prefix slots. `PackedRows` are laid out as they say.

    With `capacity`, each row of a full-attention layer is written once, straight into a buffer with room to grow: a
    batch of long prefixes (many users, or documents in context) then takes one copy of memory, not two. (Other
    layers, and all without `capacity`, are copied once more by transformers' own ``update``.)
    """
    if isinstance(rows, PackedRows):
        return _packed_rows_cache(lm, rows, capacity)
    lengths = [rows_layers[0][0].shape[1] if rows_layers else 0 for rows_layers in rows]
    width = max(lengths, default=0)
    if width == 0:
        return None, 0, torch.zeros(len(rows), 0, dtype=torch.long, device=lm.device)
    template = next(r for r in rows if r)
    # rows that share a prefix (one cartridge, many users) are written with one copy per layer, not one per row
    sharing: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(rows):
        if r:  # the same tensors, not equal ones: the runtime hands every row of a cartridge its installed copy
            sharing.setdefault(tuple(id(t) for pair in r for t in pair), []).append(i)
    groups = [(rows[idx[0]], _rows_index(idx, lm.device)) for idx in sharing.values()]
    cache = _empty_cache(lm, len(template))
    for layer in range(len(template)):
        k0, v0 = template[layer]
        grows = capacity is not None and _grows_in_place(cache, layer)
        room = max(capacity, width) if grows else width
        keys = k0.new_zeros((len(rows), k0.shape[0], room, k0.shape[2]))
        values = v0.new_zeros((len(rows), v0.shape[0], room, v0.shape[2]))
        for r, idx in groups:
            k, v = r[layer]
            keys[idx, :, width - k.shape[1] : width] = k
            values[idx, :, width - v.shape[1] : width] = v
        if grows:
            cache.layers[layer] = _preallocated_layer_class().adopt(keys, values, width)
        else:
            cache.layers[layer].update(keys, values)
    lengths_t = torch.tensor(lengths, device=lm.device)
    mask = (torch.arange(width, device=lm.device)[None] >= width - lengths_t[:, None]).long()
    return cache, width, mask


def _rows_index(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """Rows as a slice when they run in order (a plain strided copy), else as an index tensor (a scattered write,
    which an H200 profile showed at 0.47 TB/s)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def _empty_cache(lm: RunningModel, num_layers: int):
    """A transformers cache with one empty layer per model layer, of the kind the model's config asks for."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.model.config)
    if len(cache.layers) != num_layers:  # transformers versions that make layers lazily
        from transformers.cache_utils import DynamicLayer

        cache.layers = [DynamicLayer() for _ in range(num_layers)]
    return cache


def _grows_in_place(cache, layer: int) -> bool:
    """Whether a layer keeps every token (full attention), so decoding may append into spare room."""
    from transformers.cache_utils import DynamicLayer

    return type(cache.layers[layer]) is DynamicLayer


def _cache(lm: RunningModel, data: list[tuple[torch.Tensor, torch.Tensor]], capacity: int | None):
    """A cache holding `data` (per layer ``[batch, kv_heads, tokens, head_dim]``), copied once; with `capacity`, the
    full-attention layers get room to grow."""
    cache = _empty_cache(lm, len(data))
    for i, (keys, values) in enumerate(data):
        if capacity is not None and _grows_in_place(cache, i):
            cache.layers[i] = _preallocated_layer_class()(keys, values, capacity)
        else:
            cache.layers[i].update(keys, values)
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

        @classmethod
        def adopt(cls, keys: torch.Tensor, values: torch.Tensor, n: int) -> PreallocatedLayer:
            """A layer over buffers whose first `n` tokens are already written (no copy)."""
            layer = cls.__new__(cls)
            DynamicLayer.__init__(layer)
            layer.dtype, layer.device = keys.dtype, keys.device
            layer._k, layer._v, layer._n = keys, values, n
            layer.keys, layer.values = keys[:, :, :n], values[:, :, :n]
            layer.is_initialized = True
            return layer

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


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention, but grouped-query heads stay grouped even when a mask is given.

    Stock transformers copies every KV head once per query head whenever there is a padding mask (always, with
    a cartridge in a batch); on CPU that copy dominated decoding time. The arithmetic is the same.
    """
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > query.shape[2]:
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    if _on_gpu(query) and dropout == 0 and _folds(query, key, attention_mask):
        return _folded_gqa(query, key, value, attention_mask, dropout, scaling)
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


# one decoding token over this many keys or more goes through two batched matrix products (`_matmul_attention`)
# rather than SDPA's memory-efficient kernel, which runs one thread block per (row, KV head) over all the keys: with
# a few long rows (documents in context) that leaves most of a GPU idle (docs/gpu.md has the measurements)
MATMUL_DECODE_MIN_KEYS = 65536
FOLDED_MASK_LIMIT = 2**28  # mask elements a fold may copy; past it the stock path is cheaper in memory


def _on_cuda(device: torch.device) -> bool:
    """Whether work already placed on `device` runs on CUDA, whose attention kernels need the paths below (a check of
    where tensors are, never a choice of where they go): the folded grouped-query paths (its masked SDPA kernels
    lack ``enable_gqa``; CPU keeps the stock call) and the decoding kernels without cuDNN's."""
    return device.type == "cuda"


def _on_gpu(query) -> bool:
    """Where the folded paths run (`_on_cuda`)."""
    return _on_cuda(query.device)


def _folds(query, key, attention_mask) -> bool:
    """Whether masked grouped-query attention goes through `_folded_gqa`: a ``[batch or 1, 1, queries or 1, keys]``
    mask, and always for one query token (decoding), for more while the folded mask (one copy per query head of a
    group) stays small."""
    if attention_mask is None or key.shape[1] == query.shape[1] or query.shape[1] % key.shape[1]:
        return False
    group, q = query.shape[1] // key.shape[1], query.shape[2]
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[0] not in (1, query.shape[0]) \
            or attention_mask.shape[2] not in (1, q) or attention_mask.shape[3] != key.shape[2]:
        return False
    return q == 1 or attention_mask.shape[0] * group * q * attention_mask.shape[-1] <= FOLDED_MASK_LIMIT


def _folded_gqa(query, key, value, attention_mask, dropout, scaling):
    """Masked grouped-query attention as plain attention: each KV head's group of query heads becomes extra query
    rows. On CUDA, SDPA's masked kernels do not take ``enable_gqa`` (cuDNN's does, but `decoding_kernels` keeps it
    out), and its math path copies every KV head once per query head: 26 ms a layer at 4 rows of 131k keys on an
    H200, against 5.6 ms folded (docs/gpu.md)."""
    b, heads, q, d = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    folded = query.reshape(b, kv_heads, group * q, d)  # query heads are grouped by KV head, in order
    if q == 1 and key.shape[2] >= MATMUL_DECODE_MIN_KEYS and b * heads * key.shape[2] <= FOLDED_MASK_LIMIT:
        out = _matmul_attention(folded, key, value, attention_mask, scaling)
        return out.reshape(b, heads, q, d).transpose(1, 2).contiguous(), None
    mask = attention_mask.expand(-1, -1, q, -1)[:, :, None].expand(-1, -1, group, -1, -1)
    mask = mask.reshape(attention_mask.shape[0], 1, group * q, attention_mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(b, heads, q, d).transpose(1, 2).contiguous(), None


def _matmul_attention(query, key, value, attention_mask, scaling):
    """Attention of a few query rows per KV head as two batched matrix products, which read the keys and values
    once with all of the GPU, whatever the batch. The scores come out of the product in the inputs' dtype (SDPA's
    kernels keep them in float32: in bf16 this path's error is the larger, 4e-3 against 1e-3 at 512 keys,
    docs/gpu.md) and softmax runs in float32; every row must see at least one key (a decoding token sees itself)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query * scale, key.transpose(-1, -2)).float()
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask
    return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)


def decoding_kernels(device: torch.device):
    """A context for a decode step's forward: on CUDA, SDPA may pick flash, memory-efficient or math kernels but not
    cuDNN's, which builds a plan for every new shape, and a decode's key length changes every step (decoding was
    3.5-3.6x slower with it on an H200, docs/gpu.md). Elsewhere it changes nothing."""
    if not _on_cuda(torch.device(device)):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def use_grouped_sdpa(model) -> bool:
    """Switch a model on stock SDPA to `sdpa_gqa_attention` (same results, no KV-head copies). Returns if it did."""
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
    AttentionInterface.register(ATTENTION_NAME, sdpa_gqa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)
    return True
