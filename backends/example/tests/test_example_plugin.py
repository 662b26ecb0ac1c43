"""The example plugin as its author tests it: installed from its folder, found by name, keeping the contract."""

from __future__ import annotations

import json

import pytest
from cartridges_example.runtime import LoggingRuntime
from cartridges_example.synthesizer import LoggingSynthesizer

from cartridges_sdk import Cartridge, ConfigError, load_model, testing
from cartridges_sdk.plugins import runtimes, synthesizers


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lm(request):
    return testing.tiny_lm(request.param)


def test_found_by_name_from_its_installed_distribution():
    assert runtimes.get("example") is LoggingRuntime and synthesizers.get("example") is LoggingSynthesizer
    rows = {r["name"]: r for r in runtimes.describe()}
    assert rows["example"]["ok"] and rows["example"]["distribution"].startswith("cartridges-example ")
    assert rows["example"]["options"] == ["log_file"]


def test_runtime_keeps_the_contract(lm, tmp_path):
    log = tmp_path / "calls.jsonl"
    with runtimes.create("example", lm, log_file=str(log)) as runtime:
        testing.check_runtime(runtime, lm)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert {e["event"] for e in events} == {"generate", "stream"} and any(len(e["cartridges"]) == 2 for e in events)


def test_synthesizer_keeps_the_contract(lm):
    testing.check_synthesizer(synthesizers.create("example", lm), lm)


def test_chosen_by_name_from_python(lm, tmp_path):
    c = Cartridge.from_prefix(lm, testing.CONTRACT_TEXTS[0], 20)
    log = tmp_path / "ask.jsonl"
    got = c.ask("Who built it?", runtime="example", runtime_options={"log_file": str(log)}, max_new_tokens=6)
    assert got == c.ask("Who built it?", max_new_tokens=6)  # the HF runtime's answer
    assert json.loads(log.read_text())["cartridges"] == [c.fingerprint[:12]]
    with pytest.raises(ConfigError, match=r"Unknown option\(s\) \['verbose'\] for runtime 'example'; valid options: \['log_file'\]"):
        c.ask("Who?", runtime="example", runtime_options={"verbose": True})


def test_self_study_with_the_example_synthesizer(lm, tmp_path):
    log = tmp_path / "synth.jsonl"
    c = Cartridge.from_corpus(
        " ".join(testing.CONTRACT_TEXTS), lm, num_tokens=16, num_conversations=2, conversations_per_chunk=2,
        min_chunk=64, max_chunk=96, max_tokens_a=6, max_tokens_b=6, document_windows=2, window_tokens=16,
        synthesizer="example", synthesizer_options={"log_file": str(log)}, output_dir=tmp_path / "work", progress=False,
    )
    assert c.meta.init == "trained" and c.meta.training["synthesizer"] == "LoggingSynthesizer"
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    # the same-model probe, then A and B for the one group, then the windows
    assert events.count("complete") == 3 and "score" in events


@pytest.mark.default_model
def test_keeps_the_contract_on_the_default_model():
    lm = load_model()
    with runtimes.create("example", lm) as runtime:
        testing.check_runtime(runtime, lm)


@pytest.mark.default_model
def test_chosen_by_name_from_the_cli(tmp_path, capsys):
    from cartridges_sdk.cli import main

    text = tmp_path / "doc.txt"
    text.write_text(testing.CONTRACT_TEXTS[0])
    path = tmp_path / "doc.safetensors"
    assert main(["init", str(text), "-o", str(path), "--tokens", "30"]) == 0
    capsys.readouterr()
    log = tmp_path / "cli.jsonl"
    args = ["ask", str(path), "Who built the lighthouse?", "--max-new-tokens", "12"]
    assert main(args + ["--runtime", "example", "--backend-option", f"log_file={log}"]) == 0
    via_plugin = capsys.readouterr().out
    assert main(args) == 0
    assert via_plugin == capsys.readouterr().out and json.loads(log.read_text())["event"] == "generate"
    assert main(args + ["--runtime", "example", "--backend-option", "colour=red"]) == 2
    assert "valid options: ['log_file']" in capsys.readouterr().err
