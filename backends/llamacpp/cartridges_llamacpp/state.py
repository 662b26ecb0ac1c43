"""llama.cpp's sequence-state blob (``llama_state_seq_get_data`` / ``llama_state_seq_set_data``), read and written.

The layout, as llama.cpp bundled by llama-cpp-python 0.3.36 writes it (``llama_context::state_seq_get_data`` and
``llama_kv_cache::state_write``; little-endian, no padding, no version field)::

    u32 magic 0xaf143cd8, i32 source seq id
    u32 n_stream; per stream: u32 cell_count, and when it is not 0:
        per cell: i32 pos, u32 n_seq_id, i32 seq_id * n_seq_id
        u32 v_trans, u32 n_layer
        per layer, K: i32 ggml type, u64 row bytes, cell_count rows (kv heads one after another)
        per layer, V: as K when v_trans is 0; else i32 type, u32 element bytes, u32 row width, then the transpose:
                      element j of every cell, for j in 0..width-1

A context tells what it expects only through a blob of its own, so `Layout.learn` reads one (written for a few
placeholder tokens) and `Layout.blob` writes a cartridge in exactly that shape. Anything else is refused by name:
there is no version field, and llama.cpp's own reader answers a mismatch with a bare 0.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import attrs
import numpy as np

from cartridges_sdk import BackendError

MAGIC = 0xAF143CD8
# ggml types a cache may hold that map to a numpy dtype; quantized caches (q8_0, q4_0, ...) store K and V rotated
GGML_TYPES = {0: np.dtype("<f4"), 1: np.dtype("<f2")}
GGML_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 30: "bf16"}


class StateFormatError(BackendError):
    """A sequence state this backend does not recognise (another llama.cpp version or cache setting)."""


class _Reader:
    def __init__(self, data: bytes):
        self.data = memoryview(data)
        self.at = 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise StateFormatError(f"The sequence state ends at byte {len(self.data)}, inside a field at {self.at}.")
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return values if len(values) > 1 else values[0]

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        size = dtype.itemsize * count
        if self.at + size > len(self.data):
            raise StateFormatError(f"The sequence state ends at byte {len(self.data)}, inside tensor data at {self.at}.")
        out = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.at)
        self.at += size
        return out


@attrs.frozen
class Layout:
    """What one context's sequence state looks like, for any number of cells."""

    n_stream: int
    stream: int  # the stream the sequence's cells are in
    v_trans: bool
    k_types: tuple[int, ...]  # per layer
    v_types: tuple[int, ...]
    width: int  # kv heads * head dim: the values of one cell in one layer

    @property
    def num_layers(self) -> int:
        return len(self.k_types)

    @classmethod
    def learn(cls, blob: bytes) -> Layout:
        """The layout of a blob llama.cpp wrote (for at least one cell), refused when it is not the one above."""
        layout, _ = _parse(blob)
        return layout

    def size(self, cells: int) -> int:
        """Bytes of a blob of `cells` cells."""
        per_layer = 12 + cells * self.width * _itemsize(self.k_types[0])
        return 8 + 4 + 4 * self.n_stream + 12 * cells + 8 + 2 * self.num_layers * per_layer

    def blob(self, keys: Sequence[np.ndarray], values: Sequence[np.ndarray], seq_id: int = 0) -> bytes:
        """A state of ``p`` cells at positions 0..p-1 from per-layer ``[kv_heads, p, head_dim]`` keys and values
        (keys already in the engine's RoPE pairing), in the cache's own types."""
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise StateFormatError(f"The context's cache has {self.num_layers} layers; got {len(keys)} key and "
                                   f"{len(values)} value tensors.")
        heads, p, dim = keys[0].shape
        if heads * dim != self.width:
            raise StateFormatError(f"The context's cache holds {self.width} values per cell and layer; the cartridge "
                                   f"has {heads} kv heads x {dim} dims.")
        out = [struct.pack("<IiI", MAGIC, seq_id, self.n_stream)]
        for s in range(self.n_stream):
            if s != self.stream:
                out.append(struct.pack("<I", 0))
                continue
            out.append(struct.pack("<I", p))
            cells = np.zeros(p, dtype=[("pos", "<i4"), ("n", "<u4"), ("seq", "<i4")])
            cells["pos"] = np.arange(p)
            cells["n"] = 1
            cells["seq"] = seq_id
            out.append(cells.tobytes())
            out.append(struct.pack("<II", int(self.v_trans), self.num_layers))
            for k, t in zip(keys, self.k_types):
                rows = np.ascontiguousarray(np.asarray(k).transpose(1, 0, 2).reshape(p, self.width), GGML_TYPES[t])
                out.append(struct.pack("<iQ", t, rows.shape[1] * rows.itemsize))
                out.append(rows.tobytes())
            for v, t in zip(values, self.v_types):
                dtype = GGML_TYPES[t]
                if self.v_trans:  # element j (head-major) of every cell, cell after cell
                    cols = np.ascontiguousarray(np.asarray(v).transpose(0, 2, 1).reshape(self.width, p), dtype)
                    out.append(struct.pack("<iII", t, dtype.itemsize, self.width))
                    out.append(cols.tobytes())
                else:
                    rows = np.ascontiguousarray(np.asarray(v).transpose(1, 0, 2).reshape(p, self.width), dtype)
                    out.append(struct.pack("<iQ", t, self.width * dtype.itemsize))
                    out.append(rows.tobytes())
        return b"".join(out)


def read(blob: bytes, heads: int) -> tuple[Layout, list[int], list[np.ndarray], list[np.ndarray]]:
    """A blob's layout, cell positions, and per-layer float32 ``[heads, cells, head_dim]`` keys and values."""
    layout, (positions, keys, values) = _parse(blob, heads)
    return layout, positions, keys, values


def _itemsize(t: int) -> int:
    return GGML_TYPES[t].itemsize


def _check_type(t: int, what: str) -> None:
    if t not in GGML_TYPES:
        raise StateFormatError(
            f"The context's {what} cache type is {GGML_NAMES.get(t, f'ggml type {t}')}; cartridges are written into "
            "f16 or f32 caches (quantized caches store K and V rotated). Start llama.cpp with type_k and type_v f16."
        )


def _parse(blob: bytes, heads: int | None = None):
    r = _Reader(blob)
    magic = r.take("<I")
    if magic != MAGIC:
        raise StateFormatError(
            f"The sequence state starts with 0x{magic:08x}, not llama.cpp's 0x{MAGIC:08x}: it is not a sequence state "
            "of the llama.cpp this backend reads (llama-cpp-python 0.3.36)."
        )
    r.take("<i")  # the seq id it was written from; llama.cpp reads into any
    n_stream = r.take("<I")
    if not 1 <= n_stream <= 1024:
        raise StateFormatError(f"The sequence state claims {n_stream} streams; this is not a layout this backend knows.")
    found = None
    for s in range(n_stream):
        cells = r.take("<I")
        if cells == 0:
            continue
        if found is not None:
            raise StateFormatError("The sequence state has cells in two streams; one sequence lives in one stream.")
        positions = []
        for _ in range(cells):
            pos, n_seq = r.take("<iI")
            if n_seq != 1:
                raise StateFormatError(f"A cell lists {n_seq} sequences; a sequence's own state lists one per cell.")
            r.take("<i")
            positions.append(pos)
        v_trans, n_layer = r.take("<II")
        if v_trans not in (0, 1) or not 1 <= n_layer <= 4096:
            raise StateFormatError(f"v_trans={v_trans}, {n_layer} layers: not a layout this backend knows.")
        k_types, keys, width = [], [], None
        for _ in range(n_layer):
            t, row = r.take("<iQ")
            _check_type(t, "K")
            if row % _itemsize(t) or (width is not None and row // _itemsize(t) != width):
                raise StateFormatError(f"K rows of {row} bytes in ggml type {t}: layers of different widths are not "
                                       "supported.")
            width = row // _itemsize(t)
            k_types.append(t)
            keys.append(r.array(GGML_TYPES[t], cells * width).reshape(cells, width))
        v_types, values = [], []
        for _ in range(n_layer):
            if v_trans:
                t, el, w = r.take("<iII")
                _check_type(t, "V")
                if el != _itemsize(t) or w != width:
                    raise StateFormatError(f"Transposed V of {w} x {el}-byte elements; expected {width} x "
                                           f"{_itemsize(t)}.")
                values.append(r.array(GGML_TYPES[t], cells * width).reshape(width, cells).T)
            else:
                t, row = r.take("<iQ")
                _check_type(t, "V")
                if row != width * _itemsize(t):
                    raise StateFormatError(f"V rows of {row} bytes; expected {width * _itemsize(t)}.")
                values.append(r.array(GGML_TYPES[t], cells * width).reshape(cells, width))
            v_types.append(t)
        found = (s, bool(v_trans), tuple(k_types), tuple(v_types), width, positions, keys, values)
    if found is None:
        raise StateFormatError("The sequence state holds no cells; decode at least one token before reading it.")
    if r.at != len(r.data):
        raise StateFormatError(f"The sequence state has {len(r.data) - r.at} bytes after its last field; this is not "
                               "a layout this backend knows (an iSWA or recurrent model's state?).")
    s, v_trans, k_types, v_types, width, positions, keys, values = found
    layout = Layout(n_stream, s, v_trans, k_types, v_types, width)
    if heads is None:
        return layout, None
    if width % heads:
        raise StateFormatError(f"{width} values per cell do not split into {heads} kv heads.")
    dim = width // heads
    cells = len(positions)

    def per_head(rows: np.ndarray) -> np.ndarray:  # [cells, heads*dim] -> [heads, cells, dim]
        return np.asarray(rows, np.float32).reshape(cells, heads, dim).transpose(1, 0, 2).copy()

    return layout, (positions, [per_head(k) for k in keys], [per_head(v) for v in values])
