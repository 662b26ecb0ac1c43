"""ChatCartridges and CartridgeRetriever against the real langchain-core (and ChatOpenAI against a real `cartridges
serve`), on the embedded default model: each path gives the SDK's own answer, says which cartridges gave it, and
raises LangChain's errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from langchain_core.exceptions import ModelInvalidRequestError, ModelNotFoundError
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableLambda, RunnableParallel, RunnablePassthrough

from cartridges_langchain import CartridgeRetriever, ChatCartridges, langchain_class
from cartridges_langchain.errors import as_langchain
from cartridges_sdk import Cartridge, CartridgeStore
from cartridges_sdk.errors import (ConfigError, IncompatibleCartridgeError, NotInStoreError, RateLimitedError,
                                   TransientBackendError)
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


def test_invoke_stream_and_async_give_the_sdks_answer_and_name_the_cartridges(store):
    expected = store.ask(QUESTION, max_new_tokens=12)
    assert expected.cartridges == ("harrow",)
    llm = ChatCartridges(store=store, max_tokens=12)
    answer = llm.invoke(QUESTION)
    assert answer.content == expected.text
    assert answer.response_metadata["cartridges"] == ["harrow"]
    assert answer.response_metadata["cartridge_tokens"] == 64
    assert answer.usage_metadata["output_tokens"] == 12 and answer.usage_metadata["input_tokens"] > 5
    chunks = list(llm.stream(QUESTION))
    assert len(chunks) > 3 and "".join(c.content for c in chunks) == expected.text
    assert chunks[-1].response_metadata["cartridges"] == ["harrow"]
    assert asyncio.run(llm.ainvoke(QUESTION)).content == expected.text

    async def pieces():
        return [c.content async for c in llm.astream(QUESTION)]

    assert "".join(asyncio.run(pieces())) == expected.text
    # a conversation routes by its last user turn; system and assistant turns go to the model as they are
    turns = [SystemMessage("Answer briefly."), HumanMessage("Tell me about cats."), AIMessage("They are fed."),
             HumanMessage(QUESTION)]
    assert llm.invoke(turns).response_metadata["cartridges"] == ["harrow"]


def test_concurrent_calls_share_the_engine_and_keep_their_answers(store):
    # batch runs calls on a thread pool, async forms in worker threads: each answer is still its own
    llm = ChatCartridges(store=store, max_tokens=8)
    questions = [QUESTION, "Who built the lighthouse?", "How many cats does the shelter keep?", "How tall is it?"]
    alone = [llm.invoke(q).content for q in questions]
    assert [m.content for m in llm.batch(questions)] == alone

    async def together():
        async def streamed(q):
            return "".join([c.content async for c in llm.astream(q)])
        return await asyncio.gather(*(streamed(q) if i % 2 else llm.ainvoke(q) for i, q in enumerate(questions)))

    got = asyncio.run(together())
    assert [g if isinstance(g, str) else g.content for g in got] == alone


def test_the_retriever_names_the_cartridges_and_a_chain_answers_with_them(store):
    docs = CartridgeRetriever(store=store, k=2).invoke("How many cats does the shelter keep?")
    assert [d.metadata["cartridge"] for d in docs] == ["cats"]  # the lighthouse shares no word with it
    assert docs[0].page_content.startswith("The cat shelter") and docs[0].metadata["score"] > 0
    llm = ChatCartridges(store=store, max_tokens=8)
    # a RAG chain's shape, with the retriever and the model swapped: the sources come back beside the answer
    chain = RunnableParallel(docs=CartridgeRetriever(store=store), question=RunnablePassthrough()) | RunnableLambda(
        lambda x: {"answer": llm.invoke(x["question"], cartridges=x["docs"]), "sources": x["docs"]})
    out = chain.invoke(QUESTION)
    assert [d.metadata["cartridge"] for d in out["sources"]] == ["harrow"]
    assert out["answer"].content == store.ask(QUESTION, cartridges=["harrow"], max_new_tokens=8).text
    # named cartridges win over routing; one cartridge needs no store
    assert llm.invoke(QUESTION, cartridges=["cats"]).response_metadata["cartridges"] == ["cats"]
    one = ChatCartridges(cartridge=store.get("harrow"), max_tokens=8)
    assert one.invoke(QUESTION).content == out["answer"].content


def test_passages_after_the_cartridge_give_the_sdks_answer_and_are_named(store, monkeypatch):
    expected = store.ask(QUESTION, budget=128, passages=48, max_new_tokens=8)
    assert expected.cartridges == ("harrow",) and expected.passages[0].name == "harrow"
    llm = ChatCartridges(store=store, budget=128, passages=48, max_tokens=8)
    answer = llm.invoke(QUESTION)
    assert answer.content == expected.text
    meta = answer.response_metadata
    assert meta["cartridges"] == ["harrow"] and [p["source"] for p in meta["passages"]] == \
        [p.name for p in expected.passages]
    # the passages count as prompt tokens (read apart behind the cartridge): 128 - 64 of them, on top of the question's
    plain = ChatCartridges(store=store, budget=128, max_tokens=8).invoke(QUESTION)
    assert answer.usage_metadata["input_tokens"] == plain.usage_metadata["input_tokens"] + 128 - 64
    assert "".join(c.content for c in llm.stream(QUESTION)) == expected.text
    with pytest.raises(ValueError, match="leaves nothing of budget=48"):
        ChatCartridges(store=store, budget=48, passages=48)
    # a first answer picks the passages: the SDK's answer, and the draft said beside the passages it picked
    drafted = store.ask(QUESTION, budget=128, passages=48, draft=6, draft_from=store, max_new_tokens=8)
    got = ChatCartridges(store=store, budget=128, passages=48, draft=6, draft_from=store, max_tokens=8).invoke(QUESTION)
    assert got.content == drafted.text and got.response_metadata["draft"] == drafted.draft
    assert [p["source"] for p in got.response_metadata["passages"]] == [p.name for p in drafted.passages]
    with pytest.raises(ValueError, match="draft=6 ranks passages against a first answer, and this answer gets none"):
        ChatCartridges(store=store, budget=128, draft=6)
    with pytest.raises(ValueError, match="draft_from says whose cartridges.*draft=0"):
        ChatCartridges(store=store, budget=128, passages=48, draft_from=store)
    # trim: the 64-token cartridge cut to the 48 that 48 tokens of passages leave of 96, as the SDK cuts it
    cut = store.ask(QUESTION, budget=96, passages=48, trim=True, max_new_tokens=8)
    trimmed = ChatCartridges(store=store, budget=96, passages=48, trim=True, max_tokens=8)
    assert trimmed.invoke(QUESTION).content == cut.text
    assert [c.cartridge.num_tokens for c in trimmed._answerer.choose(QUESTION)] == [48]
    by_attention = store.ask(QUESTION, budget=96, passages=48, trim="attention", max_new_tokens=8)
    assert ChatCartridges(store=store, budget=96, passages=48, trim="attention",
                          max_tokens=8).invoke(QUESTION).content == by_attention.text
    with pytest.raises(ValueError, match="trim=True cuts the cartridges to what passages leave of the budget"):
        ChatCartridges(store=store, budget=96, trim=True)
    # how passages are found, where none are sought, is refused rather than ignored
    with pytest.raises(ValueError, match="retrieval='dense' says how passages are found.*budget is all cartridges"):
        ChatCartridges(store=store, budget=128, retrieval="dense")
    from cartridges_sdk.making import settings

    n = store.model.num_parameters
    monkeypatch.setattr(settings, "READER_PARAMETERS", (n, n + 1))  # counted a reader, as the 0.5B is
    # a reader's budget beside named cartridges fills with passages found for the question (not for an empty one)
    want = store.plan(QUESTION, cartridges=["cats"], budget=128)
    got = ChatCartridges(store=store, budget=128, retrieval="bm25", max_tokens=8).invoke(QUESTION, cartridges=["cats"])
    assert want.passages and [(p["source"], p["score"]) for p in got.response_metadata["passages"]] == \
        [(p.name, round(p.score, 4)) for p in want.passages]


def test_errors_are_langchains_and_the_sdks(store):
    llm = ChatCartridges(store=store, max_tokens=4)
    with pytest.raises(ModelInvalidRequestError, match="shares no word") as refused:
        llm.invoke("zzqx wvvy")
    assert isinstance(refused.value, ConfigError)
    with pytest.raises(ModelNotFoundError, match="No cartridge 'nope'") as missing:
        llm.invoke(QUESTION, cartridges=["nope"])
    assert isinstance(missing.value, NotInStoreError)
    with pytest.raises(ModelInvalidRequestError, match="ToolMessage"):
        llm.invoke([HumanMessage(QUESTION), ToolMessage("42", tool_call_id="t1")])
    with pytest.raises(ModelInvalidRequestError, match="Unknown setting"):
        llm.invoke(QUESTION, frequency_penalty=1.0)
    # every SDK error is LangChain's class and its own exact class, attributes kept
    busy = as_langchain(RateLimitedError("busy", retry_after=2.5))
    assert isinstance(busy, RateLimitedError) and isinstance(busy, TransientBackendError) and busy.retry_after == 2.5
    assert busy.is_retryable and str(busy) == "busy"
    assert issubclass(langchain_class(IncompatibleCartridgeError), (IncompatibleCartridgeError, ModelInvalidRequestError))
    # a bad setting is refused where the model is made, as pydantic's ValidationError (a ValueError) says
    with pytest.raises(ValueError, match="exactly one of cartridge"):
        ChatCartridges()
    with pytest.raises(ValueError, match="k=0 must be >= 1"):
        CartridgeRetriever(store=store, k=0)


def test_chat_openai_against_cartridges_serve(store):
    from langchain_openai import ChatOpenAI

    from cartridges_sdk.serve.background import serving
    from cartridges_sdk.serve.server import create_app
    from cartridges_sdk.serve.settings import ServeConfig

    expected = store.ask(QUESTION, max_new_tokens=10).text
    with serving(create_app(store, store.model.get_runtime("hf"), ServeConfig())) as url:
        chat = ChatOpenAI(base_url=url, api_key="none", model="harrow", max_tokens=10, temperature=0, max_retries=0)
        assert chat.invoke(QUESTION).content == expected
        assert "".join(c.content for c in chat.stream(QUESTION)) == expected
        routed = ChatOpenAI(base_url=url, api_key="none", model="auto", max_tokens=10, temperature=0, max_retries=0)
        assert asyncio.run(routed.ainvoke(QUESTION)).content == expected
        with pytest.raises(ModelNotFoundError):
            ChatOpenAI(base_url=url, api_key="none", model="nope", max_retries=0).invoke(QUESTION)
