"""Composition: concatenation along tokens, exact RoPE repositioning, and refusal across models."""

from __future__ import annotations

import pytest
import torch

from cartridges_sdk import Cartridge, ConfigError, IncompatibleCartridgeError

from conftest import TEXT, make_tiny_lm

OTHER = "Notes on tides: the sea rises twice a day, pulled by the moon and, more weakly, by the sun."


def test_reposition_equals_keys_computed_at_shifted_positions(tiny_lm):
    a = Cartridge.from_prefix(tiny_lm, TEXT, 40)
    b_ids = tiny_lm.encode(OTHER)[:30]
    b = Cartridge.from_prefix(tiny_lm, b_ids, 30)
    c = Cartridge.compose([a, b], reposition=True)
    shifted = tiny_lm.kv(b_ids, start_position=40)
    for layer, (k, v) in enumerate(shifted):
        assert torch.allclose(c.keys[layer][:, 40:], k, atol=1e-5, rtol=1e-5)
        assert torch.allclose(c.values[layer][:, 40:], v, atol=1e-5, rtol=1e-5)
        assert torch.equal(c.keys[layer][:, :40], a.keys[layer])
    # and the move is real: without it the keys differ
    assert not torch.allclose(b.keys[1], shifted[1][0], atol=1e-3)


def test_repositioned_composition_scores_like_shifted_texts(tiny_lm):
    a = Cartridge.from_prefix(tiny_lm, TEXT, 40)
    b_ids = tiny_lm.encode(OTHER)[:30]
    b = Cartridge.from_prefix(tiny_lm, b_ids, 30)
    shifted = tiny_lm.kv(b_ids, start_position=40)
    b_there = Cartridge([k for k, _ in shifted], [v for _, v in shifted], b.meta, lm=tiny_lm)
    q = tiny_lm.chat_ids([{"role": "user", "content": "What pulls the tides?"}])
    got = tiny_lm.logits(q, [Cartridge.compose([a, b], reposition=True)])
    want = tiny_lm.logits(q, [a, b_there])
    assert (got - want).abs().max().item() <= 1e-4


def test_plain_composition_equals_passing_several(tiny_lm):
    a = Cartridge.from_prefix(tiny_lm, TEXT, 25)
    b = Cartridge.from_prefix(tiny_lm, OTHER, 20)
    c = Cartridge.compose([a, b])
    assert c.num_tokens == 45 and c.meta.init == "composed"
    q = tiny_lm.chat_ids([{"role": "user", "content": "Summarise."}])
    assert torch.equal(tiny_lm.logits(q, [c]), tiny_lm.logits(q, [a, b]))


def test_composition_of_split_prefix_is_the_whole_prefix(tiny_lm):
    whole = Cartridge.from_prefix(tiny_lm, TEXT, 50)
    head = Cartridge(
        [k[:, :20] for k in whole.keys], [v[:, :20] for v in whole.values],
        whole.meta.__class__(model=whole.meta.model, num_tokens=20),
    )
    tail = Cartridge(
        [k[:, 20:] for k in whole.keys], [v[:, 20:] for v in whole.values],
        whole.meta.__class__(model=whole.meta.model, num_tokens=30, num_frozen=0),
    )
    c = Cartridge.compose([head, tail])
    for i in range(whole.num_layers):
        assert torch.equal(c.keys[i], whole.keys[i]) and torch.equal(c.values[i], whole.values[i])


def test_sinks_and_parts_are_recorded(tiny_lm):
    a = Cartridge.from_prefix(tiny_lm, TEXT, 25, num_frozen=2)
    b = Cartridge.from_prefix(tiny_lm, OTHER, 20)
    c = Cartridge.compose([a, b])
    assert c.num_frozen == 2  # the first part's sinks stay frozen
    assert [(p["offset"], p["num_tokens"], p["num_frozen"]) for p in c.meta.parts] == [(0, 25, 2), (25, 20, 1)]
    # every token is kept, the second part's sink included
    assert torch.equal(c.keys[0][:, 25], b.keys[0][:, 0])


def test_compose_refuses_different_models(tiny_llama, tiny_qwen):
    a = Cartridge.from_prefix(tiny_llama, TEXT, 20)
    b = Cartridge.from_prefix(tiny_qwen, TEXT, 20)
    with pytest.raises(IncompatibleCartridgeError, match="tiny-llama.*tiny-qwen2"):
        Cartridge.compose([a, b])


def test_compose_refuses_same_shape_other_tokenizer(tiny_llama):
    other = make_tiny_lm("llama", seed=1)
    other.identity = other.identity.__class__(
        name="tiny-llama-other-vocab", architecture=other.identity.architecture, tokenizer="0" * 16
    )
    a = Cartridge.from_prefix(tiny_llama, TEXT, 20)
    b = Cartridge.from_prefix(other, TEXT, 20)
    with pytest.raises(IncompatibleCartridgeError, match="tokenizer"):
        Cartridge.compose([a, b])


def test_reposition_needs_a_model(tiny_lm):
    a = Cartridge.from_prefix(tiny_lm, TEXT, 20)
    unbound = Cartridge(a.keys, a.values, a.meta)
    with pytest.raises(ConfigError, match="model"):
        Cartridge.compose([unbound, unbound], reposition=True)
    with pytest.raises(ConfigError, match="at least one"):
        Cartridge.compose([])
