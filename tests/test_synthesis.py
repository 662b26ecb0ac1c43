"""Self-study synthesis: grouping, exact teacher top-k, the Parquet dataset, resume, and bad-record handling."""

from __future__ import annotations

import json
import random
from contextlib import nullcontext

import attrs
import numpy as np
import pytest
import torch

from cartridges_sdk import Cartridge, Completion, ConfigError, Synthesizer, SynthesizerCapabilities
from cartridges_sdk.making.dataset import HEADER, SelfStudyDataset, Shard, merge
from cartridges_sdk.hf import HFSynthesizer
from cartridges_sdk.generation import SynthesisRequest
from cartridges_sdk.making.selfstudy import train_cartridge
from cartridges_sdk.making.conversations import teacher_prompt
from cartridges_sdk.making.settings import SynthesisConfig
from cartridges_sdk.making.synthesis import synthesize
from cartridges_sdk.trainer_inputs import ROLE_ASSISTANT

from conftest import TEXT


class FakeSynthesizer(Synthesizer):
    """Deterministic replies built from the request, with made-up top-k; can fail after N calls or spoil a reply.
    Its top-k fail the same-model probe, so tests that use it say allow_unverified_model=True."""

    capabilities = SynthesizerCapabilities(max_top_logprobs=20)

    def __init__(self, lm, fail_after: int | None = None, spoil: int | None = None):
        self.lm, self.calls, self.fail_after, self.spoil = lm, 0, fail_after, spoil
        self.seen_groups: list[list[int | None]] = []
        self.prompts: list[list[list[int]]] = []  # each call's requests' prompt ids

    def identity(self):
        return self.lm.identity

    def complete(self, requests):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("killed")
        self.calls += 1
        self.seen_groups.append([r.group for r in requests])
        self.prompts.append([list(r.prompt_ids) for r in requests])
        out = []
        for i, r in enumerate(requests):
            rng = random.Random(r.seed)
            text = f"reply {rng.randint(0, 999)} to {self.lm.tokenizer.decode(r.prompt_ids[-20:])[:12]}"
            ids = self.lm.tokenizer(text, add_special_tokens=False)["input_ids"][: r.max_tokens]
            k = r.top_logprobs
            top_ids = np.array([[(t + j) % 90 for j in range(k)] for t in ids]) if k else None
            top_lps = np.log(np.full((len(ids), k), 1.0 / (k + 1))) if k else None
            if k and self.spoil is not None and r.group == 0 and i == self.spoil:
                top_ids = top_ids + 10**6  # outside the vocabulary
            out.append(Completion(text=text, token_ids=tuple(ids), finish_reason="length", top_ids=top_ids, top_logprobs=top_lps))
        return out


def _config(**kw):
    base = dict(num_conversations=10, conversations_per_chunk=4, min_chunk=40, max_chunk=120, max_tokens_a=16,
                max_tokens_b=24, top_k=5, seed=3, document_windows=0)
    return SynthesisConfig(**{**base, **kw})


def test_dataset_round_trip_and_alignment(tiny_lm, tmp_path):
    ds = synthesize(TEXT, tiny_lm, tmp_path / "d", _config(), synthesizer=FakeSynthesizer(tiny_lm), allow_unverified_model=True, progress=False)
    convs = SelfStudyDataset(tmp_path / "d").conversations()
    assert len(convs) == 10 and sorted(c.conv_id for c in convs) == list(range(10))
    for c in convs:
        assert c.topk_ids.shape == c.topk_logprobs.shape == (len(c.target_positions), 5)
        assert (c.role_mask[c.target_positions] == ROLE_ASSISTANT).all()
        assert c.messages[0]["role"] == "user" and c.messages[1]["role"] == "assistant"
        # the targets are exactly B's reply tokens, placed after the student's chat turn
        reply = tiny_lm.tokenizer(c.messages[1]["content"], add_special_tokens=False)["input_ids"][:24]
        assert c.input_ids[c.target_positions].tolist() == reply
        assert c.input_ids[: c.target_positions[0]].tolist() == tiny_lm.chat_ids([c.messages[0]])
    assert ds.header["config"]["top_k"] == 5 and ds.header["corpus"]["num_tokens"] > 0


def test_requests_are_grouped_by_chunk(tiny_lm, tmp_path):
    fake = FakeSynthesizer(tiny_lm)
    synthesize(TEXT, tiny_lm, tmp_path / "d", _config(), synthesizer=fake, allow_unverified_model=True, progress=False)
    # the same-model probe (no group), then one call per participant per round per group: A then B for groups 0, 1, 2
    assert [set(g) for g in fake.seen_groups] == [{None}, {0}, {0}, {1}, {1}, {2}, {2}]
    assert [len(g) for g in fake.seen_groups] == [1, 4, 4, 4, 4, 2, 2]


def test_killed_synthesis_resumes_without_loss_or_duplicates(tiny_lm, tmp_path):
    whole = synthesize(TEXT, tiny_lm, tmp_path / "whole", _config(), synthesizer=FakeSynthesizer(tiny_lm), allow_unverified_model=True, progress=False)
    with pytest.raises(KeyboardInterrupt):
        synthesize(TEXT, tiny_lm, tmp_path / "part", _config(), synthesizer=FakeSynthesizer(tiny_lm, fail_after=3), allow_unverified_model=True, progress=False)
    assert SelfStudyDataset(tmp_path / "part").done_groups() == {0}
    resumed = synthesize(TEXT, tiny_lm, tmp_path / "part", _config(), synthesizer=FakeSynthesizer(tiny_lm), allow_unverified_model=True, progress=False)
    a = sorted(whole.conversations(), key=lambda c: c.conv_id)
    b = sorted(resumed.conversations(), key=lambda c: c.conv_id)
    assert [c.conv_id for c in b] == list(range(10))
    for x, y in zip(a, b):
        assert np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.topk_ids, y.topk_ids)
        assert x.messages == y.messages


def test_a_dataset_begun_before_b_context_existed_resumes_as_made_with_chunk(tiny_lm, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        synthesize(TEXT, tiny_lm, tmp_path / "d", _config(), synthesizer=FakeSynthesizer(tiny_lm, fail_after=3),
                   allow_unverified_model=True, progress=False)
    header = tmp_path / "d" / HEADER
    old = json.loads(header.read_text())
    del old["config"]["b_context"]  # as an older version wrote it
    header.write_text(json.dumps(old))
    resumed = synthesize(TEXT, tiny_lm, tmp_path / "d", _config(), synthesizer=FakeSynthesizer(tiny_lm),
                         allow_unverified_model=True, progress=False)
    assert sorted(c.conv_id for c in resumed.conversations()) == list(range(10))


def test_other_settings_on_the_same_path_are_refused(tiny_lm, tmp_path):
    synthesize(TEXT, tiny_lm, tmp_path / "d", _config(), synthesizer=FakeSynthesizer(tiny_lm), allow_unverified_model=True, progress=False)
    with pytest.raises(ConfigError, match="other settings"):
        synthesize(TEXT, tiny_lm, tmp_path / "d", _config(top_k=7), synthesizer=FakeSynthesizer(tiny_lm), allow_unverified_model=True, progress=False)


def test_bad_conversation_is_reported_and_skipped(tiny_lm, tmp_path):
    with pytest.warns(UserWarning, match="Skipped 1 bad conversation.*top-k ids outside"):
        ds = synthesize(TEXT, tiny_lm, tmp_path / "d", _config(), synthesizer=FakeSynthesizer(tiny_lm, spoil=1), allow_unverified_model=True, progress=False)
    assert len(ds) == 9 and 1 not in {c.conv_id for c in ds}


def test_hf_teacher_topk_is_exact(tiny_lm):
    """Stored top-k log-probs equal the model's own distribution at each generated token, chunk in context."""
    synth = HFSynthesizer(tiny_lm)
    context = tiny_lm.encode(TEXT[:300])
    reqs = [
        SynthesisRequest(teacher_prompt(tiny_lm, context, [{"role": "user", "content": q}]), max_tokens=12,
                         temperature=1.0, top_logprobs=4, group=0, seed=s)
        for s, q in enumerate(["Who built it?", "When was the tower automated, and by whom?"])
    ]
    outs = synth.complete(reqs)
    for req, out in zip(reqs, outs):
        prompt = list(req.prompt_ids)
        logp = tiny_lm.logits(prompt + list(out.token_ids)).log_softmax(-1)
        steps = logp[len(prompt) - 1 : len(prompt) - 1 + len(out.token_ids)]
        want = torch.topk(steps, 4, dim=-1)
        assert out.top_ids.shape == (len(out.token_ids), 4)
        assert np.array_equal(out.top_ids, want.indices.numpy())
        assert np.abs(out.top_logprobs - want.values.numpy()).max() <= 1e-4


def test_b_context_document_has_the_teacher_read_the_whole_corpus(tiny_lm, tmp_path):
    """A reads its chunk either way; B reads that chunk by default and the whole corpus with b_context='document'."""
    text = TEXT[:1200]  # 1,200 tokens (the tiny tokenizer reads characters): with a prompt, within its 2,048
    whole = tiny_lm.encode(text)
    for b_context in ("chunk", "document"):
        fake = FakeSynthesizer(tiny_lm)  # keeps no prefix: with the document, every one of B's requests reads it again
        warned = pytest.warns(UserWarning, match="reads the whole corpus again")
        with warned if b_context == "document" else nullcontext():
            ds = synthesize(text, tiny_lm, tmp_path / b_context, _config(b_context=b_context), synthesizer=fake,
                            allow_unverified_model=True, progress=False)
        a_calls, b_calls = fake.prompts[1::2], fake.prompts[2::2]  # after the same-model probe: A, B per group
        assert len(a_calls) == len(b_calls) == 3
        assert max(len(p) for call in a_calls for p in call) < len(whole) // 2  # a chunk (<= 120 tokens) and a seed
        reads_whole = [p[: len(whole)] == whole for call in b_calls for p in call]
        assert all(reads_whole) if b_context == "document" else not any(reads_whole)
        assert len(ds) == 10 and {c.chunk for c in ds.conversations()} != {(0, len(whole))}  # A's chunks are kept


def test_b_context_document_refuses_a_corpus_longer_than_the_context(tiny_lm, tmp_path):
    long_text = TEXT  # 1,765 tokens: with the markup and turns allowed for, more than the tiny model's 2,048
    with pytest.raises(ConfigError, match="A self-study prompt \\(a document of up to .*b_context='chunk'"):
        synthesize(long_text, tiny_lm, tmp_path / "d", _config(b_context="document"),
                   synthesizer=HFSynthesizer(tiny_lm), progress=False)
    with pytest.raises(ConfigError, match="b_context='whole' must be 'chunk'.*or 'document'"):
        _config(b_context="whole")


def test_a_synthesizer_started_with_less_context_than_the_model_refuses_what_it_cannot_take(tiny_lm, tmp_path):
    """An engine started with a shorter context (vLLM's max_model_len) would fail or cut short mid-run: refused
    first."""
    synth = HFSynthesizer(tiny_lm)
    synth.capabilities = attrs.evolve(synth.capabilities, max_context=300)
    with pytest.raises(ConfigError, match=r"A self-study prompt .* needs 416 tokens, more than the 300 that "
                                          r"HFSynthesizer was started with; lower .*max_chunk, or start it with"):
        synthesize(TEXT, tiny_lm, tmp_path / "d", _config(), synthesizer=synth, progress=False)
    assert not (tmp_path / "d").exists()
    synth.capabilities = attrs.evolve(synth.capabilities, max_context=416)  # exactly enough
    assert len(synthesize(TEXT, tiny_lm, tmp_path / "d", _config(num_conversations=4), synthesizer=synth,
                          progress=False)) == 4


def test_hf_synthesizer_keeps_a_and_bs_prefixes(tiny_lm, monkeypatch):
    """A's and B's shared prompts alternate group after group; each is prefilled once, however a group's questions
    begin and however many it has, and every answer is the one a fresh synthesizer gives."""
    made = []
    real = Cartridge.from_prefix
    monkeypatch.setattr(Cartridge, "from_prefix", lambda *a, **k: made.append(len(a[1])) or real(*a, **k))
    synth = HFSynthesizer(tiny_lm)
    doc, chunk = tiny_lm.encode(TEXT[:600]), tiny_lm.encode(TEXT[:200])
    # a kept prefix covering all of the next group's shared prompt, one covering all but its tail (a question
    # beginning with another letter: the kept KV is cut), and a one-request group
    groups = [("Who built it?", "When?"), ("Where is it?", "Where was it built?"), ("How tall?", "How old?"),
              ("Why?",)]
    calls = []
    for group, questions in enumerate(groups):
        for context in (chunk, doc):
            requests = [SynthesisRequest(teacher_prompt(tiny_lm, context, [{"role": "user", "content": q}]),
                                         max_tokens=3, temperature=0.0, top_logprobs=3, group=group, seed=0)
                        for q in questions]
            calls.append((requests, synth.complete(requests)))
    assert len(made) == 2
    monkeypatch.setattr(Cartridge, "from_prefix", real)
    for requests, outs in calls:
        for want, got in zip(HFSynthesizer(tiny_lm).complete(requests), outs):
            assert want.token_ids == got.token_ids
            assert np.abs(want.top_logprobs - got.top_logprobs).max() <= 1e-4
    synth.close()
    assert not synth._prefixes


def test_targets_all_with_the_document_scores_after_the_document(tiny_lm, tmp_path, monkeypatch):
    text = TEXT[:1200]
    prefixes = []
    real = HFSynthesizer.score
    monkeypatch.setattr(HFSynthesizer, "score", lambda self, p, *a: prefixes.append(list(p)) or real(self, p, *a))
    cfg = _config(num_conversations=4, conversations_per_chunk=4, max_tokens_a=6, max_tokens_b=6, top_k=4,
                  targets="all", b_context="document")
    ds = synthesize(text, tiny_lm, tmp_path / "d", cfg, synthesizer=HFSynthesizer(tiny_lm), progress=False)
    assert len(ds) == 4 and len(prefixes) == 4 and all(p == tiny_lm.encode(text) for p in prefixes)


def test_synthesizer_for_another_model_is_refused(tiny_llama, tiny_qwen, tmp_path):
    from cartridges_sdk import IncompatibleCartridgeError

    with pytest.raises(IncompatibleCartridgeError, match="same model"):
        synthesize(TEXT, tiny_llama, tmp_path / "d", _config(), synthesizer=HFSynthesizer(tiny_qwen), progress=False)


def test_targets_all_scores_every_token_and_agrees_on_answers(tiny_lm, tmp_path):
    """targets='all' adds the user turn as targets; on B's tokens its teacher top-k equals generation's."""
    cfg = dict(num_conversations=4, conversations_per_chunk=4, max_tokens_a=10, max_tokens_b=10, top_k=4)
    only_b = synthesize(TEXT, tiny_lm, tmp_path / "b", _config(**cfg), synthesizer=HFSynthesizer(tiny_lm), progress=False)
    every = synthesize(TEXT, tiny_lm, tmp_path / "all", _config(**cfg, targets="all"), synthesizer=HFSynthesizer(tiny_lm),
                       progress=False)
    for b, a in zip(only_b.conversations(), every.conversations()):
        assert np.array_equal(b.input_ids, a.input_ids)
        assert a.target_positions.tolist() == list(range(1, a.num_tokens))
        rows = b.target_positions - 1  # position t is the (t-1)-th row of the 'all' arrays
        assert np.array_equal(a.topk_ids[rows], b.topk_ids)
        assert np.abs(a.topk_logprobs[rows] - b.topk_logprobs).max() <= 1e-4


def test_document_windows_are_the_teachers_reread_of_its_chunk(tiny_lm, tmp_path):
    """Windows are consecutive slices of a chunk; each one's targets are the teacher's top-k for the window read
    right after the whole chunk, and their ids come after every conversation's."""
    from cartridges_sdk import Corpus

    cfg = _config(num_conversations=4, document_windows=5, windows_per_chunk=2, window_tokens=30)
    ds = synthesize(TEXT, tiny_lm, tmp_path / "d", cfg, synthesizer=HFSynthesizer(tiny_lm), progress=False)
    corpus_ids = Corpus.coerce(TEXT).token_ids(tiny_lm)
    convs = ds.conversations()
    windows = sorted((c for c in convs if c.seed_kind == "document"), key=lambda c: c.conv_id)
    assert [c.conv_id for c in windows] == [4, 5, 6, 7, 8]
    assert sorted(c.conv_id for c in convs if c.seed_kind != "document") == [0, 1, 2, 3]
    assert [len(set(c.group for c in windows[i : i + 2])) for i in (0, 2)] == [1, 1]
    for k, c in enumerate(windows):
        start, end = c.chunk
        offset = start + (k % 2) * 30
        assert c.input_ids.tolist() == corpus_ids[offset : offset + 30]
        assert c.target_positions.tolist() == list(range(1, 30))
        context = tiny_lm.encode(tiny_lm.tokenizer.decode(corpus_ids[start:end]))
        logp = tiny_lm.logits(context + c.input_ids.tolist()).log_softmax(-1)[len(context) : -1]
        want = torch.topk(logp, 5, dim=-1)
        assert np.array_equal(c.topk_ids, want.indices.numpy())
        assert np.abs(c.topk_logprobs - want.values.numpy()).max() <= 1e-4


def test_killed_window_synthesis_resumes(tiny_lm, tmp_path):
    cfg = _config(num_conversations=4, document_windows=6, windows_per_chunk=2, window_tokens=20)
    whole = synthesize(TEXT, tiny_lm, tmp_path / "whole", cfg, synthesizer=HFSynthesizer(tiny_lm), progress=False)

    killed = HFSynthesizer(tiny_lm)
    calls = []

    def score(*args, **kw):  # dies on the second window group, after the first was written
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed")
        return HFSynthesizer.score(killed, *args, **kw)

    killed.score = score
    with pytest.raises(KeyboardInterrupt):
        synthesize(TEXT, tiny_lm, tmp_path / "part", cfg, synthesizer=killed, progress=False)
    assert SelfStudyDataset(tmp_path / "part").done_groups() == {0, 1}
    resumed = synthesize(TEXT, tiny_lm, tmp_path / "part", cfg, synthesizer=HFSynthesizer(tiny_lm), progress=False)
    a = sorted(whole.conversations(), key=lambda c: c.conv_id)
    b = sorted(resumed.conversations(), key=lambda c: c.conv_id)
    assert [c.conv_id for c in b] == list(range(10))
    for x, y in zip(a, b):
        assert np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.topk_ids, y.topk_ids)


def contents(ds: SelfStudyDataset) -> list[tuple]:
    """Every field of every conversation, in a fixed order (a dataset's order is its parts' and holds no meaning)."""
    rows = [(c.conv_id, c.group, c.chunk, c.seed_kind, c.messages, c.input_ids.tolist(), c.role_mask.tolist(),
             c.target_positions.tolist(), c.topk_ids.tolist(), c.topk_logprobs.tolist()) for c in ds]
    return sorted(rows, key=lambda r: r[0])


SHARDED = dict(num_conversations=10, conversations_per_chunk=2, document_windows=6, windows_per_chunk=2,
               window_tokens=20)


def test_two_shards_merged_equal_the_one_process_dataset(tiny_lm, tmp_path):
    cfg = _config(**SHARDED)  # 5 conversation groups, then 3 window groups
    one = synthesize(TEXT, tiny_lm, tmp_path / "one", cfg, synthesizer=HFSynthesizer(tiny_lm), progress=False)
    shards = [synthesize(TEXT, tiny_lm, tmp_path / f"shard{i}", cfg, synthesizer=HFSynthesizer(tiny_lm),
                         progress=False, shard=Shard(i, 2)) for i in (0, 1)]
    assert [s.done_groups() for s in shards] == [{0, 2, 4, 6}, {1, 3, 5, 7}]  # disjoint, and together all 8
    assert [s.missing_groups() for s in shards] == [[], []]
    merged = merge([s.path for s in reversed(shards)], tmp_path / "merged")
    assert len(merged) == len(one) == 16 and merged.missing_groups() == []
    assert contents(merged) == contents(one)
    assert "shard" not in merged.header
    # the merged folder is the one-process dataset to a re-run too: nothing left to make, nothing refused
    watched, groups = HFSynthesizer(tiny_lm), []
    real_complete = watched.complete
    watched.complete = lambda requests: groups.extend(r.group for r in requests) or real_complete(requests)
    watched.score = None  # a window group made again would call it
    again = synthesize(TEXT, tiny_lm, tmp_path / "merged", cfg, synthesizer=watched, progress=False)
    assert contents(again) == contents(one) and groups == [None]  # the same-model probe alone


def test_a_partial_merge_names_what_is_missing_and_resumes_to_the_whole(tiny_lm, tmp_path):
    cfg = _config(**SHARDED)
    synthesize(TEXT, tiny_lm, tmp_path / "shard1", cfg, synthesizer=HFSynthesizer(tiny_lm), progress=False,
               shard=Shard(1, 2))
    merged = merge([tmp_path / "shard1"], tmp_path / "merged")
    assert merged.missing_groups() == [0, 2, 4, 6]
    with pytest.warns(UserWarning, match=r"lacks 4 of its settings' groups \(\[0, 2, 4, 6\]\).*left out of a merge"):
        train_cartridge(merged, tiny_lm, num_tokens=4, init="random", progress=False)
    whole = synthesize(TEXT, tiny_lm, tmp_path / "merged", cfg, synthesizer=HFSynthesizer(tiny_lm), progress=False)
    one = synthesize(TEXT, tiny_lm, tmp_path / "one", cfg, synthesizer=HFSynthesizer(tiny_lm), progress=False)
    assert contents(whole) == contents(one)


def test_shards_of_other_settings_do_not_mix(tiny_lm, tmp_path):
    cfg = _config(conversations_per_chunk=2)
    fake = lambda: FakeSynthesizer(tiny_lm)  # noqa: E731
    kw = dict(allow_unverified_model=True, progress=False)
    synthesize(TEXT, tiny_lm, tmp_path / "a", cfg, synthesizer=fake(), shard=Shard(0, 2), **kw)
    synthesize(TEXT, tiny_lm, tmp_path / "b", _config(conversations_per_chunk=2, top_k=3), synthesizer=fake(),
               shard=Shard(1, 2), **kw)
    with pytest.raises(ConfigError, match=r"other settings.*top_k: 5 -> 3.*only shards of one synthesis merge"):
        merge([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    assert not (tmp_path / "m" / "header.json").exists()
    with pytest.raises(ConfigError, match="holds shard 0 of 2, not shard 1 of 2; use a folder for each shard"):
        synthesize(TEXT, tiny_lm, tmp_path / "a", cfg, synthesizer=fake(), shard=Shard(1, 2), **kw)
    with pytest.raises(ConfigError, match="both a source and the output"):
        merge([tmp_path / "a"], tmp_path / "a")
    for bad, why in (("2/2", "index must be below the count"), ("1/0", "index must be below"),
                     ("a/2", "must be INDEX/COUNT"), ("3", "must be INDEX/COUNT")):
        with pytest.raises(ConfigError, match=why):
            Shard.parse(bad)


def test_windows_need_a_synthesizer_that_scores(tiny_lm, tmp_path):
    with pytest.raises(ConfigError, match="document_windows=2 needs a synthesizer that scores.*document_windows=0"):
        synthesize(TEXT, tiny_lm, tmp_path / "d", _config(document_windows=2), synthesizer=FakeSynthesizer(tiny_lm),
                   allow_unverified_model=True, progress=False)


def test_window_settings_that_cannot_make_a_target_are_refused(tiny_lm, tmp_path):
    with pytest.raises(ConfigError, match="window_tokens=1"):
        _config(window_tokens=1)
    with pytest.raises(ConfigError, match="document_windows=0"):
        synthesize("x", tiny_lm, tmp_path / "d", _config(num_conversations=1, document_windows=1), progress=False)


def test_packed_prompts_give_each_row_the_kv_it_would_have_alone(tiny_lm):
    """Prompts are prefilled packed end to end (no padding, duplicates once); each row's KV must equal the KV of
    the prefix and its own prompt computed alone."""
    from cartridges_sdk.hf.decode import prefill_rows

    prefix_ids = tiny_lm.encode(TEXT[:120])
    prompts = [tiny_lm.encode(t) for t in ("a question", "another, longer question here", "a question", "x")]
    rows = prefill_rows(tiny_lm, tiny_lm.kv(prefix_ids), prompts)
    assert len(rows) == len(prompts)
    for i, prompt in enumerate(prompts):
        layers = rows.row(i)
        alone = tiny_lm.kv(prefix_ids + prompt[:-1])
        assert len(layers) == len(alone)
        for (k, v), (k0, v0) in zip(layers, alone):
            torch.testing.assert_close(k, k0, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(v, v0, rtol=1e-4, atol=1e-5)
    no_prefix = prefill_rows(tiny_lm, None, prompts[:2])
    torch.testing.assert_close(no_prefix.row(1)[0][0], tiny_lm.kv(prompts[1][:-1])[0][0], rtol=1e-4, atol=1e-5)


def test_packed_rows_decode_as_the_same_rows_laid_out_one_by_one(tiny_lm):
    """`PackedRows` put padding between the shared prefix and each row's own tokens; decoding must not see it: the
    greedy tokens and top-k log-probabilities equal those of the rows written one by one (right-aligned)."""
    from cartridges_sdk import GenerationParams
    from cartridges_sdk.hf.decode import decode, prefill_rows

    prefix_ids = tiny_lm.encode(TEXT[:90])
    prompts = [tiny_lm.encode(t) for t in ("a question", "another, longer question here", "x", "a question")]
    packed = prefill_rows(tiny_lm, tiny_lm.kv(prefix_ids), prompts)
    params = GenerationParams(max_new_tokens=6, temperature=0.0)
    last = [p[-1:] for p in prompts]
    *_, fast = decode(tiny_lm, packed, last, params, top_logprobs=3)
    *_, slow = decode(tiny_lm, [packed.row(i) for i in range(len(prompts))], last, params, top_logprobs=3)
    assert fast.tokens == slow.tokens
    for a, b in zip(fast.top_logprobs, slow.top_logprobs):
        torch.testing.assert_close(torch.stack(a), torch.stack(b), rtol=1e-4, atol=1e-5)


def test_windows_scored_together_match_each_scored_alone(tiny_lm):
    """The HF synthesizer scores a chunk's equally long windows in one forward pass (and a shorter one apart): each
    window's top-k must be what the model gives it alone after the chunk. With `score_dtype` a copy of the model in
    that dtype scores, close to the float32 figures."""

    chunk = tiny_lm.encode(TEXT[:150])
    windows = [tiny_lm.encode(TEXT[a : a + 40])[:12] for a in (0, 50, 100)] + [tiny_lm.encode(TEXT[200:240])[:7]]
    scored = HFSynthesizer(tiny_lm).score(chunk, windows, 5)
    for window, (ids, lps) in zip(windows, scored):
        alone = tiny_lm.logits(window, [Cartridge.from_prefix(tiny_lm, chunk, len(chunk))])[:-1].log_softmax(-1)
        top = torch.topk(alone, 5, dim=-1)
        assert ids.shape == (len(window) - 1, 5)
        torch.testing.assert_close(torch.from_numpy(lps), top.values, rtol=1e-4, atol=1e-5)
        assert (ids[:, 0] == top.indices[:, 0].numpy()).all()
    in_bf16 = HFSynthesizer(tiny_lm, score_dtype="bf16")
    assert in_bf16.scorer.dtype == torch.bfloat16 and in_bf16.lm is tiny_lm
    for (_, lps), (_, lps16) in zip(scored, in_bf16.score(chunk, windows, 5)):
        torch.testing.assert_close(torch.from_numpy(lps16), torch.from_numpy(lps), rtol=0.05, atol=0.05)
