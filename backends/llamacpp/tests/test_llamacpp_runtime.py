"""The llama.cpp runtime against real llama-cpp-python and the default model's GGUF (Q4_1 weights, f16 KV cache):
cartridges written into a llama.cpp sequence, checked against llama.cpp's own prefill and against HF. One engine for
the module (two: flash attention off and on, which store V differently)."""

from __future__ import annotations

import numpy as np
import pytest

from cartridges_sdk import (
    BackendError,
    Cartridge,
    GenerationParams,
    GenerationRequest,
    IncompatibleCartridgeError,
    testing,
)
from cartridges_sdk.cli import main
from cartridges_sdk.testing.fixtures import lm  # noqa: F401  (the module's model, a pytest fixture)

pytestmark = pytest.mark.default_model

QUESTION = [{"role": "user", "content": "Who built the lighthouse, and when?"}]
TEXT = " ".join(testing.CONTRACT_TEXTS)


@pytest.fixture(scope="module")
def runtime(lm):
    return lm.get_runtime("llamacpp")  # by name, as cartridge.ask(q, runtime="llamacpp") reaches it


def test_the_engine_is_built_without_amx_kernels():
    """scripts/setup.sh compiles llama.cpp less its AMX kernels: on a VM that reports AMX they died with SIGILL at the
    first answer, taking the process with them. A build with them (plain `pip install`) fails here, not later."""
    import llama_cpp

    assert b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info(), "rebuild it: ./scripts/setup.sh"


def kl_to_hf(runtime, lm, cartridge, follow):
    """Per position of `follow` (teacher-forced after the cartridge and QUESTION), KL(HF || llama.cpp) in nats."""
    prompt = lm.chat_ids(QUESTION, after_cartridge=True)
    seq = prompt + follow
    served = runtime.next_token_logprobs([cartridge], seq)[len(prompt) - 1 : -1]
    hf = lm.logits(seq, cartridges=[cartridge])[len(prompt) - 1 : -1].double().log_softmax(-1).numpy()
    return (np.exp(hf) * (hf - served)).sum(-1)


def test_keeps_the_runtime_contract(runtime, lm):
    # inside llama.cpp, exact: cartridges of llama.cpp's own prefill answer as the text in context (measured 0.0).
    # Against the student's float32 forward (HF, the GGUF's weights dequantized), llama.cpp's Q4_1 kernels differ by
    # up to 0.55 nats on the 4th-5th candidates (first choice the same or 0.08 behind; sizes 8 and 24); the KL of
    # the whole distribution is what test_an_hf_cartridge_serves_close_to_hf bounds
    testing.check_runtime(runtime, lm, tolerance=1e-4, reference_tolerance=0.75, prefix=runtime.prefill)


@pytest.mark.parametrize("flash_attn", [False, True])
def test_a_cartridge_of_llamacpps_own_prefill_answers_exactly_as_the_text_in_context(lm, tmp_path, flash_attn):
    # read out of llama.cpp, saved in the cartridge format (rotate-half keys), loaded back and written into the
    # sequence: the same cells, so the same greedy tokens and log-probs, bit for bit, as the text in context (llama.cpp
    # evaluates that text in a batch of its own, as its prompt cache would hold it)
    runtime = lm.get_runtime("llamacpp", flash_attn=flash_attn)
    ids = lm.encode(TEXT)
    params = GenerationParams(max_new_tokens=24, top_logprobs=5)
    for p in (9, 64):
        made = runtime.prefill(ids[:p])
        made.save(tmp_path / f"c{p}.safetensors")
        back = Cartridge.load(tmp_path / f"c{p}.safetensors", model=lm)
        assert back.meta.extra["computed_by"] == "llama.cpp"
        cart, text = runtime.generate([GenerationRequest(QUESTION, [back], params),
                                       GenerationRequest(QUESTION, [], params, prefix_ids=ids[:p])])
        assert cart.token_ids == text.token_ids
        assert np.array_equal(cart.top_ids, text.top_ids) and np.array_equal(cart.top_logprobs, text.top_logprobs)
        # and the blob llama.cpp writes for the text is the one this backend writes for the cartridge, byte for byte
        assert runtime.state_blob(back) == runtime.state_of(ids[:p])


def test_an_hf_cartridge_serves_close_to_hf(runtime, lm):
    ids = lm.encode(TEXT)
    follow = lm.tokenizer(" It was built in 1871 by the harbour board.", add_special_tokens=False)["input_ids"]
    worst = {}
    for p in (32, 128):
        kl = kl_to_hf(runtime, lm, Cartridge.from_prefix(lm, ids[:p], p), follow)
        worst[p] = float(kl.max())
        print(f"p={p}: KL(HF || llama.cpp) mean {kl.mean():.4f}, max {kl.max():.4f} nats over {len(kl)} positions")
    # measured: max 0.008 nats at p = 8, 32, 128 (mean 0.002), as the text itself in llama.cpp vs HF (max 0.0085)
    assert max(worst.values()) < 0.03


def test_a_self_study_cartridge_serves_close_to_hf(runtime, lm, tmp_path):
    trained = Cartridge.from_corpus(
        TEXT * 2, lm, num_tokens=32, num_conversations=4, conversations_per_chunk=4, min_chunk=96, max_chunk=160,
        max_tokens_a=12, max_tokens_b=16, document_windows=4, window_tokens=32, output_dir=tmp_path / "w",
        progress=False,
    )
    trained.save(tmp_path / "trained.safetensors")  # as a user would: built in HF, saved, loaded for llama.cpp
    trained = Cartridge.load(tmp_path / "trained.safetensors", model=lm)
    follow = lm.tokenizer(" The lighthouse was built in 1871.", add_special_tokens=False)["input_ids"]
    kl = kl_to_hf(runtime, lm, trained, follow)
    print(f"trained p=32: KL(HF || llama.cpp) mean {kl.mean():.4f}, max {kl.max():.4f} nats")
    assert kl.max() < 0.03
    answer = trained.ask("Who built the lighthouse?", runtime="llamacpp", max_new_tokens=12)
    assert answer == runtime.generate([GenerationRequest([{"role": "user", "content": "Who built the lighthouse?"}],
                                                         [trained], GenerationParams(max_new_tokens=12))])[0].text


def test_streams_and_writes_a_cartridge_into_the_sequence_once(runtime, lm):
    c = Cartridge.from_prefix(lm, testing.CONTRACT_TEXTS[0], 30)
    request = GenerationRequest(QUESTION, [c], GenerationParams(max_new_tokens=24))
    loads = runtime.loads
    pieces = list(runtime.stream(request))
    assert len(pieces) > 5 and "".join(pieces) == runtime.generate([request])[0].text
    assert runtime.loads - loads == 1  # the second request found it still in the cells
    other = GenerationRequest(QUESTION, [], GenerationParams(max_new_tokens=4))
    runtime.generate([other, request, request])
    assert runtime.loads - loads == 2  # written again after a request that needed the cells for itself
    # a stream paused while another request used the one sequence stops with an error, not with wrong text
    paused = runtime.stream(request)
    next(paused)
    runtime.generate([other])
    with pytest.raises(BackendError, match="Another request used llama.cpp's sequence while this stream was paused"):
        list(paused)


def test_a_gguf_of_another_model_is_refused_before_any_cartridge(lm):
    from cartridges_llamacpp import LlamaCppRuntime

    tiny = testing.tiny_lm("llama")
    with pytest.raises(IncompatibleCartridgeError, match=r"\.gguf is not the student's model 'tiny-llama-seed0' "
                       r"\(num_layers 30 vs 3; num_kv_heads 3 vs 2"):
        LlamaCppRuntime(tiny, gguf=str(lm.gguf))  # the embedded model's GGUF for a model that is not it


def test_the_cli_answers_through_llamacpp(lm, tmp_path, capsys):
    c = Cartridge.from_prefix(lm, testing.CONTRACT_TEXTS[0], 30)
    c.save(tmp_path / "c.safetensors")
    assert main(["ask", str(tmp_path / "c.safetensors"), "Who built the lighthouse?", "--runtime", "llamacpp",
                 "--max-new-tokens", "12"]) == 0
    said = capsys.readouterr().out.strip()
    assert said and said == c.ask("Who built the lighthouse?", runtime="llamacpp", max_new_tokens=12)


def test_an_exported_state_file_is_restored_by_llamacpp_itself(lm, tmp_path):
    # what llama-server's slot restore calls (llama_state_seq_load_file), into a context of its own
    import ctypes

    from cartridges_llamacpp.export import export_state_file
    from llama_cpp import llama_cpp as C

    runtime = lm.get_runtime("llamacpp", n_ctx=512)
    c = Cartridge.from_prefix(lm, TEXT, 40)
    tokens, count = (C.llama_token * 64)(), ctypes.c_size_t()
    wrong = export_state_file(c, tmp_path / "other.bin", flash_attn=not runtime.options.flash_attn)
    assert C.llama_state_seq_load_file(runtime.llm.ctx, str(wrong).encode(), 0, tokens, 64, ctypes.byref(count)) == 0
    path = export_state_file(c, tmp_path / "slot.bin", flash_attn=runtime.options.flash_attn)
    loaded = C.llama_state_seq_load_file(runtime.llm.ctx, str(path).encode(), 0, tokens, 64, ctypes.byref(count))
    assert loaded == path.stat().st_size and count.value == 40 and list(tokens[:40]) == [0] * 40
    assert runtime.sequence_state() == runtime.state_blob(c)  # the cells the runtime itself writes


def test_one_request_that_fails_in_llamacpp_fails_alone(runtime, lm, tmp_path):
    """Behind `cartridges serve` (batch by batch: llama.cpp answers one sequence at a time), a batch that fails
    because of one request is answered again one by one: only that request fails."""
    from cartridges_sdk import CartridgeStore

    store = CartridgeStore(tmp_path, lm)
    for i, text in enumerate(testing.CONTRACT_TEXTS):
        store.add(f"c{i}", Cartridge.from_prefix(lm, text, 20 + i))
    testing.check_one_request_fails_alone(runtime, store, store.names(), max_new_tokens=6)
