"""KV compaction: exact at full length, better with more tokens, chunked within the model's context."""

from __future__ import annotations

import copy

import pytest
import torch

from cartridges_sdk import Cartridge, load_model
from cartridges_sdk.making.compaction import attention_error
from cartridges_sdk.making.settings import CompactionConfig
from cartridges_sdk.errors import ConfigError
from cartridges_sdk.testing import tiny_lm as make_tiny_lm

from conftest import TEXT


def _ids(lm, n):
    ids = lm.encode(TEXT)
    assert len(ids) >= n
    return ids[:n]


def test_compacting_to_full_length_is_the_prefix_cartridge(tiny_lm):
    ids = _ids(tiny_lm, 300)
    compact = Cartridge.compact(tiny_lm, ids, len(ids), progress=False, report=False)
    prefix = Cartridge.from_prefix(tiny_lm, ids, len(ids))
    assert compact.meta.init == "compact"
    for ck, pk, cv, pv in zip(compact.keys, prefix.keys, compact.values, prefix.values):
        assert torch.equal(ck, pk) and torch.equal(cv, pv)
    # and so the same next-token distribution as the text in context
    question = tiny_lm.encode("Who keeps the light?")
    in_context = tiny_lm.logits(ids + question)[len(ids):]
    torch.testing.assert_close(compact.logits(question), in_context, atol=1e-4, rtol=1e-4)


def test_attention_error_falls_as_num_tokens_grows(tiny_lm):
    ids = _ids(tiny_lm, 600)
    errors = [attention_error(tiny_lm, ids, Cartridge.compact(tiny_lm, ids, p, progress=False, report=False)) for p in (16, 64, 256, 600)]
    assert errors[0] > errors[1] > errors[2] > errors[3]
    assert errors[3] < 1e-5  # nothing dropped: the outputs are the text's own


def test_compaction_beats_keeping_the_first_tokens(tiny_lm):
    """Fitted values and chosen keys reproduce the whole text's attention better than its first p tokens do."""
    ids = _ids(tiny_lm, 600)
    compact = Cartridge.compact(tiny_lm, ids, 64, progress=False, report=False)
    # the first 64 tokens, seen from where the text ends (the frame compaction fits in)
    from cartridges_sdk.lm import rope_inv_freq
    from cartridges_sdk.rope import shift_keys

    inv = rope_inv_freq(tiny_lm)
    first = Cartridge.from_prefix(tiny_lm, ids, 64)
    first = Cartridge([shift_keys(k, -(600 - 64), inv) for k in first.keys], first.values, first.meta, lm=tiny_lm)
    assert attention_error(tiny_lm, ids, compact) < attention_error(tiny_lm, ids, first)


def test_a_corpus_longer_than_the_context_is_compacted_per_chunk_within_it():
    lm = make_tiny_lm("llama")
    model = copy.deepcopy(lm.model)
    model.config.max_position_embeddings = 200
    short = load_model(model, lm.tokenizer)
    ids = _ids(short, 700)
    seen = []

    def watch(_module, args, kwargs):
        pos = kwargs.get("position_ids")
        seen.append(int(pos.max()) + 1 if pos is not None else kwargs["input_ids"].shape[1])

    hook = short.model.base_model.register_forward_pre_hook(watch, with_kwargs=True)
    try:
        c = Cartridge.compact(short, ids, 64, progress=False, report=False)
    finally:
        hook.remove()
    assert seen and max(seen) <= 200
    with pytest.raises(ConfigError, match="use chunk_questions=0"):  # its own questions need more room than that
        Cartridge.compact(short, ids, 64, config=CompactionConfig(chunk_questions=2), progress=False, report=False)
    info = c.meta.extra["compaction"]
    assert len(info["chunks"]) == 4 and sum(info["chunk_tokens"]) == 64 == c.num_tokens
    assert [p["offset"] for p in c.meta.parts] == [0, 16, 32, 48]
    assert c.meta.init == "compact" and c.meta.corpus["num_tokens"] == 700
    assert torch.isfinite(c.logits(short.encode("Who keeps the light?"))).all()


def test_compaction_round_trips_through_the_file(tmp_path, tiny_llama):
    ids = _ids(tiny_llama, 300)
    c = Cartridge.compact(tiny_llama, ids, 32, progress=False, report=False)
    back = Cartridge.load(c.save(tmp_path / "c.safetensors"), tiny_llama)
    assert back.meta.init == "compact" and back.meta.extra["compaction"]["corpus_tokens"] == 300
    torch.testing.assert_close(back.logits(ids[:5]), c.logits(ids[:5]))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"select": "best"}, "select='best'"),
        ({"corpus_queries": -1}, "corpus_queries=-1"),
        ({"ridge": float("nan")}, "ridge=nan"),
        ({"corpus_queries": 0}, "no probe_questions"),
        ({"max_chunk_tokens": 1}, "max_chunk_tokens=1"),
        ({"probe_questions": ("",)}, "probe_questions"),
        ({"probe_questions": "Summarize it."}, "must be a list of questions"),
        ({"mass": "False"}, "mass='False' must be true or false"),
        ({"ridge": 0}, "ridge=0"),
        ({"keep_surprising": 1.0}, "keep_surprising=1.0 must be a share"),
        ({"keep_surprising": -0.1}, "keep_surprising=-0.1"),
        ({"keep_surprising": True}, "keep_surprising=True"),
    ],
)
def test_bad_settings_are_refused_by_name(settings, message):
    with pytest.raises(ConfigError, match=message):
        CompactionConfig(**settings)


def test_bad_sizes_are_refused_before_any_work(tiny_llama):
    ids = _ids(tiny_llama, 100)
    with pytest.raises(ConfigError, match="more than the 100 tokens"):
        Cartridge.compact(tiny_llama, ids, 101, progress=False, report=False)
    with pytest.raises(ConfigError, match="num_tokens=1"):
        Cartridge.compact(tiny_llama, ids, 1, progress=False, report=False)
    with pytest.raises(ConfigError, match="too few for a corpus read in 5 chunks.*max_chunk_tokens"):
        Cartridge.compact(tiny_llama, ids, 3, config=CompactionConfig(max_chunk_tokens=20), progress=False, report=False)


@pytest.mark.default_model
def test_compacted_beats_the_first_tokens_on_held_out_questions(default_lm):
    """On hand-written questions about the sample corpus (never seen by compaction), a compacted cartridge is
    closer to the text in context than the first-p start, on gold-answer likelihood and on KL."""
    import json
    from pathlib import Path

    from cartridges_sdk.making.evaluation import score

    spec = json.loads((Path(__file__).parent / "data" / "harrow_point_qa.json").read_text())
    qa = [tuple(pair) for pair in spec["qa"]]
    first, compact = score(default_lm, TEXT, [Cartridge.from_prefix(default_lm, TEXT, 64),
                                             Cartridge.compact(default_lm, TEXT, 64, progress=False, report=False)], qa)
    print(f"first 64: nll {first.nll_cartridge:.3f} kl {first.kl_icl_cartridge:.3f} | "
          f"compact 64: nll {compact.nll_cartridge:.3f} kl {compact.kl_icl_cartridge:.3f}")
    # measured: NLL 4.106 -> 3.037, KL 0.976 -> 0.362 (self-study's quality test reaches 3.96 and 0.945)
    assert compact.nll_cartridge < first.nll_cartridge - 0.5
    assert compact.kl_icl_cartridge < first.kl_icl_cartridge - 0.3


def test_token_ids_may_come_as_a_tensor(tiny_llama):
    ids = _ids(tiny_llama, 120)
    a = Cartridge.compact(tiny_llama, ids, 16, progress=False, report=False)
    b = Cartridge.compact(tiny_llama, torch.tensor(ids), 16, progress=False, report=False)
    assert all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        Cartridge.compact(tiny_llama, [10**7] * 20, 16, progress=False, report=False)


def test_chunk_shares_add_up_and_follow_the_lengths():
    import random

    from cartridges_sdk.making.compaction import _shares, _split

    rng = random.Random(0)
    for _ in range(500):
        total, limit = rng.randint(2, 5000), rng.randint(2, 800)
        lengths = [b - a for a, b in _split(total, limit)]
        assert sum(lengths) == total and max(lengths) <= limit and max(lengths) - min(lengths) <= 1
        if total < 2 * len(lengths):
            continue
        budget = rng.randint(2 * len(lengths), total)
        shares = _shares(budget, lengths)
        assert sum(shares) == budget and all(2 <= s <= n for s, n in zip(shares, lengths))
        assert max(shares) - min(shares) <= 2  # chunks of (nearly) equal length get (nearly) equal shares


def test_the_attention_function_is_restored_after_an_error(tiny_llama):
    from cartridges_sdk.making.recording import recording as _recording

    before = tiny_llama.model.config._attn_implementation
    with pytest.raises(KeyError):
        with _recording(tiny_llama):
            assert tiny_llama.model.config._attn_implementation != before
            raise KeyError("boom")
    assert tiny_llama.model.config._attn_implementation == before
    ids = _ids(tiny_llama, 40)
    torch.testing.assert_close(tiny_llama.logits(ids), tiny_llama.logits(ids))  # and the model still runs


@pytest.mark.parametrize("select", ["max", "mean"])
def test_the_fit_reads_queries_in_blocks_without_changing_the_result(monkeypatch, select):
    """Blocks bound the fit's memory on long chunks; they must not change what is kept or fitted."""
    from cartridges_sdk.making import compaction

    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 300, 8, generator=g), torch.randn(2, 300, 8, generator=g)
    queries = 2 * torch.randn(6, 250, 8, generator=g)
    whole = compaction.fit_layer(keys, values, queries, 0.35, 40, 0.01, select=select)
    monkeypatch.setattr(compaction, "QUERY_BLOCK", 37)
    blocked = compaction.fit_layer(keys, values, queries, 0.35, 40, 0.01, select=select)
    for a, b in zip(whole, blocked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert whole[0].shape == (2, 40, 8) and whole[1].shape == (2, 40, 8)


def test_another_thread_answers_as_usual_while_compaction_records(tiny_llama):
    """A server thread answering while a watcher compacts (serve --watch) gets the model's own attention."""
    import threading

    from cartridges_sdk.making import recording

    x = torch.tensor([tiny_llama.encode("The keeper rowed out at dawn.")])
    with torch.no_grad():
        want = tiny_llama.model(x).logits
    got = {}

    def answer():
        with torch.no_grad():
            got["logits"] = tiny_llama.model(x).logits

    with recording.recording(tiny_llama) as recorder:
        thread = threading.Thread(target=answer)
        thread.start()
        thread.join()
    assert torch.equal(got["logits"], want) and not recorder.queries  # nothing of the other thread's was recorded


def test_recordings_that_overlap_in_two_threads_each_record_and_the_last_restores(tiny_llama):
    """Two threads recording at once (two answers cutting cartridges by attention, or one and a compaction), the
    first closing before the second: the second still records, and the model gets its own attention back only when
    both are closed."""
    import threading

    from cartridges_sdk.making import recording

    ids = tiny_llama.encode("The keeper rowed out at dawn.")
    before = tiny_llama.model.config._attn_implementation
    opened, closed, got = threading.Event(), threading.Event(), {}

    def second():
        with recording.recording(tiny_llama) as recorder:
            opened.set()
            closed.wait(30)  # the first recording closes meanwhile
            got["switched"] = tiny_llama.model.config._attn_implementation
            tiny_llama.logits(ids)
            got["layers"] = len(recorder.queries)

    with recording.recording(tiny_llama) as first:
        thread = threading.Thread(target=second)
        thread.start()
        assert opened.wait(30)
        tiny_llama.logits(ids)
    closed.set()
    thread.join(30)
    assert first.queries and got["switched"] == recording.RECORDING
    assert got["layers"] == len(first.queries)  # the second recorded every layer after the first had closed
    assert tiny_llama.model.config._attn_implementation == before  # the last to close switched it back


def test_the_chunks_own_questions_are_references_and_asking_them_is_not(tiny_llama, monkeypatch):
    """chunk_questions: the model asks its own questions about the chunk (sampled with a fixed seed, so the cartridge
    is the same every time), and only those questions and their answers become reference queries."""
    from cartridges_sdk.making import compaction

    lm, ids = tiny_llama, _ids(tiny_llama, 200)
    asked: list[list[int]] = []
    own_questions = compaction._own_questions

    def spy(lm_, cache, start, count, rec):
        before = {i: len(q) for i, q in rec.queries.items()}
        questions = own_questions(lm_, cache, start, count, rec)
        assert {i: len(q) for i, q in rec.queries.items()} == before  # asking recorded nothing
        assert cache.get_seq_length() == start  # and left the chunk's cache as it was
        asked.extend(questions)
        return questions

    monkeypatch.setattr(compaction, "_own_questions", spy)
    references = []
    fit = compaction.fit_layer
    monkeypatch.setattr(compaction, "fit_layer",
                        lambda k, v, q, *a, **kw: references.append(q.shape[1]) or fit(k, v, q, *a, **kw))
    config = CompactionConfig(corpus_queries=0, chunk_questions=3, answer_tokens=4)
    first = Cartridge.compact(lm, ids, 32, config=config, progress=False, report=False)
    # the answers' tokens only (at most 4 a question, one query each): not the prompts' chat-template tokens
    assert 0 < references[0] <= 3 * 4 and len(set(references)) == 1
    again = Cartridge.compact(lm, ids, 32, config=config, progress=False, report=False)
    assert len(asked) == 6 and asked[:3] == asked[3:] and len({tuple(q) for q in asked[:3]}) == 3
    for a, b in zip(first.keys + first.values, again.keys + again.values):
        assert torch.equal(a, b)
    plain = Cartridge.compact(lm, ids, 32, config=CompactionConfig(chunk_questions=0), progress=False, report=False)
    assert not all(torch.equal(a, b) for a, b in zip(first.values, plain.values))
    assert first.meta.extra["compaction"]["chunk_questions"] == 3
    with pytest.raises(ConfigError, match="chunk_questions=-1"):
        CompactionConfig(chunk_questions=-1)


@pytest.mark.default_model
def test_the_least_expected_words_are_chosen_whole(default_lm):
    """`keep_surprising` chooses the words holding the tokens the model least expected, each word whole (a rare
    name's tail is what a reader needs to spell it), never the sink."""
    from cartridges_sdk.making import compaction

    ids = default_lm.encode(TEXT)
    _, _, _, surprisal = compaction._read(default_lm, ids, CompactionConfig(keep_surprising=0.5).for_model(default_lm))
    assert surprisal.shape == (len(ids),) and surprisal[0] == 0 and bool((surprisal[1:] > 0).all())
    kept = compaction.surprising_words(default_lm, ids, surprisal, 40).tolist()
    assert 0 < len(kept) <= 40 and 0 not in kept
    assert int(surprisal[1:].argmax()) + 1 in kept  # the least expected token of all
    # the lamp's fuel, spelled once in the text: every token of the word, or none of them
    fuel = [i for i in range(len(ids)) if "col" in default_lm.tokenizer.decode(ids[i : i + 1]).lower()]
    assert fuel, "the sample should spell colza"
    word = range(fuel[0], fuel[0] + len(default_lm.tokenizer.encode(" colza", add_special_tokens=False)))
    assert all(i in kept for i in word) or not any(i in kept for i in word)
    assert compaction.surprising_words(default_lm, ids, surprisal, 0) is None


def test_kept_positions_stay_whatever_their_attention():
    """`fit_layer(keep=...)`: positions no reference query attends to stay, as the text's own keys (without the
    mass shift), beside the sink and the best-attended ones."""
    from cartridges_sdk.making.compaction import fit_layer

    torch.manual_seed(0)
    keys, values, queries = torch.randn(1, 64, 8), torch.randn(1, 64, 8), torch.randn(2, 30, 8)
    keys[0, 40] = keys[0, 41] = -5 * queries.mean((0, 1))  # attended by no query: never chosen otherwise
    plain, _ = fit_layer(keys, values, queries, 0.35, 8, 0.01, mass=False)
    kept, _ = fit_layer(keys, values, queries, 0.35, 8, 0.01, mass=False, keep=torch.tensor([40, 41]))
    def has(k, pos):
        return bool((k[0] == keys[0, pos]).all(-1).any())
    assert not has(plain, 40) and has(kept, 40) and has(kept, 41) and has(kept, 0) and kept.shape == (1, 8, 8)


def test_self_study_starts_from_the_compaction_asked_for(tiny_llama, tmp_path):
    """`from_corpus(compaction=...)` reaches the compacted start; a start kept by an earlier run is reused only when it
    was made with the same compaction settings."""
    from cartridges_sdk.making.selfstudy import initial_cartridge
    from cartridges_sdk.making.settings import StartConfig

    ids = _ids(tiny_llama, 200)
    saved = tmp_path / "start.safetensors"
    plain = initial_cartridge(tiny_llama, ids, 40, "compact", 0, saved=saved, progress=False)
    keep = CompactionConfig(keep_surprising=0.5)
    kept = initial_cartridge(tiny_llama, ids, 40, "compact", 0, saved=saved, progress=False, compaction=keep)
    assert kept.meta.extra["compaction"]["keep_surprising"] == 0.5
    assert not all(torch.equal(a, b) for a, b in zip(plain.keys, kept.keys))
    again = initial_cartridge(tiny_llama, ids, 40, "compact", 0, saved=saved, progress=False, compaction=keep)
    assert all(torch.equal(a, b) for a, b in zip(kept.keys, again.keys))
    # a start kept before the setting existed was made with its default, not with what is asked now
    import attrs

    older = Cartridge.load(saved, tiny_llama)
    made = {k: v for k, v in older.meta.extra["compaction"].items() if k != "keep_surprising"}
    Cartridge(older.keys, older.values, attrs.evolve(older.meta, extra={**older.meta.extra, "compaction": made})).save(saved)
    redone = initial_cartridge(tiny_llama, ids, 40, "compact", 0, saved=saved, progress=False, compaction=keep)
    assert redone.meta.extra["compaction"]["keep_surprising"] == 0.5
    with pytest.raises(ConfigError, match="must be a CompactionConfig"):
        StartConfig(40, "compact", compaction={"keep_surprising": 0.5})
    with pytest.raises(ConfigError, match="init='prefix'"):
        StartConfig(40, "prefix", compaction=keep)


def test_a_word_is_kept_whole_and_a_long_run_is_its_one_token(tiny_llama):
    from cartridges_sdk.making.compaction import MAX_WORD, surprising_words

    text = "go " + "x" * (MAX_WORD + 3) + " cat dog"
    ids = tiny_llama.encode(text)  # one token a character, after the BOS
    offset = len(ids) - len(text)
    surprisal = torch.zeros(len(ids))
    cat, run = offset + text.index("cat") + 1, offset + 3 + 5
    surprisal[cat], surprisal[run] = 9.0, 5.0
    # this tokenizer's space is a token of its own, and the letters after it continue it: the word is " cat"; the run
    # has no word edge in sight, so it is its one token
    kept = surprising_words(tiny_llama, ids, surprisal, 5).tolist()
    assert kept == sorted([offset + text.index(" cat") + i for i in range(4)] + [run])
