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
from cartridges_sdk.serve.answering import Answerer, Chosen, Usage, last_user_text

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
    budget: int | None = Field(default=None, description="route as many as fit this many cartridge tokens")
    runtime: Any = Field(default="hf", description="a runtime name or object")
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
                                  self.runtime_options)
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
        turns, chosen, gen = self._prepare([_turn(m) for m in messages], kwargs)
        text, usage = self._answerer.answer(turns, chosen, **gen)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), raw=_raw(chosen, usage))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        turns, chosen, gen = self._prepare([_turn(m) for m in messages], kwargs)

        def pieces() -> ChatResponseGen:
            text = ""
            for piece, usage in _read(self._answerer.stream(turns, chosen, **gen)):
                text += piece
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=piece,
                                   raw=_raw(chosen, usage) if usage else None)
        return pieces()

    # -- completion: the prompt as one user turn --------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        turns, chosen, gen = self._prepare([{"role": "user", "content": prompt}], kwargs)
        text, usage = self._answerer.answer(turns, chosen, **gen)
        return CompletionResponse(text=text, raw=_raw(chosen, usage))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        turns, chosen, gen = self._prepare([{"role": "user", "content": prompt}], kwargs)

        def pieces() -> CompletionResponseGen:
            text = ""
            for piece, usage in _read(self._answerer.stream(turns, chosen, **gen)):
                text += piece
                yield CompletionResponse(text=text, delta=piece, raw=_raw(chosen, usage) if usage else None)
        return pieces()

    # -- async: the engine runs in a worker thread, so an event loop keeps serving while it decodes -----------
    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await asyncio.to_thread(self.chat, messages, **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self.complete, prompt, formatted, **kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return _in_thread(self.stream_chat(messages, **kwargs))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return _in_thread(self.stream_complete(prompt, formatted, **kwargs))

    def _prepare(self, turns: list[dict[str, str]], kwargs: dict[str, Any]) -> tuple[list, list[Chosen], dict]:
        named = kwargs.pop("cartridges", None)
        gen = {"max_new_tokens": kwargs.pop("max_tokens", self.max_tokens),
               "temperature": kwargs.pop("temperature", self.temperature), "top_p": kwargs.pop("top_p", self.top_p),
               "seed": kwargs.pop("seed", self.seed)}
        if kwargs:
            raise ConfigError(f"Unknown setting(s) {sorted(kwargs)} for CartridgeLLM; it takes cartridges, max_tokens, "
                              "temperature, top_p and seed.")
        question = last_user_text(turns) if self.store is not None and not named else ""
        return turns, self._answerer.choose(question, named), gen


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


async def _in_thread(gen):
    """A sync generator read in a worker thread, one item at a time, as an async generator."""
    end = object()
    while (item := await asyncio.to_thread(next, gen, end)) is not end:
        yield item


def _raw(chosen: Sequence[Chosen], usage: Usage) -> dict[str, Any]:
    return {"cartridges": [c.name for c in chosen], "versions": [c.version for c in chosen],
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cartridge_tokens": usage.cartridge_tokens, "finish_reason": usage.finish_reason}
