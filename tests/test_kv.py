"""The KV plumbing a GPU leans on: grouped-query attention folded into plain attention (what CUDA runs when a mask
is given), and per-row prefix caches written once into room to grow."""

import pytest
import torch

from cartridges_sdk import kv
from cartridges_sdk.kv import _folded_gqa, _folds, rows_prefix_cache


def _stock(query, key, value, mask):
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("q,path", [(1, "sdpa"), (1, "matmul"), (3, "sdpa")])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "batch-broadcast", "query-broadcast"])
def test_folded_gqa_equals_grouped_sdpa(q, path, mask_kind, monkeypatch):
    # a decoding token (q = 1) over many keys takes two matrix products instead of SDPA's kernel
    monkeypatch.setattr(kv, "MATMUL_DECODE_MIN_KEYS", 0 if path == "matmul" else 10**9)
    torch.manual_seed(0)
    b, heads, kv_heads, length, d = 2, 8, 2, 11, 16
    query = torch.randn(b, heads, q, d)
    key, value = torch.randn(b, kv_heads, length, d), torch.randn(b, kv_heads, length, d)
    keep = torch.rand(b, 1, q, length) > 0.3
    keep[..., -1] = True  # every query sees at least one key
    mask = {"bool": keep, "float": torch.zeros(keep.shape).masked_fill(~keep, float("-inf")),
            "batch-broadcast": keep[:1], "query-broadcast": keep[:, :, :1]}[mask_kind]
    assert _folds(query, key, mask)
    out, _ = _folded_gqa(query, key, value, mask, 0.0, None)
    expected = _stock(query, key, value, mask).transpose(1, 2)
    assert out.shape == (b, q, heads, d)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_fold_only_where_it_pays():
    query, key = torch.randn(1, 8, 4, 16), torch.randn(1, 2, 10, 16)
    assert not _folds(query, key, None)  # no mask: the flash kernels take enable_gqa themselves
    assert not _folds(query, torch.randn(1, 8, 10, 16), torch.ones(1, 1, 4, 10, dtype=torch.bool))  # no grouping
    long_key = torch.randn(1, 2, 2**16, 16)
    big = torch.ones(1, 1, 4096, 1, dtype=torch.bool).expand(1, 1, 4096, 2**16)
    assert not _folds(torch.randn(1, 8, 4096, 16), long_key, big)  # a long masked prefill: the copy would be huge
    assert _folds(torch.randn(1, 8, 1, 16), long_key, big[:, :, :1])  # decoding always folds
    assert not _folds(torch.randn(1, 8, 1, 16), key, big[:, :, :1])  # a mask of another length: the stock call
    assert not _folds(query, key, torch.ones(1, 1, 2, 10, dtype=torch.bool))  # nor of another query length


def test_rows_prefix_cache_writes_each_row_once_into_room(tiny_llama):
    lm = tiny_llama
    shape = (lm.num_kv_heads, 0, lm.head_dim)

    def prefix(n, fill):
        return [(torch.full((shape[0], n, shape[2]), fill + i), torch.full((shape[0], n, shape[2]), -fill - i))
                for i in range(lm.num_layers)]

    rows = [prefix(3, 1.0), None, prefix(5, 10.0)]
    cache, width, mask = rows_prefix_cache(lm, rows, capacity=9)
    assert width == 5
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    for i, layer in enumerate(cache.layers):
        assert layer.keys.shape == (3, shape[0], 5, shape[2])
        assert layer._k.shape[2] == 9  # room to grow, allocated once
        assert layer.keys.data_ptr() == layer._k.data_ptr()  # the cache is the buffer the rows were written into
        assert torch.all(layer.keys[0, :, 2:] == 1.0 + i) and torch.all(layer.keys[0, :, :2] == 0)
        assert torch.all(layer.values[2] == -10.0 - i) and torch.all(layer.keys[1] == 0)
        new = torch.ones(3, shape[0], 2, shape[2])
        keys, _ = layer.update(new, new)
        assert keys.shape[2] == 7 and layer._k.data_ptr() == keys.data_ptr()  # appended in place
    plain, width, _ = rows_prefix_cache(lm, rows)  # without capacity: an ordinary cache of the same content
    for mine, theirs in zip(plain.layers, cache.layers):
        assert torch.equal(mine.keys, theirs.keys[:, :, :5])


def test_rows_sharing_a_cartridge_are_written_as_if_each_had_its_own(tiny_llama):
    lm = tiny_llama
    torch.manual_seed(1)

    def prefix(n):
        return [(torch.randn(lm.num_kv_heads, n, lm.head_dim), torch.randn(lm.num_kv_heads, n, lm.head_dim))
                for _ in range(lm.num_layers)]

    a, b = prefix(4), prefix(2)
    # rows of one cartridge out of order (written through an index) and in one run (written as a slice)
    for shared in ([a, b, a, a, None, b], [a, a, b, None, b, b]):
        own = [[(k.clone(), v.clone()) for k, v in r] if r else None for r in shared]
        for capacity in (None, 12):
            one, width, mask = rows_prefix_cache(lm, shared, capacity=capacity)
            other, width2, mask2 = rows_prefix_cache(lm, own, capacity=capacity)
            assert width == width2 == 4 and torch.equal(mask, mask2)
            for x, y in zip(one.layers, other.layers):
                assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


@pytest.mark.parametrize("path", ["sdpa", "matmul"])
def test_a_model_decoding_through_the_folds_keeps_the_runtime_contract(path, monkeypatch):
    """The folds run on CUDA alone; here they are switched on for a CPU model, whose every padded batch and decoding
    step then goes through them, and the runtime must still answer exactly as the text in context does."""
    from cartridges_sdk import testing
    from cartridges_sdk.hf import HFRuntime

    calls = []
    real = kv._folded_gqa
    monkeypatch.setattr(kv, "_on_gpu", lambda query: True)
    monkeypatch.setattr(kv, "_folded_gqa", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    monkeypatch.setattr(kv, "MATMUL_DECODE_MIN_KEYS", 0 if path == "matmul" else 10**9)
    lm = testing.tiny_lm("qwen2")  # 4 query heads on 2 KV heads
    with HFRuntime(lm) as runtime:
        testing.check_runtime_exactness(runtime, lm)
        testing.check_no_cross_talk(runtime, lm)
    assert 1 in calls and any(q > 1 for q in calls)  # decoding steps and padded prompts both folded
