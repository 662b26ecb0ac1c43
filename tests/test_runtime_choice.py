"""`runtime="auto"`: which runtime it stands for, that it is the same engine as when named, and how it refuses."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from cartridges_sdk import ConfigError
from cartridges_sdk import runtime_choice
from cartridges_sdk.plugins import runtimes
from cartridges_sdk.runtime_choice import choose_runtime

from conftest import TEXT


def test_a_model_not_read_from_a_gguf_is_answered_by_hf(tiny_lm):
    assert tiny_lm.gguf is None
    assert choose_runtime(tiny_lm) == "hf"
    assert tiny_lm.get_runtime("auto") is tiny_lm.get_runtime("hf")


@pytest.mark.default_model
def test_the_embedded_gguf_on_a_cpu_is_answered_by_llamacpp(default_lm):
    assert default_lm.gguf is not None and default_lm.gguf.suffix == ".gguf"
    assert choose_runtime(default_lm) == "llamacpp"
    runtime = default_lm.get_runtime("auto")
    assert runtime is default_lm.get_runtime("llamacpp")  # one engine, whichever way it is asked for
    assert runtime.gguf == default_lm.gguf  # llama.cpp runs the file the student was read from


@pytest.mark.default_model
def test_auto_is_the_default_and_a_cartridge_matches_its_text_inside_the_runtime_it_picks(default_lm):
    """The exactness contract inside llama.cpp: a cartridge of llama.cpp's own prefill of a text's first tokens
    answers as that text in context, both asked the default way."""
    llamacpp = default_lm.get_runtime("llamacpp")
    ids = default_lm.encode(TEXT)[:120]
    c = llamacpp.prefill(ids)
    question = "Who built the lighthouse, and when?"
    got = c.ask(question, max_new_tokens=32)
    assert got == default_lm.ask(question, document=ids, max_new_tokens=32)
    assert got == c.ask(question, max_new_tokens=32, runtime=llamacpp)
    assert "1871" in got or "Ellison" in got


@pytest.mark.default_model
def test_options_with_auto_are_refused_naming_the_runtime_it_picks(default_lm):
    with pytest.raises(ConfigError, match=r"runtime='auto' picks 'llamacpp'.*runtime='llamacpp'"):
        default_lm.ask("Who?", runtime="auto", runtime_options={"n_ctx": 512})
    assert default_lm.get_runtime("llamacpp", n_ctx=512).max_positions >= 512  # named, the same options are taken


def test_a_preferred_runtime_that_fails_to_import_is_passed_over_with_a_warning(tiny_lm, monkeypatch):
    monkeypatch.setitem(runtimes._extra, "broken-fast", "no_such_module_here:FastRuntime")
    monkeypatch.setattr(runtime_choice, "PREFERRED", ("broken-fast",))
    with pytest.warns(UserWarning, match=r"passed over 'broken-fast'.*no_such_module_here"):
        assert choose_runtime(tiny_lm) == "hf"


def test_llamacpp_serves_fast_only_a_gguf_of_a_family_it_runs_on_a_cpu(tiny_lm):
    from cartridges_llamacpp.runtime import LlamaCppRuntime

    def model(gguf, device, model_type):
        return types.SimpleNamespace(gguf=gguf, device=torch.device(device),
                                     model=types.SimpleNamespace(config=types.SimpleNamespace(model_type=model_type)))

    assert LlamaCppRuntime.serves_fast(model("m.gguf", "cpu", "qwen2"))
    assert LlamaCppRuntime.serves_fast(model("m.gguf", "cpu", "llama"))
    assert not LlamaCppRuntime.serves_fast(model(None, "cpu", "llama"))  # no GGUF to run
    assert not LlamaCppRuntime.serves_fast(model("m.gguf", "meta", "llama"))  # not on the CPU
    assert not LlamaCppRuntime.serves_fast(model("m.gguf", "cpu", "gemma"))  # a family the runtime refuses
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_runtime(tiny_lm) == "hf"  # nothing to warn about when the preferred runtime imports


def test_llamacpp_without_a_gguf_says_how_to_give_one(tiny_lm):
    with pytest.raises(ConfigError, match=r"not loaded from a GGUF.*gguf="):
        tiny_lm.get_runtime("llamacpp")


@pytest.mark.default_model
def test_the_model_copy_in_another_dtype_keeps_the_gguf(default_lm):
    assert default_lm.in_dtype(torch.bfloat16).gguf == default_lm.gguf
