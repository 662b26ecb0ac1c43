"""`cartridges serve`'s app on a real uvicorn server on 127.0.0.1 (started and stopped here), called with the real
openai client and raw HTTP: answers equal the Python API's, many concurrent clients, bad input answered 4xx."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from cartridges_sdk import Cartridge, CartridgeStore
from cartridges_sdk.serve.server import create_app
from cartridges_sdk.serve.settings import ServeConfig
from cartridges_sdk.testing import free_port, serving

TEXTS = [f"Keeper {n} of the lighthouse number {i} logged {w} storms in the winter of 18{i}{n}."
         for i, (n, w) in enumerate(zip("ABCDEFGH", ("three", "five", "nine", "two", "six", "one", "four", "ten")))]
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama):
    store = CartridgeStore(tmp_path_factory.mktemp("store"), tiny_llama)
    for i, text in enumerate(TEXTS):
        store.add(f"c{i}", Cartridge.from_prefix(tiny_llama, text, 8 + i), corpus=text)
    app = create_app(store, tiny_llama.get_runtime("hf"), ServeConfig(api_key=KEY))
    with serving(app) as url:
        yield url, store, app


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0], api_key=KEY, max_retries=0, timeout=120)


def ask(client, model, question, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                          temperature=0, max_tokens=kw.pop("max_tokens", 8), **kw)


def test_a_readers_budget_names_the_passages_that_fill_it(served, client, tiny_llama, monkeypatch):
    from cartridges_sdk.making import settings

    plain = ask(client, "auto", "Who logged storms?", extra_body={"budget": 64})
    assert "passages" not in plain.model_extra and plain.usage.model_extra["cartridge_tokens"] < 64
    n = tiny_llama.num_parameters
    monkeypatch.setattr(settings, "READER_PARAMETERS", (n, n + 1))  # counted a reader, as the 0.5B is
    got = ask(client, "auto", "Who logged storms?", extra_body={"budget": 64})
    assert len(got.model_extra["cartridges"]) == 1 and got.model_extra["passages"]
    assert got.usage.prompt_tokens > plain.usage.prompt_tokens  # the passages count among the prompt's tokens


def test_a_first_answer_picks_the_passages_as_store_ask_does(served, client):
    _, store, _ = served
    want = store.ask("Who logged storms?", cartridges=["c3"], passages=24, draft=5, max_new_tokens=8)
    assert want.draft and want.passages
    got = ask(client, "c3", "Who logged storms?", extra_body={"passages": 24, "draft": 5})
    assert got.choices[0].message.content == want.text and got.model_extra["draft"] == want.draft
    assert [p["source"] for p in got.model_extra["passages"]] == [p.name for p in want.passages]
    streamed = list(ask(client, "c3", "Who logged storms?", stream=True, extra_body={"passages": 24, "draft": 5}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.text
    assert streamed[0].model_extra["draft"] == want.draft
    # a conversation drafts its last user turn alone, as store.ask drafts its question
    turns = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello."},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Who logged storms?"}]
    chat = client.chat.completions.create(model="c3", messages=turns, max_tokens=8, temperature=0,
                                          extra_body={"passages": 24, "draft": 5})
    assert chat.model_extra["draft"] == want.draft
    assert ask(client, "c3", "Who logged storms?", extra_body={"draft": 0}).model_extra.get("draft") is None
    for body, why in (({"draft": 5}, "'draft' says how passages are found, and this request gets none"),
                      ({"passages": 24, "draft": -1}, "'draft' .* must be an int from 0 to 256"),
                      ({"passages": 24, "draft": 257}, "'draft' .* must be an int from 0 to 256"),
                      ({"passages": 24, "draft": True}, "'draft' .* must be an int from 0 to 256")):
        with pytest.raises(openai.BadRequestError, match=why) as refused:
            ask(client, "c3", "Who logged storms?", extra_body=body)
        assert refused.value.body["param"] == "draft"


def test_trim_cuts_the_routed_cartridge_as_store_ask_does(served, client):
    _, store, _ = served
    want = store.ask("Who logged storms?", budget=24, passages=20, trim=True, max_new_tokens=8)
    got = ask(client, "auto", "Who logged storms?", extra_body={"budget": 24, "passages": 20, "trim": True})
    assert got.choices[0].message.content == want.text and got.model_extra["cartridges"] == list(want.cartridges)
    assert got.usage.model_extra["cartridge_tokens"] == 4  # cut to what 20 tokens of passages leave of 24
    whole = ask(client, "auto", "Who logged storms?", extra_body={"budget": 24, "passages": 20})
    assert whole.usage.model_extra["cartridge_tokens"] == store.get(want.cartridges[0]).num_tokens > 4
    # "attention": the cut keeps what the question reads most, as store.ask(..., trim="attention") cuts it
    want = store.ask("Who logged storms?", budget=24, passages=20, trim="attention", max_new_tokens=8)
    got = ask(client, "auto", "Who logged storms?", extra_body={"budget": 24, "passages": 20, "trim": "attention"})
    assert got.choices[0].message.content == want.text and got.usage.model_extra["cartridge_tokens"] == 4
    for body, why in (({"budget": 24, "trim": True}, "'trim' cuts the routed cartridges"),
                      ({"budget": 24, "passages": 20, "trim": 1}, "'trim' .* must be true or false"),
                      ({"budget": 24, "passages": 20, "trim": "middle"}, "or one of \\['first', 'attention'\\]"),
                      ({"budget": 24, "trim": "attention"}, "'trim' cuts the routed cartridges"),
                      ({"budget": 24, "passages": 23, "trim": True}, "1 cartridge\\(s\\) cannot be cut to fit 1")):
        with pytest.raises(openai.BadRequestError, match=why) as refused:
            ask(client, "auto", "Who logged storms?", extra_body=body)
        assert refused.value.body["param"] == "trim"


def test_answers_equal_the_python_apis_streamed_and_not(served, client, tiny_llama):
    _, store, _ = served
    want = tiny_llama.ask("Who logged storms?", cartridges=[store.get("c3")], max_new_tokens=8)
    got = ask(client, "c3", "Who logged storms?")
    assert got.choices[0].message.content == want and got.usage.completion_tokens == 8
    assert got.model_extra["cartridges"] == ["c3"]
    chunks = list(ask(client, "c3", "Who logged storms?", stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == got.choices[0].finish_reason == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 8  # usage last, as OpenAI sends it
    assert chunks[-1].usage.prompt_tokens == got.usage.prompt_tokens
    assert chunks[-1].model_extra["cartridges"] == ["c3"]
    both = client.chat.completions.create(model="c1", messages=[{"role": "user", "content": "Who?"}], max_tokens=6,
                                          temperature=0, extra_body={"cartridges": ["c1", "c2"]})
    assert both.choices[0].message.content == tiny_llama.ask(
        "Who?", cartridges=[store.get("c1"), store.get("c2")], max_new_tokens=6)
    # OpenAI's list of text parts (what IDE clients such as Continue send) reads as the text itself
    parts = client.chat.completions.create(
        model="c3", messages=[{"role": "user", "content": [{"type": "text", "text": "Who logged"},
                                                            {"type": "text", "text": "storms?"}]}],
        max_tokens=8, temperature=0)
    assert parts.choices[0].message.content == tiny_llama.ask("Who logged\nstorms?", cartridges=[store.get("c3")],
                                                              max_new_tokens=8)
    names = [m.id for m in client.models.list().data]
    assert names[:8] == [f"c{i}" for i in range(8)] and "auto" in names and tiny_llama.name in names


def hammer(client, app, store, lm, clients=64):
    """`clients` concurrent requests over 8 cartridges, every third one streamed: each gets its own greedy answer."""
    jobs = [(f"c{i % 8}", f"What did keeper {'ABCDEFGH'[i % 8]} log? ({i // 8})", i % 3 == 0) for i in range(clients)]
    want = {j: lm.ask(j[1], cartridges=[store.get(j[0])], max_new_tokens=8) for j in jobs}

    def one(job):
        name, question, stream = job
        if not stream:
            return ask(client, name, question).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in ask(client, name, question, stream=True))

    start = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        got = list(pool.map(one, jobs))
    assert time.monotonic() - start < 120
    assert got == [want[j] for j in jobs]  # none lost, none mixed up
    assert app.state.engine.largest_batch > 1  # answered together, not one by one


def test_many_concurrent_clients_get_their_own_answers(served, client, tiny_llama):
    hammer(client, served[2], served[1], tiny_llama)  # HF: a ContinuousRuntime, streams batched with the rest
    assert served[2].state.engine.runtime.widest_batch > 1  # decoded together, not only queued together


def test_a_runtime_answering_batch_by_batch_serves_them_too(served, tiny_llama):
    store = served[1]  # the example plugin's runtime is a plain Runtime: the server gathers batches for it
    app = create_app(store, tiny_llama.get_runtime("example"), ServeConfig(api_key=KEY))
    with serving(app) as url:
        hammer(openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120), app, store, tiny_llama, 24)


def test_routing_picks_the_cartridge_and_says_which(client):
    got = ask(client, "auto", "Which keeper logged ten storms in the winter of 187H?")
    assert got.model_extra["cartridges"] == ["c7"]
    follow_up = client.chat.completions.create(model="auto", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "Which keeper logged ten storms in the winter of 187H?"},
        {"role": "assistant", "content": "Keeper H."}, {"role": "user", "content": "Why?"}])
    assert follow_up.model_extra["cartridges"] == ["c7"]  # "Why?" alone names nothing: the earlier turn routes it
    with pytest.raises(openai.BadRequestError, match="shares no word with the corpus of any cartridge"):
        ask(client, "auto", "Why?")


def test_bad_input_gets_a_clear_4xx_and_the_server_stays_up(served, client):
    url, store, _ = served
    with pytest.raises(openai.NotFoundError, match=r"No cartridge 'nope' in the store; it holds: c0, c1"):
        ask(client, "nope", "Hi")
    with pytest.raises(openai.AuthenticationError, match="Missing or wrong API key"):
        ask(openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0), "c0", "Hi")
    with pytest.raises(openai.BadRequestError, match=r"Unsupported parameter\(s\) \['tools'\]"):
        ask(client, "c0", "Hi", extra_body={"tools": []})
    with pytest.raises(openai.BadRequestError, match="'max_tokens' must be an int from 1 to 2048"):
        ask(client, "c0", "Hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match=r"do not fit the \d+ positions the model's \d+-token context"):
        ask(client, "c0", "storm " * 3000, max_tokens=100)
    with pytest.raises(openai.BadRequestError, match=r"stop=5 must be a non-empty string or a list of them"):
        ask(client, "c0", "Hi", extra_body={"stop": 5})
    with pytest.raises(openai.BadRequestError, match="'stream_options' goes with 'stream': true only"):
        ask(client, "c0", "Hi", stream_options={"include_usage": True})
    with pytest.raises(openai.BadRequestError, match="'stream_options' must be"):
        ask(client, "c0", "Hi", stream=True, stream_options={"include_usage": "yes"})
    big = httpx.post(f"{url}/chat/completions", content=b"x" * 1_000_001, headers={"authorization": f"Bearer {KEY}"})
    assert big.status_code == 413 and "the limit is 1000000" in big.json()["error"]["message"]
    raw = httpx.post(f"{url}/chat/completions", content=b"{not json", headers={"authorization": f"Bearer {KEY}"})
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    raw = httpx.post(f"{url}/chat/completions", json={"model": "c0", "messages": [{"role": "robot", "content": "x"}]},
                     headers={"authorization": f"Bearer {KEY}"})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "messages[0]"
    image = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(openai.BadRequestError, match=r"parts of type \['image_url', 'text'\]; this server reads text"):
        client.chat.completions.create(model="c0", messages=[{"role": "user", "content": image}], max_tokens=4)
    # a damaged file dropped into the store while serving is left out; the others keep answering
    (store.root / "broken.safetensors").write_bytes(b"\x00" * 64)
    assert "broken" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError, match="'broken' is left out of the store: .* not a readable cartridge"):
        ask(client, "broken", "Hi")
    # one deleted behind the store's back is left out when next asked for, with a 404
    store.get("c6")
    store._memory.clear()
    (store.root / "c6.safetensors").unlink()
    with pytest.raises(openai.NotFoundError, match="'c6'"):
        ask(client, "c6", "Hi")
    # a client that goes away mid-stream: its work stops, the next request is answered
    with httpx.stream("POST", f"{url}/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "c0", "messages": [{"role": "user", "content": "Hi"}], "stream": True,
                            "max_tokens": 200}) as response:
        next(response.iter_lines())
    assert ask(client, "c0", "Hi").choices[0].message.content
    assert httpx.get(f"{url.removesuffix('/v1')}/health").json()["status"] == "ok"


def test_a_full_queue_answers_429_with_retry_after(tmp_path, tiny_llama):
    release, busy = threading.Event(), threading.Event()

    class Slow:  # a runtime that holds the engine until released (our queue logic, not an engine, is under test)
        def generate(self, requests):
            busy.set()
            release.wait(30)
            return tiny_llama.get_runtime("hf").generate(requests)

    store = CartridgeStore(tmp_path, tiny_llama)
    store.add("c0", Cartridge.from_prefix(tiny_llama, TEXTS[0], 8))
    with serving(create_app(store, Slow(), ServeConfig(max_queue=1, max_batch=1))) as url:
        body = {"model": "c0", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        try:
            with ThreadPoolExecutor(2) as pool:
                first = pool.submit(httpx.post, f"{url}/chat/completions", json=body, timeout=60)  # taken by the engine
                assert busy.wait(30)
                second = pool.submit(httpx.post, f"{url}/chat/completions", json=body, timeout=60)  # waits in the queue
                deadline = time.monotonic() + 30
                while httpx.get(f"{url.removesuffix('/v1')}/health").json()["waiting"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                third = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
                assert third.status_code == 429 and third.headers["retry-after"] == "1"
                release.set()
                assert first.result().status_code == 200 and second.result().status_code == 200
        finally:
            release.set()


@pytest.mark.default_model
def test_cartridges_serve_as_a_user_runs_it(tmp_path, default_lm):
    # the CLI in its own process, on the default model; called from here as another process would
    import subprocess
    import sys

    store = CartridgeStore(tmp_path / "store", default_lm)
    store.add("harrow", Cartridge.from_prefix(default_lm, TEXTS[0] + " " + TEXTS[5], 40), corpus=TEXTS[0])
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cartridges_sdk.cli", "serve", "--store", str(store.root),
                             "--port", str(port), "--api-key", KEY], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stderr.read()
                time.sleep(0.3)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
        got = ask(client, "harrow", "Who logged storms?", max_tokens=16).choices[0].message.content
        assert got == default_lm.ask("Who logged storms?", cartridges=[store.get("harrow")], max_new_tokens=16)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "serving 1 cartridge(s)" in proc.stderr.read()
