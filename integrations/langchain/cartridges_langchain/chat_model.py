"""`ChatCartridges`: a LangChain chat model that answers with a cartridge, or with the cartridges a store routes each
question to, in place of a chat model fed retrieved text."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, PrivateAttr, model_validator

from cartridges_sdk.serve import Answerer, Selection, Usage
from cartridges_sdk.runtime_choice import runtime_name

from .errors import invalid_request, langchain_errors

ROLES = {"human": "user", "ai": "assistant", "system": "system"}


class ChatCartridges(BaseChatModel):
    """Answers with `cartridge`, or with `store`'s cartridges: those named in `cartridges`, else the best `k` for the
    last user message (or as many as fit `budget` tokens); with `passages` tokens, the store's best passages after
    them (`budget` then counts both; `retrieval` bm25 (None), dense or fused; `passages_from` "store" (None) or
    "routed", refused where no passages are sought; `passages` left at None, a reader's answer with a `budget`
    fills what its cartridges leave, as `CartridgeStore.plan` says; `draft` N ranks them against the question and a
    first answer of at most N tokens, written by `draft_from`'s cartridges when given, as `CartridgeStore.ask`
    does; `trim` cuts cartridges larger than what the passages leave of the budget, ``"attention"`` to the tokens the
    question reads most). A call may name its own with
    ``invoke(..., cartridges=[...])``: store names, or the documents `CartridgeRetriever` returned. Each answer's
    ``response_metadata["cartridges"]`` says which cartridges gave it (and ``["passages"]`` which passages,
    ``["draft"]`` the first answer that picked them)."""

    cartridge: Any = None
    store: Any = None
    cartridges: list[str] | None = None
    k: int = 1
    budget: int | None = None
    passages: int | None = None
    retrieval: str | None = None
    passages_from: str | None = None
    draft: int = 0
    draft_from: Any = None
    trim: bool | str = False
    runtime: Any = "auto"
    runtime_options: dict[str, Any] | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    model_config = ConfigDict(arbitrary_types_allowed=True)
    _answerer: Answerer = PrivateAttr()

    @model_validator(mode="after")
    def _build(self) -> ChatCartridges:
        with langchain_errors():
            self._answerer = Answerer(self.cartridge, self.store, self.k, self.budget, self.cartridges, self.runtime,
                                      self.runtime_options, self.passages, self.retrieval, self.passages_from,
                                      self.draft, self.draft_from, self.trim)
        return self

    @property
    def _llm_type(self) -> str:
        return "cartridges"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        # what LangChain's answer cache keys on: everything that changes an answer
        source = {"cartridge": self.cartridge.fingerprint} if self.cartridge is not None else {
            "store": str(self.store.root), "cartridges": self.cartridges, "k": self.k, "budget": self.budget,
            "passages": self.passages, "retrieval": self.retrieval, "passages_from": self.passages_from,
            "draft": self.draft, "draft_from": None if self.draft_from is None else str(self.draft_from.root),
            "trim": self.trim}
        return {"model": self._answerer.model.name, **source,
                # "auto" as the runtime it stands for here: llama.cpp's answers are not HF's
                "runtime": runtime_name(self.runtime, self._answerer.model) if isinstance(self.runtime, str)
                else type(self.runtime).__name__,
                "runtime_options": self.runtime_options, "max_tokens": self.max_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        with langchain_errors():
            turns, chosen, gen = self._prepare(messages, stop, kwargs)
            text, usage = self._answerer.answer(turns, chosen, **gen)
        message = AIMessage(content=text, response_metadata=_metadata(chosen, usage),
                            usage_metadata=_usage_metadata(usage))
        return ChatResult(generations=[ChatGeneration(message=message,
                                                      generation_info={"finish_reason": usage.finish_reason})],
                          llm_output={"model_name": self._answerer.model.name})

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        with langchain_errors():
            turns, chosen, gen = self._prepare(messages, stop, kwargs)
            pieces = self._answerer.stream(turns, chosen, **gen)
            while True:
                try:
                    piece = next(pieces)
                except StopIteration as done:
                    usage: Usage = done.value
                    break
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
                if run_manager:
                    run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
        yield ChatGenerationChunk(
            message=AIMessageChunk(content="", response_metadata=_metadata(chosen, usage),
                                   usage_metadata=_usage_metadata(usage), chunk_position="last"),
            generation_info={"finish_reason": usage.finish_reason})

    def _prepare(self, messages: Sequence[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any]) -> tuple[list[dict[str, str]], Selection, dict[str, Any]]:
        turns = [_turn(m) for m in messages]
        named = _names(kwargs.pop("cartridges", None))
        defaults = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                    "seed": self.seed}
        return (turns, *self._answerer.plan(turns, named, kwargs, defaults, stop or ()))


def _turn(message: BaseMessage) -> dict[str, str]:
    role = ROLES.get(message.type) or (message.role if message.type == "chat" else None)
    if role not in ("user", "assistant", "system"):
        raise invalid_request(
            f"A {type(message).__name__} (type {message.type!r}) cannot be sent to a cartridge; send system, human "
            "and AI messages (tool calls are not supported).")
    if isinstance(message.content, str):
        return {"role": role, "content": message.content}
    parts = [p if isinstance(p, str) else p.get("text") if p.get("type") == "text" else None for p in message.content]
    if any(p is None for p in parts):
        raise invalid_request("Only text content can be sent to a cartridge; this message has "
                                            f"{[p.get('type') for p in message.content if isinstance(p, dict)]}.")
    return {"role": role, "content": "".join(parts)}


def _names(given: Any) -> list[str] | None:
    """Store names from a list of names, or of the documents `CartridgeRetriever` returned."""
    if given is None:
        return None
    if isinstance(given, (str, Document)):
        given = [given]
    names = [g.metadata.get("cartridge") if isinstance(g, Document) else g for g in given]
    if not names or not all(isinstance(n, str) and n for n in names):
        raise invalid_request(f"cartridges={given!r:.120} must be store names or documents from "
                                            "CartridgeRetriever (with metadata['cartridge']).")
    return names


def _metadata(chosen: Selection, usage: Usage) -> dict[str, Any]:
    return {**chosen.sources(), "cartridge_tokens": usage.cartridge_tokens, "finish_reason": usage.finish_reason}


def _usage_metadata(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
