"""The ground truth: an untrained cartridge from the first p tokens behaves exactly like those tokens in context."""

from __future__ import annotations

import pytest
import torch

from cartridges_sdk import Cartridge

from conftest import TEXT

QUESTION = "When was the lighthouse built, and by whom?"


def _reference_generate(lm, context_ids, prompt_ids, max_new_tokens):
    """Greedy generation by transformers itself with the context tokens in the prompt."""
    ids = torch.tensor([context_ids + prompt_ids])
    out = lm.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=lm.pad_token_id,
        eos_token_id=sorted(lm.eos_token_ids),
    )
    new = out[0, ids.shape[1] :].tolist()
    eos = lm.eos_token_ids
    if new and new[-1] in eos:
        new = new[:-1]
    return lm.tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("p", [2, 17, 64, 100])
def test_logits_match_context_tiny(tiny_lm, p):
    ids = tiny_lm.encode(TEXT)
    q = tiny_lm.chat_ids([{"role": "user", "content": QUESTION}])
    c = Cartridge.from_prefix(tiny_lm, ids[:p], p)
    got = tiny_lm.logits(q, [c])
    want = tiny_lm.logits(ids[:p] + q)[p:]
    assert got.shape == (len(q), tiny_lm.model.config.vocab_size)
    assert (got - want).abs().max().item() <= 1e-4
    # the body-only pass (`LM.hidden`, what the attention cut reads) is the same pass: in context too, and the LM
    # head over its states gives the logits
    hidden = tiny_lm.hidden(q, [c])
    assert (hidden - tiny_lm.hidden(ids[:p] + q)[p:]).abs().max().item() <= 1e-4
    with torch.inference_mode():
        assert (tiny_lm.model.get_output_embeddings()(hidden).float() - got).abs().max().item() <= 1e-4


def test_cartridge_changes_logits(tiny_lm):
    """Guard against a vacuous pass: with the cartridge the logits differ from no context at all."""
    ids = tiny_lm.encode(TEXT)
    q = tiny_lm.chat_ids([{"role": "user", "content": QUESTION}])
    c = Cartridge.from_prefix(tiny_lm, ids, 40)
    assert (tiny_lm.logits(q, [c]) - tiny_lm.logits(q)).abs().max().item() > 1e-2


def test_greedy_ask_matches_generate_in_context_tiny(tiny_lm):
    ids = tiny_lm.encode(TEXT)
    p = 50
    c = Cartridge.from_prefix(tiny_lm, TEXT, p)
    prompt = tiny_lm.chat_ids([{"role": "user", "content": QUESTION}])
    want = _reference_generate(tiny_lm, ids[:p], prompt, 24)
    assert c.ask(QUESTION, max_new_tokens=24) == want


def test_batched_ask_equals_one_at_a_time(tiny_lm):
    c = Cartridge.from_prefix(tiny_lm, TEXT, 60)
    questions = ["Who?", "When was the tower automated and who left?", "Where did the granite come from?"]
    batched = c.ask(questions, max_new_tokens=16)
    single = [c.ask(q, max_new_tokens=16) for q in questions]
    assert batched == single


def test_several_cartridges_equal_their_concatenated_context(tiny_lm):
    """Two prefix cartridges in a row behave like the two texts' tokens in context, when keys are repositioned."""
    a = tiny_lm.encode(TEXT)[:30]
    b = tiny_lm.tokenizer("Other notes about keepers and lamps.", add_special_tokens=False)["input_ids"]
    ca = Cartridge.from_prefix(tiny_lm, a, len(a))
    # b's KV computed right after a's, as one text; then split into two cartridges
    both = Cartridge.from_prefix(tiny_lm, a + b, len(a) + len(b))
    cb = Cartridge(
        [k[:, len(a) :] for k in both.keys],
        [v[:, len(a) :] for v in both.values],
        both.meta.__class__(model=both.meta.model, num_tokens=len(b), num_frozen=0),
    )
    q = tiny_lm.chat_ids([{"role": "user", "content": QUESTION}])
    got = tiny_lm.logits(q, [ca, cb])
    want = tiny_lm.logits(a + b + q)[len(a) + len(b) :]
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.default_model
@pytest.mark.parametrize("p", [64, 200, 333])
def test_logits_match_context_default_model(default_lm, p):
    ids = default_lm.encode(TEXT)
    q = default_lm.chat_ids([{"role": "user", "content": QUESTION}])
    c = Cartridge.from_prefix(default_lm, ids, p)
    got = default_lm.logits(q, [c])
    want = default_lm.logits(ids[:p] + q)[p:]
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.default_model
def test_greedy_ask_matches_generate_in_context_default_model(default_lm):
    ids = default_lm.encode(TEXT)
    p = 120  # the first paragraph: who built it and when
    c = Cartridge.from_prefix(default_lm, TEXT, p)
    prompt = default_lm.chat_ids([{"role": "user", "content": QUESTION}])
    want = _reference_generate(default_lm, ids[:p], prompt, 32)
    got = c.ask(QUESTION, max_new_tokens=32, runtime="hf")  # the student's own numbers: HF, not llama.cpp
    assert got == want
    assert "1871" in got or "Ellison" in got  # the answer is in the paragraph the cartridge holds
