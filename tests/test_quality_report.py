"""The quality report: a cartridge scored against its own corpus in context on questions the model asks itself."""

from __future__ import annotations

import json
import math

import attrs
import pytest

from cartridges_sdk import Cartridge, CartridgeStore, ConfigError, SyncConfig
from cartridges_sdk.cli import main
from cartridges_sdk.making.report import CorpusReport, check_quality, report_of, _windows
from cartridges_sdk.making.settings import ReportConfig
from cartridges_sdk.serve.documents import SUFFIX

from conftest import DATA, TEXT

pytestmark = pytest.mark.default_model

QUICK = ReportConfig(questions=2, answer_tokens=16)


def test_the_text_itself_recovers_everything_and_a_random_cartridge_does_not(default_lm):
    # a cartridge of the whole text is the text in context, exactly (the project's ground truth): nothing is lost
    exact = Cartridge.from_prefix(default_lm, TEXT, len(default_lm.encode(TEXT)))
    report = check_quality(default_lm, TEXT, exact, attrs.evolve(QUICK, dtype=None))  # in the model's own dtype
    assert report.questions == 2 and report.windows == 1 and report.window_tokens == len(default_lm.encode(TEXT))
    assert report.nll["context"] < report.nll["none"]  # the text helps, so there is something to recover
    assert report.recovered == pytest.approx(1.0, abs=1e-4) and report.kl == pytest.approx(0.0, abs=1e-5)
    assert report.agreement == 1.0
    # the same questions again (the report's own seed): the same figures. In the model's dtype: "fastest" is timed, and
    # on a machine where bf16 and float32 run the 135M about as fast it picks either, so two questions would differ
    fixed = attrs.evolve(QUICK, dtype=None)
    noise = Cartridge.random(default_lm, 32, seed=3)
    first, again = check_quality(default_lm, TEXT, noise, fixed), check_quality(default_lm, TEXT, noise, fixed)
    assert first == attrs.evolve(again, seconds=first.seconds)  # the same but for the time it took
    assert first.kl > 0.01 and first.agreement < 1.0 and first.recovered < 0.9


def test_the_report_travels_in_the_file_and_refuses_another_corpus(default_lm, tmp_path):
    c = Cartridge.compact(default_lm, TEXT, 48, progress=False, report=QUICK)
    assert c.quality is not None and c.quality["questions"] == 2 and set(c.quality) >= {"recovered", "kl", "agreement"}
    c.save(tmp_path / "c.safetensors")
    loaded = Cartridge.load(tmp_path / "c.safetensors")
    assert loaded.quality == c.quality and report_of(loaded) == report_of(c)
    assert Cartridge.compact(default_lm, TEXT, 48, progress=False, report=False).quality is None
    with pytest.raises(ConfigError, match="made from another corpus"):
        check_quality(default_lm, TEXT + " One more sentence.", c, QUICK)
    with pytest.raises(ConfigError, match=r"report='yes' must be True, False \(skip the quality report\) or a "):
        Cartridge.compact(default_lm, TEXT, 48, progress=False, report="yes")
    with pytest.raises(ConfigError, match="questions=0"):
        ReportConfig(questions=0)
    with pytest.raises(ConfigError, match="dtype='fp8'"):
        ReportConfig(dtype="fp8")


def test_a_long_corpus_is_read_in_stretches_that_keep_its_first_token(default_lm):
    ids = default_lm.encode(TEXT * 4)
    config = ReportConfig(window_tokens=300, windows=3)
    windows = _windows(default_lm, ids, config)
    assert len(windows) == 3 and all(len(w) == 300 and w[0] == ids[0] for w in windows)
    assert windows[0][1:] == ids[1:300] and windows[-1][1:] == ids[-299:]  # spread from the start to the end
    assert _windows(default_lm, ids[:200], config) == [ids[:200]]  # it fits: read whole


def test_summary_says_when_the_reader_does_not_read():
    weak = CorpusReport(recovered=-2.0, kl=0.03, agreement=0.9, questions=8,
                        nll={"none": 1.00, "context": 0.98, "cartridge": 1.04}, windows=1, window_tokens=400,
                        seconds=20.0, seed=1)
    assert not weak.informative and "Not informative" in weak.summary()
    strong = CorpusReport(recovered=0.68, kl=0.92, agreement=0.73, questions=8,
                          nll={"none": 3.42, "context": 0.35, "cartridge": 1.34}, windows=1, window_tokens=400,
                          seconds=20.0, seed=1)
    assert strong.informative and "recovers 0.68 of what the text in context adds" in strong.summary()
    assert "Not informative" not in strong.summary()
    nothing = CorpusReport.from_dict({**strong.to_dict(), "recovered": None})
    assert math.isnan(nothing.recovered) and "nothing to recover" in nothing.summary()


def test_compact_prints_and_keeps_it_inspect_shows_it_eval_runs_it_again(tmp_path, capsys):
    out = tmp_path / "c.safetensors"
    corpus = str(DATA / "harrow_point.txt")
    assert main(["compact", corpus, "-o", str(out), "--tokens", "64", "--no-report"]) == 0
    assert Cartridge.load(out).quality is None
    assert main(["inspect", str(out)]) == 0
    assert "not checked (cartridges eval FILE --corpus PATH" in capsys.readouterr().out
    assert main(["eval", str(out), "--corpus", corpus, "--questions", "2"]) == 0
    printed = capsys.readouterr().out
    assert "quality report: " in printed and "2 held-out questions" in printed and f"kept the report in {out}" in printed
    kept = Cartridge.load(out).quality
    assert kept["questions"] == 2
    assert main(["inspect", str(out)]) == 0
    assert "2 held-out questions the model asked itself" in capsys.readouterr().out
    assert main(["eval", str(out), "--corpus", corpus, "--questions", "2", "--seed", "5", "--json", "--no-save"]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["seed"] == 5 and Cartridge.load(out).quality == kept  # --no-save leaves the file as it was
    stray = tmp_path / "other.txt"
    stray.write_text("A different text altogether, about tides.")
    assert main(["eval", str(out), "--corpus", str(stray)]) != 0
    assert "made from another corpus" in capsys.readouterr().err


def test_sync_keeps_each_compacted_documents_report_in_its_record(default_lm, tmp_path):
    store = CartridgeStore(tmp_path / "store", default_lm)
    docs = {"harrow.txt": TEXT, "short.txt": "A short note."}
    store.sync(docs, SyncConfig(tokens=48, report=QUICK), progress=False)
    records = store.records()
    assert records["harrow.txt"]["method"] == "compact" and records["harrow.txt"]["quality"]["questions"] == 2
    assert "quality" not in records["short.txt"]  # kept whole: exact, nothing to check
    assert store.get("harrow.txt").quality == records["harrow.txt"]["quality"]
    # checked again from the shell: the record says what the file now holds
    path, corpus = store.root / f"harrow.txt{SUFFIX}", store.corpus_path("harrow.txt")
    assert main(["eval", str(path), "--corpus", str(corpus), "--questions", "2", "--seed", "11"]) == 0
    store.refresh()
    assert store.records()["harrow.txt"]["quality"]["seed"] == 11
    bare = CartridgeStore(tmp_path / "bare", default_lm)
    bare.sync(docs, SyncConfig(tokens=48, report=False), progress=False)
    assert "quality" not in bare.records()["harrow.txt"]
