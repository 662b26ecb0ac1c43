"""`cartridges serve`: an OpenAI-compatible HTTP API over a cartridge store, on FastAPI and uvicorn.

``POST /v1/chat/completions`` answers with the cartridge its ``model`` names (or several, composed, listed in the
extra field ``cartridges``; or the ones a question is routed to, ``model="auto"``), streamed as server-sent events
when asked. ``GET /v1/models`` lists the cartridges; ``GET /health`` says the server is up.

One thread drives the runtime (`engine.Engine`): requests wait in a bounded queue, and the ones waiting together
are answered in one heterogeneous batch. A full queue answers 429 with ``retry-after``; bad input answers
4xx naming the problem and never reaches the engine.

With a key file (`access.KeyFile`), each key opens only the cartridges its allow-list names: it is listed, routed
to and answered from those alone, and any other name is answered exactly as a name that does not exist (404), so
a key learns nothing of what it may not read. An audit log (`audit.AuditLog`) records every request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
from fastapi import FastAPI, Request  # this module is imported only to serve; the core never imports it
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import Headers

from ..checks import at_least_one
from ..errors import ConfigError, IncompatibleCartridgeError
from ..plugins import Runtime
from ..requests import Completion, GenerationParams, GenerationRequest
from .access import Grant, KeyFile, KeyFileError, RateLimits
from .audit import AuditLog
from .engine import Engine, Job
from .guard import LOOPBACK_HOSTS, BadRequest, Guard, authorize, check_host, check_host_names, host_names
from .parse import parse_request, read_json
from .store import SUFFIX, CartridgeStore, NotInStoreError, versions




def _check_key(_inst, _attr, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value or not value.isascii()
                              or not value.isprintable() or " " in value):
        raise ConfigError("The API key must be a non-empty string of printable ASCII characters with no spaces (HTTP "
                          "headers carry ASCII only, so another key could never be sent as typed).")


# what the runtime's own checks refuse: the request's fault, answered 400 (a stream's error event says so too)
REFUSALS = (ConfigError, IncompatibleCartridgeError)


@attrs.frozen
class ServeConfig:
    # a bearer token clients must send (compared in constant time); None: no authentication (bind to 127.0.0.1 then)
    api_key: str | None = attrs.field(default=None, repr=False, validator=_check_key)
    # the names a request's Host header may carry (any port): a loopback-only server answers only requests addressed
    # to it, so a web page that rebinds its own name to 127.0.0.1 (DNS rebinding) gets 403; None: any Host
    allowed_hosts: tuple[str, ...] | None = attrs.field(default=LOOPBACK_HOSTS, converter=host_names, validator=check_host_names)
    # requests waiting for the engine; more are answered 429 with retry-after
    max_queue: int = attrs.field(default=256, validator=at_least_one)
    # requests answered together in one batch
    max_batch: int = attrs.field(default=16, validator=at_least_one)
    # largest request body, in bytes
    max_body_bytes: int = attrs.field(default=1_000_000, validator=at_least_one)
    # largest max_tokens a request may ask for
    max_new_tokens: int = attrs.field(default=2048, validator=at_least_one)
    # tokens an answer gets when a request does not say
    default_max_tokens: int = attrs.field(default=256, validator=at_least_one)
    # a key file (`cartridges keys`): per-key allow-lists and rate limits, re-read when it changes; not with api_key
    keys_file: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    # an append-only JSON-lines log of every request (who, which cartridges, status)
    audit_log: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    # write each request's last user turn into the audit log too (off: it may hold what the log must not)
    audit_questions: bool = False

    def __attrs_post_init__(self) -> None:
        if self.api_key is not None and self.keys_file is not None:
            raise ConfigError("api_key (one key for everything) and keys_file (a key per user) exclude each other; "
                              "give one. Add the shared key to the file with `cartridges keys add ID --allow '*'`.")
        if self.audit_questions and self.audit_log is None:
            raise ConfigError("audit_questions writes questions into the audit log; give audit_log too.")


def create_app(store: CartridgeStore, runtime: Runtime, config: ServeConfig | None = None) -> Any:
    """The ASGI app (FastAPI). The engine thread starts with the app and stops with it."""
    config = config or ServeConfig()
    lm = store.model
    ids = itertools.count()
    state: dict[str, Any] = {"refreshed": 0.0}
    keys = KeyFile(config.keys_file) if config.keys_file is not None else None  # a bad file stops the start
    limits = RateLimits() if keys is not None else None
    audit = AuditLog(config.audit_log, questions=config.audit_questions) if config.audit_log is not None else None

    @asynccontextmanager
    async def lifespan(_app):
        state["engine"] = _app.state.engine = Engine(runtime, config.max_queue, config.max_batch)
        try:
            yield
        finally:
            await asyncio.to_thread(state["engine"].close)
            if audit is not None:
                audit.close()

    # with a key, the API's own pages (/docs, /redoc, /openapi.json) are behind it too: the guard below covers them
    app = FastAPI(title="cartridges-sdk", lifespan=lifespan)
    scrub = _scrubber(store.root)

    def error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
        return JSONResponse({"error": {"message": scrub(message), "type": kind, "param": param, "code": status}},
                            status_code=status, headers=headers)

    @app.exception_handler(BadRequest)
    async def _bad(_request, exc: BadRequest):
        return error(exc.status, exc.message, exc.param, exc.headers)

    def guard(scope: dict[str, Any]) -> JSONResponse | None:
        """Every path: the Host and Origin checks first (DNS rebinding, web pages), then the key and its rate limit
        (all but /health); a refusal, or None. The key's grant goes into the scope, for the endpoints."""
        headers = Headers(scope=scope)
        try:
            check_host(config.allowed_hosts, headers.get("host"), headers.get("origin"))
            if audit is not None and audit.broken and scope["path"] != "/health":
                raise BadRequest(503, "The server cannot write its audit log; its operator must fix that (the "
                                 "server's log says why).", headers={"retry-after": "10"})
            if scope["path"] != "/health":
                if keys is None:
                    authorize(config.api_key, headers)
                else:
                    grant = scope[GRANT] = _grant(keys, headers)
                    scope[AUDIT]["key"] = grant.key_id
                    wait = limits.wait(grant)
                    if wait is not None:
                        raise BadRequest(429, f"This key's rate limit ({grant.rate}) is used up; retry in "
                                         f"{wait:.0f} s.", headers={"retry-after": str(max(1, round(wait)))})
        except BadRequest as refused:
            return error(refused.status, refused.message, refused.param, refused.headers)
        return None

    def done(scope: dict[str, Any], status: int | None) -> None:
        if audit is not None and scope["path"] != "/health":
            audit.write({**scope[AUDIT], "status": status if status is not None else 500})

    app.add_middleware(Guard, check=guard, done=done)

    def refresh(force: bool = False) -> None:
        if force or time.monotonic() - state["refreshed"] > 1.0:  # a folder re-read at most once a second
            store.refresh()
            state["refreshed"] = time.monotonic()

    def visible(grant: Grant | None) -> list[str]:
        """The cartridges a request may see: all of them, or those its key opens."""
        return store.names() if grant is None else grant.filter(store.names())

    def grant_of(request: Request) -> Grant | None:
        """The request's grant; with a key file, a request the guard let through without one is refused rather
        than shown every cartridge (a route added later, a path the guard reads differently)."""
        grant = request.scope.get(GRANT)
        if keys is not None and grant is None:
            raise BadRequest(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.")
        return grant

    def not_found(name: str, grant: Grant | None) -> BadRequest:
        """The 404 for a name the request cannot use. For a key with an allow-list it reads the same whether the
        cartridge is missing or someone else's, and lists only the key's own."""
        where = "in the store" if grant is None else "in the store for this key"
        return BadRequest(404, f"No cartridge {name!r} {where}; it holds: {', '.join(visible(grant)[:50]) or 'none'} "
                          f"(and 'auto', {lm.name!r}).", "model")

    def resolve(body: dict[str, Any], names: list[str] | None, messages: list[dict[str, str]],
                params: GenerationParams, grant: Grant | None) -> tuple[list[str], list[Any], int, int]:
        """The request's cartridges (routed, for model='auto') and token counts, checked against the context. Runs
        off the event loop: it may read files, rebuild the routing index and tokenize a long conversation."""
        refresh()
        if names == [lm.name] and lm.name not in store:  # the bare model, no cartridge
            names = []
        if names is None:  # model="auto": routed by the last user turn, or all of them for a follow-up ("Why?")
            among = None if grant is None else visible(grant)
            if among == []:
                raise BadRequest(404, "This key opens no cartridge in the store, so there is nothing to route to.",
                                 "model")
            turns = [m["content"] for m in messages if m["role"] == "user"]
            for question in (turns[-1], "\n".join(turns)) if len(turns) > 1 else (turns[-1],):
                try:
                    routes = store.within(question, body["budget"], among=among) if body.get("budget") else \
                        store.route(question, k=body.get("k", 1), among=among)
                    names = [r.name for r in routes]
                    break
                except ConfigError as err:
                    refused = err
            if names is None:
                raise BadRequest(400, str(refused), "model")
        barred = [n for n in names if grant is not None and not grant.allows(n)]
        if barred:
            refresh(True)  # as for a missing name, so the answer takes as long as one
            raise not_found(barred[0], grant)
        try:
            cartridges = [store.get(n) for n in names]
        except NotInStoreError:
            refresh(True)
            missing = [n for n in names if n not in store]
            if missing:
                why = store.refused().get(missing[0] + SUFFIX)
                if why is not None:  # its file is there but was left out: say why, not just "no such cartridge"
                    raise BadRequest(404, f"The cartridge {missing[0]!r} is left out of the store: {why}", "model")
                raise not_found(missing[0], grant) from None
            cartridges = [store.get(n) for n in names]
        try:
            prompt_tokens = len(lm.prompt_ids(messages, after_cartridge=bool(cartridges)))
        except Exception as err:  # noqa: BLE001 - e.g. a template that wants alternating turns or no system turn
            raise BadRequest(400, f"The model's chat template refuses these messages: {type(err).__name__}: "
                             f"{str(err)[:300]}", "messages") from None
        used = sum(c.num_tokens for c in cartridges)
        limit = lm.max_context
        if limit is not None and used + prompt_tokens + params.max_new_tokens > limit:
            raise BadRequest(400, f"The conversation ({prompt_tokens} tokens) and max_tokens={params.max_new_tokens} "
                             f"do not fit the {limit - used} positions the model's {limit}-token context leaves after "
                             f"the cartridges ({used} tokens); shorten the conversation or lower max_tokens.",
                             "messages")
        return names, cartridges, prompt_tokens, used

    @app.get("/health")
    async def health():
        engine = state.get("engine")
        if engine is None or not engine.alive:
            return JSONResponse({"status": "down", "reason": "the engine thread is not running"}, status_code=503)
        if keys is not None:  # no key is needed here, so it says nothing of the store (how many records it holds)
            return {"status": "ok"}
        return {"status": "ok", "cartridges": len(store), "model": lm.name, "waiting": engine.jobs.qsize()}

    @app.get("/v1/models")
    async def models(request: Request):
        await asyncio.to_thread(refresh, True)
        names = visible(grant_of(request))
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "cartridges"} for n in names]
        data.append({"id": "auto", "object": "model", "created": 0, "owned_by": "cartridges"})
        data.append({"id": lm.name, "object": "model", "created": 0, "owned_by": "cartridges"})
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await read_json(request, config.max_body_bytes)
        grant = grant_of(request)
        record = request.scope[AUDIT]
        record.update(model=str(body.get("model"))[:200], user=str(body.get("user"))[:256] if "user" in body else None)
        names, messages, params, stream, include_usage = parse_request(body, config)
        record.update(stream=stream, question=[m["content"] for m in messages if m["role"] == "user"][-1])
        if names is not None:  # the names asked for, refused ones too: a key probing for others' shows in the log
            record["asked"] = [n[:200] for n in names[:16]]
        names, cartridges, prompt_tokens, used = await asyncio.to_thread(resolve, body, names, messages, params,
                                                                         grant)
        record["cartridges"] = names
        job_request = GenerationRequest(messages, cartridges, params)
        loop = asyncio.get_running_loop()
        job = Job(job_request, stream, loop, asyncio.Queue() if stream else loop.create_future())
        if not state["engine"].submit(job):
            raise BadRequest(429, f"The server is busy ({config.max_queue} requests waiting); retry shortly.",
                             headers={"retry-after": "1"})
        rid = f"chatcmpl-{next(ids)}-{int(time.time())}"
        # which cartridges answered, and the version (SHA-256) of the document each stands for, if sync made it
        sources = {"cartridges": names, "versions": list(versions(cartridges))}
        model = body["model"]
        usage = {"prompt_tokens": prompt_tokens, "cartridge_tokens": used}
        if stream:
            return StreamingResponse(_events(job, rid, model, sources, usage, include_usage, scrub, record),
                                     media_type="text/event-stream")
        try:
            out: Completion = await _wait(job, request)
        except REFUSALS as err:
            raise BadRequest(400, str(err)) from err
        except BadRequest:
            raise
        except Exception as err:
            raise BadRequest(500, f"The runtime failed: {type(err).__name__}: {err}") from err
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "finish_reason": out.finish_reason}],
                "usage": _usage(usage, len(out.token_ids)), **sources}

    return app


async def _wait(job: Job, request: Any) -> Completion:
    """The job's answer; a client that disconnects meanwhile cancels it (it is not run, or its answer dropped)."""
    try:
        while True:
            done, _ = await asyncio.wait({job.out}, timeout=0.5)
            if done:
                return job.out.result()
            if await request.is_disconnected():
                job.cancelled.set()
                raise BadRequest(499, "The client disconnected.")
    finally:
        if not job.out.done():
            job.cancelled.set()


async def _events(job: Job, rid: str, model: str, sources: dict[str, list], usage: dict[str, int],
                  include_usage: bool, scrub, record: dict[str, Any]) -> AsyncIterator[str]:
    """Server-sent events in the OpenAI chunk format, then usage (if asked for, as OpenAI does: a last chunk with no
    choices); a client that goes away cancels its decoding."""
    def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": choices, **sources, **extra}
        return f"data: {json.dumps(body)}\n\n"

    try:
        yield chunk({"role": "assistant", "content": ""})
        while isinstance(piece := await job.out.get(), str):
            yield chunk({"content": piece})
        if isinstance(piece, BaseException):
            kind = "invalid_request_error" if isinstance(piece, REFUSALS) else "server_error"
            record["error"] = kind  # the stream began with 200: the log says how it ended
            yield f"data: {json.dumps({'error': {'message': scrub(str(piece)), 'type': kind}})}\n\n"
            yield "data: [DONE]\n\n"  # the stream is over: clients waiting for the end marker stop here
            return
        if piece is None:  # cut short (the server is stopping)
            return
        yield chunk({}, piece.finish_reason)
        if include_usage:
            yield chunk(None, usage=_usage(usage, len(piece.token_ids)))
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # finished, or the client disconnected: either way, no more work for it


GRANT = "cartridges.grant"  # the scope key of the request's grant (a key file's entry), set by the guard
AUDIT = "cartridges.audit"  # the scope key of the request's audit record, filled in as the request is read


def _grant(keys: KeyFile, headers: Headers) -> Grant:
    """The grant of the request's bearer key: 401 without one that the file holds; 503 while the file is unreadable
    (no request is let through on a file that may have revoked its key)."""
    given = headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    try:
        grant = keys.authenticate(token) if token else None
    except KeyFileError as err:
        import logging

        logging.getLogger("cartridges_sdk.serve").error("Refusing every request: %s", err)
        raise BadRequest(503, "The server's key file cannot be read; its operator must fix it (the server's log "
                         "says how).") from None
    if grant is None:
        raise BadRequest(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.")
    return grant


def _scrubber(root: Path):
    """A function that replaces the store's absolute path in a message with its folder name: clients are told names,
    never where the server keeps its files."""
    paths = sorted({p for p in (str(root.absolute()), str(root.resolve())) if len(p) > 1}, key=len, reverse=True)

    def scrub(message: str) -> str:
        for path in paths:
            message = message.replace(path, root.name or "store")
        return message

    return scrub


def _usage(usage: dict[str, int], completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": completion_tokens,
            "total_tokens": usage["prompt_tokens"] + completion_tokens, "cartridge_tokens": usage["cartridge_tokens"]}
