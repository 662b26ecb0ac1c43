"""`CartridgeLLM`: a LlamaIndex LLM that answers with a cartridge, or with the cartridges a store routes each
question to, wherever LlamaIndex takes an LLM (chat engines, agents' plain answers, `Settings.llm`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseAsyncGen, ChatResponseGen,
                                              CompletionResponse, CompletionResponseAsyncGen, CompletionResponseGen,
                                              LLMMetadata, MessageRole)
from llama_index.core.llms import CustomLLM
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from cartridges_sdk.errors import ConfigError
from cartridges_sdk.serve import Answerer, Selection, Usage

ROLES = {MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant", MessageRole.SYSTEM: "system"}


class CartridgeLLM(CustomLLM):
    """Answers with `cartridge`, or with `store`'s cartridges: those named in `cartridges`, else the best `k` for the
    prompt (or the last user message), or as many as fit `budget` cartridge tokens. Each response's ``raw`` says
    which cartridges gave it and its token counts. Errors are the SDK's (`ConfigError` is a ValueError,
    `NotInStoreError` a KeyError), as LlamaIndex's own LLMs raise their provider's."""

    cartridge: Any = Field(default=None, description="one Cartridge, bound to its model")
    store: Any = Field(default=None, description="a CartridgeStore whose cartridges are routed per question")
    cartridges: list[str] | None = Field(default=None, description="store names to always answer with")
    k: int = Field(default=1, description="routed cartridges per question")
    budget: int | None = Field(default=None, description="route as many as fit this many context tokens (cartridges, "
                               "plus passages if any)")
    passages: int | None = Field(default=None, description="prompt tokens of the store's best passages after the "
                                 "cartridges (None: with a budget, a reader's fill what the cartridges leave)")
    retrieval: str | None = Field(default=None, description="how passages are ranked: bm25 (None), dense or fused")
    passages_from: str | None = Field(default=None, description="passages of the whole store (None), or 'routed': "
                                      "only of the answering cartridges' documents")
    draft: int = Field(default=0, description="tokens of a first answer the passages are ranked against with the "
                       "question (0: none), as CartridgeStore.ask's draft")
    draft_from: Any = Field(default=None, description="a CartridgeStore of the same documents whose cartridges write "
                            "the first answer (None: the answering cartridges)")
    trim: bool | str = Field(default=False, description="cut cartridges larger than what the passages leave of the "
                             "budget to their first tokens (True), or to those the question reads most ('attention'), "
                             "as CartridgeStore.ask's trim")
    runtime: Any = Field(default="auto", description="a runtime name (\"auto\": the fastest installed) or object")
    runtime_options: dict[str, Any] | None = None
    max_tokens: int = Field(default=256, description="new tokens per answer")
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    model_config = ConfigDict(arbitrary_types_allowed=True)
    _answerer: Answerer = PrivateAttr()

    @model_validator(mode="after")
    def _build(self) -> CartridgeLLM:
        self._answerer = Answerer(self.cartridge, self.store, self.k, self.budget, self.cartridges, self.runtime,
                                  self.runtime_options, self.passages, self.retrieval, self.passages_from,
                                  self.draft, self.draft_from, self.trim)
        return self

    @classmethod
    def class_name(cls) -> str:
        return "CartridgeLLM"

    @property
    def metadata(self) -> LLMMetadata:
        lm = self._answerer.model
        return LLMMetadata(context_window=lm.max_context or 2048, num_output=self.max_tokens, is_chat_model=True,
                           model_name=lm.name)

    # -- chat ------------------------------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream([_turn(m) for m in messages], kwargs, _chat_piece)

    # -- completion: the prompt as one user turn --------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream([{"role": "user", "content": prompt}], kwargs, _completion_piece)

    # -- async: routing and the engine run in worker threads, so an event loop keeps serving while it decodes --
    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await asyncio.to_thread(self._chat, messages, kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._complete, prompt, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        turns = [_turn(m) for m in messages]
        return in_thread(await asyncio.to_thread(self._stream, turns, kwargs, _chat_piece))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        turns = [{"role": "user", "content": prompt}]
        return in_thread(await asyncio.to_thread(self._stream, turns, kwargs, _completion_piece))

    # -- the work, without LlamaIndex's callback events (the public methods above send them once) -------------
    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        turns, chosen, gen = self._prepare([_turn(m) for m in messages], kwargs)
        text, usage = self._answerer.answer(turns, chosen, **gen)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), raw=_raw(chosen, usage))

    def _complete(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponse:
        turns, chosen, gen = self._prepare([{"role": "user", "content": prompt}], kwargs)
        text, usage = self._answerer.answer(turns, chosen, **gen)
        return CompletionResponse(text=text, raw=_raw(chosen, usage))

    def _stream(self, turns: list[dict[str, str]], kwargs: dict[str, Any], make: Any) -> Any:
        """Route and check now (errors surface at the call); generate as the caller reads."""
        turns, chosen, gen = self._prepare(turns, kwargs)

        def pieces():
            text = ""
            for piece, usage in _read(self._answerer.stream(turns, chosen, **gen)):
                text += piece
                yield make(text, piece, _raw(chosen, usage) if usage else None)
        return pieces()

    def _prepare(self, turns: list[dict[str, str]], kwargs: dict[str, Any]) -> tuple[list, Selection, dict]:
        named = kwargs.pop("cartridges", None)
        defaults = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                    "seed": self.seed}
        return (turns, *self._answerer.plan(turns, named, kwargs, defaults))


def _turn(message: ChatMessage) -> dict[str, str]:
    role = ROLES.get(message.role)
    if role is None:
        raise ConfigError(f"A {message.role.value!r} message cannot be sent to a cartridge; send system, user and "
                          "assistant messages (tool calls are not supported).")
    return {"role": role, "content": message.content or ""}


def _read(pieces):
    """(piece, None) for each piece of a stream, then ("", usage) once it ends."""
    while True:
        try:
            yield next(pieces), None
        except StopIteration as done:
            yield "", done.value
            return


def _chat_piece(text: str, delta: str, raw: dict | None) -> ChatResponse:
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta, raw=raw)


def _completion_piece(text: str, delta: str, raw: dict | None) -> CompletionResponse:
    return CompletionResponse(text=text, delta=delta, raw=raw)


async def in_thread(gen):
    """A sync generator read in a worker thread, one item at a time, as an async generator."""
    end = object()
    while (item := await asyncio.to_thread(next, gen, end)) is not end:
        yield item


def _raw(chosen: Selection, usage: Usage) -> dict[str, Any]:
    return {**chosen.sources(), "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cartridge_tokens": usage.cartridge_tokens, "finish_reason": usage.finish_reason}
