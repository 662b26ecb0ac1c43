"""The benchmark harness (benchmarks/): data parsing, budgets, and a whole run on a tiny model whose ICL and
untrained-cartridge figures are checked against a direct re-computation with the plain transformers model."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from conftest import TEXT

from benchmarks import measure, methods
from benchmarks.data import DEFAULT_DATA, EVALDATA, load_corpora, parse_question
from benchmarks.profiles import Profile, get_profile
from benchmarks.run import run
from cartridges_sdk import Cartridge
from cartridges_sdk.errors import ConfigError

DOC = TEXT[:700]
FREE = [("Who built the lighthouse?", "Margaret Ellison"), ("When was it built?", "In 1871.")]
MC = [
    ("What is Harrow Point?\n\n (A) a lighthouse \n (B) a harbour \n (C) a ship \n (D) a town", "(A) a lighthouse"),
    ("Which sea?\nA. the north one\nB. the south one\nC. the east one", "B"),
]
TINY = Profile("test", sizes=(16, 64, 5000), conversations=2, document_windows=2, generic_conversations=2,
               mmlu_per_topic=1, kv_budget_gib=0.0005, decode_tokens=2)


def _write(path: Path, docs: list[tuple[str, list[tuple[str, str]]]]) -> Path:
    with path.open("w") as f:
        for text, qa in docs:
            f.write(json.dumps({"input": text, "instructions": [q for q, _ in qa], "outputs": [a for _, a in qa]}) + "\n")
    return path


def test_parse_question_finds_options_and_gold_letters():
    q = parse_question(*MC[0])
    assert q.options == ("A", "B", "C", "D") and q.gold == "A" and q.multiple_choice
    q = parse_question(*MC[1])
    assert q.options == ("A", "B", "C") and q.gold == "B"
    q = parse_question("How did they obtain the dataset?", "public resources")
    assert not q.multiple_choice
    # a free-form answer that happens to start with a capital letter is not a choice
    assert not parse_question("Name it.", "A lighthouse").multiple_choice


def test_load_corpora_single_concat_and_errors(tmp_path):
    data = _write(tmp_path / "d.jsonl", [(DOC, FREE), (DOC[::-1], MC)])
    singles = load_corpora(data, "0,1")
    assert [c.name for c in singles] == ["d-0", "d-1"]
    assert not singles[0].multiple_choice and singles[1].multiple_choice
    (joined,) = load_corpora(data, "0,1", concat=True)
    assert joined.text == DOC + "\n\n" + DOC[::-1] and len(joined.questions) == 4 and joined.doc_indices == (0, 1)
    with pytest.raises(ConfigError, match="documents 0..1"):
        load_corpora(data, "2")
    with pytest.raises(ConfigError, match="comma-separated"):
        load_corpora(data, "first")
    with pytest.raises(ConfigError, match="does not exist"):
        load_corpora(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input": DOC, "instructions": ["q1", "q2"], "outputs": ["a1"]}) + "\n")
    with pytest.raises(ConfigError, match="2 instructions and 1 outputs"):
        load_corpora(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ConfigError, match="bad.jsonl:1 is not JSON"):
        load_corpora(bad)


@pytest.mark.skipif(not EVALDATA.is_dir(), reason="../shared/evaldata is not on this machine")
def test_real_multiple_choice_files_parse_as_multiple_choice():
    for name in ("quality_dev.jsonl", "tpo_dev.jsonl"):
        corpora = load_corpora(EVALDATA / name, ",".join(str(i) for i in range(8)))
        assert all(c.multiple_choice for c in corpora), name
    assert not any(c.multiple_choice for c in load_corpora(DEFAULT_DATA, "0,1,2"))


def test_profile_overrides_are_checked_and_renamed():
    custom = get_profile("quick", sizes=[128], conversations=8)
    assert custom.name == "quick+custom" and custom.sizes == (128,)
    assert get_profile("full").sizes == (128, 512, 2048)
    with pytest.raises(ConfigError, match="Unknown profile setting"):
        get_profile("quick", lr=0.1)
    with pytest.raises(ConfigError, match="sizes"):
        get_profile("quick", sizes=[])
    with pytest.raises(ConfigError, match="--profile 'fast'"):
        get_profile("fast")


def test_raw_windows_are_next_token_targets_that_cover_both_ends(tiny_llama):
    ids = list(range(10, 10 + 1000))
    windows = methods.raw_windows(ids, 12, seed=0, width=100)
    assert len(windows) == 12 and all(w.num_tokens == 100 for w in windows)
    for w in windows:
        assert (w.topk_ids[:, 0] == w.input_ids[1:]).all() and (w.topk_logprobs == 0).all()
    starts = sorted(int(w.input_ids[0]) - 10 for w in windows)
    assert starts[0] == 0 and starts[-1] == 900  # the opening and the end are both trained


def test_training_flops_grow_with_cartridge_size(tiny_llama):
    windows = methods.raw_windows(list(range(20, 300)), 3, seed=0, width=50)
    small, large = (methods.training_flops(tiny_llama, windows, p, 1) for p in (8, 64))
    assert 0 < small < large
    assert methods.training_flops(tiny_llama, windows, 8, 2) == pytest.approx(2 * small)


def _hand_nll(lm, prefix_ids: list[int], question: str, answer: str) -> float:
    """Gold-answer NLL with the plain transformers model: prefix + chat turn + answer, one forward, no SDK scoring."""
    tok = lm.tokenizer
    chat = list(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"])
    adds_bos = len(tok("a")["input_ids"]) > len(tok("a", add_special_tokens=False)["input_ids"])
    if prefix_ids and adds_bos:  # the sequence already began; SmolLM2's bos is <|im_start|> and must stay
        chat = chat[1:]
    ans = tok(answer.strip(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    seq = prefix_ids + chat
    with torch.no_grad():
        logits = lm.model(torch.tensor([seq + ans])).logits[0].float()
    logp = logits[len(seq) - 1 : len(seq) - 1 + len(ans)].log_softmax(-1)
    return float(-logp.gather(-1, torch.tensor(ans)[:, None]).mean())


def test_the_synthesis_yardstick_reads_what_the_teacher_reads():
    """B decodes after a chunk, or after the whole corpus with b_context='document': the yardstick reads as much."""
    from cartridges_sdk.making.settings import SynthesisConfig

    chunk = SynthesisConfig(min_chunk=512, max_chunk=1024)
    assert measure.yardstick_context(5000, chunk) == 768
    assert measure.yardstick_context(300, chunk) == 300
    assert measure.yardstick_context(5000, attrs.evolve(chunk, b_context="document")) == 5000
    assert measure.yardstick_context(1, chunk) == 2


def test_whole_run_on_a_tiny_model(tmp_path, tiny_llama):
    lm = tiny_llama
    data = _write(tmp_path / "held.jsonl", [(DOC, FREE), (DOC[200:], MC)])
    out = tmp_path / "out"
    result = run(profile=TINY, data=data, docs="0,1", concat=False, model=lm, seed=0, out=out)

    doc_ids = lm.tokenizer(DOC)["input_ids"]
    first = result["corpora"][0]
    assert first["tokens"] == len(doc_ids) and first["skipped_sizes"] == [5000]
    rows = {(r["method"], r["p"]): r for r in first["rows"]}
    assert set(rows) == {("icl", None), ("none", None)} | {(m, p) for m in methods.SIZED for p in (16, 64)}
    # the reference and the untrained cartridge against an independent computation
    icl = sum(_hand_nll(lm, doc_ids, q, a) for q, a in FREE) / len(FREE)
    none = sum(_hand_nll(lm, [], q, a) for q, a in FREE) / len(FREE)
    assert first["nll_icl"] == pytest.approx(icl, abs=1e-4) and first["nll_none"] == pytest.approx(none, abs=1e-4)
    for p in (16, 64):
        truncated = sum(_hand_nll(lm, doc_ids[:p], q, a) for q, a in FREE) / len(FREE)
        assert rows[("untrained", p)]["nll"] == pytest.approx(truncated, abs=1e-4)
        assert rows[("untrained", p)]["closure"] == pytest.approx((none - truncated) / (none - icl), abs=1e-3)
        assert rows[("untrained", p)]["kv_bytes"] == p * measure.kv_bytes_per_token(lm) == p * 2 * 3 * 2 * 16 * 4
        assert rows[("untrained", p)]["kl_vs_untrained"] == pytest.approx(1.0)
    assert rows[("icl", None)]["closure"] == pytest.approx(1.0) and rows[("icl", None)]["kl"] == pytest.approx(0.0)
    assert first["max_nll_diff_truncated_vs_untrained"] < 1e-4
    for kind in methods.TRAINED:
        cost = rows[(kind, 16)]["cost"]
        assert cost["training_tokens"] > 0 and cost["training_s"] > 0 and cost["fraction_of_matmul_peak"] > 0
        assert rows[(kind, 16)]["mmlu"] is not None
    assert rows[("selfstudy", 16)]["cost"]["generated_tokens"] > 0 and rows[("ntp", 16)]["cost"]["generated_tokens"] == 0
    assert rows[("selfstudy", 16)]["cost"]["fraction_of_raw_decode"] > 0 and result["raw_decode_tokens_per_s"] > 0
    assert rows[("ntp", 16)]["cost"]["fraction_of_raw_decode"] is None
    # the compacted start is scored on its own, and every trained method starts from it
    assert rows[("compact", 16)]["kv_bytes"] == rows[("untrained", 16)]["kv_bytes"]
    assert rows[("compact", 16)]["nll"] != pytest.approx(rows[("untrained", 16)]["nll"], abs=1e-4)
    trained = Cartridge.load(out / "work" / "held-0" / "selfstudy-p16.safetensors", lm)
    assert trained.meta.extra["init"] == "compact"

    second = result["corpora"][1]
    assert second["multiple_choice"] and second["chance"] == pytest.approx((1 / 4 + 1 / 3) / 2)
    assert all(0 <= r["mc_accuracy"] <= 1 for r in second["rows"])
    curves = result["throughput"]["curves"]
    assert curves["icl"]["max_batch"] < curves["cartridge:16"]["max_batch"]
    assert curves["cartridge:16"]["points"][-1]["batch"] == curves["cartridge:16"]["max_batch"]
    for name in ("results.json", "results.md", "frontier-held-0.png", "frontier-held-1.png", "throughput.png"):
        assert (out / name).stat().st_size > 0, name
    assert "| untrained cartridge, p=16 |" in (out / "results.md").read_text()

    # a re-run reuses every trained cartridge and the scores
    trained = out / "work" / "held-0" / "selfstudy-p16.safetensors"
    stamp = trained.stat().st_mtime_ns
    costs_before = json.loads((out / "work" / "held-0" / "cost.json").read_text())
    again = run(profile=TINY, data=data, docs="0,1", concat=False, model=lm, seed=0, out=out, throughput=False)
    assert trained.stat().st_mtime_ns == stamp
    costs_after = json.loads((out / "work" / "held-0" / "cost.json").read_text())
    assert {k: v for k, v in costs_after.items() if k.startswith("training")} == \
        {k: v for k, v in costs_before.items() if k.startswith("training")}
    strip = lambda rows: [{k: v for k, v in r.items() if k != "cost"} for r in rows]
    assert strip(again["corpora"][0]["rows"]) == strip(first["rows"])  # the peak, hence % of it, is re-measured
    assert [r["cost"]["training_s"] for r in again["corpora"][0]["rows"] if "cost" in r] == \
        [r["cost"]["training_s"] for r in first["rows"] if "cost" in r]
    # other settings in the same folder are refused rather than mixed in
    with pytest.raises(ConfigError, match="other settings"):
        run(profile=TINY, data=data, docs="0,1", concat=False, model=lm, seed=1, out=out)


def test_short_documents_and_too_long_corpora(tmp_path, tiny_llama):
    data = _write(tmp_path / "short.jsonl", [(DOC[:40], FREE), (DOC, FREE), (DOC, FREE), (DOC, FREE)])
    only = Profile("test", sizes=(64,), conversations=2, document_windows=2, generic_conversations=2)
    result = run(profile=only, data=data, docs="0", concat=False, model=tiny_llama, seed=0, out=tmp_path / "a",
                 mmlu=False, throughput=False)
    (corpus,) = result["corpora"]
    assert corpus["skipped_sizes"] == [64] and [r["method"] for r in corpus["rows"]] == ["icl", "none"]
    assert not (tmp_path / "a" / "work" / "short-0" / "data-selfstudy").exists()  # no synthesis for nothing
    # three 700-character documents joined exceed the tiny model's 2048 positions: refused before any work
    with pytest.raises(ConfigError, match="cannot be computed"):
        run(profile=only, data=data, docs="1,2,3", concat=True, model=tiny_llama, seed=0, out=tmp_path / "b",
            mmlu=False, throughput=False)
    assert not (tmp_path / "b" / "work" / "short-1+2+3").exists()


def test_sync_benchmark_on_a_tiny_model(tmp_path, tiny_llama):
    from benchmarks import sync as bench
    from benchmarks.data import Corpus, Question

    topics = ["lighthouse keeper", "orchard apples", "branch railway", "harbour slate", "tide tables"]
    docs = [(f"d{i}.txt", Corpus(f"d{i}", f"Notes on the {t}. " * 12, (Question(f"What about the {t}?", t),), (i,)))
            for i, t in enumerate(topics)]
    inc = bench.incremental(tiny_llama, docs, tmp_path, 32)
    assert inc["full_sync"]["num_added"] == 5 and inc["unchanged_sync"]["num_skipped"] == 5
    assert inc["one_edit_sync"]["updated"] == ["d0.txt"] and inc["one_edit_sync"]["num_skipped"] == 4
    assert inc["untouched_files_identical"] and inc["untouched_answers_identical"] and inc["edited_file_changed"]
    comp = bench.composition(tiny_llama, docs, tmp_path, 1, 0, "default", 32)
    assert comp["questions"] == 5 and set(comp["closure"]["random"]) == {1, 2, 4}
    study = dict(num_conversations=2, conversations_per_chunk=2, min_chunk=20, max_chunk=40, max_tokens_a=6,
                 max_tokens_b=6, document_windows=2, window_tokens=16, top_k=4)
    studied = bench.self_studied(tiny_llama, docs, tmp_path, 1, 0, 32, 1, study, distractors=2)
    assert studied["self_studied"] == ["d0.txt", "d0.txt"] and studied["questions"] == 1
    row = studied["rows"][0]
    assert row["compact_1"] != row["self_study_1"] and set(studied["closure"]["self_study"]) == {1, 2, 4}
    assert row["among_1"] != row["self_study_1"] and set(studied["closure"]["among"]) == {1, 2, 4}
    assert len(studied["pools"]["d0.txt"]) == 4 and row["among_4_unseen"] == 0  # all 4 others are in its pool
    whole = bench.whole_corpus(tiny_llama, docs, tmp_path, 1, 64)
    assert whole["questions"] == 5 and whole["routed_has_own"] == 1.0 and set(whole["closure"]) == {
        "routed", "whole_cartridge", "rag", "truncated_best"}


@pytest.mark.default_model
def test_models_benchmark_measures_a_model_in_a_process_of_its_own(default_lm):
    from benchmarks.models import run_child

    from cartridges_sdk.models import default_cache_dir

    row = run_child("default", default_cache_dir(), "float32", prefill=64, decode=4)
    assert row["model"] == default_lm.name
    assert row["parameters"] == sum(p.numel() for p in default_lm.model.parameters())
    assert row["load_seconds"] > 0 and row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0
    assert row["peak_memory_mb"] > 4 * row["parameters"] / 2**20  # the child's own peak: its fp32 weights at least


def test_codebase_benchmark_on_a_tiny_model(tmp_path, tiny_llama):
    from benchmarks import codebase as bench

    pkg = tmp_path / "harbour"
    (pkg / "_tides").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Harbour tools."""\n')
    (pkg / "_tides" / "tables.py").write_text(
        'def high_water(day):\n    """Return the hour of high water at the quay on the given day of the month."""\n'
        '    return day % 12\n\n\nclass Gauge:\n    """A tide gauge that records the water level at the harbour wall."""\n\n'
        '    def read(self):\n        """Read the current water level in feet above the datum."""\n        return 4\n')
    (pkg / "boats.py").write_text(
        'class Mooring:\n    """A mooring buoy that holds one fishing boat in the outer harbour."""\n\n'
        '    def _hidden(self):\n        """Private helpers are not asked about, whatever they say."""\n')
    questions = bench.docstring_questions(pkg, "harbour", 10, 0, per_module=5)
    assert [(q.module, q.qualname) for q in questions] == [
        ("_tides.tables.py", "high_water"), ("_tides.tables.py", "Gauge"), ("_tides.tables.py", "Gauge.read"),
        ("boats.py", "Mooring")]
    assert questions[2].question == "What does the Gauge.read method in harbour do?"
    assert questions[3].answer == "A mooring buoy that holds one fishing boat in the outer harbour."
    text = (pkg / "_tides" / "tables.py").read_text()
    window = bench.best_window(tiny_llama, text, 10, 24)  # the module does not fit: 24 tokens around line 10
    assert len(window) == 24 and window != tiny_llama.encode(text)[:24]
    result = bench.run(tiny_llama, pkg, "harbour", tmp_path / "store", 32, 4, 0, 1, 4)
    # at most 2 questions per module (of 3 in tables.py), so 3 in all
    assert result["modules"] == 3 and result["questions"] == 3 and set(result["closure"]) == {"routed", "own", "rag"}
    assert all(r["routed"] == r["own"] for r in result["rows"] if r["routed_right"])
    assert set(result["timing"]) == {"routed", "rag", "best"}
    # a request holds the 32-token cartridge where the best context holds the whole module (over 180 tokens)
    assert result["timing"]["routed"]["kv_tokens"] + 150 < result["timing"]["best"]["kv_tokens"]
    # a change to the router is measured again without scoring the rest: the scores and timings are reused
    again = bench.run(tiny_llama, pkg, "harbour", tmp_path / "store", 32, 4, 0, 1, 4,
                      earlier={**result, "model": tiny_llama.name})
    assert [r["rag"] for r in again["rows"]] == [r["rag"] for r in result["rows"]]
    assert again["rows"] == result["rows"] and again["timing"] == result["timing"]
    with pytest.raises(SystemExit, match="another model, size or question set"):
        bench.run(tiny_llama, pkg, "harbour", tmp_path / "store", 32, 4, 0, 1, 4, earlier={**result, "model": "x"})


def test_closure_comes_with_an_interval_from_resampling_the_questions():
    from benchmarks.vs_rag import closure, closure_interval, table

    def row(none, icl, got):
        return {"nll": {"none": none, "icl": icl, "m": got}}

    same = [row(5.0, 2.0, 3.0)] * 6  # every question alike: nothing to resample, the interval is the closure
    assert closure(same, "m") == 0.667 and closure_interval(same, "m") == [0.667, 0.667]
    spread = [row(5.0, 2.0, g) for g in (2.0, 2.5, 3.0, 4.0, 4.5, 5.0)] + [row(4.0, 1.0, 1.5), row(6.0, 2.0, 5.5)]
    low, high = closure_interval(spread, "m")
    assert low < closure(spread, "m") < high and closure_interval(spread, "m") == [low, high]  # seeded
    # four times the questions, spread alike, narrow it about twofold
    low4, high4 = closure_interval(spread * 4, "m")
    assert 0.35 < (high4 - low4) / (high - low) < 0.65
    # a draw whose questions have no drop in all is set aside, not counted as some closure
    odd = [row(5.0, 2.0, 3.0), row(2.0, 2.5, 0.0)]  # drops of 3 and -0.5: a quarter of the draws have none (-4)
    assert closure(odd, "m") == 1.6 and closure_interval(odd, "m") == [0.667, 1.6]
    assert closure_interval([row(2.0, 4.0, 3.0)], "m") is None  # no drop, no closure, no interval
    assert closure_interval(odd, "m", resamples=1) is None  # its one draw (seed 0) has no drop: none to give
    # the table prints it after the closure, and not for no context and ICL (0 and 1 by definition)
    sets = {"qasper": {"methods": ["none", "icl", "bm25"], "closure": {"none": 0.0, "icl": 1.0, "bm25": 0.5},
                       "closure_interval": {"none": [0.0, 0.0], "icl": [1.0, 1.0], "bm25": [0.3, 0.71]},
                       "mc_questions": 0}}
    lines = table({"scope": "document", "sets": sets}).splitlines()
    assert lines[2].endswith("| 0.00 |") and lines[3].endswith("| 1.00 |") and lines[4].endswith("| 0.50 (0.30 to 0.71) |")


def test_vs_rag_on_a_tiny_model(tmp_path, tiny_llama, monkeypatch):
    from benchmarks import vs_rag
    from benchmarks.rag import Retriever, passages
    from cartridges_sdk.making.evaluation import answer_logprobs, choose, nll
    from cartridges_sdk.serve.passages import FUSED_K, PassageIndex, drafted, passage_ids

    lm = tiny_llama
    half = len(TEXT) // 2
    data = _write(tmp_path / "set.jsonl", [(TEXT[:half], FREE), (TEXT[half:], MC)])
    assert vs_rag.options(MC[1][0]) == ("Which sea?", ["the north one", "the south one", "the east one"])
    methods_ = ["none", "icl", "bm25", "dense", "fused", "cartridge", "selfstudy", "hybrid:8", "hybrid-selfstudy:8",
                "default", "cartridge+rerank", "multi:8", "hybrid+draft:8", "hybrid-selfstudy+draft:4/8",
                "hybrid-selfstudy+draft+attention:4/8"]
    result = vs_rag.run_dataset(lm, data, 2, 2, 16, tmp_path / "work", methods_,
                                {"num_conversations": 2, "document_windows": 2}, draft_from="selfstudy")
    assert result["questions"] == 4 and result["methods"] == methods_  # the drafter is among them already
    gap = sum(r["nll"]["none"] - r["nll"]["icl"] for r in result["rows"])
    if gap > 0:  # a random model may read the document as noise: then closure is undefined, not made up
        assert result["closure"]["none"] == 0 and result["closure"]["icl"] == 1
    else:
        assert set(result["closure"].values()) == {None}
    assert set(result["closure_interval"]) == set(methods_)
    stored = {"cartridge", "selfstudy", "hybrid:8", "hybrid-selfstudy:8", "default", "cartridge+rerank", "multi:8",
              "hybrid+draft:8", "hybrid-selfstudy+draft:4/8", "hybrid-selfstudy+draft+attention:4/8"}
    assert set(result["mc_accuracy"]) == set(methods_) and set(result["routed_right"]) == stored
    # the letter the reader picks, options listed: read from the closure's own passes, as measure.choose reads it
    assert set(result["mc_letter"]) == set(methods_) and result["mc_questions"] == 2
    mcq = load_corpora(data, [1])[0].questions[0]
    assert result["rows"][2]["letter_right"]["none"] == (choose(lm, mcq.question, mcq.options) == mcq.gold)
    # every method is held to the budget: cartridge tokens plus passage tokens
    assert all(0 < r["context_tokens"][k] <= 16 for r in result["rows"] for k in ("bm25", "dense", "fused"))
    assert all(r["context_tokens"][k] == 16 for r in result["rows"]
               for k in ("cartridge", "selfstudy", "hybrid:8", "cartridge+rerank", "hybrid+draft:8",
                         "hybrid-selfstudy+draft:4/8", "hybrid-selfstudy+draft+attention:4/8"))
    # ':4/8': the 8-token self-studied cartridges cut to 4 (no store of 4-token ones is made), passages the rest
    assert not any(p.name.startswith("selfstudy-4-") for p in (tmp_path / "work").iterdir())
    assert vs_rag.made_size("hybrid-selfstudy+draft:4/8", 16) == 8 and vs_rag.made_size("hybrid:8", 16) == 8
    for bad in ("selfstudy:4/8", "hybrid:8/4", "hybrid:4/x", "hybrid+attention:8", "cartridge+attention:4/8"):
        with pytest.raises(vs_rag.ConfigError, match="':TOKENS/MADE' after a hybrid one .*'\\+attention' only there"):
            vs_rag.method_spec(bad, 16)
    # '+attention': the same cut, keeping what the question and its first answer read most (trim="attention")
    studied = vs_rag.CartridgeStore(vs_rag.store_of(lm, "selfstudy:8", 16, tmp_path / "work",
                                                    {"num_conversations": 2, "document_windows": 2})[1], lm)
    doc, q = load_corpora(data, [0])[0], FREE[0]
    plan = vs_rag.method_plan(studied, "hybrid-selfstudy+draft+attention:4/8", q[0], 16, doc.name, studied)
    first = studied.ask(q[0], cartridges=[doc.name], max_new_tokens=vs_rag.DRAFT, temperature=0.0).text
    want = studied.plan(q[0], cartridges=[doc.name], budget=16, passages=12, passages_from="routed",
                        trim="attention", query=drafted(q[0], first))
    assert plan.sizes == (4,) and plan.passages == want.passages
    torch.testing.assert_close(plan.parts(studied)[0].keys[0], want.parts(studied)[0].keys[0])
    assert all(r["context_tokens"]["multi:8"] in (8, 16) for r in result["rows"])  # documents sharing a word
    with pytest.raises(vs_rag.ConfigError, match="smaller than the budget"):
        vs_rag.method_spec("hybrid:16", 16)
    # a first answer picks passages, so '+draft' goes only where there are passages
    assert vs_rag.method_spec("hybrid+draft:8", 16) == ("hybrid+draft", 8)
    with pytest.raises(vs_rag.ConfigError, match="'\\+draft' and one of .* after one of \\['hybrid'"):
        vs_rag.method_spec("cartridge+draft", 16)
    with pytest.raises(vs_rag.ConfigError, match="default budget is all cartridges.*use hybrid\\+draft:N"):
        vs_rag.run_dataset(lm, data, 2, 2, 16, tmp_path / "work", ["none", "icl", "default+draft"])
    for chosen, drafter, why in [(["none", "icl", "hybrid:8"], "selfstudy", "none is asked for"),
                             (["none", "icl", "hybrid+draft:8"], "bm25", "use a stored method")]:
        with pytest.raises(vs_rag.ConfigError, match=why):
            vs_rag.run_dataset(lm, data, 2, 2, 16, tmp_path / "work", chosen, draft_from=drafter)
    # RAG's score is the reader's with those passages in context, recomputed here from the retriever alone
    q = FREE[0]
    retriever = Retriever("bm25", [p for _, p in passages([TEXT[:half], TEXT[half:]])], tmp_path / "work")
    direct = nll(answer_logprobs(lm, q[0], q[1], document=retriever.context(lm, q[0], 16)), lm, q[1])
    assert result["rows"][0]["nll"]["bm25"] == pytest.approx(direct, abs=1e-3)
    # fused RAG made beside BM25 and dense (as the run makes it) reuses their indexes: the ranking of one made alone
    built = {k: Retriever(k, retriever.chunks, tmp_path / "work") for k in ("bm25", "dense")}
    reused = Retriever("fused", retriever.chunks, tmp_path / "work", built=built)
    assert reused.ranked(q[0]) == Retriever("fused", retriever.chunks, tmp_path / "work").ranked(q[0])
    assert reused.seconds == built["bm25"].seconds + built["dense"].seconds
    # '+fused' (or '+dense'): a method's passages ranked by that retrieval, as store.plan(retrieval=...) ranks them
    assert vs_rag.method_spec("hybrid+draft+fused:8", 16) == ("hybrid+draft+fused", 8)
    for bad in ("cartridge+fused", "hybrid+dense+fused:8", "selfstudy+dense"):
        with pytest.raises(vs_rag.ConfigError, match=r"one of \['\+dense', '\+fused'\] after one of"):
            vs_rag.method_spec(bad, 16)
    compact8, name = vs_rag.CartridgeStore(tmp_path / "work" / "compact-8", lm), load_corpora(data, [0])[0].name
    fused = vs_rag.method_plan(compact8, "hybrid+fused:8", q[0], 16, document=name)
    assert fused == compact8.plan(q[0], cartridges=[name], budget=16, passages=8, passages_from="routed",
                                  retrieval="fused")
    assert fused.passages and all(p.score <= 2 / (FUSED_K + 1) for p in fused.passages)  # ranks added, not BM25's
    # asked of its own document: every stored method answers with that document's cartridge, RAG with its passages
    own = vs_rag.run_dataset(lm, data, 2, 2, 16, tmp_path / "work", ["none", "icl", "bm25", "cartridge", "hybrid:8",
                                                                      "opening:4", "multi"], scope="document",
                             mc=("letter",))
    assert own["mc_accuracy"] is None and set(own["mc_letter"]) == {"none", "icl", "bm25", "cartridge", "hybrid:8",
                                                                    "opening:4", "multi"}
    # cartridges alone, its own: the very cartridge (not a refused setting answered with nothing)
    assert [r["nll"]["multi"] for r in own["rows"]] == [r["nll"]["cartridge"] for r in own["rows"]]
    assert [r["nll"]["multi"] for r in own["rows"]] != [r["nll"]["none"] for r in own["rows"]]
    # the document's first 4 tokens, exact, then its best passages up to the budget read apart, as store.plan
    # fills one
    doc = load_corpora(data, [0])[0]
    ids = lm.encode(doc.text)
    pre, _ = passage_ids(lm, PassageIndex.of({doc.name: doc.text}).ranked(q[0], 8), 12, after_cartridge=False)
    assert own["rows"][0]["context_tokens"]["opening:4"] == 4 + len(pre) == 16
    opened = Cartridge.compose([Cartridge.from_prefix(lm, ids, 4), Cartridge.from_prefix(lm, pre, len(pre))],
                               reposition=True, model=lm)
    assert own["rows"][0]["nll"]["opening:4"] == pytest.approx(nll(answer_logprobs(
        lm, q[0], q[1], cartridges=[opened]), lm, q[1]), abs=1e-3)
    with pytest.raises(vs_rag.ConfigError, match=r"\['opening:4'\] read the opening .* use scope='document'"):
        vs_rag.run_dataset(lm, data, 2, 2, 16, tmp_path / "work", ["none", "icl", "opening:4"])
    assert not any("likeliest_right" in r for r in own["rows"])  # four passes a context saved where letters suffice
    assert own["scope"] == "document" and all(own["routed_right"][k] == 1 for k in ("cartridge", "hybrid:8"))
    first = retriever.context(lm, q[0], 16, among=[i for i, (d, _) in enumerate(passages([TEXT[:half], TEXT[half:]]))
                                                   if d == 0])
    assert own["rows"][0]["nll"]["bm25"] == pytest.approx(nll(answer_logprobs(lm, q[0], q[1], document=first), lm,
                                                              q[1]), abs=1e-3)
    # --compaction's settings make stores of their own, every cartridge in them compacted that way
    vs_rag.run_dataset(lm, data, 2, 1, 16, tmp_path / "work", ["none", "icl", "cartridge"], scope="document",
                       compaction={"corpus_queries": 32})
    other = vs_rag.CartridgeStore(tmp_path / "work" / "compact-16-corpus_queries=32", lm)
    assert {other.get(n).meta.extra["compaction"]["corpus_queries"] for n in other.names()} == {32}
    # a store compacted otherwise than asked (an older SDK's defaults, say) is compacted again, not scored as these
    _, seconds = vs_rag.build_store(lm, {d.name: d.text for d in load_corpora(data, [0, 1])},
                                    tmp_path / "work" / "compact-16-corpus_queries=32", 16, None)
    other.refresh()
    assert seconds is not None and {other.get(n).meta.extra["compaction"]["corpus_queries"]
                                    for n in other.names()} == {2048}
    # --only: one document's questions, scored as the full run scored them (same stores, same RAG index), and
    # self-study trains that document's cartridge alone
    one = vs_rag.run_dataset(lm, data, 2, 2, 16, tmp_path / "work", ["none", "icl", "bm25", "cartridge", "selfstudy"],
                             {"num_conversations": 2, "document_windows": 1}, only=[1])
    assert one["only"] == [1] and [r["doc"] for r in one["rows"]] == [r["doc"] for r in result["rows"][2:]]
    assert all(r["nll"][m] == full["nll"][m] for r, full in zip(one["rows"], result["rows"][2:])
               for m in ("none", "icl", "bm25", "cartridge"))
    partly = vs_rag.CartridgeStore(tmp_path / "work" / "selfstudy-16-document_windows=1-num_conversations=2", lm)
    names = load_corpora(data, [0, 1])
    assert {n: r["method"] for n, r in partly.records().items()} == {names[0].name: "compact",
                                                                    names[1].name: "self-study"}
    with pytest.raises(vs_rag.ConfigError, match=r"only=\[2\]: give document numbers from 0 to 1"):
        vs_rag.run_dataset(lm, data, 2, 2, 16, tmp_path / "work", ["none", "icl"], only=[2])
    with pytest.raises(vs_rag.ConfigError, match="mc=\\['letters'\\]"):
        vs_rag.run_dataset(lm, data, 2, 2, 16, tmp_path / "work", ["none", "icl"], mc=("letters",))
    with pytest.raises(vs_rag.ConfigError, match="scope='paper'"):
        vs_rag.run_dataset(lm, data, 2, 2, 16, tmp_path / "work", ["none", "icl"], scope="paper")
    assert all(result["build_seconds"][k] > 0 for k in ("cartridge", "selfstudy", "dense", "hybrid:8"))
    assert result["build_seconds"]["bm25"] >= 0  # milliseconds on a corpus this small
    studied = vs_rag.CartridgeStore(tmp_path / "work" / "selfstudy-16-document_windows=2-num_conversations=2", lm)
    assert {r["method"] for r in studied.records().values()} == {"self-study"}
    assert not any("quality" in r for r in studied.records().values())  # the benchmark scores them; no report
    corpus = load_corpora(data, [0])[0]
    store = vs_rag.CartridgeStore(tmp_path / "work" / "compact-16", lm)
    rows = vs_rag.speed(lm, corpus, 16, retriever, {"cartridge": store}, [1, 2], 2, icl_users=[1])
    by = {(r["method"], r["users"]): r for r in rows}
    assert ("icl", 2) not in by and ("cartridge", 2) in by and ("default", 1) not in by
    assert by["cartridge", 1]["prompt_tokens"] < by["rag", 1]["prompt_tokens"] < by["icl", 1]["prompt_tokens"]
    assert by["cartridge", 1]["kv_mib_per_user"] < by["icl", 1]["kv_mib_per_user"]
    assert all(r["first_token_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in rows)
    whole = {"model": lm.name, "tokens": 16, "sets": {"set": result}, "speed": rows}
    table = vs_rag.table(whole)
    assert "| RAG, dense (MiniLM) |" in table and "| cartridge | 2 |" in table
    assert "set MC letter (of 2) | set MC likeliest (of 2)" in table
    assert [p.name for p in vs_rag.plots(whole, tmp_path / "img")] == ["vs-rag-quality.png", "vs-rag-speed.png"]
    # the default, for a reader: an 8-token cartridge and 8 tokens of passages each request reads apart, which
    # count among its prompt tokens and are planned within its first-token time
    from cartridges_sdk.making import settings

    monkeypatch.setattr(settings, "READER_PARAMETERS", (lm.num_parameters, lm.num_parameters + 1))
    small = vs_rag.CartridgeStore(tmp_path / "work" / "compact-8", lm)
    planned = small.plan(corpus.questions[0].question, budget=16)
    assert planned.passages_kv.num_tokens == 8
    drafts = []
    monkeypatch.setattr(small, "drafted_plan", lambda *a, **kw: drafts.append((a, kw)) or
                        vs_rag.CartridgeStore.drafted_plan(small, *a, **kw))
    timed = vs_rag.speed(lm, corpus, 16, retriever, {"default": small, "default+draft": small}, [1, 2], 2)
    first_answers = [a for a, _ in drafts if a[1]]  # the default plans through drafted_plan too, with no draft
    assert len(first_answers) == 2 and first_answers[0][1] == vs_rag.DRAFT  # once to size it, once within the timing
    default = next(r for r in timed if r["method"] == "default")
    # a first answer before the plan: timed for one user (each request drafts alone), its passages as many tokens
    drafted = [r for r in timed if r["method"] == "default+draft"]
    assert [r["users"] for r in drafted] == [1] and drafted[0]["prompt_tokens"] == default["prompt_tokens"]
    assert default["prompt_tokens"] == by["cartridge", 1]["prompt_tokens"] + 8
    assert default["kv_mib_per_user"] == by["cartridge", 1]["kv_mib_per_user"]
    # a hybrid method is timed as the run plans it: the cut path ('4/8': the self-studied 8-token cartridge cut to
    # 4, then 12 tokens of passages found with a first answer the drafter's cartridges write) for one user
    cut_path = "hybrid-selfstudy+draft:4/8"
    folder = vs_rag.store_of(lm, cut_path, 16, tmp_path / "work", {"num_conversations": 2, "document_windows": 2})[1]
    assert folder.name == "selfstudy-8-document_windows=2-num_conversations=2" and folder.is_dir()
    studied = vs_rag.CartridgeStore(folder, lm)
    earlier = len(drafts)
    hybrids = vs_rag.speed(lm, corpus, 16, retriever, {"default+draft": small, cut_path: studied, "hybrid:8": small},
                           [1, 2], 2, draft_from=studied)
    assert [(r["method"], r["users"]) for r in hybrids if r["method"] not in ("none", "icl", "rag")] == [
        ("default+draft", 1), (cut_path, 1), ("hybrid:8", 1), ("hybrid:8", 2)]
    drafted_by = [kw["draft_from"] for a, kw in drafts[earlier:] if a[1] == vs_rag.DRAFT]
    assert drafted_by and all(d is studied for d in drafted_by)  # by the drafter, as its quality rows' first answer
    cut = next(r for r in hybrids if r["method"] == cut_path)
    assert cut["prompt_tokens"] == by["cartridge", 1]["prompt_tokens"] + 12
    assert cut["kv_mib_per_user"] == by["cartridge", 1]["kv_mib_per_user"]
    calls = []
    assert vs_rag.first_token_seconds(lm, [[1, 2]] * 3, [], lambda: calls.append(1) or []) > 0 and len(calls) == 3
    asked_of_own = {"model": lm.name, "tokens": 16, "scope": "document", "sets": {"set": own}}
    assert "| its own cartridge (compacted) |" in vs_rag.table(asked_of_own)
    assert [p.name for p in vs_rag.plots(asked_of_own, tmp_path / "img")] == ["vs-rag-quality-document.png"]


def test_best_window_is_the_lowest_nll_of_any_exact_span(tmp_path, tiny_llama):
    from benchmarks.best_window import best_windows, starts
    from cartridges_sdk.making.evaluation import answer_logprobs, nll

    assert starts(10, 16, 4) == [0] and starts(40, 16, 8) == [0, 8, 16, 24] and starts(41, 16, 8) == [0, 8, 16, 24, 25]
    lm = tiny_llama
    half = len(TEXT) // 2
    data = _write(tmp_path / "set.jsonl", [(TEXT[:half], FREE), (TEXT[half:], MC)])
    got = best_windows(lm, data, 2, 2, 8, 4, only=[0], likely=True)
    assert got["questions"] == 2 and set(got["closure_per_doc"]) == {got["rows"][0]["doc"]}
    doc = load_corpora(data, [0])[0]
    ids = lm.encode(doc.text)
    q = doc.questions[0]
    every = [nll(answer_logprobs(lm, q.question, q.answer, document=ids[s: s + 8]), lm, q.answer)
             for s in starts(len(ids), 8, 4)]
    row = got["rows"][0]
    assert row["nll"]["best_window"] == pytest.approx(min(every), abs=1e-3)
    assert row["start"]["best_window"] == starts(len(ids), 8, 4)[every.index(min(every))]
    assert got["closure"]["none"] == 0 and got["closure"]["icl"] == 1
    # the likeliest window is picked without the answer: the question's likelihood after it, less its lift
    from cartridges_sdk.serve.rerank import lift, question_logprob

    windows = [Cartridge.from_prefix(lm, ids[s: s + 8], 8) for s in starts(len(ids), 8, 4)]
    picked = [question_logprob(lm, q.question, w) - lift(lm, w) for w in windows]
    assert row["start"]["likeliest_window"] == starts(len(ids), 8, 4)[picked.index(max(picked))]
    assert row["nll"]["likeliest_window"] == pytest.approx(every[picked.index(max(picked))], abs=1e-3)
    assert all(row["nll"][k] >= row["nll"]["best_window"] for k in ("bm25_window", "likeliest_window",
                                                                   "fused_window"))
    assert set(got["closure"]) == {"none", "icl", "best_window", "bm25_window", "likeliest_window", "fused_window"}


def test_run_folders_name_a_mapping_setting_plainly():
    from benchmarks.naming import plain, settings_tag
    from benchmarks.sync import among_name

    # --set 'seed_weights={"question": 1}' once made a folder named with quotes, braces and a space
    assert plain({"question": 1, "creative": 0.5}) == "creative:0.5+question:1"
    assert plain(("a", "b")) == "a+b" and plain(0.01) == "0.01"
    assert settings_tag({"lr": 0.01, "seed_weights": {"question": 1}}) == "lr=0.01-seed_weights=question:1"
    assert settings_tag(None) == "" and among_name(4, None) == "among-4"
    assert among_name(4, {"seed_weights": {"question": 1}}) == "among-4-seed_weights=question:1"


def test_spearman_and_the_sets_the_quality_report_benchmark_reads():
    from benchmarks.quality_report import correlations, parse_sets, spearman

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0 and spearman([1, 2, 3], [3, 2, 1]) == -1.0
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == 0.949  # ties take their mean rank: 4.5 / sqrt(4.5 * 5)
    assert spearman([1, 2], [1, 2]) is None and spearman([1, 1, 1], [1, 2, 3]) is None
    assert parse_sets("qasper:0-2,tpo:3") == [("qasper", [0, 1, 2]), ("tpo", [3])]
    with pytest.raises(ConfigError, match="SET:FIRST-LAST"):
        parse_sets("papers:0-2")
    rows = [{"size": s, "closure": c, "report": {"recovered": r, "agreement": r, "kl": 1 - r}}
            for s, c, r in [(8, 0.1, 0.2), (8, 0.3, 0.4), (8, 0.5, 0.3), (16, 0.6, 0.7), (16, None, 0.1)]]
    got = correlations(rows, [8, 16])
    assert got["points"] == 5 and got["all"]["recovered"] == got["all"]["-kl"] == 0.8 and got["p=16"]["recovered"] is None


@pytest.mark.slow  # a minute; its parts (spearman, sets, correlations) are checked above in the default tier
@pytest.mark.default_model
def test_quality_report_benchmark_end_to_end(tmp_path, monkeypatch, capsys):
    import sys

    from benchmarks import quality_report

    out = tmp_path / "q.json"
    monkeypatch.setattr(sys, "argv", ["quality_report", "--model", "default", "--sets", "tpo:0", "--sizes", "32",
                                      "--questions", "1", "--report-questions", "1", "--out", str(out)])
    quality_report.main()
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["set"] == "tpo" and row["size"] == 32 and row["questions"] == 1 and row["report"]["questions"] <= 1
    assert result["correlation"]["points"] == 1 and "| tpo | 0 | 32 |" in capsys.readouterr().out


def test_the_quickstart_texts_benchmark_cuts_its_texts_and_reads_the_verdict():
    from benchmarks.quickstart_texts import TEXTS, summary

    for name, spec in TEXTS.items():
        if spec is None:
            continue
        text = spec.read()
        assert 1500 < len(text) <= spec.chars and text == text.strip() and (spec.stop != "." or text.endswith("."))
        assert all(a.split("|")[0].lower() in text.lower() for a in spec.questions.values()), name  # answerable
    out = ("answering with the llamacpp runtime (the fastest installed here)\n"
           "...\nright answers: no context 0/3, whole text 2/3, compacted 1/3, self-study 2/3\n"
           "The self-study cartridge answers 1 of the 2 questions the whole text answers right, at 4.0x less KV\n")
    assert summary(out) == {"right": {"no context": 0, "whole text": 2, "compacted": 1, "self-study": 2},
                            "questions": 3, "cartridge": "self-study", "kept": 1, "whole_text_right": 2,
                            "runtime": "llamacpp"}
    with pytest.raises(RuntimeError, match="no 'right answers:' line"):
        summary("Traceback ...")


@pytest.mark.slow  # a minute; tests/test_quickstart.py checks the quick start's verdict lines against `summary`
@pytest.mark.default_model
def test_the_quickstart_texts_benchmark_runs_the_quick_start_as_a_user_does(tmp_path, capsys):
    from benchmarks import quickstart_texts

    out = tmp_path / "qt.json"
    result = quickstart_texts.main(["--texts", "tpo-2", "--model", "default", "--out", str(out),
                                    "--", "--tokens", "32"])
    (row,) = result["rows"]
    assert row["text"] == "tpo-2" and row["questions"] == 3 and row["cartridge"] == "compacted"
    assert set(row["right"]) == {"no context", "whole text", "compacted"}
    assert json.loads(out.read_text())["quickstart_args"] == ["--tokens", "32"]
    assert "in all: the cartridge answers" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        quickstart_texts.main(["--texts", "nope"])


@pytest.mark.slow  # half a minute: both runtimes answer the sample's questions on the embedded model
def test_the_runtimes_benchmark_times_each_runtime_and_says_what_auto_picks(tmp_path):
    from benchmarks.runtimes import main

    result = main(["--models", "default", "--out", str(tmp_path / "runtimes.json")])
    rows = {r["runtime"]: r for r in result["rows"]}
    assert set(rows) == {"hf", "llamacpp"} and {r["auto"] for r in rows.values()} == {"llamacpp"}
    assert rows["hf"]["same_as_hf"] == rows["hf"]["answers_compared"] == 7  # the reference agrees with itself
    assert 0 <= rows["llamacpp"]["same_as_hf"] <= 7
    assert all(r["tokens_per_s"] > 0 and r["users_at_once_s"] > 0 for r in rows.values())
    assert json.loads((tmp_path / "runtimes.json").read_text())["rows"][0]["answers"]


@pytest.mark.slow  # 70 s; the store's scale paths (routing index, workers) have tests of their own in the default tier
def test_the_scale_benchmark_measures_a_store_and_its_server(tmp_path):
    """`benchmarks.scale` at one small size: every figure measured from a real sync, server and router, the routed
    questions reaching their documents, and the plot drawn."""
    from benchmarks import scale

    result = scale.main(["--sizes", "40", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "scale.json"),
                         "--plot", str(tmp_path / "scale.png")])
    (row,) = result["rows"]
    assert row["documents"] == 40 and row["first_build_built"] == 40 and row["routed_right"] == "40/40"
    for key, _ in scale.PANELS:
        assert row[key] > 0, key
    assert row["new_cartridge_answered_after_s"] < 5  # the server reads the folder again at least once a second
    assert (tmp_path / "scale.png").stat().st_size > 0 and json.loads((tmp_path / "scale.json").read_text())["rows"]


def test_selfstudy_variants_of_training_train_on_the_same_data(tmp_path):
    """benchmarks.selfstudy: a run that differs from an earlier one in training settings only gets that run's
    dataset (and its compacted start when made alike), so variants differ in nothing else."""
    from benchmarks.selfstudy import reuse_synthesis
    from cartridges_sdk.making.selfstudy import COMPACT_START

    first = tmp_path / "qa-0-p16-s0-aaaa"
    reuse_synthesis(first, {"data": "d1", "start": "s1"})
    (first / "data").mkdir()
    (first / "data" / "header.json").write_text("{}")
    (first / "train" / COMPACT_START).write_bytes(b"start")
    lr = tmp_path / "qa-0-p16-s0-bbbb"  # another learning rate: data and start
    reuse_synthesis(lr, {"data": "d1", "start": "s1"})
    assert (lr / "data" / "header.json").is_file() and (lr / "train" / COMPACT_START).read_bytes() == b"start"
    compacted = tmp_path / "qa-0-p16-s0-cccc"  # another compaction: the data, not the start
    reuse_synthesis(compacted, {"data": "d1", "start": "s2"})
    assert (compacted / "data").is_dir() and not (compacted / "train" / COMPACT_START).exists()
    for folder, tags in ((tmp_path / "qa-0-p16-s0-dddd", {"data": "d2", "start": "s3"}),  # other synthesis settings
                         (tmp_path / "qa-1-p16-s0-eeee", {"data": "d1", "start": "s1"})):  # another document
        reuse_synthesis(folder, tags)
        assert not (folder / "data").exists()
    (lr / "data" / "header.json").write_text('{"own": 1}')
    reuse_synthesis(lr, {"data": "d1", "start": "s1"})  # a folder with data of its own keeps them
    assert (lr / "data" / "header.json").read_text() == '{"own": 1}'


def test_a_recipe_stands_for_the_flags_docs_spell_out():
    """benchmarks' --recipe gives the settings and compaction keys of the long command docs/self-study.md says it
    stands for, as those flags parse, so its runs name (and reuse) the folders of runs with the flags written out."""
    import re
    import shlex

    from benchmarks.naming import recipe_flags
    from cartridges_sdk.cli.common import parse_settings

    doc = (Path(__file__).parents[1] / "docs" / "self-study.md").read_text()
    block = re.search(r"`--recipe reader` stands for these flags\.\n\n<!--.*?-->\n```bash\n(.*?)```", doc, re.S)
    words = shlex.split(block.group(1).replace("\\\n", " "))
    flag = lambda name: [words[i + 1] for i, w in enumerate(words) if w == name]
    settings, compaction = recipe_flags("reader")
    assert settings == {"num_conversations": int(flag("--conversations")[0]), "epochs": int(flag("--epochs")[0]),
                        **parse_settings(flag("--set"))}
    assert compaction == parse_settings(flag("--compaction")) and compaction
    assert recipe_flags(None) == ({}, {})
    with pytest.raises(ConfigError, match="not a recipe"):
        recipe_flags("readr")
