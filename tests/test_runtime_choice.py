"""`runtime="auto"`: which runtime it stands for, that it is the same engine as when named, and how it refuses."""

from __future__ import annotations

import threading
import time
import types
import warnings

import pytest
import torch

from cartridges_sdk import ConfigError
from cartridges_sdk import runtime_choice
from cartridges_sdk.plugins import runtimes
from cartridges_sdk.runtime_choice import choose_runtime
from cartridges_sdk.serve.answering import _held

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
    assert runtime.max_positions == default_lm.max_context == 8192  # the context HF allows, not a smaller one
    assert default_lm.auto_runtime == "llamacpp"


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


# -- a stream on a one-sequence runtime (llama.cpp) holds the engine to its end, without deadlocking its readers


def _counting(n: int, fail_at: int | None = None):
    for i in range(n):
        if i == fail_at:
            raise RuntimeError("the engine broke")
        yield f"{i} "
    return "finished"


def test_a_held_stream_lets_its_reader_ask_something_else_before_reading_on():
    lock = threading.Lock()
    first = _held(_counting(3), lock)
    assert next(first) == "0 "
    # the same thread now waits for the engine: the first stream's own thread finishes it and lets go
    second = _held(_counting(2), lock)
    assert list(second) == ["0 ", "1 "]
    assert list(first) == ["1 ", "2 "]
    assert not lock.locked()


def test_a_held_stream_lets_go_of_the_engine_when_read_no_further_or_when_it_fails():
    lock = threading.Lock()
    stream = _held(_counting(10**6), lock)
    next(stream)
    stream.close()
    deadline = time.monotonic() + 10
    while lock.locked() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not lock.locked()
    broken = _held(_counting(3, fail_at=1), lock)
    assert next(broken) == "0 "
    with pytest.raises(RuntimeError, match="the engine broke"):
        next(broken)
    assert not lock.locked()


def test_a_held_stream_returns_what_the_steps_return():
    def read(gen):
        out = yield from gen
        return out

    pieces = []
    reader = read(_held(_counting(2), threading.Lock()))
    try:
        while True:
            pieces.append(next(reader))
    except StopIteration as done:
        assert (pieces, done.value) == (["0 ", "1 "], "finished")
