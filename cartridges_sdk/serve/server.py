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
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
from fastapi import FastAPI, Request  # this module is imported only to serve; the core never imports it
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import Headers

from ..cartridge import Cartridge
from ..errors import ConfigError
from ..generation import GenerationParams, GenerationRequest
from ..lm import LM
from ..plugins import Runtime
from .access import FailedLogins, Grant, KeyFile, KeyFileError, RateLimits
from .audit import AuditLog, shown
from .documents import SUFFIX
from .engine import Engine, Job
from .guard import BadRequest, Guard, authorize, check_host
from .parse import parse_request, read_json
from .records import versions
from .replies import answer, completion_body, error_response, scrubber, stream_events
from .settings import ServeConfig
from .store import CartridgeStore, NotInStoreError
from .subjects import named, unknown_name

GRANT = "cartridges.grant"  # the scope key of the request's grant (a key file's entry), set by the guard
TOKEN = "cartridges.token"  # the scope key of the request's bearer key: a running answer checks it is still good
JOB = "cartridges.job"  # the scope key of the request's engine job, stopped when the response ends however it ends
LOGGED = "cartridges.logged"  # the scope key saying the request's line is in the audit log
AUDIT = "cartridges.audit"  # the scope key of the request's audit record, filled in as the request is read


@attrs.define(eq=False)
class ServerState:
    """What one app's routes share: the store and the settings, the key file and its rate limits, the audit log, the
    message scrubber, and the engine (from the app's start to its end)."""

    store: CartridgeStore
    config: ServeConfig = attrs.field(factory=ServeConfig)
    keys: KeyFile | None = None
    limits: RateLimits | None = None
    audit: AuditLog | None = None
    scrub: Callable[[str], str] = str
    engine: Engine | None = None
    # failed authentications by client address (a key file or api_key)
    logins: FailedLogins = attrs.field(default=attrs.Factory(lambda self: FailedLogins(self.config.auth_failures),
                                                             takes_self=True))
    refreshed: float = 0.0  # when the store's folder was last re-read (time.monotonic)
    ids: Iterator[int] = attrs.field(factory=itertools.count)
    # each audit line's request id: this server's start (hex seconds) and a count, so two runs' lines never clash
    requests: Iterator[str] = attrs.field(factory=lambda: (f"{int(time.time()):x}-{n}" for n in itertools.count()))

    @classmethod
    def open(cls, store: CartridgeStore, config: ServeConfig) -> ServerState:
        """The state `config` asks for: its key file read (a bad file stops the start), its audit log opened."""
        keys = KeyFile(config.keys_file) if config.keys_file is not None else None
        audit = AuditLog(config.audit_log, questions=config.audit_questions) if config.audit_log is not None else None
        return cls(store, config, keys, RateLimits() if keys is not None else None, audit, scrubber(store.root))

    @property
    def lm(self) -> LM:
        return self.store.model

    def refresh(self, force: bool = False) -> None:
        if force or time.monotonic() - self.refreshed > 1.0:  # a folder re-read at most once a second
            self.store.refresh()
            self.refreshed = time.monotonic()

    def visible(self, grant: Grant | None) -> list[str]:
        """The cartridges a request may see: all of them, or those its key opens."""
        return self.store.names() if grant is None else grant.filter(self.store.names())


def create_app(store: CartridgeStore, runtime: Runtime, config: ServeConfig | None = None) -> Any:
    """The ASGI app (FastAPI). The engine thread starts with the app and stops with it."""
    state = ServerState.open(store, config or ServeConfig())
    # with a key, the API's own pages (/docs, /redoc, /openapi.json) are behind it too: the guard covers them
    app = FastAPI(title="cartridges-sdk", lifespan=functools.partial(_running, state, runtime))
    app.state.served = state
    app.add_exception_handler(BadRequest, _refused)
    app.add_middleware(Guard, check=functools.partial(refusal, state), opened=functools.partial(_opened, state),
                       done=functools.partial(_ended, state), unlogged=_unlogged)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    return app


@asynccontextmanager
async def _running(state: ServerState, runtime: Runtime, app: Any):
    state.engine = app.state.engine = Engine(runtime, state.config.max_queue, state.config.max_batch)
    try:
        yield
    finally:
        await asyncio.to_thread(state.engine.close)
        if state.audit is not None:
            for address, count in state.logins.counted().items():
                state.audit.write({"key": None, "client": address, "status": 429, "refusals_not_logged": count})
            state.audit.close()


async def _refused(request: Request, exc: BadRequest) -> JSONResponse:
    return error_response(exc, request.app.state.served.scrub)


# ---- who may ask: every path passes here first


def refusal(state: ServerState, scope: dict[str, Any]) -> JSONResponse | None:
    """The refusal `admit` gives a request, as a response; or None to let it through."""
    try:
        admit(state, scope)
    except BadRequest as refused:
        return error_response(refused, state.scrub)
    return None


def admit(state: ServerState, scope: dict[str, Any]) -> None:
    """Every path: the Host and Origin checks first (DNS rebinding, web pages), then the key and its rate limit
    (all but /health); raises BadRequest. The key's grant goes into the scope, for the endpoints."""
    headers = Headers(scope=scope)
    check_host(state.config.allowed_hosts, headers.get("host"), headers.get("origin"))
    if scope["path"] == "/health":
        return
    if state.audit is not None and state.audit.broken:
        raise BadRequest(503, "The server cannot write its audit log; its operator must fix that (the server's log "
                         "says why).", headers={"retry-after": "10"})
    if state.keys is None and state.config.api_key is None:
        return
    address = scope[AUDIT]["client"] = (scope.get("client") or ("unknown",))[0]
    wait = state.logins.wait(address)
    if wait is not None:  # too many wrong keys from there: whatever it sends now is refused, and counted quietly
        scope[AUDIT]["quiet"] = True
        raise BadRequest(429, f"Too many failed authentications from this address ({state.config.auth_failures}); "
                         f"retry in {wait:.0f} s.", headers={"retry-after": str(max(1, round(wait)))})
    try:
        if state.keys is None:
            authorize(state.config.api_key, headers)
            return
        grant = scope[GRANT] = key_grant(state.keys, bearer(headers))
    except BadRequest as refused:
        if refused.status == 401:
            state.logins.failed(address)
        raise
    scope[TOKEN] = bearer(headers)
    scope[AUDIT]["key"] = grant.key_id
    wait = state.limits.wait(grant)
    if wait is not None:
        raise BadRequest(429, f"This key's rate limit ({grant.rate}) is used up; retry in {wait:.0f} s.",
                         headers={"retry-after": str(max(1, round(wait)))})


def bearer(headers: Headers) -> str:
    given = headers.get("authorization", "")
    return given[7:] if given.lower().startswith("bearer ") else ""


def key_grant(keys: KeyFile, token: str) -> Grant:
    """The grant of the bearer key `token`: 401 when the file does not hold it; 503 while the file is unreadable,
    for every request, one without a key too (none is let through on a file that may have revoked its key)."""
    try:
        grant = keys.authenticate(token)  # an empty token too: the file is read, and a broken one answers 503
    except KeyFileError as err:
        logging.getLogger("cartridges_sdk.serve").error("Refusing every request: %s", err)
        raise BadRequest(503, "The server's key file cannot be read; its operator must fix it (the server's log "
                         "says how).") from None
    if grant is None or not token:
        raise BadRequest(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.")
    return grant


def withdrawn(state: ServerState, scope: dict[str, Any], names: list[str]) -> tuple[str, BadRequest] | None:
    """Why a running answer's key may no longer read it (revoked, rotated, its grant narrowed, its file broken), as
    the audit log's word and the refusal to send; None while it may."""
    if state.keys is None:
        return None
    try:
        grant = state.keys.authenticate(scope.get(TOKEN, ""))
    except KeyFileError:
        return "key-file-broken", BadRequest(503, "The server's key file cannot be read; the answer was stopped.")
    if grant is None:
        return "key-revoked", BadRequest(401, "This key was revoked or rotated; the answer was stopped.")
    if not all(grant.allows(n) for n in names):
        return "grant-withdrawn", BadRequest(403, "This key no longer opens the cartridges answering; the answer "
                                             "was stopped.")
    return None


def grant_of(state: ServerState, scope: dict[str, Any]) -> Grant | None:
    """The request's grant; with a key file, a request the guard let through without one is refused rather than
    shown every cartridge (a route added later, a path the guard reads differently)."""
    grant = scope.get(GRANT)
    if state.keys is not None and grant is None:
        raise BadRequest(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.")
    return grant


def _opened(state: ServerState, scope: dict[str, Any], status: int) -> bool:
    """Log the request before its response's first byte; False when the line could not be written (the response is
    then replaced by a 503: nothing is answered unlogged). A blocked address's refusals are counted, a line a minute."""
    if state.audit is None or scope["path"] == "/health":
        return True
    record = scope[AUDIT]
    if record.pop("quiet", False):
        counted = state.logins.quiet(record["client"])
        if counted is None:
            return True
        record["refusals_not_logged"] = counted
    record.setdefault("request", next(state.requests))
    state.audit.write({**record, "status": status})
    scope[LOGGED] = state.audit.broken is None
    return scope[LOGGED] or status == 503


def _ended(state: ServerState, scope: dict[str, Any], status: int | None) -> None:
    """Once the response is over: its job stopped, and a second line for a stream that ended in an error (it began
    with 200) or a request that crashed before its response began."""
    job = scope.get(JOB)
    if job is not None:
        job.cancelled.set()
    if state.audit is None or scope["path"] == "/health":
        return
    record = scope[AUDIT]
    if status is None:
        record.setdefault("request", next(state.requests))
        state.audit.write({**record, "status": 500})
    elif scope.get(LOGGED) and status == 200 and "error" in record:
        state.audit.write({**record, "status": status, "ended": record["error"]})


def _unlogged() -> Any:
    return error_response(BadRequest(503, "The server cannot write its audit log; its operator must fix that (the "
                                     "server's log says why).", headers={"retry-after": "10"}), str)


# ---- which cartridges answer


def resolve(state: ServerState, body: dict[str, Any], names: list[str] | None, messages: list[dict[str, str]],
            params: GenerationParams, grant: Grant | None) -> tuple[list[str], list[Cartridge], int, int]:
    """The request's cartridge names and cartridges (routed, for model='auto') and token counts (the prompt's, the
    cartridges'), checked against the context. Runs off the event loop: it may read files, rebuild the routing
    index and tokenize a long conversation."""
    state.refresh()
    if names == [state.lm.name] and state.lm.name not in state.store:  # the bare model, no cartridge
        names = []
    if names is None:
        names = routed(state, body, messages, grant)
    cartridges = cartridges_for(state, names, grant)
    prompt_tokens, used = check_fits(state.lm, messages, cartridges, params)
    return names, cartridges, prompt_tokens, used


def routed(state: ServerState, body: dict[str, Any], messages: list[dict[str, str]],
           grant: Grant | None) -> list[str]:
    """model='auto': the cartridges the last user turn is routed to (`k` or `budget`), or, for a follow-up that
    routes nowhere ("Why?"), those all the user's turns are; only among the key's own, and, when the question names
    a subject, only among that subject's (`about`)."""
    among = None if grant is None else state.visible(grant)
    if among == []:
        raise BadRequest(404, "This key opens no cartridge in the store, so there is nothing to route to.", "model")
    turns = [m["content"] for m in messages if m["role"] == "user"]
    asked = (turns[-1], "\n".join(turns)) if len(turns) > 1 else (turns[-1],)
    subject = about(state, asked, among)
    for question in asked:
        try:
            routes = state.store.within(question, body["budget"], among=subject or among) if body.get("budget") \
                else state.store.route(question, k=body.get("k", 1), among=subject or among)
            return [r.name for r in routes]
        except ConfigError as err:
            refused = err
    if subject:  # the question names them, in words their corpora lack: they answer all the same
        return subject[:body.get("k", 1)] if not body.get("budget") else subject[:1]
    raise BadRequest(400, str(refused), "model")


def about(state: ServerState, asked: tuple[str, ...], among: list[str] | None) -> list[str] | None:
    """The cartridges, of those the key opens (`among`; None: all), about the subject the question names (the last
    turn first, then the whole conversation); None when it names none. A question naming someone whom no such
    cartridge is about is refused (404) in the same words whether that someone is another key's subject or nobody:
    it is never answered from someone else's record, and learns nothing of who else is in the store."""
    subjects = state.store.subjects()
    if among is not None:
        opened = set(among)
        subjects = {name: subject for name, subject in subjects.items() if name in opened}
    if not subjects:  # no cartridge the key opens says who it is about: routing as ever
        return None
    for question in asked:
        found = named(question, subjects)
        if found:
            return found
        stranger = unknown_name(question)
        if stranger is not None:
            raise BadRequest(404, f"No record you can open is about {shown(stranger)!r}. Ask about a subject of the "
                             "cartridges your key opens (GET /v1/models lists them), or name a cartridge as model.",
                             "messages")
    return None


def cartridges_for(state: ServerState, names: list[str], grant: Grant | None) -> list[Cartridge]:
    """The named cartridges; a name the key may not open is answered exactly as one the store lacks."""
    store = state.store
    barred = [n for n in names if grant is not None and not grant.allows(n)]
    if barred:
        state.refresh(True)  # as for a missing name, so the answer takes as long as one
        raise not_found(state, barred[0], grant)
    try:
        return [store.get(n) for n in names]
    except NotInStoreError:
        state.refresh(True)
        missing = [n for n in names if n not in store]
        if missing:
            why = store.refused().get(missing[0] + SUFFIX)
            if why is not None:  # its file is there but was left out: say why, not just "no such cartridge"
                raise BadRequest(404, f"The cartridge {missing[0]!r} is left out of the store: {why}", "model")
            raise not_found(state, missing[0], grant) from None
        return [store.get(n) for n in names]


def not_found(state: ServerState, name: str, grant: Grant | None) -> BadRequest:
    """The 404 for a name the request cannot use. For a key with an allow-list it reads the same whether the
    cartridge is missing or someone else's, and lists only the key's own."""
    where = "in the store" if grant is None else "in the store for this key"
    return BadRequest(404, f"No cartridge {shown(name)!r} {where}; it holds: {', '.join(state.visible(grant)[:50]) or 'none'} "
                      f"(and 'auto', {state.lm.name!r}).", "model")


def check_fits(lm: LM, messages: list[dict[str, str]], cartridges: list[Cartridge],
               params: GenerationParams) -> tuple[int, int]:
    """The prompt's tokens and the cartridges', refused (400) when they and max_tokens overflow the context."""
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
    return prompt_tokens, used


# ---- the routes


async def health(request: Request):
    state: ServerState = request.app.state.served
    engine = state.engine
    if engine is None or not engine.alive:
        return JSONResponse({"status": "down", "reason": "the engine thread is not running"}, status_code=503)
    if state.keys is not None:  # no key is needed here, so it says nothing of the store (how many records it holds)
        return {"status": "ok"}
    return {"status": "ok", "cartridges": len(state.store), "model": state.lm.name, "waiting": engine.jobs.qsize()}


async def models(request: Request):
    state: ServerState = request.app.state.served
    await asyncio.to_thread(state.refresh, True)
    names = state.visible(grant_of(state, request.scope))
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "cartridges"} for n in names]
    data.append({"id": "auto", "object": "model", "created": 0, "owned_by": "cartridges"})
    data.append({"id": state.lm.name, "object": "model", "created": 0, "owned_by": "cartridges"})
    return {"object": "list", "data": data}


async def chat(request: Request):
    state: ServerState = request.app.state.served
    body = await read_json(request, state.config.max_body_bytes)
    grant = grant_of(state, request.scope)
    record = request.scope[AUDIT]
    record.update(model=str(body.get("model"))[:200], user=str(body.get("user"))[:256] if "user" in body else None)
    names, messages, params, stream, include_usage = parse_request(body, state.config)
    record.update(stream=stream, question=[m["content"] for m in messages if m["role"] == "user"][-1])
    if names is not None:  # the names asked for, refused ones too: a key probing for others' shows in the log
        record["asked"] = [shown(n) for n in names]  # every one: the request's size limit bounds them
    names, cartridges, prompt_tokens, used = await asyncio.to_thread(resolve, state, body, names, messages, params,
                                                                     grant)
    record["cartridges"] = names
    job = request.scope[JOB] = submit(state, GenerationRequest(messages, cartridges, params), stream)
    check = functools.partial(withdrawn, state, request.scope, names)
    rid = f"chatcmpl-{next(state.ids)}-{int(time.time())}"
    # which cartridges answered, and the version (SHA-256) of the document each stands for, if sync made it
    sources = {"cartridges": names, "versions": list(versions(cartridges))}
    usage = {"prompt_tokens": prompt_tokens, "cartridge_tokens": used}
    if stream:
        return StreamingResponse(stream_events(job, rid, body["model"], sources, usage, include_usage, state.scrub,
                                               record, check), media_type="text/event-stream")
    out = await answer(job, request)
    stopped = check()  # the key revoked while it ran: the answer is not sent
    if stopped is not None:
        record["error"] = stopped[0]
        raise stopped[1]
    return completion_body(rid, body["model"], out, sources, usage)


def submit(state: ServerState, request: GenerationRequest, stream: bool) -> Job:
    """The request, queued for the engine (from the event loop); 429 when the queue is full."""
    loop = asyncio.get_running_loop()
    job = Job(request, stream, loop, asyncio.Queue() if stream else loop.create_future())
    if not state.engine.submit(job):
        raise BadRequest(429, f"The server is busy ({state.config.max_queue} requests waiting); retry shortly.",
                         headers={"retry-after": "1"})
    return job
