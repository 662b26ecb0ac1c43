"""CartridgeLLM and CartridgeQueryEngine against the real llama-index-core, on the embedded default model: each path
gives the SDK's own answer and names the cartridges that gave it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from llama_index.core.llms import ChatMessage

from cartridges_llamaindex import CartridgeLLM, CartridgeQueryEngine
from cartridges_sdk import Cartridge, CartridgeStore
from cartridges_sdk.errors import ConfigError, NotInStoreError
from cartridges_sdk.testing.fixtures import lm  # noqa: F401  (the embedded model, one per module)

HARROW = (Path(__file__).parents[3] / "examples" / "data" / "harrow_point.txt").read_text("utf-8")
CATS = "The cat shelter in Ostend keeps forty cats. Volunteers feed them twice a day and the vet visits on Fridays."
QUESTION = "When was the lighthouse built?"


@pytest.fixture(scope="module")
def store(lm, tmp_path_factory):  # noqa: F811
    s = CartridgeStore(tmp_path_factory.mktemp("store"), lm)
    s.add("harrow", Cartridge.from_prefix(lm, HARROW, 64), corpus=HARROW)
    s.add("cats", Cartridge.from_prefix(lm, CATS, 16), corpus=CATS)
    return s


def test_complete_chat_stream_and_async_give_the_sdks_answer(store):
    expected = store.ask(QUESTION, max_new_tokens=10).text
    llm = CartridgeLLM(store=store, max_tokens=10)
    assert llm.metadata.is_chat_model and llm.metadata.num_output == 10
    done = llm.complete(QUESTION)
    assert done.text == expected and done.raw["cartridges"] == ["harrow"] and done.raw["completion_tokens"] == 10
    streamed = list(llm.stream_complete(QUESTION))
    assert "".join(r.delta for r in streamed) == expected == streamed[-1].text
    assert streamed[-1].raw["cartridges"] == ["harrow"]
    turns = [ChatMessage(role="system", content="Answer briefly."), ChatMessage(role="user", content=QUESTION)]
    assert llm.chat(turns).message.content == store.model.chat(
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}],
        [store.get("harrow")], max_new_tokens=10)
    assert "".join(r.delta for r in llm.stream_chat(turns)) == llm.chat(turns).message.content
    assert asyncio.run(llm.acomplete(QUESTION)).text == expected

    async def pieces():
        return [r.delta async for r in await llm.astream_complete(QUESTION)]

    assert "".join(asyncio.run(pieces())) == expected
    assert llm.complete(QUESTION, cartridges=["cats"]).raw["cartridges"] == ["cats"]


def test_query_engine_answers_with_routed_cartridges_and_shows_them_as_sources(store):
    expected = store.ask(QUESTION, max_new_tokens=10).text
    engine = CartridgeQueryEngine(store, k=2, max_tokens=10)
    response = engine.query(QUESTION)
    assert response.response == expected and response.metadata["cartridges"] == ["harrow"]
    [source] = response.source_nodes
    assert source.node.metadata["cartridge"] == "harrow" and source.score > 0
    assert source.node.text.startswith(HARROW[:40])
    streaming = CartridgeQueryEngine(store, streaming=True, max_tokens=10).query(QUESTION)
    assert "".join(streaming.response_gen) == expected
    assert asyncio.run(engine.aquery(QUESTION)).response == expected

    async def streamed():  # an async query with streaming=True streams asynchronously, as LlamaIndex's own engines do
        response = await CartridgeQueryEngine(store, streaming=True, max_tokens=10).aquery(QUESTION)
        return [piece async for piece in response.async_response_gen()]

    assert "".join(asyncio.run(streamed())) == expected


def test_passages_are_answered_with_and_shown_as_source_nodes(store):
    expected = store.ask(QUESTION, budget=128, passages=48, max_new_tokens=8)
    response = CartridgeQueryEngine(store, budget=128, passages=48, max_tokens=8).query(QUESTION)
    assert response.response == expected.text and response.metadata["cartridges"] == ["harrow"]
    cartridge, *passages = response.source_nodes
    assert cartridge.node.metadata["cartridge"] == "harrow"
    assert [n.node.metadata["source"] for n in passages] == [p.name for p in expected.passages]
    assert passages[0].node.text == expected.passages[0].text and passages[0].score > 0
    llm = CartridgeLLM(store=store, budget=128, passages=48, max_tokens=8)
    completion = llm.complete(QUESTION)
    assert completion.text == expected.text and completion.raw["passages"][0]["source"] == "harrow"
    drafted = store.ask(QUESTION, budget=128, passages=48, draft=6, max_new_tokens=8)
    response = CartridgeQueryEngine(store, budget=128, passages=48, draft=6, max_tokens=8).query(QUESTION)
    assert response.response == drafted.text and response.metadata["draft"] == drafted.draft
    assert [n.node.metadata["source"] for n in response.source_nodes[1:]] == [p.name for p in drafted.passages]
    assert CartridgeLLM(store=store, budget=128, passages=48, draft=6, max_tokens=8).complete(QUESTION).text == \
        drafted.text
    with pytest.raises(ValueError, match="draft=6 asks for passages, which are retrieved from a store"):
        CartridgeLLM(cartridge=store.get("harrow"), draft=6)
    with pytest.raises(ValueError, match="draft=-1 must be a number of tokens"):
        CartridgeQueryEngine(store, budget=128, passages=48, draft=-1)
    # trim: the 64-token cartridge cut to the 48 that 48 tokens of passages leave of 96, as the SDK cuts it
    cut = store.ask(QUESTION, budget=96, passages=48, trim=True, max_new_tokens=8)
    response = CartridgeQueryEngine(store, budget=96, passages=48, trim=True, max_tokens=8).query(QUESTION)
    by_attention = store.ask(QUESTION, budget=96, passages=48, trim="attention", max_new_tokens=8)
    assert str(CartridgeQueryEngine(store, budget=96, passages=48, trim="attention", max_tokens=8)
               .query(QUESTION)) == by_attention.text
    assert CartridgeLLM(store=store, budget=96, passages=48, trim="attention", max_tokens=8).complete(
        QUESTION).text == by_attention.text
    assert response.response == cut.text and response.source_nodes[0].node.metadata["tokens"] == 48
    llm = CartridgeLLM(store=store, budget=96, passages=48, trim=True, max_tokens=8)
    assert llm.complete(QUESTION).text == cut.text and cut.sizes == (48,)
    assert [c.cartridge.num_tokens for c in llm._answerer.choose(QUESTION)] == [48]
    with pytest.raises(ValueError, match="trim=True asks for passages, which are retrieved from a store"):
        CartridgeLLM(cartridge=store.get("harrow"), trim=True)
    with pytest.raises(ValueError, match="passages=8 asks for passages, which are retrieved from a store"):
        CartridgeLLM(cartridge=store.get("harrow"), passages=8)
    with pytest.raises(ValueError, match="retrieval='dense' asks for passages.*or drop retrieval"):
        CartridgeLLM(cartridge=store.get("harrow"), retrieval="dense")
    with pytest.raises(ValueError, match="passages_from='routed' says how passages are found.*no budget"):
        CartridgeQueryEngine(store, passages_from="routed")


def test_errors_name_the_problem(store):
    llm = CartridgeLLM(store=store, max_tokens=4)
    with pytest.raises(ConfigError, match="shares no word"):
        llm.complete("zzqx wvvy")
    with pytest.raises(NotInStoreError, match="No cartridge 'nope'"):
        llm.complete(QUESTION, cartridges=["nope"])
    with pytest.raises(ConfigError, match="'tool' message"):
        llm.chat([ChatMessage(role="tool", content="42")])
    with pytest.raises(ValueError, match="exactly one of cartridge"):
        CartridgeLLM()
    with pytest.raises(ConfigError, match="Unknown generation setting"):
        CartridgeQueryEngine(store, frequency_penalty=1.0)
