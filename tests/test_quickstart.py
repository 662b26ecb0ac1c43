"""The quick start on a user's own text and questions (`--corpus`, `--question`), run as a user runs it; on the
embedded model, which the tests use (its default reader is pulled by name: tests/test_named_models.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.quickstart_texts import summary

ROOT = Path(__file__).resolve().parent.parent

TEXT = ("The Orrin Valley railway opened in 1903 and ran for forty-two kilometres between the mill town of Caddon and "
        "the harbour at Wrenmouth. Its engines burned peat from the valley floor until 1921, when the company bought "
        "coal from the mines at Teyne. Passenger trains stopped in 1958; the line closed to freight in 1966, and its "
        "track bed is now a walking path.")


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), *args], capture_output=True,
                          text=True, timeout=600, cwd=cwd, check=False)


def test_by_default_the_compacted_cartridge_answers_and_is_reported(tmp_path):
    """Without --self-study the quick start ends with the compacted cartridge, made in seconds, and says how to train
    it further; its quality report is the compacted cartridge's."""
    done = run("--model", "default", "--work-dir", str(tmp_path / "work"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    verdict = summary(out)
    assert verdict["cartridge"] == "compacted" and set(verdict["right"]) == {"no context", "whole text", "compacted"}
    assert "Self-study from the compacted" not in out and "`--self-study` trains it further" in out
    assert len(re.findall(r"quality report: (recovers|the text|the model asked)", done.stderr)) == 1
    assert (tmp_path / "work.safetensors").is_file()


@pytest.mark.slow  # a minute: self-study in the quick start; the default quick start stays in the default tier
def test_your_own_text_and_questions_go_through_the_same_steps(tmp_path):
    corpus = tmp_path / "railway.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    questions = ["When did the railway open?", "What did its engines burn first?"]
    # the first marked by what a right answer names; the second ('') left to the reader to compare
    done = run("--model", "default", "--corpus", str(corpus), "--question", questions[0], "--answer", "1903",
               "--question", questions[1], "--answer", "", "--self-study", "--conversations", "4", "--work-dir",
               str(tmp_path / "work"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    corpus_tokens = int(re.search(r"corpus: railway\.txt, (\d+) tokens", out).group(1))
    # a quarter of the corpus by default, rounded up, at least 32
    tokens = int(re.search(r"Compacting the text into (\d+) tokens", out).group(1))
    assert tokens == max(32, -(-corpus_tokens // 4))
    for q in questions:  # each asked twice over: the baselines first, then the whole text beside the cartridge
        assert out.count(f"Q: {q}") == 2
    assert (out.index("whole text:") < out.index("Compacting the text") < out.index("Self-study from the compacted")
            < out.index("-token cartridges in place of the text"))
    # the first question's answers marked in all five places: no context, whole text (twice), compacted, self-study
    assert out.count("[right]") + out.count("[wrong]") == 5
    assert re.search(r"right answers: no context \d/1, whole text \d/1, compacted \d/1, self-study \d/1\n", out), out
    kept = re.search(r"The self-study cartridge answers (\d) of the (\d) questions the whole text answers right", out)
    assert kept
    # the benchmark that runs the quick start over several texts reads these two lines the same way
    verdict = summary(out)
    assert (verdict["questions"], verdict["cartridge"]) == (1, "self-study") and set(verdict["right"]) == {
        "no context", "whole text", "compacted", "self-study"}
    assert (verdict["kept"], verdict["whole_text_right"]) == (int(kept.group(1)), int(kept.group(2)))
    # every answer came from the runtime "auto" picks for the embedded GGUF: llama.cpp, installed with the tests
    assert verdict["runtime"] == "llamacpp"
    assert "Compare the cartridges' answers with the whole text's above (1 without an --answer" in out
    assert f"at {corpus_tokens / tokens:.1f}x less KV memory" in out
    # one quality report, the trained cartridge's (the compacted start's is skipped)
    assert len(re.findall(r"quality report: (recovers|the text|the model asked)", done.stderr)) == 1
    assert (tmp_path / "work.safetensors").is_file()


def test_bad_arguments_are_named_before_any_work(tmp_path):
    missing = run("--model", "default", "--corpus", str(tmp_path / "nope.txt"))
    assert missing.returncode == 2
    assert "nope.txt: no such file" in missing.stderr
    unpaired = run("--model", "default", "--question", "Who?", "--question", "When?", "--answer", "1903")
    assert unpaired.returncode == 2
    assert "1 --answer for 2 --question" in unpaired.stderr
    bad_setting = run("--model", "default", "--set", "lr")
    assert bad_setting.returncode == 2
    assert "--set 'lr' must look like key=value" in bad_setting.stderr
    for args, said in ((["--self-study", "--set", "num_tokens=8"], "--set num_tokens: the quick start sets it"),
                       (["--set", "lr=0.01"], "runs with --self-study; add it"),
                       (["--conversations", "8"], "runs with --self-study; add it"),
                       (["--keep-surprising", "1.5"], "--keep-surprising: keep_surprising=1.5 must be a share")):
        refused = run("--model", "default", *args)
        assert refused.returncode == 2 and said in refused.stderr

