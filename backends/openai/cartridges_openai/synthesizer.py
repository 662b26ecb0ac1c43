"""Self-study synthesis against OpenAI-compatible servers: the SDK's token ids in, token ids and raw top-k out.

The completions endpoint is used, not the chat one: it takes the prompt as a list of token ids, so the teacher sees
exactly the chunk and chat the SDK rendered, and it returns per-token log-probs (``logprobs=k``) before temperature
(vLLM's default). Scoring given sequences uses ``echo`` with ``logprobs``. Requests of a chunk group are sent
together, spread over the servers, and retried on transient failures (see `retry`) on another server when one is up.

Every server answers the same-model probe before its answers are used: when the synthesizer opens and whenever it
comes back after failing (it may have been restarted with other weights). Each must agree with the first one's
answer; the SDK's own probe then checks that one against the student (`check_same_model`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import attrs

from cartridges_sdk import (BackendError, BackendUnavailableError, Completion, ConfigError, SynthesisRequest,
                            Synthesizer, SynthesizerCapabilities)
from cartridges_sdk.kit import (IncompatibleCartridgeError, is_loopback, probe_gap, probe_request, PROBE_TOLERANCE,
    PROBE_TOP_K, TransientBackendError)

from .logprobs import TokenReader, positions, topk
from .options import OpenAIOptions, shown
from .retry import Backoff, ServerDownError, to_backend_error
from .servers import Server, ServerPool

log = logging.getLogger("cartridges_openai")
T = TypeVar("T")

# sampling as the other synthesizers sample (plain temperature): vLLM's server would otherwise fill what a request
# leaves out from the model's generation_config (top_p, top_k, min_p, repetition_penalty)
PLAIN_SAMPLING = {"top_p": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
PLAIN_SAMPLING_EXTRA = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


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
            asyncio.run_coroutine_threadsafe(self._cancel_all(), self.loop).result(timeout=30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
        if not self.loop.is_running():
            self.loop.close()

    @staticmethod
    async def _cancel_all() -> None:
        """Cancel what is left (e.g. requests of an interrupted call) and let it finish, so nothing is cut mid-way."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAISynthesizer(Synthesizer):
    """The teacher behind one or several OpenAI-compatible servers that serve the student's model.

    It cannot read the served model's files, so it reports no identity and the same-model probe decides (ids and
    log-probs of a fixed prompt against the student's own forward) before any synthesis.
    """

    Options = OpenAIOptions
    capabilities = SynthesizerCapabilities(max_top_logprobs=20, score=True, prefix_reuse=True)

    @classmethod
    def capabilities_with(cls, options: Any) -> SynthesizerCapabilities:
        return attrs.evolve(cls.capabilities, max_top_logprobs=options.max_logprobs)

    def __init__(self, student, /, **options: Any):  # positional: `model` is an option (the served model's name)
        super().__init__(student, **options)
        self.urls = self.options.urls()
        self.names = tuple(shown(u) for u in self.urls)  # URLs as messages show them (no user:password)
        self.reader = TokenReader(student.tokenizer)
        self.model = self.options.model
        self.wait = Backoff(self.options.backoff, self.options.max_backoff)
        self.sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # tests record the delays through this
        self.probe = probe_request(student, min(PROBE_TOP_K, self.options.max_logprobs))
        self.reference: tuple[str, Completion] | None = None  # the first server's probe answer: all must agree
        _warn_about_the_key(self.options, self.urls)
        self._loop: _LoopThread | None = _LoopThread()
        try:
            self.pool = self._loop.run(self._open())
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        return f"{type(self).__name__} (model {self.model!r} at {', '.join(self.names)})"

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
                                                                    timeout=self._timeout(self.options.timeout)),
                          self.options.concurrency, self.options.cooldown)
        try:
            listed = await asyncio.gather(*(self._models(s) for s in pool.servers), return_exceptions=True)
            self._choose_model(pool, listed)
            self.pool = pool
            # every server that is up answers the probe now (in order, so the first one is the reference); one that
            # fails it for a passing reason is probed again, with retries, before its first request
            for server in pool.servers:
                if server.down_until <= pool.clock():
                    try:
                        await self._verify(server, pool.clock())
                    except TransientBackendError as err:
                        log.warning("%s did not answer the same-model probe (%s); it is probed again before its "
                                    "first request.", server.name, err)
        except BaseException:
            await pool.aclose()
            raise
        return pool

    def _timeout(self, seconds: float) -> Any:
        """`seconds` for an answer, and at most `connect_timeout` of them to connect. The client's own Timeout
        class: openai 1-2 are built on httpx, 3 on httpx2, and each refuses the other's."""
        import openai

        return openai.Timeout(seconds, connect=min(self.options.connect_timeout, seconds))

    async def _models(self, server: Server) -> dict[str, int | None]:
        """The models `server` serves, each with the context it was started with where it says (vLLM's model card
        has `max_model_len`)."""
        try:
            page = await server.client.models.list(timeout=self._timeout(min(self.options.timeout, 30.0)))
        except Exception as err:  # noqa: BLE001 - said with the server's URL below
            raise to_backend_error(err, server.name) from err
        return {m.id: getattr(m, "max_model_len", None) for m in page.data}

    def _choose_model(self, pool: ServerPool, listed: list[dict[str, int | None] | BaseException]) -> None:
        """Settle the model name and the shortest context a server says it takes (so prompts longer than that are
        refused before work), and leave out servers that are down now (they rejoin when they come back)."""
        for server, got in zip(pool.servers, listed):
            if isinstance(got, BaseException) and not isinstance(got, TransientBackendError):
                raise got  # 401, 404: a mistake to fix, not a server to wait for
        reachable = [(s, got) for s, got in zip(pool.servers, listed) if not isinstance(got, BaseException)]
        if not reachable:
            reasons = "; ".join(str(got) for got in listed)
            raise BackendUnavailableError(f"No server answered: {reasons}. Start the server, or fix base_url.")
        if self.model is None:
            first_name, first = reachable[0][0].name, reachable[0][1]
            if len(first) != 1:
                raise ConfigError(f"{first_name} serves {list(first)}; choose one with the option model=...")
            self.model = next(iter(first))
        for server, got in reachable:
            if self.model not in got:
                raise ConfigError(f"{server.name} serves {list(got)}, not {self.model!r}; give every server the same "
                                  "model (vLLM: --served-model-name), or set the option model=...")
        contexts = [got[self.model] for _, got in reachable if type(got[self.model]) is int and got[self.model] > 0]
        if contexts:
            self.capabilities = attrs.evolve(self.capabilities, max_context=min(contexts))
        for server, got in zip(pool.servers, listed):
            if isinstance(got, BaseException):
                log.warning("%s is down now (%s); it will be tried again when other servers fail or after %.0f s.",
                            server.name, got, pool.cooldown)
                pool.failed(server, got, down=True)

    async def _verify(self, server: Server, since: float) -> None:
        """Send the probe to `server` alone and check its answer agrees with the reference (the first server's),
        once per time it joins: a server that failed may come back with other weights. `since`: when the caller
        began waiting; a failure after that (e.g. of the probe another request sent) sends it elsewhere at once."""
        async with server.verifying:
            if server.verified:
                return
            if server.failed_at > since:
                raise ServerDownError(f"{server.name} failed while a request waited for its same-model probe.")
            body = self._completion_body(self.probe)
            sent = self.pool.clock()
            name, response = server.name, await self._send(server, body)
            answer = self._read_completion(self.probe, name, response)
            if self.reference is None:
                self.reference = (name, answer)
            else:
                gap = probe_gap(self.reference[1], answer)
                if gap > PROBE_TOLERANCE:
                    raise IncompatibleCartridgeError(
                        f"{name} does not serve the same model as {self.reference[0]}: their answers to the same-model "
                        f"probe differ by {gap:.3f} nats (tolerance {PROBE_TOLERANCE}). Serve the student's model on "
                        "every server, or leave this one out of base_url; a stopped synthesis resumes where it was."
                    )
            server.verified = server.failed_at < sent  # not when it went down while the probe was out

    async def _send(self, server: Server, body: dict[str, Any]) -> dict[str, Any]:
        """One completions call on `server`, its failure classified and counted."""
        extra = {"return_tokens_as_token_ids": True} if self.options.token_ids else {}
        started = self.pool.clock()
        async with self.pool.use(server):
            try:
                response = await server.client.completions.create(
                    model=self.model, **_standard(body), extra_body={**extra, **_extra(body)})
            except Exception as err:  # noqa: BLE001 - classified, then raised as the SDK's error
                error = to_backend_error(err, server.name)
                if isinstance(error, TransientBackendError):
                    self.pool.failed(server, error, down=isinstance(error, ServerDownError))
                raise error from err
        self.pool.succeeded(server, started)
        return response.to_dict()

    async def _post(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """One completions call with retries: a transient failure is retried after a backoff (or the server's
        retry-after), on another server when one is up; a permanent one fails at once. Returns (server, response)."""
        from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt

        attempts = self.options.max_retries + 1
        server: Server | None = None
        retrying = AsyncRetrying(stop=stop_after_attempt(attempts), wait=self.wait, sleep=self.sleep, reraise=True,
                                 retry=retry_if_exception_type(TransientBackendError), before_sleep=_log_retry)
        try:
            async for attempt in retrying:
                with attempt:
                    server = self.pool.pick(avoid=server)
                    if not server.verified:
                        server.assigned += 1  # waiting for its probe counts as its load
                        try:
                            await self._verify(server, self.pool.clock())
                        finally:
                            server.assigned -= 1
                    return server.name, await self._send(server, body)
        except TransientBackendError as err:
            err.add_note(f"Gave up after {attempts} attempt(s) over {', '.join(self.names)} (the option max_retries).")
            raise
        raise AssertionError("unreachable")  # tenacity either returns or raises

    @staticmethod
    def _completion_body(r: SynthesisRequest, seeds: bool = False) -> dict[str, Any]:
        return {"prompt": list(r.prompt_ids), "max_tokens": r.max_tokens, "temperature": r.temperature,
                "seed": r.seed if seeds else None, "logprobs": r.top_logprobs, "stop_token_ids": list(r.stop_ids),
                **PLAIN_SAMPLING, **PLAIN_SAMPLING_EXTRA}

    def _read_completion(self, r: SynthesisRequest, name: str, response: dict[str, Any]) -> Completion:
        choice = response["choices"][0]
        stops = set(r.stop_ids) | self.lm.eos_token_ids
        ids, cands = positions(choice, self.reader, name, stops=stops)
        if not ids or len(ids) > r.max_tokens:
            raise BackendError(f"{name} returned {len(ids)} tokens for max_tokens={r.max_tokens}.")
        top_ids = top_lps = None
        if r.top_logprobs:
            top_ids, top_lps = topk(cands, r.top_logprobs, name)
        return Completion.from_ids(self.lm, ids, choice.get("finish_reason"), stop_ids=r.stop_ids, top_ids=top_ids,
                                   top_logprobs=top_lps)

    async def _complete(self, r: SynthesisRequest) -> Completion:
        name, response = await self._post(self._completion_body(r, self.options.seeds))
        return self._read_completion(r, name, response)

    async def _score(self, prefix: list[int], seq: list[int], k: int) -> tuple[Any, Any]:
        prompt = prefix + seq
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": k}
        try:
            name, response = await self._post(body)
        except BackendError as err:
            if _status(err) in (400, 422):
                err.add_note("Scoring given sequences (document windows, targets='all') needs `echo` with `logprobs` "
                             "on the completions endpoint; without it, set document_windows=0 and targets='assistant'.")
            raise
        ids, cands = positions(response["choices"][0], self.reader, name)
        if ids[: len(prompt)] != prompt:
            raise BackendError(f"{name} echoed other tokens than the prompt ids it was sent; it does not take token-id "
                               "prompts as they are.")
        return topk(cands[len(prefix) + 1 : len(prompt)], k, name)


STANDARD = ("prompt", "max_tokens", "temperature", "seed", "logprobs", "echo", *PLAIN_SAMPLING)


def _standard(body: dict[str, Any]) -> dict[str, Any]:
    """The completions API's own parameters (the openai client sends them as they are)."""
    return {k: v for k, v in body.items() if k in STANDARD and v is not None}


def _extra(body: dict[str, Any]) -> dict[str, Any]:
    """Server extensions (vLLM's stop_token_ids, top_k, ...), sent in the body; servers that do not know them
    ignore them."""
    return {k: v for k, v in body.items() if k not in STANDARD}


def _status(err: BaseException) -> int | None:
    return getattr(err.__cause__, "status_code", None)


def _warn_about_the_key(options: OpenAIOptions, urls: Sequence[str]) -> None:
    """The environment's key was meant for someone's API; say so when it would travel unencrypted off this host."""
    if options.api_key is not None or not os.environ.get("OPENAI_API_KEY"):
        return
    for url in urls:
        if urlsplit(url).scheme == "http" and not is_loopback(urlsplit(url).hostname or ""):
            log.warning("OPENAI_API_KEY is sent to %s over plain http; pass api_key=... for this server (or 'none'), "
                        "or use https.", shown(url))


def _log_retry(state: Any) -> None:
    err = state.outcome.exception()
    log.debug("Retrying a request in %.1f s (attempt %d failed): %s", state.next_action.sleep, state.attempt_number, err)
