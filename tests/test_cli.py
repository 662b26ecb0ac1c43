"""The `cartridges` command, as a user runs it, on the embedded default model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cartridges_sdk import Cartridge
from cartridges_sdk.cli import main
from cartridges_sdk.making.selfstudy import COMPACT_START

from conftest import DATA

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    tides = d / "tides.txt"
    tides.write_text("Tides rise and fall twice a day because the moon pulls on the oceans. " * 4)
    assert main(["init", str(DATA / "harrow_point.txt"), "-o", str(d / "a.safetensors"), "--tokens", "120"]) == 0
    assert main(["init", str(tides), "-o", str(d / "b.safetensors"), "--tokens", "40"]) == 0
    return d


def test_inspect(files, capsys):
    assert main(["inspect", str(files / "a.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "120 (1 frozen)" in out and "30 layers" in out
    assert main(["inspect", "--json", str(files / "a.safetensors")]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["num_tokens"] == 120 and meta["init"] == "prefix"


@pytest.mark.parametrize("reposition", [False, True])
def test_compose(files, capsys, reposition):
    out = files / f"ab{int(reposition)}.safetensors"
    args = ["compose", str(files / "a.safetensors"), str(files / "b.safetensors"), "-o", str(out)]
    assert main(args + (["--reposition"] if reposition else [])) == 0
    c = Cartridge.load(out)
    assert c.num_tokens == 160 and len(c.meta.parts) == 2
    assert [p["repositioned"] for p in c.meta.parts] == [False, reposition]


def test_ask_answers_from_the_cartridge(files, capsys):
    assert main(["ask", str(files / "a.safetensors"), "When was the Harrow Point lighthouse built?", "--max-new-tokens", "40"]) == 0
    assert "1871" in capsys.readouterr().out


def test_ask_stream(files, capsys):
    assert main(["ask", str(files / "a.safetensors"), "Who built the lighthouse?", "--max-new-tokens", "20", "--stream"]) == 0
    assert capsys.readouterr().out.strip()


def test_ask_a_store_with_passages(files, capsys, default_lm):
    from cartridges_sdk import CartridgeStore

    harrow = (DATA / "harrow_point.txt").read_text("utf-8")
    store = CartridgeStore(files / "store", default_lm)
    store.add("harrow", Cartridge.load(files / "a.safetensors", store.model), corpus=harrow)
    store.add("tides", Cartridge.load(files / "b.safetensors", store.model),
              corpus=(files / "tides.txt").read_text("utf-8"))
    question = "When was the Harrow Point lighthouse built?"
    args = ["ask", "--store", str(files / "store"), question, "--max-new-tokens", "8"]
    assert main(args + ["--budget", "200", "--passages", "64"]) == 0
    out, err = capsys.readouterr()
    want = store.ask(question, budget=200, passages=64, max_new_tokens=8)
    assert out.strip() == want.text.strip() and want.cartridges == ("harrow",)
    assert "cartridges: harrow; passages from: harrow" in err
    for bad, said in [(["--passages", "64"], "--passages picks a store's cartridges or passages; add --store"),
                      (["--store", str(files / "store")], "not both, not neither")]:
        assert main(["ask", str(files / "a.safetensors"), question, *bad]) == 2
        assert said in capsys.readouterr().err
    assert main(args + ["--budget", "64", "--passages", "64"]) == 2
    assert "leaves nothing of budget=64 for cartridges" in capsys.readouterr().err
    # the embedded 135M is no reader: its budget is all cartridges, so how to find passages is refused, not ignored
    assert main(args + ["--budget", "200", "--passages-from", "routed"]) == 2
    assert "--passages-from says how passages are found, and this question gets none" in capsys.readouterr().err
    assert main(args + ["--budget", "200", "--draft", "4"]) == 2
    assert "--draft says how passages are found, and this question gets none" in capsys.readouterr().err
    # a first answer picks the passages: the same answer and passages as the store's own
    assert main(args + ["--budget", "200", "--passages", "64", "--draft", "4"]) == 0
    out, err = capsys.readouterr()
    drafted = store.ask(question, budget=200, passages=64, draft=4, max_new_tokens=8)
    assert out.strip() == drafted.text.strip() and drafted.draft is not None
    assert f"passages from: {', '.join(sorted({p.name for p in drafted.passages}))}" in err
    # another store's cartridges write it: here the same store's, alone
    assert main(args + ["--budget", "200", "--passages", "64", "--draft", "4", "--draft-from", str(files / "store")]) == 0
    out, _ = capsys.readouterr()
    assert out.strip() == store.ask(question, budget=200, passages=64, draft=4, draft_from=store,
                                    max_new_tokens=8).text.strip()
    for bad, said in [(["--draft-from", str(files / "store")], "no --draft N asks for one"),
                      (["--draft", "4", "--draft-from", str(files / "nowhere")], "no such store folder")]:
        assert main(args + ["--budget", "200", "--passages", "64", *bad]) == 2
        assert said in capsys.readouterr().err
    assert not (files / "nowhere").exists()
    # trim: the 120-token cartridge cut to the 96 that 64 tokens of passages leave of 160, the draft by it whole
    trimmed = ["--budget", "160", "--passages", "64", "--trim"]
    assert main(args + trimmed + ["--draft", "4", "--draft-from", str(files / "store")]) == 0
    out, err = capsys.readouterr()
    want = store.ask(question, budget=160, passages=64, trim=True, draft=4, draft_from=store, max_new_tokens=8)
    assert out.strip() == want.text.strip() and want.sizes == (96,)
    assert "cartridges: harrow (its first 96 of 120 tokens)" in err
    assert main(args + ["--budget", "160", "--trim"]) == 2
    assert "--trim cuts the cartridges to what --passages leave of --budget" in capsys.readouterr().err
    # --trim-by attention: the cut keeps the 96 tokens the question reads most
    assert main(args + ["--budget", "160", "--passages", "64", "--trim-by", "attention"]) == 0
    out, err = capsys.readouterr()
    want = store.ask(question, budget=160, passages=64, trim="attention", max_new_tokens=8)
    assert out.strip() == want.text.strip() and "cartridges: harrow (its most read 96 of 120 tokens)" in err
    assert main(args + ["--budget", "160", "--trim-by", "attention"]) == 2
    assert "--trim-by cuts the cartridges to what --passages leave of --budget" in capsys.readouterr().err


def test_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage" * 10)
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "truncated or corrupt" in err


def test_wrong_model_from_the_cli(files, tmp_path, tiny_qwen, capsys):
    tiny_qwen.model.save_pretrained(tmp_path / "tiny")
    tiny_qwen.tokenizer.save_pretrained(tmp_path / "tiny")
    code = main(["ask", str(files / "a.safetensors"), "Hi", "--model", str(tmp_path / "tiny")])
    err = capsys.readouterr().err
    assert code == 2 and "SmolLM2-135M-Instruct" in err and "does not fit" in err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "cartridges_sdk.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "compose" in out.stdout


TINY = ["--set", "conversations_per_chunk=4", "--set", "max_tokens_a=8", "--set", "max_tokens_b=8",
        "--set", "min_chunk=64", "--set", "max_chunk=128", "--set", "document_windows=2", "--set", "window_tokens=32"]


def test_synthesize_then_train(tmp_path, capsys, monkeypatch):
    from cartridges_sdk.making import precision

    # two trainings below are compared bit for bit: "fastest" is timed per model load, and a loaded machine can time
    # the two loads differently (it did once), so both compute in the model's own dtype
    monkeypatch.setattr(precision, "fastest_dtypes", lambda lm, stages=precision.STAGES: dict.fromkeys(stages, None))
    corpus = str(DATA / "harrow_point.txt")
    data = tmp_path / "data.parquet"
    assert main(["synthesize", corpus, "-o", str(data), "--conversations", "4", *TINY]) == 0
    assert "4 conversations, 2 document windows" in capsys.readouterr().out
    # the dataset keeps its corpus: the default start (the corpus compacted) needs nothing else, as the README says
    assert main(["train", str(data), "-o", str(tmp_path / "c.safetensors"), "--tokens", "16", "--set", "lr=0.01"]) == 0
    c = Cartridge.load(tmp_path / "c.safetensors")
    assert c.meta.init == "trained" and c.meta.training["config"]["lr"] == 0.01
    assert c.meta.training["init"] == "compact"
    assert c.meta.training["synthesis"]["max_tokens_b"] == 8
    # --corpus still works, from the same start, and is checked against the corpus the dataset was made from
    assert main(["train", str(data), "-o", str(tmp_path / "d.safetensors"), "--tokens", "16", "--set", "lr=0.01",
                 "--corpus", corpus]) == 0
    d = Cartridge.load(tmp_path / "d.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(c.keys + c.values, d.keys + d.values))
    other = tmp_path / "other.txt"
    other.write_text("Another text altogether, about tides. " * 20)
    assert main(["train", str(data), "-o", str(tmp_path / "e.safetensors"), "--tokens", "16",
                 "--corpus", str(other)]) == 2
    err = capsys.readouterr().err
    assert "is not the one" in err and "leave --corpus out: the dataset keeps its corpus" in err
    # a kept corpus that was changed is refused by name, before any model work
    kept = data / "corpus.txt"
    kept.write_text(kept.read_text() + "an edit")
    assert main(["train", str(data), "-o", str(tmp_path / "e.safetensors"), "--tokens", "16"]) == 2
    assert "changed or damaged" in capsys.readouterr().err
    # a dataset made before datasets kept their corpus still loads, and the default start asks for the corpus
    kept.unlink()
    assert main(["train", str(data), "-o", str(tmp_path / "e.safetensors"), "--tokens", "16"]) == 2
    assert "init='compact' (the default) needs the whole corpus: pass --corpus" in capsys.readouterr().err
    assert main(["train", str(data), "-o", str(tmp_path / "e.safetensors"), "--tokens", "16", "--init", "prefix"]) == 0
    # --compaction says how the compacted start is made, and is refused with a start that is not one
    assert main(["train", str(data), "-o", str(tmp_path / "e.safetensors"), "--tokens", "16", "--init", "prefix",
                 "--compaction", "keep_surprising=0.5"]) == 2
    assert "compaction= says how init='compact' compacts" in capsys.readouterr().err
    assert main(["train", str(data), "-o", str(tmp_path / "g.safetensors"), "--tokens", "16", "--corpus", corpus,
                 "--compaction", "keep_surprising=0.5"]) == 0
    start = Cartridge.load(tmp_path / "g.safetensors.work" / COMPACT_START)
    assert start.meta.extra["compaction"]["keep_surprising"] == 0.5
    # trained among other cartridges: the files named, each checked before the model loads
    among = ["train", str(data), "-o", str(tmp_path / "f.safetensors"), "--tokens", "16", "--init", "prefix",
             "--set", "max_distractors=1", "--distractors", str(tmp_path / "c.safetensors")]
    assert main([*among, str(tmp_path / "gone.safetensors")]) == 2
    assert "--distractors " in capsys.readouterr().err
    assert main([*among, str(tmp_path / "d.safetensors")]) == 0
    assert Cartridge.load(tmp_path / "f.safetensors").meta.training["distractors"] == {
        "most": 1, "alone": 0.5, "content": [c.fingerprint, d.fingerprint]}
    # a training setting given to synthesize is refused with a pointer to the right command
    assert main(["synthesize", corpus, "-o", str(tmp_path / "x"), "--set", "lr=0.1"]) == 2
    assert "cartridges train" in capsys.readouterr().err
    assert main(["train", str(data), "-o", str(tmp_path / "y.safetensors"), "--tokens", "16", "--set", "top_k=5"]) == 2
    assert "cartridges synthesize" in capsys.readouterr().err


def test_shards_made_apart_then_merged(tmp_path, capsys):
    corpus = str(DATA / "harrow_point.txt")
    common = ["synthesize", corpus, "--conversations", "8", *TINY]  # groups: 2 of conversations, 1 of windows
    assert main([*common, "-o", str(tmp_path / "s1"), "--shard", "1/2"]) == 0
    assert "4 conversations, 0 document windows (shard 1 of 2" in capsys.readouterr().out
    assert main(["merge", str(tmp_path / "s1"), "-o", str(tmp_path / "data")]) == 0
    out = capsys.readouterr()
    assert "2 group(s) missing: [0, 2]" in out.out and "run the same `cartridges synthesize`" in out.err
    assert main(["train", str(tmp_path / "s1"), "-o", str(tmp_path / "c.safetensors"), "--tokens", "8",
                 "--init", "random"]) == 2
    assert "holds shard 1 of 2 of a synthesis, not the whole dataset" in capsys.readouterr().err
    assert main([*common, "-o", str(tmp_path / "s0"), "--shard", "0/2"]) == 0
    assert main(["merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "-o", str(tmp_path / "data")]) == 0
    assert capsys.readouterr().out.strip().endswith("8 conversations, 2 document windows")
    assert (tmp_path / "data" / "corpus.txt").read_text() == (tmp_path / "s0" / "corpus.txt").read_text()  # kept
    assert main([*common, "-o", str(tmp_path / "s0"), "--shard", "0/2", "--nproc", "2"]) == 2
    assert "Use one or the other" in capsys.readouterr().err
    assert main([*common, "-o", str(tmp_path / "s0"), "--shard", "0/3"]) == 2  # not the shard that folder holds
    assert "holds shard 0 of 2, not shard 0 of 3" in capsys.readouterr().err


def test_build(tmp_path, capsys):
    out = tmp_path / "b.safetensors"
    args = ["build", str(DATA / "harrow_point.txt"), "-o", str(out), "--tokens", "16", "--conversations", "4", *TINY]
    # the reader's recipe, with each flag over it: --conversations, --epochs and --set (TINY) win, and the compacted
    # start is made as --compaction says key by key over the recipe's (here with the text's own questions)
    assert main([*args, "--recipe", "reader", "--epochs", "1", "--compaction", "chunk_questions=1",
                 "--compaction", "answer_tokens=4"]) == 0
    built = Cartridge.load(out)
    assert built.num_tokens == 16
    synthesis, training = built.meta.training["synthesis"], built.meta.training["config"]
    assert (synthesis["num_conversations"], synthesis["document_windows"], training["epochs"]) == (4, 2, 1)
    assert (synthesis["b_context"], synthesis["seed_weights"], training["lr"], training["conversation_weight"]) == (
        "document", {"question": 1}, 0.01, 2.0)  # the recipe's
    assert (tmp_path / "b.safetensors.work" / "data" / "header.json").is_file()
    made = Cartridge.load(tmp_path / "b.safetensors.work" / "train" / COMPACT_START).meta.extra["compaction"]
    assert (made["chunk_questions"], made["answer_tokens"], made["keep_surprising"]) == (1, 4, 0.45)
    # refused before any model work: a name CompactionConfig lacks, and a compaction for a start that is not one
    assert main([*args, "--compaction", "selection=max"]) == 2
    assert "--compaction 'selection' is not a compaction setting" in capsys.readouterr().err
    assert main([*args, "--init", "prefix", "--compaction", "chunk_questions=1"]) == 2
    assert "compaction= says how init='compact' compacts" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main([*args, "--recipe", "nope"])
    assert "argument --recipe: invalid choice: 'nope' (choose from 'reader')" in capsys.readouterr().err


def test_compact_then_ask(tmp_path, capsys):
    out = tmp_path / "c.safetensors"
    assert main(["compact", str(DATA / "harrow_point.txt"), "-o", str(out), "--tokens", "96"]) == 0
    assert "96 tokens standing in for" in capsys.readouterr().out
    c = Cartridge.load(out)
    assert c.meta.init == "compact" and c.num_tokens == 96
    # a fact the question does not give away (the engineer's name) comes from the compacted text
    assert main(["ask", str(out), "When was the Harrow Point lighthouse built?", "--max-new-tokens", "40"]) == 0
    assert "Ellison" in capsys.readouterr().out
    assert main(["compact", str(DATA / "harrow_point.txt"), "-o", str(tmp_path / "x"), "--tokens", "96",
                 "--set", "selection=max"]) == 2
    assert "not a compaction setting" in capsys.readouterr().err
