"""The example plugin as its author tests it: installed from its folder, found by name, keeping the contract."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from cartridges_example.runtime import LoggingRuntime
from cartridges_example.synthesizer import LoggingSynthesizer

from cartridges_sdk import (Cartridge, CartridgeStore, ConfigError, GenerationParams, GenerationRequest,
                            SynthesisRequest, UnsupportedModelError, load_model, testing)
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


# ---- the engine is the plugin's own

def test_engine_logits_equal_the_models_own_forward(lm):
    from cartridges_example.engine import Engine

    engine, ids = Engine(lm.model), lm.encode(testing.CONTRACT_TEXTS[1])[:40]
    reference = lm.logits(ids)
    cache = engine.new_cache(len(ids))
    got = torch.cat([engine.forward(ids[:30], cache, all_logits=True),  # a prefill, then more tokens after it
                     engine.forward(ids[30:], cache, all_logits=True)])
    assert (got - reference).abs().max() < 1e-4  # float32: ~2e-7 here
    cartridge = Cartridge.from_prefix(lm, ids, 20)  # keys post-RoPE for positions 0..19, installed as they are
    cache = engine.new_cache(len(ids))
    cache.install(list(zip(cartridge.keys, cartridge.values)))
    assert cache.length == 20 and (engine.forward(ids[20:], cache, all_logits=True) - reference[20:]).abs().max() < 1e-4


def test_runtime_and_synthesizer_never_call_the_transformers_model(lm, monkeypatch):
    cartridge = Cartridge.from_prefix(lm, testing.CONTRACT_TEXTS[0], 16)  # made by the student's forward
    want = lm.ask("Who built it?", [cartridge], max_new_tokens=6)  # the HF runtime's answer
    runtime, synthesizer = runtimes.create("example", lm), synthesizers.create("example", lm)

    def refuse(*args, **kwargs):
        raise AssertionError("the example backend called the transformers model")

    monkeypatch.setattr(lm.model, "forward", refuse)
    monkeypatch.setattr(lm.model.base_model, "forward", refuse)
    assert runtime.generate([GenerationRequest([{"role": "user", "content": "Who built it?"}], [cartridge],
                                               GenerationParams(max_new_tokens=6))])[0].text == want
    assert synthesizer.complete([SynthesisRequest(lm.encode("The lamp"), max_tokens=4, top_logprobs=2)])[0].token_ids
    assert len(synthesizer.score(lm.encode("The"), [lm.encode("lamp burned")], 2)) == 1


def test_refuses_what_the_engine_does_not_implement():
    from cartridges_example.engine import Engine

    model = testing.tiny_model("llama", vocab_size=32)
    model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match=r"rope_type='linear'.*runtime='hf'"):
        Engine(model)
    model = testing.tiny_model("qwen2", vocab_size=32)
    model.config.model_type = "mistral"
    with pytest.raises(UnsupportedModelError, match=r"not 'mistral'"):
        Engine(model)


def test_one_request_fails_alone_behind_the_server(tmp_path):
    lm = testing.tiny_lm("llama")
    store = CartridgeStore(tmp_path / "store", lm)
    for i, text in enumerate(testing.CONTRACT_TEXTS):
        store.add(f"c{i}", Cartridge.from_prefix(lm, text, 8 + i), corpus=text)
    with runtimes.create("example", lm) as runtime:
        testing.check_one_request_fails_alone(runtime, store, store.names())


def test_a_request_too_long_fails_the_batch_before_any_compute(lm, monkeypatch):
    runtime = runtimes.create("example", lm)
    monkeypatch.setattr(runtime.engine, "forward", lambda *a, **k: pytest.fail("computed before the check"))
    ok = GenerationRequest([{"role": "user", "content": "Hi"}], [], GenerationParams(max_new_tokens=4))
    long = attrs.evolve(ok, params=GenerationParams(max_new_tokens=lm.max_context))
    with pytest.raises(ConfigError, match=r"Request 1 .* needs \d+ tokens, more than the 2048-token context"):
        runtime.generate([ok, long])
