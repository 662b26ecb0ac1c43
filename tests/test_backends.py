"""The plugin seams: backends built by name, options, runtimes chosen at every entry point, installs keyed on content,
the key layout in the file, capabilities and the same-model check before work, engine errors, and module layers."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from cartridges_sdk import (
    Cartridge,
    CartridgeFormatError,
    ConfigError,
    GenerationRequest,
    IncompatibleCartridgeError,
    ModelIdentity,
    PluginError,
    SynthesizerCapabilities,
    TransientBackendError,
    testing,
)
from cartridges_sdk.making.dataset import SelfStudyDataset
from cartridges_sdk.hf import HFRuntime, HFSynthesizer
from cartridges_sdk.plugins import Registry, Runtime, runtimes, synthesizers
from cartridges_sdk.rope import INTERLEAVED, ROTATE_HALF
from cartridges_sdk.making.settings import SynthesisConfig
from cartridges_sdk.making.synthesis import synthesize

from conftest import TEXT
from test_contract import OtherModelsTopK


def _tiny_synthesis(**kw):
    base = dict(num_conversations=4, conversations_per_chunk=2, min_chunk=60, max_chunk=100, max_tokens_a=6,
                max_tokens_b=6, top_k=4, document_windows=0)
    return SynthesisConfig(**{**base, **kw})


# -- registry and construction ------------------------------------------------------------------------------


def test_one_constructor_contract_with_checked_options(tiny_llama):
    synth = synthesizers.create("hf", tiny_llama, autocast_dtype="bfloat16")
    assert isinstance(synth, HFSynthesizer) and synth.autocast_dtype == torch.bfloat16
    with pytest.raises(ConfigError, match=r"Unknown option\(s\) \['dtype'\] for synthesizer 'hf'; valid options: \['autocast_dtype', 'score_dtype'\]"):
        synthesizers.create("hf", tiny_llama, dtype="bf16")
    with pytest.raises(ConfigError, match="autocast_dtype='int8'"):
        synthesizers.create("hf", tiny_llama, autocast_dtype="int8")
    with pytest.raises(ConfigError, match="max_installed=0"):
        runtimes.create("hf", tiny_llama, max_installed=0)


def test_duplicate_names_are_refused_unless_replaced():
    reg = Registry("cartridges_sdk.test_only", Runtime, "runtime")
    reg.register("mine", HFRuntime)
    with pytest.raises(PluginError, match="'mine' is already registered.*replace=True"):
        reg.register("mine", testing.FakeRuntime)
    reg.register("mine", testing.FakeRuntime, replace=True)
    assert reg.get("mine") is testing.FakeRuntime
    with pytest.raises(PluginError, match="'hf' is already registered"):
        runtimes.register("hf", testing.FakeRuntime)  # the installed entry point keeps its name


def test_runtime_by_name_at_every_entry_point(tiny_llama, monkeypatch):
    monkeypatch.setitem(runtimes._extra, "fake", testing.FakeRuntime)
    c = Cartridge.from_prefix(tiny_llama, TEXT, 20)
    assert c.ask("Who?", runtime="fake") == "fake answer"
    assert c.chat([{"role": "user", "content": "Who?"}], runtime="fake") == "fake answer"
    assert tiny_llama.ask("Who?", runtime="fake") == "fake answer"
    fake = tiny_llama.get_runtime("fake")
    assert tiny_llama.get_runtime("fake") is fake and len(fake.requests) == 3  # built once, reused
    assert fake.requests[0].cartridges == (c,) and fake.requests[2].cartridges == ()
    tiny_llama.close()
    assert fake.closed and tiny_llama.get_runtime("fake") is not fake
    with pytest.raises(PluginError, match="No runtime named 'nope'; available: .*'fake'.*'hf'"):
        c.ask("Who?", runtime="nope")
    with pytest.raises(ConfigError, match="runtime_options go with a runtime name"):
        c.ask("Who?", runtime=fake, runtime_options={"x": 1})


def test_cli_lists_backends_and_whether_they_import(capsys, monkeypatch):
    from cartridges_sdk.cli import main

    monkeypatch.setitem(runtimes._extra, "broken", "no_such_engine_pkg:Runtime")
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "runtimes:" in out and "synthesizers:" in out and "trainers:" in out
    assert "hf           ok      cartridges_sdk.hf:HFRuntime" in out and "scores sequences: yes" in out
    assert "broken       BROKEN" in out and "No module named 'no_such_engine_pkg'" in out
    assert main(["backends", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in listing["trainers"]} >= {"torch"}


# -- runtimes: heterogeneous batches, installs, fingerprints ---------------------------------------------------


def test_hf_runtime_installs_each_cartridge_content_once(tiny_llama):
    rt = HFRuntime(tiny_llama, max_installed=2)
    a = Cartridge.from_prefix(tiny_llama, TEXT, 20)
    a_again = Cartridge.from_prefix(tiny_llama, TEXT, 20)  # another object, same content
    b = Cartridge.from_prefix(tiny_llama, TEXT, 30)
    ask = lambda *cs: GenerationRequest([{"role": "user", "content": "Who?"}], list(cs))  # noqa: E731
    rt.generate([ask(a), ask(a_again), ask(a, b), ask()])
    rt.generate([ask(b), ask(a_again)])
    assert a.fingerprint == a_again.fingerprint != b.fingerprint and rt.installs == 2
    c = Cartridge.from_prefix(tiny_llama, TEXT, 40)
    rt.generate([ask(c)])  # a third content evicts the least recently used
    rt.generate([ask(b)])
    assert rt.installs == 4


def test_fingerprint_is_content_not_provenance(tiny_llama, tmp_path):
    a = Cartridge.from_prefix(tiny_llama, TEXT, 20)
    later = Cartridge(a.keys, a.values, attrs.evolve(a.meta, created="2030-01-01T00:00:00+00:00", extra={"note": 1}))
    assert later.fingerprint == a.fingerprint
    a.save(tmp_path / "a.safetensors")
    assert Cartridge.load(tmp_path / "a.safetensors").fingerprint == a.fingerprint
    nudged = Cartridge([k.clone() for k in a.keys], a.values, a.meta)
    nudged.keys[1][0, 5, 0] += 1e-3
    assert nudged.fingerprint != a.fingerprint


# -- the key layout in the file --------------------------------------------------------------------------------


def test_key_layout_is_recorded_and_old_files_load_as_rotate_half(tiny_llama, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    c = Cartridge.from_prefix(tiny_llama, TEXT, 20)
    path = c.save(tmp_path / "c.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["meta"])
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    assert meta["key_layout"] == {"rope_applied": True, "positions": "0..p-1", "pairing": "rotate_half"}
    del meta["key_layout"]  # as files written before the field existed
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata={"format": "cartridges-sdk", "format_version": "1",
                                                                     "meta": json.dumps(meta)})
    assert Cartridge.load(tmp_path / "old.safetensors").pairing == ROTATE_HALF
    meta["key_layout"] = {"pairing": "zigzag"}
    save_file(tensors, str(tmp_path / "odd.safetensors"), metadata={"format": "cartridges-sdk", "format_version": "1",
                                                                     "meta": json.dumps(meta)})
    with pytest.raises(CartridgeFormatError, match="odd.safetensors.*zigzag"):
        Cartridge.load(tmp_path / "odd.safetensors")


def test_interleaved_keys_convert_exactly_and_serve_the_same(tiny_lm, tmp_path):
    c = Cartridge.from_prefix(tiny_lm, TEXT, 24)
    inter = c.in_key_pairing(INTERLEAVED)
    assert inter.pairing == INTERLEAVED and not torch.equal(inter.keys[0], c.keys[0])
    assert torch.equal(inter.keys[0][:, :, 0], c.keys[0][:, :, 0])  # dim 0 stays, dim 1 takes old dim head_dim/2
    assert torch.equal(inter.keys[0][:, :, 1], c.keys[0][:, :, c.keys[0].shape[-1] // 2])
    back = Cartridge.load(inter.save(tmp_path / "i.safetensors")).in_key_pairing(ROTATE_HALF)
    assert all(torch.equal(x, y) for x, y in zip(back.keys, c.keys))
    q = tiny_lm.chat_ids([{"role": "user", "content": "Who built it?"}])
    assert torch.equal(tiny_lm.logits(q, [inter]), tiny_lm.logits(q, [c]))  # the HF runtime converts on install
    assert c.ask("Who built it?", max_new_tokens=8) == inter.bind(tiny_lm).ask("Who built it?", max_new_tokens=8)


# -- capabilities and the same model, before any work --------------------------------------------------------------


def test_settings_a_synthesizer_cannot_serve_are_refused_before_work(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setitem(synthesizers._extra, "fake", testing.FakeSynthesizer)
    with pytest.raises(ConfigError, match="document_windows=96 needs a synthesizer that scores.*set document_windows=0"):
        Cartridge.from_corpus(TEXT, tiny_llama, num_tokens=8, synthesizer="fake", output_dir=tmp_path / "w")
    with pytest.raises(ConfigError, match=r"top_k=50 but synthesizer 'fake' returns at most 20.*top_k <= 20"):
        Cartridge.from_corpus(TEXT, tiny_llama, num_tokens=8, synthesizer="fake", document_windows=0, top_k=50,
                              output_dir=tmp_path / "w")
    with pytest.raises(ConfigError, match="targets='all' needs a synthesizer that scores"):
        synthesize(TEXT, tiny_llama, tmp_path / "d", _tiny_synthesis(targets="all"),
                   synthesizer=testing.FakeSynthesizer(tiny_llama))
    with pytest.raises(ConfigError, match=r"Unknown option\(s\) \['speed'\] for trainer 'torch'"):
        Cartridge.from_corpus(TEXT, tiny_llama, num_tokens=8, trainer_options={"speed": 2}, output_dir=tmp_path / "w")
    assert not (tmp_path / "w").exists() and not (tmp_path / "d").exists()  # nothing was started


class NameOnly(HFSynthesizer):
    """Serves a model but reports only its name: the probe must decide."""

    def identity(self):
        return ModelIdentity(name=self.lm.name)


class ClaimsAnotherVocabulary(HFSynthesizer):
    def identity(self):
        return attrs.evolve(self.lm.identity, tokenizer="f" * 16)


def test_partial_identity_is_decided_by_the_probe(tiny_llama, tmp_path):
    ds = synthesize(TEXT, tiny_llama, tmp_path / "d", _tiny_synthesis(), synthesizer=NameOnly(tiny_llama), progress=False)
    check = SelfStudyDataset(tmp_path / "d").header["model_check"]
    assert check["method"] == "probe" and check["max_logprob_diff"] <= 1e-4 and len(ds) == 4


def test_another_model_is_refused_and_an_override_is_recorded(tiny_llama, tmp_path):
    other = testing.tiny_lm("llama", seed=1)  # same architecture and tokenizer, other weights
    with pytest.raises(IncompatibleCartridgeError, match="does not serve the student's model 'tiny-llama-seed0'.*differ"):
        synthesize(TEXT, tiny_llama, tmp_path / "d", _tiny_synthesis(), synthesizer=NameOnly(other), progress=False)
    assert not (tmp_path / "d").exists()
    synthesize(TEXT, tiny_llama, tmp_path / "d", _tiny_synthesis(), synthesizer=NameOnly(other),
               allow_unverified_model=True, progress=False)
    check = SelfStudyDataset(tmp_path / "d").header["model_check"]
    assert check["method"] == "override" and "differ from the student's" in check["unverified_because"]
    # a field both sides report and that differs is never overridden
    with pytest.raises(IncompatibleCartridgeError, match="tokenizer vocabulary"):
        synthesize(TEXT, tiny_llama, tmp_path / "e", _tiny_synthesis(), synthesizer=ClaimsAnotherVocabulary(tiny_llama),
                   allow_unverified_model=True, progress=False)


def test_a_right_identity_with_wrong_weights_is_caught_before_work(tiny_llama, tmp_path):
    other = testing.tiny_lm("llama", seed=1)  # reports the student's full identity, runs other weights
    with pytest.raises(IncompatibleCartridgeError, match="does not serve the student's model"):
        Cartridge.from_corpus(TEXT, tiny_llama, num_tokens=8, synthesizer=OtherModelsTopK(tiny_llama, other),
                              output_dir=tmp_path / "w", progress=False)
    assert not (tmp_path / "w" / "data").exists()
    synthesize(TEXT, tiny_llama, tmp_path / "d", _tiny_synthesis(), synthesizer=HFSynthesizer(tiny_llama), progress=False)
    check = SelfStudyDataset(tmp_path / "d").header["model_check"]
    assert check["method"] == "probe" and check["identity"] == "complete" and check["max_logprob_diff"] <= 1e-4


def test_fakes_pass_only_with_the_override(tiny_llama, tmp_path):
    with pytest.raises(IncompatibleCartridgeError, match="FakeSynthesizer does not serve"):
        synthesize(TEXT, tiny_llama, tmp_path / "d", _tiny_synthesis(), synthesizer=testing.FakeSynthesizer(tiny_llama))
    synthesize(TEXT, tiny_llama, tmp_path / "d", _tiny_synthesis(), synthesizer=testing.FakeSynthesizer(tiny_llama),
               allow_unverified_model=True, progress=False)
    assert SelfStudyDataset(tmp_path / "d").header["model_check"]["method"] == "override"


def test_strict_identity_needs_every_field():
    full = ModelIdentity("m", architecture={"num_layers": 2, "vocab_size": 10}, tokenizer="abc")
    partial = ModelIdentity("m", architecture={"num_layers": 2})
    assert partial.mismatch(full) is None  # lenient: cartridges imported with shapes only still bind
    problem = partial.mismatch(full, strict=True)
    assert "vocab_size: not reported vs 10" in problem
    assert "tokenizer vocabulary: not reported vs abc" in problem


# -- engine errors --------------------------------------------------------------------------------------------


class FlakySynthesizer(testing.FakeSynthesizer):
    """Fails on its `fail_on`-th call (the first is the same-model probe)."""

    capabilities = SynthesizerCapabilities(max_top_logprobs=20)

    def __init__(self, lm, fail_on: int):
        super().__init__(lm)
        self.fail_on, self.calls = fail_on, 0

    def complete(self, requests):
        self.calls += 1
        if self.calls == self.fail_on:
            raise TransientBackendError("the server went away (HTTP 503)", retry_after=2.0)
        return super().complete(requests)


def test_an_engine_failure_says_what_is_saved_and_resumes(tiny_llama, tmp_path, capsys):
    with pytest.raises(TransientBackendError) as info:
        synthesize(TEXT, tiny_llama, tmp_path / "d", _tiny_synthesis(), synthesizer=FlakySynthesizer(tiny_llama, 4),
                   allow_unverified_model=True, progress=False)
    assert info.value.retry_after == 2.0
    assert any("1 of 2 groups are saved" in n and "run the same synthesis again" in n for n in info.value.__notes__)
    ds = synthesize(TEXT, tiny_llama, tmp_path / "d", _tiny_synthesis(), synthesizer=FlakySynthesizer(tiny_llama, 99),
                    allow_unverified_model=True, progress=False)
    assert sorted(c.conv_id for c in ds) == [0, 1, 2, 3]


def test_importing_the_sdk_imports_no_engine():
    code = ("import sys, cartridges_sdk; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('transformers', 'vllm', 'llama_cpp', 'openai') or m.startswith('cartridges_sdk.hf')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
