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
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs

from fastapi import FastAPI, Request  # this module is imported only to serve; the core never imports it
from fastapi.responses import JSONResponse, StreamingResponse

from ..cartridge import Cartridge
from ..errors import ConfigError
from ..generation import GenerationParams, GenerationRequest
from ..lm import LM
from ..plugins import Runtime
from .access import Grant
from .admission import ended, grant_of, opened, refusal, unlogged, withdrawn
from .audit import shown
from .documents import SUFFIX
from .engine import Engine, Job
from .guard import BadRequest, Guard
from .answering import last_user_text
from .parse import parse_request, read_json
from .passages import Passage, Plan, TrimError, drafted, fills, sought
from .records import versions
from .replies import answer, completion_body, error_response, stream_events
from .settings import ServeConfig
from .state import AUDIT, JOB, ServerState
from .store import CartridgeStore, NotInStoreError
from .subjects import named, unknown_name


def create_app(store: CartridgeStore, runtime: Runtime, config: ServeConfig | None = None) -> Any:
    """The ASGI app (FastAPI). The engine thread starts with the app and stops with it."""
    state = ServerState.open(store, config or ServeConfig())
    # with a key, the API's own pages (/docs, /redoc, /openapi.json) are behind it too: the guard covers them
    app = FastAPI(title="cartridges-sdk", lifespan=functools.partial(_running, state, runtime))
    app.state.served = state
    app.add_exception_handler(BadRequest, _refused)
    app.add_middleware(Guard, check=functools.partial(refusal, state), opened=functools.partial(opened, state),
                       done=functools.partial(ended, state), unlogged=unlogged)
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


# ---- which cartridges answer


def resolve(state: ServerState, body: dict[str, Any], names: list[str] | None, messages: list[dict[str, str]],
            params: GenerationParams, grant: Grant | None, query: str | None = None,
            first: Resolved | None = None) -> Resolved:
    """The request's cartridge names and cartridges (routed, for model='auto'), the passages after them (with
    'passages'; ranked against `query`, else the last user turn) and token counts, checked against the context.
    Given the `first` resolution (before a draft), its cartridges answer and its passages' scope holds: only the
    passages are found again. Runs off the event loop: it may read files, rebuild the routing or passage index and
    tokenize a long conversation."""
    state.refresh()
    if first is not None:
        names, scope = first.names, first.scope
    else:
        if names == [state.lm.name] and state.lm.name not in state.store:  # the bare model, no cartridge
            names = []
        scope = None if grant is None else state.visible(grant)
        if names is None:
            names, scope = routed(state, body, messages, grant)
    cartridges = cartridges_for(state, names, grant)
    wanted = sought(state.lm, body.get("passages"), body.get("budget"))
    ignored = [f for f in ("retrieval", "passages_from", "draft") if body.get(f) not in (None, 0) and not wanted]
    if ignored:  # an ignored setting would answer something else than asked for
        raise BadRequest(400, f"'{ignored[0]}' says how passages are found, and this request gets none: "
                         f"{state.lm.name}'s budget is all cartridges unless 'passages' (tokens of them) is sent.",
                         ignored[0])
    plan = passages_for(state, body, messages, names, scope, query) if wanted else None
    found, prefix, apart = (plan.passages, plan.prefix_ids, plan.passages_kv) if plan else ((), (), None)
    if plan is not None:  # as the plan read them, which it placed the passages after; 'trim': cut to fit
        cartridges = plan.answering(state.store)
    answering = cartridges + ([apart] if apart is not None else [])  # the passages' KV, read apart, after them
    prompt_tokens, used = check_fits(state.lm, messages, answering, params, prefix)
    read = apart.num_tokens if apart is not None else 0  # passages count as prompt tokens however they are read
    if body.get("draft") and first is None:  # the first answer reads the same cartridges and passages
        check_fits(state.lm, draft_turn(messages), answering, draft_params(body["draft"]), prefix)
    return Resolved(names, answering, found, prefix, prompt_tokens + read, used - read, scope)


@attrs.frozen
class Resolved:
    """What answers a request: cartridges by name (`cartridges` ends with the passages' KV when they are read apart
    behind cartridges), passages as prompt tokens when no cartridge is in front, and the token counts (the passages
    among the prompt's, however they are read)."""

    names: list[str]
    cartridges: list[Cartridge]
    passages: tuple[Passage, ...]
    prefix_ids: tuple[int, ...]
    prompt_tokens: int
    cartridge_tokens: int
    scope: list[str] | None = None  # the documents passages may come from (None: all)


def draft_turn(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """What a first answer answers: the last user turn alone, as `CartridgeStore.ask`'s draft does."""
    return [{"role": "user", "content": last_user_text(messages)}]


def draft_params(tokens: int) -> GenerationParams:
    return GenerationParams.from_kwargs({"max_new_tokens": tokens, "temperature": 0.0})


def routed(state: ServerState, body: dict[str, Any], messages: list[dict[str, str]],
           grant: Grant | None) -> tuple[list[str], list[str] | None]:
    """model='auto': the cartridges the last user turn is routed to (`k`, or `budget` less `passages`), or, for a
    follow-up that routes nowhere ("Why?"), those all the user's turns are; only among the key's own, and, when the
    question names a subject, only among that subject's (`about`). Also returns those it routed among (None: all)."""
    among = None if grant is None else state.visible(grant)
    if among == []:
        raise BadRequest(404, "This key opens no cartridge in the store, so there is nothing to route to.", "model")
    turns = [m["content"] for m in messages if m["role"] == "user"]
    asked = (turns[-1], "\n".join(turns)) if len(turns) > 1 else (turns[-1],)
    subject = about(state, asked, among)
    budget = body["budget"] - (body.get("passages") or 0) if body.get("budget") else None
    auto = fills(state.lm, body.get("passages"), budget)  # the best k that fit, then passages fill the rest
    for question in asked:
        try:
            routes = state.store.within(question, budget, among=subject or among) if budget \
                else state.store.route(question, k=body.get("k", 1), among=subject or among)
            routes = routes[:body.get("k", 1)] if auto else routes
            return [r.name for r in routes], subject or among
        except ConfigError as err:
            refused = err
    if subject:  # the question names them, in words their corpora lack: they answer all the same
        return (subject[:body.get("k", 1)] if not body.get("budget") else subject[:1]), subject
    raise BadRequest(400, str(refused), "model")


def passages_for(state: ServerState, body: dict[str, Any], messages: list[dict[str, str]], names: list[str],
                 scope: list[str] | None,
                 query: str | None = None) -> Plan:
    """The passages best matching the last user turn: as prompt tokens, or, behind cartridges, their KV read apart
    (`passages.read_apart`), of the documents the request may see (`scope`) or only the answering cartridges'
    own; in a store whose cartridges say whom they are about (records), always only their own: a passage of someone
    else's record never reaches the answer. The plan (`passages.plan`) holds them, and the cartridges as it read them
    (with 'trim', cut: `Plan.answering`)."""
    source = body.get("passages_from", "store")
    records = bool(state.store.subjects())
    if records:
        source = "routed"
    if source == "routed" and not names:
        fix = ("in a store of records they come only from the answering cartridges' documents, so name a cartridge "
               "or route (model='auto')") if records else "send 'passages_from': 'store', or a cartridge"
        raise BadRequest(400, "Passages from the answering cartridges' documents need cartridges to answer with; "
                         f"this request has none ({fix}).", "passages_from")
    try:
        plan = state.store.plan(last_user_text(messages), cartridges=names, budget=body.get("budget"),
                                passages=body.get("passages"), retrieval=body.get("retrieval", "bm25"),
                                passages_from=source, among=scope, query=query, trim=body.get("trim") or False)
    except ConfigError as err:
        raise BadRequest(400, str(err), "trim" if isinstance(err, TrimError) else "passages") from None
    return plan


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


def check_fits(lm: LM, messages: list[dict[str, str]], cartridges: list[Cartridge], params: GenerationParams,
               prefix_ids: Sequence[int] = ()) -> tuple[int, int]:
    """The prompt's tokens (passages included) and the cartridges', refused (400) when they and max_tokens overflow
    the context."""
    try:
        prompt_tokens = len(lm.prompt_ids(messages, prefix_ids=prefix_ids, after_cartridge=bool(cartridges)))
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
    got = await asyncio.to_thread(resolve, state, body, names, messages, params, grant)
    record["cartridges"] = got.names
    first = None
    if body.get("draft"):  # a first answer with what the question found, then passages found with its words too
        turn = draft_turn(messages)
        first = (await answer(submit(state, GenerationRequest(turn, got.cartridges, draft_params(body["draft"]),
                                                              prefix_ids=got.prefix_ids), False), request)).text
        record["draft_tokens"] = body["draft"]
        query = drafted(turn[0]["content"], first)
        got = await asyncio.to_thread(resolve, state, body, None, messages, params, grant, query, got)
    names = got.names
    if got.passages:
        record["passages"] = sorted({p.name for p in got.passages})
    job = request.scope[JOB] = submit(state, GenerationRequest(messages, got.cartridges, params,
                                                               prefix_ids=got.prefix_ids), stream)
    check = functools.partial(withdrawn, state, request.scope, names)
    rid = f"chatcmpl-{next(state.ids)}-{int(time.time())}"
    # which cartridges answered, and the version (SHA-256) of the document each stands for, if sync made it; and
    # the passages put after them, by document, best first
    sources = {"cartridges": names, "versions": list(versions(got.cartridges[:len(names)]))}
    if sought(state.lm, body.get("passages"), body.get("budget")):  # a reader's budget fills passages too
        sources["passages"] = [{"source": p.name, "score": round(p.score, 4)} for p in got.passages]
    if first is not None:
        sources["draft"] = first
    usage = {"prompt_tokens": got.prompt_tokens, "cartridge_tokens": got.cartridge_tokens}
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
