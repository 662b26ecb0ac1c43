"""Self-study synthesis against OpenAI-compatible servers: the SDK's token ids in, token ids and raw top-k out.

The completions endpoint is used, not the chat one: it takes the prompt as a list of token ids, so the teacher sees
exactly the chunk and chat the SDK rendered, and it returns per-token log-probs (``logprobs=k``) before temperature
(vLLM's default). Scoring given sequences uses ``echo`` with ``logprobs``. Requests of a chunk group are sent
together, spread over the servers, and retried on transient failures (see `retry`) on another server when one is up.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import attrs

from cartridges_sdk import (BackendError, BackendUnavailableError, Completion, ConfigError, SynthesisRequest,
                            Synthesizer, SynthesizerCapabilities)
from cartridges_sdk.errors import TransientBackendError

from .logprobs import TokenReader, positions, topk
from .options import OpenAIOptions
from .retry import Backoff, ServerDownError, to_backend_error
from .servers import Server, ServerPool

log = logging.getLogger("cartridges_openai")
T = TypeVar("T")


class _LoopThread:
    """An event loop on its own thread, so the synchronous Synthesizer API works from scripts and notebooks alike
    (a notebook's own loop is never blocked or re-entered)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cartridges-openai", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. Ctrl-C: stop the requests still in flight
            raise

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
        if not self.loop.is_running():
            self.loop.close()


class OpenAISynthesizer(Synthesizer):
    """The teacher behind one or several OpenAI-compatible servers that serve the student's model.

    It cannot read the served model's files, so it reports no identity and the same-model probe decides (ids and
    log-probs of a fixed prompt against the student's own forward) before any synthesis.
    """

    Options = OpenAIOptions
    capabilities = SynthesizerCapabilities(max_top_logprobs=20, score=True, prefix_reuse=True)

    def __init__(self, student, /, **options: Any):  # positional: `model` is an option (the served model's name)
        self.lm = student
        self.options = OpenAIOptions(**options)
        self.capabilities = attrs.evolve(type(self).capabilities, max_top_logprobs=self.options.max_logprobs)
        self.urls = self.options.urls()
        self.reader = TokenReader(student.tokenizer)
        self.model = self.options.model
        self.wait = Backoff(self.options.backoff, self.options.max_backoff)
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # tests record the delays through this
        self._loop: _LoopThread | None = _LoopThread()
        try:
            self.pool = self._loop.run(self._open())
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        return f"{type(self).__name__} (model {self.model!r} at {', '.join(self.urls)})"

    # ---- the Synthesizer API (synchronous, run on the loop thread)

    def complete(self, requests: Sequence[SynthesisRequest]) -> list[Completion]:
        return self._run(self._all(self._complete(r) for r in requests))

    def score(self, prefix_ids: Sequence[int], sequences: Sequence[Sequence[int]], top_k: int) -> list[tuple[Any, Any]]:
        return self._run(self._all(self._score(list(prefix_ids), list(s), top_k) for s in sequences))

    def stats(self) -> list[dict[str, Any]]:
        """Per server: requests sent, succeeded and failed, and whether it is in rotation now."""
        return self.pool.stats()

    def close(self) -> None:
        if self._loop is None:
            return
        if getattr(self, "pool", None) is not None:
            try:
                self._loop.run(self.pool.aclose())
            except Exception:  # noqa: BLE001 - closing must not hide the error that led here
                pass
        self._loop.close()
        self._loop = None

    # ---- internals

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise BackendError(f"{type(self).__name__} is closed; build a new one.")
        return self._loop.run(coro)

    @staticmethod
    async def _all(coros) -> list:
        """Run concurrently, results in order; the first failure cancels the rest."""
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _open(self) -> ServerPool:
        import openai

        key = self.options.key()
        pool = ServerPool(self.urls, lambda url: openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0,
                                                                    timeout=self.options.timeout),
                          self.options.concurrency, self.options.cooldown)
        try:
            listed = await asyncio.gather(*(self._models(s) for s in pool.servers), return_exceptions=True)
            self._choose_model(pool, listed)
        except BaseException:
            await pool.aclose()
            raise
        return pool

    async def _models(self, server: Server) -> list[str]:
        try:
            page = await server.client.models.list(timeout=min(self.options.timeout, 30.0))
        except Exception as err:  # noqa: BLE001 - said with the server's URL below
            raise to_backend_error(err, server.url) from err
        return [m.id for m in page.data]

    def _choose_model(self, pool: ServerPool, listed: list[list[str] | BaseException]) -> None:
        """Settle the model name, and leave out servers that are down now (they rejoin when they come back)."""
        for server, got in zip(pool.servers, listed):
            if isinstance(got, BaseException) and not isinstance(got, TransientBackendError):
                raise got  # 401, 404: a mistake to fix, not a server to wait for
        reachable = [(s, got) for s, got in zip(pool.servers, listed) if not isinstance(got, BaseException)]
        if not reachable:
            reasons = "; ".join(str(got) for got in listed)
            raise BackendUnavailableError(f"No server answered: {reasons}. Start the server, or fix base_url.")
        if self.model is None:
            first_url, first = reachable[0][0].url, reachable[0][1]
            if len(first) != 1:
                raise ConfigError(f"{first_url} serves {first}; choose one with the option model=...")
            self.model = first[0]
        for server, got in reachable:
            if self.model not in got:
                raise ConfigError(f"{server.url} serves {got}, not {self.model!r}; give every server the same model "
                                  "(vLLM: --served-model-name), or set the option model=...")
        for server, got in zip(pool.servers, listed):
            if isinstance(got, BaseException):
                log.warning("%s is down now (%s); it will be tried again when other servers fail or after %.0f s.",
                            server.url, got, pool.cooldown)
                pool.failed(server, got, down=True)

    async def _post(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """One completions call with retries: a transient failure is retried after a backoff (or the server's
        retry-after), on another server when one is up; a permanent one fails at once. Returns (url, response)."""
        from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt

        extra = {"return_tokens_as_token_ids": True} if self.options.token_ids else {}
        attempts = self.options.max_retries + 1
        server: Server | None = None
        retrying = AsyncRetrying(stop=stop_after_attempt(attempts), wait=self.wait, sleep=self.sleep, reraise=True,
                                 retry=retry_if_exception_type(TransientBackendError), before_sleep=_log_retry)
        try:
            async for attempt in retrying:
                with attempt:
                    server = self.pool.pick(avoid=server)
                    async with self.pool.use(server):
                        try:
                            response = await server.client.completions.create(
                                model=self.model, **_standard(body), extra_body={**extra, **_extra(body)})
                        except Exception as err:  # noqa: BLE001 - classified, then raised as the SDK's error
                            error = to_backend_error(err, server.url)
                            self.pool.failed(server, error, down=isinstance(error, ServerDownError))
                            raise error from err
                    self.pool.succeeded(server)
                    return server.url, response.to_dict()
        except TransientBackendError as err:
            err.add_note(f"Gave up after {attempts} attempt(s) over {', '.join(self.urls)} (the option max_retries).")
            raise
        raise AssertionError("unreachable")  # tenacity either returns or raises

    async def _complete(self, r: SynthesisRequest) -> Completion:
        body = {"prompt": list(r.prompt_ids), "max_tokens": r.max_tokens, "temperature": r.temperature,
                "seed": r.seed if self.options.seeds else None, "logprobs": r.top_logprobs, "stop_token_ids": list(r.stop_ids)}
        url, response = await self._post(body)
        choice = response["choices"][0]
        ids, cands = positions(choice, self.reader, url)
        if not ids or len(ids) > r.max_tokens:
            raise BackendError(f"{url} returned {len(ids)} tokens for max_tokens={r.max_tokens}.")
        top_ids = top_lps = None
        if r.top_logprobs:
            top_ids, top_lps = topk(cands, r.top_logprobs, url)
        stops = set(r.stop_ids) | self.lm.eos_token_ids
        body_ids = ids[:-1] if ids[-1] in stops else ids
        return Completion(text=self.lm.tokenizer.decode(body_ids, skip_special_tokens=True), token_ids=tuple(ids),
                          finish_reason="stop" if choice.get("finish_reason") == "stop" else "length",
                          top_ids=top_ids, top_logprobs=top_lps)

    async def _score(self, prefix: list[int], seq: list[int], k: int) -> tuple[Any, Any]:
        prompt = prefix + seq
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": k}
        try:
            url, response = await self._post(body)
        except BackendError as err:
            if not isinstance(err, TransientBackendError):
                err.add_note("Scoring given sequences (document windows, targets='all') needs `echo` with `logprobs` "
                             "on the completions endpoint; without it, set document_windows=0 and targets='assistant'.")
            raise
        ids, cands = positions(response["choices"][0], self.reader, url)
        if ids[: len(prompt)] != prompt:
            raise BackendError(f"{url} echoed other tokens than the prompt ids it was sent; it does not take token-id "
                               "prompts as they are.")
        return topk(cands[len(prefix) + 1 : len(prompt)], k, url)


STANDARD = ("prompt", "max_tokens", "temperature", "seed", "logprobs", "echo")


def _standard(body: dict[str, Any]) -> dict[str, Any]:
    """The completions API's own parameters (the openai client sends them as they are)."""
    return {k: v for k, v in body.items() if k in STANDARD and v is not None}


def _extra(body: dict[str, Any]) -> dict[str, Any]:
    """Server extensions (vLLM's stop_token_ids), sent in the body; servers that do not know them ignore them."""
    return {k: v for k, v in body.items() if k not in STANDARD}


def _log_retry(state: Any) -> None:
    err = state.outcome.exception()
    log.debug("Retrying a request in %.1f s (attempt %d failed): %s", state.next_action.sleep, state.attempt_number, err)
