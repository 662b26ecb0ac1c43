"""The server's pieces called alone, with no engine and no socket: the Host and key check, resolving a request's
cartridges, and the error bodies and event streams it sends back (tests/test_server.py runs them all together)."""

from __future__ import annotations

import asyncio
import json

import attrs
import pytest

from cartridges_sdk import Cartridge, CartridgeStore, ConfigError
from cartridges_sdk.generation import Completion, GenerationParams
from cartridges_sdk.serve.access import Grant
from cartridges_sdk.serve.engine import Job
from cartridges_sdk.serve.guard import BadRequest
from cartridges_sdk.serve.replies import error_response, scrubber, stream_events
from cartridges_sdk.serve.admission import admit
from cartridges_sdk.serve.server import check_fits, resolve
from cartridges_sdk.serve.state import AUDIT, ServerState
from cartridges_sdk.serve.settings import ServeConfig

KEY = "sk-parts"
TEXTS = {"tides": "The harbour tides rise twice a day at the old pier.",
         "bees": "Bees in the orchard make clover honey every June."}
QUESTION = [{"role": "user", "content": "When do the harbour tides rise?"}]


@pytest.fixture
def state(tmp_path, tiny_llama):
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    for name, text in TEXTS.items():
        store.add(name, Cartridge.from_prefix(tiny_llama, text, 6), corpus=text)
    return ServerState(store, ServeConfig(api_key=KEY))


def scope(path: str = "/v1/models", host: str = "127.0.0.1:8000", key: str | None = KEY, **headers: str) -> dict:
    sent = {"host": host, **headers, **({"authorization": f"Bearer {key}"} if key is not None else {})}
    return {"type": "http", "method": "GET", "path": path, AUDIT: {"key": None},
            "headers": [(name.encode(), value.encode()) for name, value in sent.items()]}


def refused(call, *args) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        call(*args)
    return caught.value


def test_admit_checks_the_host_first_then_the_key(state):
    admit(state, scope())
    assert refused(admit, state, scope(key="sk-wrong")).status == 401
    assert refused(admit, state, scope(key=None)).status == 401
    # a page rebinding its name to 127.0.0.1 is refused for the name, whatever key it sends
    assert refused(admit, state, scope(host="rebound.example", key="sk-wrong")).status == 403
    assert refused(admit, state, scope(origin="https://elsewhere.example")).param == "origin"
    admit(state, scope(path="/health", key=None))  # no key needed to ask whether the server is up


def test_resolve_names_routes_and_refuses_a_barred_name_as_a_missing_one(state):
    params = GenerationParams(max_new_tokens=4)
    got = resolve(state, {}, ["bees"], QUESTION, params, None)
    assert got.names == ["bees"] and got.cartridge_tokens == got.cartridges[0].num_tokens == 6
    assert got.prompt_tokens > 0 and got.passages == () and got.prefix_ids == ()
    assert resolve(state, {"k": 1}, None, QUESTION, params, None).names == ["tides"]  # model="auto"
    bare = resolve(state, {}, [state.lm.name], QUESTION, params, None)  # the bare model
    assert bare.names == [] and bare.cartridges == []
    missing = refused(resolve, state, {}, ["nope"], QUESTION, params, None)
    assert missing.status == 404 and "No cartridge 'nope' in the store;" in missing.message
    grant = Grant("clinic", allow=("bees",))
    barred = refused(resolve, state, {}, ["tides"], QUESTION, params, grant)
    absent = refused(resolve, state, {}, ["tidez"], QUESTION, params, grant)
    assert barred.status == absent.status == 404 and "it holds: bees " in barred.message  # the key's own only
    assert barred.message.replace("'tides'", "'tidez'") == absent.message  # it learns nothing of others' names
    nowhere = refused(resolve, state, {}, None, QUESTION, params, Grant("nobody", allow=("none-*",)))
    assert nowhere.status == 404 and "opens no cartridge" in nowhere.message


def test_passages_fill_the_budget_after_the_routed_cartridge_and_stay_within_what_the_key_opens(state):
    params = GenerationParams(max_new_tokens=4)
    got = resolve(state, {"budget": 30, "passages": 10}, None, QUESTION, params, None)
    # behind the cartridge the passages are KV read apart (`passages.read_apart`), answered after it
    assert got.names == ["tides"] and got.prefix_ids == () and got.passages[0].name == "tides"
    assert [c.num_tokens for c in got.cartridges] == [6, 30 - 6] and got.cartridge_tokens == 6
    bare = resolve(state, {"budget": 30, "passages": 10}, None, QUESTION, params, None)
    # the passages count as prompt tokens, as they would before the question in the prompt
    assert got.prompt_tokens == bare.prompt_tokens == len(state.lm.prompt_ids(QUESTION, after_cartridge=True)) + 24
    # the whole store's passages by default; a key's passages come only from the cartridges it opens
    wide = resolve(state, {"passages": 400}, ["bees"], QUESTION, params, None)
    assert {p.name for p in wide.passages} == {"tides"}  # the only passage sharing a word with the question
    barred = resolve(state, {"passages": 400}, ["bees"], QUESTION, params, Grant("clinic", allow=("bees",)))
    assert barred.passages == () and barred.prefix_ids == ()
    own = resolve(state, {"passages": 400, "passages_from": "routed"}, ["bees"], QUESTION, params, None)
    assert own.passages == ()
    # passages alone, with the bare model: RAG over the store
    rag = resolve(state, {"passages": 12}, [state.lm.name], QUESTION, params, None)
    assert rag.cartridges == [] and len(rag.prefix_ids) == 12
    assert refused(resolve, state, {"passages": 12, "passages_from": "routed"}, [state.lm.name], QUESTION, params,
                   None).param == "passages_from"


def test_after_a_first_answer_the_same_cartridges_answer_with_passages_found_with_its_words(state):
    params = GenerationParams(max_new_tokens=4)
    body = {"budget": 30, "passages": 10, "draft": 4}
    got = resolve(state, body, None, QUESTION, params, Grant("clinic", allow=("tides", "bees")))
    assert got.names == ["tides"] and [p.name for p in got.passages] == ["tides"] and got.scope == ["bees", "tides"]
    # the first answer's words find the bees' passage; routing is not done again, and the key's scope holds
    again = resolve(state, body, None, QUESTION, params, None, "clover honey in June", got)
    assert again.names == ["tides"] and [p.name for p in again.passages][0] == "bees" and again.scope == got.scope
    barred = resolve(state, body, None, QUESTION, params, None, "clover honey in June",
                     attrs.evolve(got, scope=["tides"]))
    assert barred.passages == ()  # the bees' passage is outside the first resolution's scope, and no other matches
    # the first answer must fit the context too: a draft is refused where max_tokens would be
    long = [{"role": "user", "content": "When do the harbour tides rise? " * (state.lm.max_context // 10)}]
    assert refused(resolve, state, {"passages": 10, "draft": 4}, ["tides"], long, GenerationParams(max_new_tokens=1),
                   None).param == "messages"


def test_a_readers_budget_is_filled_with_passages_when_the_request_names_none(state, monkeypatch):
    from cartridges_sdk.making import settings

    params = GenerationParams(max_new_tokens=4)
    plain = resolve(state, {"budget": 30}, None, QUESTION, params, None)
    assert plain.names == ["tides"] and plain.passages == () and [c.num_tokens for c in plain.cartridges] == [6]
    # how passages are found makes no sense where none are: refused, not ignored
    ignored = refused(resolve, state, {"budget": 30, "passages_from": "routed"}, None, QUESTION, params, None)
    assert ignored.status == 400 and ignored.param == "passages_from" and "'passages'" in ignored.message
    n = state.lm.num_parameters
    monkeypatch.setattr(settings, "READER_PARAMETERS", (n, n + 1))  # counted a reader, as the 0.5B is
    got = resolve(state, {"budget": 30}, None, QUESTION, params, None)
    assert got.names == ["tides"] and got.passages[0].name == "tides"
    assert [c.num_tokens for c in got.cartridges] == [6, 30 - 6] and got.cartridge_tokens == 6
    # ... and there they say how: only the routed cartridge's document ("bees" shares no word with the question)
    own = resolve(state, {"budget": 30, "retrieval": "bm25", "passages_from": "routed"}, ["bees"], QUESTION,
                  params, None)
    assert own.names == ["bees"] and own.passages == ()
    assert resolve(state, {"budget": 30}, ["bees"], QUESTION, params, None).passages[0].name == "tides"
    off = resolve(state, {"budget": 30, "passages": 0}, None, QUESTION, params, None)
    assert off.passages == () and [c.num_tokens for c in off.cartridges] == [6]


def test_check_fits_refuses_a_conversation_the_context_cannot_hold(state):
    lm = state.lm
    assert lm.max_context is not None
    cartridges = [state.store.get("tides")]
    prompt_tokens, used = check_fits(lm, QUESTION, cartridges, GenerationParams(max_new_tokens=4))
    assert used == 6 and prompt_tokens > 0
    too_long = GenerationParams(max_new_tokens=lm.max_context - used - prompt_tokens + 1)
    refusal = refused(check_fits, lm, QUESTION, cartridges, too_long)
    assert refusal.status == 400 and refusal.param == "messages" and "do not fit" in refusal.message


def test_errors_take_openais_shape_and_never_name_the_stores_path(tmp_path):
    root = tmp_path / "store"
    response = error_response(BadRequest(404, f"{root.resolve()}/x.safetensors is gone", "model"), scrubber(root))
    assert response.status_code == 404
    assert json.loads(response.body) == {"error": {"message": "store/x.safetensors is gone", "type": "not_found_error",
                                                   "param": "model", "code": 404}}
    busy = error_response(BadRequest(429, "Slow down.", headers={"retry-after": "3"}), str)
    assert json.loads(busy.body)["error"]["type"] == "rate_limit_error" and busy.headers["retry-after"] == "3"
    assert json.loads(error_response(BadRequest(503, "Down."), str).body)["error"]["type"] == "server_error"


def events(pieces: list) -> tuple[list[str], dict, Job]:
    """What `stream_events` sends for a job whose engine put `pieces` on its queue."""
    async def run():
        job = Job(None, True, asyncio.get_running_loop(), asyncio.Queue())
        for piece in pieces:
            job.out.put_nowait(piece)
        record: dict = {}
        sent = [e async for e in stream_events(job, "chatcmpl-1", "tides", {"cartridges": ["tides"], "versions": [None]},
                                               {"prompt_tokens": 5, "cartridge_tokens": 6}, True, str, record)]
        return sent, record, job

    return asyncio.run(run())


def test_a_stream_sends_its_pieces_the_finish_then_usage_and_ends_with_done():
    sent, record, job = events(["Hel", "lo", Completion("Hello", (1, 2), "stop")])
    assert sent[-1] == "data: [DONE]\n\n" and job.cancelled.is_set() and not record
    chunks = [json.loads(e.removeprefix("data: ")) for e in sent[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [{"role": "assistant", "content": ""}, {"content": "Hel"},
                                                              {"content": "lo"}]
    assert chunks[3]["choices"][0]["finish_reason"] == "stop"
    assert chunks[4]["choices"] == [] and chunks[4]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2,
                                                                 "total_tokens": 7, "cartridge_tokens": 6}
    assert all(c["cartridges"] == ["tides"] and c["id"] == "chatcmpl-1" for c in chunks)
    # a refusal mid-stream (the response already began with 200): an error event, then the end marker
    sent, record, _ = events(["Hel", ConfigError("stop=5 must be a string.")])
    assert json.loads(sent[-2].removeprefix("data: "))["error"] == {"message": "stop=5 must be a string.",
                                                                   "type": "invalid_request_error"}
    assert sent[-1] == "data: [DONE]\n\n" and record == {"error": "invalid_request_error"}
