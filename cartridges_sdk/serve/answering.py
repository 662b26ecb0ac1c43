"""What a framework integration (LangChain, LlamaIndex) answers with: one cartridge, named cartridges of a store, or
a store's cartridges routed per question. The integrations translate messages and errors; the choice of cartridges,
the request and its usage counts live here once, so both frameworks answer the same question the same way.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..cartridge import Cartridge
from ..checks import at_least_one
from ..errors import ConfigError
from ..generation import Completion, GenerationParams, GenerationRequest, Message
from ..plugins import ContinuousRuntime
from .passages import Passage, check_draft, check_settings, check_sought, check_trim, sought
from .store import CartridgeStore, check_draft_from
from .records import document_record

CALL_SETTINGS = ("max_tokens", "temperature", "top_p", "seed")  # what a framework call may set, by OpenAI's names
PREVIEW_CHARS = 400  # how much of a routed cartridge's corpus a retriever shows as the document's text
# one lock per engine: frameworks call from thread pools (LangChain's batch, async forms in worker threads), and an
# engine need not be thread-safe (docs/writing-a-backend.md). On a ContinuousRuntime a stream takes it for each step
# only, so streams and calls interleave (the runtime holds each one's reports for it), and a step may run on any
# thread; a plain Runtime keeps one answer going at a time (llama.cpp's one sequence), so a stream holds it throughout.
_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def engine_lock(runtime: Any) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(runtime, threading.Lock())


def _stepped(steps: Generator[str, None, Any], lock: threading.Lock) -> Generator[str, None, Any]:
    """`steps`, each of its steps (and its closing) taken under `lock`."""
    try:
        while True:
            with lock:
                try:
                    piece = next(steps)
                except StopIteration as done:
                    return done.value
            yield piece
    finally:
        with lock:
            steps.close()


def _held(steps: Generator[str, None, Any], lock: threading.Lock) -> Generator[str, None, Any]:
    """`steps` for a runtime that cannot interleave answers: a thread of its own takes `lock`, runs them to the end
    (or until the reader stops) and hands each piece over a queue. The engine is held from the first step to the
    last, yet the holder never waits for a reader's thread, so readers on a busy thread pool, or one that asks
    something else before reading on, cannot deadlock it."""
    pieces: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def produce() -> None:
        ended: tuple[str, Any] = ("done", None)
        try:
            with lock:
                try:
                    while not stop.is_set():
                        pieces.put(("piece", next(steps)))
                except StopIteration as done:
                    ended = ("done", done.value)
                except BaseException as err:  # handed to the reader, raised there
                    ended = ("error", err)
                finally:
                    steps.close()
        finally:
            pieces.put(ended)

    threading.Thread(target=produce, name="cartridges-stream", daemon=True).start()
    try:
        while True:
            kind, value = pieces.get()
            if kind == "piece":
                yield value
            elif kind == "done":
                return value
            else:
                raise value
    finally:
        stop.set()


@attrs.frozen
class Chosen:
    """A cartridge picked to answer, with what a framework shows as its source: the store's name for it, its routing
    score (None when named or given), the document version (SHA-256) it stands for, and the opening of its corpus."""

    name: str
    cartridge: Cartridge
    score: float | None = None
    version: str | None = None
    origin: str | None = None
    corpus: Path | None = None  # its corpus text, read for `preview` only when a framework shows one

    @property
    def preview(self) -> str:
        return _opening(_head(self.corpus) if self.corpus is not None else None)

    def metadata(self) -> dict[str, Any]:
        """What a framework's document or source node carries, JSON-ready."""
        return {"cartridge": self.name, "score": self.score, "sha256": self.version, "source": self.origin or self.name,
                "tokens": self.cartridge.num_tokens}


@attrs.frozen
class Selection:
    """What answers a conversation: the cartridges picked (composed in order), then the passages of the store's
    corpora after them, each after a line naming its document: their KV read apart (`passages_kv`, see
    `passages.read_apart`), or prompt tokens (`prefix_ids`) with no cartridge in front. Iterating it (and `len`)
    gives the cartridges, as the list of `Chosen` it replaced did."""

    cartridges: tuple[Chosen, ...]
    passages: tuple[Passage, ...] = ()
    prefix_ids: tuple[int, ...] = ()
    passages_kv: Any = attrs.field(default=None, eq=False)
    draft: str | None = None  # the first answer the passages were ranked against (`CartridgeStore.ask`'s draft)

    def kv(self) -> list[Cartridge]:
        """What goes before the prompt: the cartridges, then the passages' KV (if read apart)."""
        return [c.cartridge for c in self.cartridges] + ([self.passages_kv] if self.passages_kv is not None else [])

    def __iter__(self):
        return iter(self.cartridges)

    def __len__(self) -> int:
        return len(self.cartridges)

    def sources(self) -> dict[str, Any]:
        """What an answer says it came from, JSON-ready: cartridges, the document version each stands for, and,
        with passages, each passage's document and score, best first."""
        out: dict[str, Any] = {"cartridges": [c.name for c in self.cartridges],
                               "versions": [c.version for c in self.cartridges]}
        if self.passages:
            out["passages"] = [{"source": p.name, "score": round(p.score, 4)} for p in self.passages]
        if self.draft is not None:
            out["draft"] = self.draft
        return out


@attrs.frozen
class Usage:
    """Token counts of one answer: the prompt (chat turns, without the cartridges' KV) and the new tokens."""

    prompt_tokens: int
    completion_tokens: int
    cartridge_tokens: int
    finish_reason: str


@attrs.frozen
class Answerer:
    """Answers chat turns with `cartridge`, or with `store`'s cartridges: `names` when given, else the best `k` for
    the question (or as many as fit `budget` tokens); with `passages` tokens, the store's best passages after them,
    the budget shared (`CartridgeStore.plan`), ranked against the question and a first answer of at most `draft`
    tokens when given (written by `draft_from`'s cartridges when given: `CartridgeStore.drafted_plan`); with `trim`,
    cartridges larger than what the passages leave of `budget` cut to fit. `runtime` is a runtime name or object,
    as for `lm.chat`."""

    cartridge: Cartridge | None = None
    store: CartridgeStore | None = None
    k: int = attrs.field(default=1, validator=at_least_one)
    budget: int | None = attrs.field(default=None, validator=attrs.validators.optional(at_least_one))
    names: tuple[str, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    runtime: Any = "auto"
    runtime_options: dict[str, Any] | None = None
    passages: int | None = None  # None: a reader with a budget fills what the cartridges leave (`passages.fills`)
    retrieval: str | None = None  # None: bm25, where passages are sought; given where none are, refused
    passages_from: str | None = None  # None: the whole store
    draft: int = 0  # tokens of a first answer that picks the passages (0: none)
    draft_from: CartridgeStore | None = None  # None: the answering plan's cartridges write it
    trim: bool | str = False  # cut cartridges larger than what `passages` leave of `budget` ("attention": by it)

    def __attrs_post_init__(self) -> None:
        if (self.cartridge is None) == (self.store is None):
            raise ConfigError("Give exactly one of cartridge= (one Cartridge) or store= (a CartridgeStore, routed per "
                              f"question); got cartridge={self.cartridge!r:.60} and store={self.store!r:.60}.")
        if self.cartridge is not None and not isinstance(self.cartridge, Cartridge):
            raise ConfigError(f"cartridge={self.cartridge!r:.60} must be a Cartridge (Cartridge.load(path, model=lm)).")
        if self.cartridge is not None and self.cartridge.lm is None:
            raise ConfigError("The cartridge has no model to answer with; load it with Cartridge.load(path, model=lm).")
        if self.store is not None and not isinstance(self.store, CartridgeStore):
            raise ConfigError(f"store={self.store!r:.60} must be a CartridgeStore (CartridgeStore(folder, lm)).")
        check_settings(self.passages, self.retrieval, self.passages_from, self.budget)
        if self.store is None:
            given = [f"{n}={v!r:.60}" for n, v in (("passages", self.passages), ("retrieval", self.retrieval),
                                                   ("passages_from", self.passages_from), ("draft", self.draft),
                                                   ("draft_from", self.draft_from), ("trim", self.trim)) if v]
            if given:
                raise ConfigError(f"{given[0]} asks for passages, which are retrieved from a store's documents; "
                                  f"build it with store=, or drop {given[0].split('=')[0]}.")
        else:
            check_sought(self.store.model, self.passages, self.budget, self.retrieval, self.passages_from)
            check_draft(self.store.model, self.draft, self.passages, self.budget)
            check_draft_from(self.draft_from, self.draft)
            check_trim(self.trim, self.passages, self.budget)

    @property
    def model(self) -> Any:
        return self.cartridge.lm if self.cartridge is not None else self.store.model

    def choose(self, question: str, names: Sequence[str] | None = None) -> Selection:
        """The cartridges (and passages) that answer `question`: `names` (of the store) when given, else this
        answerer's."""
        if self.cartridge is not None:
            if names:
                raise ConfigError(f"cartridges={list(names)!r} names store cartridges, but this answers with one "
                                  "cartridge; build it with store= to pick cartridges by name.")
            record = document_record(self.cartridge) or {}
            return Selection((Chosen(record.get("name") or "cartridge", self.cartridge, version=record.get("sha256"),
                                     origin=record.get("origin")),))
        names = list(names) if names else list(self.names) if self.names else None
        settings = {"k": self.k, "budget": self.budget, "passages": self.passages, "retrieval": self.retrieval,
                    "passages_from": self.passages_from, "cartridges": names, "trim": self.trim}
        if self.draft:  # the first answer is generated: it holds the engine its drafter answers on, as answers do
            # (planning too, inside drafted_plan: seconds at most, where a rebuilt passage index is the longest)
            source = self.draft_from if self.draft_from is not None else self.store
            drafter = source.model._runtime(self.runtime, self.runtime_options)
            with engine_lock(drafter):
                plan, first = self.store.drafted_plan(question, self.draft, draft_from=self.draft_from,
                                                      runtime=drafter, **settings)
        else:
            plan, first = self.store.plan(question, **settings), None
        out = []
        answering = plan.answering(self.store)  # as the plan read them; `trim`: cut to fit
        for name, score, cartridge in zip(plan.cartridges, plan.scores, answering):
            record = document_record(cartridge) or {}
            out.append(Chosen(name, cartridge, score, record.get("sha256"), record.get("origin"),
                              self.store.corpus_path(name)))
        return Selection(tuple(out), plan.passages, plan.prefix_ids, plan.passages_kv, first)

    def plan(self, turns: Sequence[Message], names: Sequence[str] | None, call: dict[str, Any],
             defaults: dict[str, Any], stop: Sequence[str] = ()) -> tuple[Selection, dict[str, Any]]:
        """The cartridges for a conversation (`names`, else routed by its last user turn) and its generation
        settings: a call's own `call` keyword arguments (of `CALL_SETTINGS`) over the integration's `defaults`."""
        unknown = sorted(set(call) - set(CALL_SETTINGS))
        if unknown:
            raise ConfigError(f"Unknown setting(s) {unknown}; a call takes cartridges and {', '.join(CALL_SETTINGS)}.")
        merged = {**defaults, **call}
        gen = {"max_new_tokens" if k == "max_tokens" else k: merged[k] for k in CALL_SETTINGS if k in merged}
        looks = self.store is not None and (not names or sought(self.model, self.passages, self.budget))
        question = last_user_text(turns) if looks else ""  # a reader's budget fills with passages for it too
        return self.choose(question, names), {**gen, "stop": tuple(stop)}

    def request(self, messages: Sequence[Message], chosen: Selection, **gen: Any) -> GenerationRequest:
        if not messages:
            raise ConfigError("No messages to answer; send at least one user message.")
        return GenerationRequest(list(messages), chosen.kv(), GenerationParams.from_kwargs(gen),
                                 prefix_ids=chosen.prefix_ids)

    def answer(self, messages: Sequence[Message], chosen: Selection, **gen: Any) -> tuple[str, Usage]:
        """The answer to the conversation with the `chosen` cartridges (and passages) before it, and its token
        counts."""
        request = self.request(messages, chosen, **gen)
        runtime = self._runtime()
        with engine_lock(runtime):
            completion = runtime.generate([request])[0]
        return completion.text, self._usage(request, completion, chosen)

    def stream(self, messages: Sequence[Message], chosen: Selection, **gen: Any) -> Generator[str, None, Usage]:
        """Yield the answer's text as it comes; return its token counts when read to the end."""
        request = self.request(messages, chosen, **gen)
        runtime = self._runtime()
        if isinstance(runtime, ContinuousRuntime):
            completion = yield from _stepped(runtime.stream(request), engine_lock(runtime))
        else:  # one sequence (llama.cpp): a stream holds the engine from its first step to its last
            completion = yield from _held(runtime.stream(request), engine_lock(runtime))
        return self._usage(request, completion, chosen)

    def _runtime(self) -> Any:
        return self.model._runtime(self.runtime, self.runtime_options)

    def _usage(self, request: GenerationRequest, completion: Completion, chosen: Selection) -> Usage:
        prompt = len(self.model.prompt_ids(list(request.messages), prefix_ids=request.prefix_ids,
                                           after_cartridge=bool(request.cartridges)))
        read = chosen.passages_kv.num_tokens if chosen.passages_kv is not None else 0  # passages count as prompt
        return Usage(prompt + read, len(completion.token_ids), sum(c.num_tokens for c in request.cartridges) - read,
                     completion.finish_reason)


def last_user_text(messages: Sequence[Message]) -> str:
    """The question a store routes by: the last user turn's text."""
    for message in reversed(messages):
        if message["role"] == "user":
            return message["content"]
    raise ConfigError("The conversation has no user message to route by; end it with the user's question.")


def _head(path: Path) -> str:
    """The start of a corpus file: enough for a preview, without reading a whole document per question."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(PREVIEW_CHARS * 2)


def _opening(text: str | None) -> str:
    if not text:
        return ""
    text = text.strip()
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS].rsplit(" ", 1)[0] + " ..."
