"""Constructors and their refusals."""

from __future__ import annotations

import pytest
import torch

from cartridges_sdk import Cartridge, ConfigError

from conftest import TEXT


def test_from_prefix_shapes_and_size(tiny_lm):
    c = Cartridge.from_prefix(tiny_lm, TEXT, 24)
    assert c.num_tokens == 24 and c.num_frozen == 1 and c.num_layers == 3
    assert tuple(c.keys[0].shape) == (2, 24, 16)  # kv heads (GQA), tokens, head dim
    assert c.nbytes == 3 * 2 * 2 * 24 * 16 * 4
    assert c.meta.init == "prefix" and c.meta.dtype == "float32"


def test_text_and_ids_give_the_same_cartridge(tiny_lm):
    ids = tiny_lm.encode(TEXT)
    a, b = Cartridge.from_prefix(tiny_lm, TEXT, 30), Cartridge.from_prefix(tiny_lm, torch.tensor(ids), 30)
    assert all(torch.equal(x, y) for x, y in zip(a.keys, b.keys))


def test_bos_is_included_where_the_model_uses_one(tiny_llama, tiny_qwen):
    assert tiny_llama.encode("abc")[0] == tiny_llama.tokenizer.bos_token_id
    assert tiny_qwen.encode("abc")[0] != tiny_qwen.tokenizer.bos_token_id


@pytest.mark.parametrize(
    "text, n, match",
    [("", 5, "empty"), ("   \n", 5, "empty"), (TEXT, 10**6, "more than the"), (TEXT, 1, "greater than num_frozen")],
)
def test_bad_prefix_inputs(tiny_lm, text, n, match):
    with pytest.raises(ConfigError, match=match):
        Cartridge.from_prefix(tiny_lm, text, n)


def test_out_of_vocab_ids(tiny_lm):
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        Cartridge.from_prefix(tiny_lm, [1, 2, 10**7], 3)


def test_num_frozen_must_fit(tiny_lm):
    with pytest.raises(ConfigError, match="num_frozen"):
        Cartridge.from_prefix(tiny_lm, TEXT, 5, num_frozen=5)


def test_random_text_is_deterministic_and_unrelated(tiny_lm):
    a = Cartridge.from_random_text(tiny_lm, 300, seed=3)
    b = Cartridge.from_random_text(tiny_lm, 300, seed=3)
    c = Cartridge.from_random_text(tiny_lm, 300, seed=4)
    assert a.num_tokens == 300 and a.meta.init == "random_text"
    assert torch.equal(a.keys[2], b.keys[2]) and not torch.equal(a.keys[2], c.keys[2])


def test_random_text_longer_than_the_shipped_text_wraps(tiny_lm):
    c = Cartridge.from_random_text(tiny_lm, 6000)  # char tokenizer: longer than the shipped text
    assert c.num_tokens == 6000


def test_random_has_the_scale_of_real_kv(tiny_lm):
    real = Cartridge.from_random_text(tiny_lm, 256)
    rnd = Cartridge.random(tiny_lm, 256, seed=1)
    assert rnd.meta.init == "random"
    assert torch.equal(rnd.keys[0], Cartridge.random(tiny_lm, 256, seed=1).keys[0])
    for layer in range(rnd.num_layers):
        for got, want in ((rnd.keys[layer], real.keys[layer]), (rnd.values[layer], real.values[layer])):
            ratio = got[:, 1:].std() / want[:, 1:].std()
            assert 0.7 < ratio < 1.4


def test_unbound_cartridge_says_how_to_bind(tiny_lm):
    c = Cartridge.from_prefix(tiny_lm, TEXT, 10)
    loose = Cartridge(c.keys, c.values, c.meta)
    with pytest.raises(ConfigError, match="bind"):
        loose.ask("hi")
    assert loose.bind(tiny_lm).ask("hi", max_new_tokens=3) == c.ask("hi", max_new_tokens=3)


def test_inconsistent_tensors_are_refused(tiny_lm):
    c = Cartridge.from_prefix(tiny_lm, TEXT, 10)
    with pytest.raises(ConfigError, match="Layer 1"):
        Cartridge([c.keys[0], c.keys[1][:, :5], c.keys[2]], c.values, c.meta)
    with pytest.raises(ConfigError, match="num_tokens"):
        Cartridge([k[:, :5] for k in c.keys], [v[:, :5] for v in c.values], c.meta)
