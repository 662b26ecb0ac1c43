"""Our own reading and writing of llama.cpp's sequence-state layout (no engine here; the engine's own blobs are read
and loaded in test_llamacpp_runtime.py)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from cartridges_llamacpp.state import MAGIC, Layout, StateFormatError, read

HEADS, DIM, LAYERS = 2, 4, 3


def kv(p, seed=0):
    rng = np.random.default_rng(seed)
    keys = [rng.standard_normal((HEADS, p, DIM)).astype(np.float32) for _ in range(LAYERS)]
    values = [rng.standard_normal((HEADS, p, DIM)).astype(np.float32) for _ in range(LAYERS)]
    return keys, values


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("ggml_type", [0, 1])  # f32, f16
def test_a_written_state_reads_back_the_same(v_trans, ggml_type):
    layout = Layout(n_stream=1, stream=0, v_trans=v_trans, k_types=(ggml_type,) * LAYERS,
                    v_types=(ggml_type,) * LAYERS, width=HEADS * DIM)
    keys, values = kv(5)
    blob = layout.blob(keys, values)
    assert len(blob) == layout.size(5)
    got_layout, positions, got_k, got_v = read(blob, HEADS)
    assert got_layout == layout and positions == [0, 1, 2, 3, 4]
    exact = 0 if ggml_type == 0 else 1e-3  # f16 rounds
    for a, b in zip(keys + values, got_k + got_v):
        assert a.shape == b.shape and np.abs(a - b).max() <= exact * np.abs(a).max()


def test_the_layout_on_the_wire():
    # one layer, one head of 2 dims, 2 cells, f32, V transposed: every byte where the layout says
    layout = Layout(n_stream=1, stream=0, v_trans=True, k_types=(0,), v_types=(0,), width=2)
    k = np.array([[[1, 2], [3, 4]]], np.float32)  # [head, cell, dim]
    v = np.array([[[5, 6], [7, 8]]], np.float32)
    blob = layout.blob([k], [v], seq_id=0)
    want = struct.pack("<IiI", MAGIC, 0, 1) + struct.pack("<I", 2)
    want += struct.pack("<iIi", 0, 1, 0) + struct.pack("<iIi", 1, 1, 0)  # cells: pos, one seq, seq 0
    want += struct.pack("<II", 1, 1)  # v_trans, layers
    want += struct.pack("<iQ", 0, 8) + np.array([1, 2, 3, 4], "<f4").tobytes()  # K rows, cell after cell
    want += struct.pack("<iII", 0, 4, 2) + np.array([5, 7, 6, 8], "<f4").tobytes()  # V: element j of every cell
    assert blob == want


def test_what_it_does_not_know_is_refused_by_name():
    layout = Layout(n_stream=1, stream=0, v_trans=False, k_types=(1,) * LAYERS, v_types=(1,) * LAYERS,
                    width=HEADS * DIM)
    blob = layout.blob(*kv(3))
    with pytest.raises(StateFormatError, match="starts with 0x00000000, not llama.cpp's 0xaf143cd8"):
        Layout.learn(b"\0" * 64)
    with pytest.raises(StateFormatError, match="ends at byte"):
        Layout.learn(blob[:-5])
    with pytest.raises(StateFormatError, match="bytes after its last field"):
        Layout.learn(blob + b"\0\0")
    with pytest.raises(StateFormatError, match="holds no cells"):
        Layout.learn(struct.pack("<IiII", MAGIC, 0, 1, 0))
    q8 = bytearray(blob)
    at = 8 + 4 + 4 + 12 * 3 + 8  # the first layer's K type
    q8[at : at + 4] = struct.pack("<i", 8)
    with pytest.raises(StateFormatError, match="K cache type is q8_0; cartridges are written into f16 or f32 caches"):
        Layout.learn(bytes(q8))
    with pytest.raises(StateFormatError, match="has 3 layers; got 2 key"):
        layout.blob(*(t[:2] for t in kv(3)))


def test_cells_go_to_the_sequences_stream():
    layout = Layout(n_stream=3, stream=1, v_trans=False, k_types=(1,) * LAYERS, v_types=(1,) * LAYERS,
                    width=HEADS * DIM)
    blob = layout.blob(*kv(2))
    assert struct.unpack_from("<II", blob, 12) == (0, 2)  # stream 0 empty, stream 1 holds the cells
    assert Layout.learn(blob) == layout
