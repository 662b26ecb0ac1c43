"""One request never hurts another: runtimes that fail a chosen request's batch, and the check that a server
answers every other request as it would alone (docs/security.md)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..generation import Completion, GenerationRequest
from ..plugins import ContinuousRuntime, Runtime
from ..serve.background import serving
from .contract import fail

POISON = "POISON"  # a request whose last message holds this word makes a `Failing` runtime fail its batch
# (with a plain RuntimeError, as an engine's own code fails, not with an SDK error: the server must survive either)


class _Gate:
    """Holds the engine thread in its next runtime call until `until()` holds, so the requests sent meanwhile queue
    up and go to the runtime as one batch (arrival timing must not decide what a check sees)."""

    def __init__(self) -> None:
        self.until: Callable[[], bool] | None = None
        self.holding = threading.Event()

    def __call__(self) -> None:
        until, self.until = self.until, None
        if until is not None:
            self.holding.set()
            deadline = time.monotonic() + 60
            while not until() and time.monotonic() < deadline:
                time.sleep(0.01)


def _poisoned(request: GenerationRequest) -> bool:
    return POISON in request.messages[-1]["content"]


class FailingRuntime(Runtime):
    """A real runtime whose `generate` fails any batch holding a POISON request: an engine failure that one request
    triggers, for checking that the server fails that request alone."""

    def __init__(self, inner: Runtime):
        self.inner, self.gate = inner, _Gate()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        self.gate()
        if any(_poisoned(r) for r in requests):
            raise RuntimeError("the engine choked on a poisoned request")
        return self.inner.generate(requests)

    def stream(self, request: GenerationRequest):
        self.gate()
        pieces = self.inner.stream(request)
        if _poisoned(request):  # after its first piece: a failure mid-way
            yield next(pieces)
            pieces.close()
            raise RuntimeError("the engine choked on a poisoned request")
        return (yield from pieces)


class FailingContinuousRuntime(ContinuousRuntime):
    """A real continuous runtime whose every third `step` fails while a POISON request is in the engine (after the
    step ran, so streams have shown text and the others' progress is lost with it)."""

    def __init__(self, inner: ContinuousRuntime):
        self.inner, self.gate, self.poisoned, self.steps = inner, _Gate(), set(), 0

    def add(self, request: GenerationRequest) -> str:
        handle = self.inner.add(request)
        if _poisoned(request):
            self.poisoned.add(handle)
        return handle

    def step(self) -> list[tuple[str, Completion, bool]]:
        self.gate()
        progress = self.inner.step()
        if self.poisoned & {h for h, _, _ in progress}:  # decoding now, with whatever shares its batch
            self.steps += 1
            if self.steps % 3 == 0:
                raise RuntimeError("the engine choked on a poisoned request")
        self.poisoned -= {h for h, _, ended in progress if ended}
        return progress

    def abort(self, handle: str) -> None:
        self.poisoned.discard(handle)
        self.inner.abort(handle)


def failing(runtime: Runtime) -> Runtime:
    """`runtime`, failing whatever batch a POISON request is in (`FailingContinuousRuntime` or `FailingRuntime`)."""
    return FailingContinuousRuntime(runtime) if isinstance(runtime, ContinuousRuntime) else FailingRuntime(runtime)


def chat_answer(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, str]:
    """(status, answer text or error message) of one chat completion from the server at `url` (its ``/v1`` base),
    streamed or not as `body` says; a stream must end with ``[DONE]``, failed ones too."""
    import httpx  # the [test] and backends' dependency, not the core's

    if not body.get("stream"):
        r = httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=300)
        data = r.json()
        return r.status_code, data["choices"][0]["message"]["content"] if r.status_code == 200 else \
            data["error"]["message"]
    text, error, done = "", None, False
    with httpx.stream("POST", f"{url}/chat/completions", json=body, headers=headers, timeout=300) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(r.read())["error"]["message"]
        for line in r.iter_lines():
            done = done or line == "data: [DONE]"
            event = json.loads(line[6:]) if line.startswith("data: {") else {}
            if "error" in event:
                error = event["error"]["message"]
            elif event.get("choices"):
                text += event["choices"][0]["delta"].get("content") or ""
    if not done:
        fail("stream", "a stream ended without [DONE]")
    return (500, error) if error is not None else (200, text)


def check_one_request_fails_alone(runtime: Runtime, store: Any, names: Sequence[str], *, max_new_tokens: int = 12,
                                  poison: dict[str, Any] | None = None) -> None:
    """Behind `cartridges serve` on 127.0.0.1: 8 concurrent requests over the store's cartridges `names` (every
    third one streamed, on a continuous runtime, whose batches hold streams; a plain runtime answers each stream
    alone), sent while the engine is held so they reach the runtime as one batch; one of them is
    `poison` (a request body), or else one that makes `failing(runtime)` fail its batch. That one gets an error
    (400 for a body the server refuses, 500 for a failed engine) and every other gets the answer it gets alone."""
    from ..serve.server import create_app  # FastAPI: the [serve] extra, not the core
    from ..serve.settings import ServeConfig

    served = failing(runtime) if poison is None else runtime
    app = create_app(store, served, ServeConfig(max_batch=16))
    questions = [f"What does the text say? ({i})" for i in range(8)]
    streams = isinstance(runtime, ContinuousRuntime)
    jobs = [{"model": names[i % len(names)], "messages": [{"role": "user", "content": q}], "temperature": 0,
             "max_tokens": max_new_tokens, "stream": streams and i % 3 == 0} for i, q in enumerate(questions)]
    want = [store.model.ask(j["messages"][0]["content"], cartridges=[store.get(j["model"])], runtime=runtime,
                            max_new_tokens=max_new_tokens) for j in jobs]
    jobs[3] = poison or {**jobs[3], "messages": [{"role": "user", "content": f"Tell me about {POISON}."}]}

    with serving(app) as url, ThreadPoolExecutor(len(jobs) + 1) as pool:
        gate = getattr(served, "gate", None)
        if gate is not None:  # a first request holds the engine while the 8 queue up
            gate.until = lambda: app.state.engine.jobs.qsize() >= len(jobs)
            first = pool.submit(chat_answer, url, {**jobs[1], "stream": False})
            if not gate.holding.wait(120):
                fail("isolation", "the engine never called the runtime")
        got = list(pool.map(lambda j: chat_answer(url, j), jobs))
        for i, ((status, text), expected) in enumerate(zip(got, want)):
            if i == 3 and (status < 400 or (poison is None and "poisoned" not in text)):
                fail("isolation", f"the poisoned request got {status}: {text[:200]!r}")
            if i != 3 and (status, text) != (200, expected):
                fail("isolation", f"request {i} got {status} {text[:200]!r}, alone it gets {expected!r}")
        if gate is not None:
            if first.result()[0] != 200:
                fail("isolation", f"the first request failed: {first.result()}")
            if app.state.engine.replayed < 2:
                fail("isolation", "the poisoned batch was never answered again in smaller batches")
        if chat_answer(url, {**jobs[0], "stream": False}) != (200, want[0]):
            fail("isolation", "the server did not answer the next request")
