"""Backend interfaces (small ABCs), what a synthesizer can do, and the entry-point registry that builds backends by name.

A backend distribution registers classes under the entry-point groups ``cartridges_sdk.runtimes``,
``cartridges_sdk.synthesizers`` and ``cartridges_sdk.trainers``; the built-in Hugging Face backend registers the
same way (see ``pyproject.toml``). Nothing is imported until a name is asked for, so ``import cartridges_sdk``
never imports vllm or llama_cpp.

Every backend is built the same way, ``registry.create(name, model, **options)``: the student model (an `LM`)
plus the options its ``Options`` class declares; an unknown option is refused with the list of valid ones.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from abc import ABC, abstractmethod
from collections.abc import Container, Generator, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import attrs

from .checks import at_least_one, count, non_negative, optional_int, require, unit_interval
from .errors import BackendUnavailableError, ConfigError, PluginError

if TYPE_CHECKING:
    from .cartridge import Cartridge
    from .identity import ModelIdentity
    from .models import LM
    from .training import TrainConfig

Message = dict[str, str]


def _token_ids(value: Any) -> tuple[int, ...]:
    return tuple(int(t) for t in value)


def _stops(value: Any) -> tuple[str, ...]:
    stops = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
    if stops is None or not all(isinstance(s, str) and s for s in stops):
        raise ConfigError(f"stop={value!r} must be a non-empty string or a list of them.")
    return stops


def _messages(value: Any) -> tuple[Message, ...]:
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ConfigError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {value!r:.80}.")
    messages = tuple(value)
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f"Message {i} is {m!r}; every message needs a string 'role' and a string 'content'.")
    return messages


# temperatures below this decode greedily, as vLLM does: dividing logits by a tinier one overflows to inf and NaN
GREEDY_BELOW = 1e-5
SEEDS = (-(2**63), 2**63 - 1)  # every engine seeds a signed 64-bit generator; a larger seed overflowed inside one


def _temperature(value: Any) -> Any:
    return 0.0 if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < GREEDY_BELOW \
        else value


def _seed(_inst, attribute, value) -> None:
    optional_int(_inst, attribute, value)
    if value is not None and not SEEDS[0] <= value <= SEEDS[1]:
        raise ConfigError(f"seed={value!r:.40} must be a 64-bit signed integer, from -2**63 to 2**63-1.")


@attrs.frozen
class GenerationParams:
    """How to sample an answer. ``temperature=0`` is greedy decoding, and so is any temperature below `GREEDY_BELOW`.

    With ``top_logprobs=k`` the completion also carries, per generated token, the model's top-k candidates and
    their log-probabilities before temperature (what the contract suite compares across engines).
    """

    max_new_tokens: int = attrs.field(default=256, validator=at_least_one)
    temperature: float = attrs.field(default=0.0, converter=_temperature, validator=non_negative)
    top_p: float = attrs.field(default=1.0, validator=unit_interval)
    top_k: int = attrs.field(default=0, validator=count)
    seed: int | None = attrs.field(default=None, validator=_seed)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stops)
    top_logprobs: int = attrs.field(default=0, validator=count)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> GenerationParams:
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"Unknown generation setting(s) {unknown}; valid ones are {sorted(known)}.")
        return cls(**kwargs)


@attrs.frozen
class Completion:
    """One generated answer: the text, its token ids, and why it ended (``"stop"`` or ``"length"``).

    `top_ids` / `top_logprobs`, when asked for: per generated token, the model's top-k candidates and their
    log-probabilities before temperature (arrays of shape ``[tokens, k]``).
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    top_ids: Any = None
    top_logprobs: Any = None

    @classmethod
    def from_ids(
        cls, lm: LM, ids: Sequence[int], finish_reason: str | None, *, stop_ids: Iterable[int] = (),
        stop: Sequence[str] = (), top_ids: Any = None, top_logprobs: Any = None,
    ) -> Completion:
        """Generated ids as a `Completion`, the same in every engine: the text is the student's tokenizer's decoding
        without the ending stop token (or end-of-turn token), cut before the first stop string."""
        ids = tuple(int(i) for i in ids)
        body = ids[:-1] if ids and ids[-1] in set(stop_ids) | lm.eos_token_ids else ids
        text = lm.tokenizer.decode(list(body), skip_special_tokens=True)
        for s in stop:
            if s in text:
                text = text[: text.index(s)]
        return cls(text=text, token_ids=ids, finish_reason="stop" if finish_reason == "stop" else "length",
                   top_ids=top_ids, top_logprobs=top_logprobs)


@attrs.frozen
class GenerationRequest:
    """One conversation to answer with its own cartridges (zero, one, or several used one after another).

    `prefix_ids` are plain tokens placed after the cartridges and before the chat: a document in context, which is
    how a runtime shows that a cartridge made from those tokens answers the same.
    """

    messages: tuple[Message, ...] = attrs.field(converter=_messages)
    cartridges: tuple[Cartridge, ...] = attrs.field(default=(), converter=tuple)
    params: GenerationParams = attrs.field(factory=GenerationParams)
    prefix_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)


@attrs.frozen
class SynthesisRequest:
    """One completion to sample for self-study, as token ids of the student's tokenizer.

    `prompt_ids` is the teacher's whole prompt, rendered once by the SDK (the chunk, then the chat turn ready for
    the answer) with the same rule the student's sequences follow, so an engine only continues it: it never applies
    a chat template and needs no Hugging Face weights. Generation ends at any of `stop_ids` (kept as the last token)
    or after `max_tokens`. Requests of one `group` share their chunk, so an engine can prefill it once.
    """

    prompt_ids: tuple[int, ...] = attrs.field(converter=_token_ids)
    stop_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    max_tokens: int = attrs.field(default=128, validator=at_least_one)
    temperature: float = attrs.field(default=1.0, validator=non_negative)
    top_logprobs: int = attrs.field(default=0, validator=count)
    group: int | None = None
    seed: int | None = attrs.field(default=None, validator=optional_int)

    @prompt_ids.validator
    def _check_prompt(self, _attribute, value):
        if not value:
            raise ConfigError("A synthesis request needs at least one prompt token.")


@attrs.frozen
class SynthesizerCapabilities:
    """What a synthesizer can do; the SDK refuses settings it cannot serve before the first conversation."""

    max_top_logprobs: int = attrs.field(default=0, validator=count)  # top-k it returns per sampled token
    score: bool = False  # teacher top-k for given sequences (document windows and targets="all" need it)
    prefix_reuse: bool = False  # a group's shared prompt is prefilled once


@attrs.frozen
class NoOptions:
    """The options of a backend that takes none."""


class Backend(ABC):
    """What every backend shares: one way to be built, from the student model and named options, and closed.

    Declare options as a frozen attrs class in ``Options`` (validators give errors that name the bad value); the
    constructor receives the model and each option as a keyword. Override `create` only when building needs more
    than that (e.g. starting an engine from the model's files).
    """

    Options: ClassVar[type] = NoOptions

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in attrs.fields(cls.Options)]

    @classmethod
    def parse_options(cls, options: dict[str, Any], label: str | None = None) -> Any:
        """The options as a validated ``Options`` instance; unknown names are refused with the valid ones."""
        label = label or cls.__name__
        unknown = sorted(set(options) - set(cls.option_names()))
        if unknown:
            valid = cls.option_names()
            raise ConfigError(f"Unknown option(s) {unknown} for {label}; valid options: {valid or 'none'}.")
        return cls.Options(**options)

    @classmethod
    def create(cls, model: LM, /, **options: Any) -> Backend:
        """The SDK's one constructor call for every backend."""
        opts = cls.parse_options(options)
        return cls(model, **{name: getattr(opts, name) for name in cls.option_names()})

    def close(self) -> None:
        """Release the engine (processes, memory, connections). Safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Runtime(Backend):
    """Answers batches of requests, each with its own cartridges and messages: many users, one batch.

    An engine installs a cartridge once and keys it on `Cartridge.fingerprint` (its content), so the same
    cartridge sent again, by any user, is reused. Cartridges for another model are refused before the engine sees them.
    """

    @abstractmethod
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        """One completion per request, in order; each as if it had been asked alone."""

    def stream(self, request: GenerationRequest) -> Generator[str, None, Completion]:
        """Yield the answer's text as it is produced, and return its `Completion` (what `generate` would give: token
        ids and finish reason, for usage counts) when read to the end; by default all at once, for engines that cannot
        stream."""
        completion = self.generate([request])[0]
        yield completion.text
        return completion


class ContinuousRuntime(Runtime):
    """A runtime that takes requests one at a time and is stepped: a server adds each request as it arrives, and the
    engine starts it at once (vLLM's continuous batching) or with the next batch (the HF runtime), so streamed answers
    share batches with the rest. `generate` and `stream` come for free on top.

    What an implementation guarantees: every added handle is reported ended exactly once by some `step` (unless
    aborted); nothing is reported for it after that or after `abort`; a failed `step` raises, and the requests it
    concerned are then dropped by the caller (`abort`).
    """

    @abstractmethod
    def add(self, request: GenerationRequest) -> str:
        """Queue `request` in the engine and return its handle; a bad request is refused here, before any step."""

    @abstractmethod
    def step(self) -> list[tuple[str, Completion, bool]]:
        """Advance the engine once: each request that progressed, its answer so far, and whether it has ended."""

    @abstractmethod
    def abort(self, handle: str) -> None:
        """Drop a request that is no longer wanted (its client went away), freeing its place in the engine."""

    def _reports(self, handles: Container[str]) -> list[tuple[str, Completion, bool]]:
        """The next reports for `handles`: held ones first, else one `step`, whose reports for other requests (a
        `stream` and a `generate` interleaved on one runtime) are held for their own readers (the latest of each)."""
        held: dict[str, tuple[Completion, bool]] = self.__dict__.setdefault("_held_reports", {})
        mine = [(h, *held.pop(h)) for h in [h for h in held if h in handles]]
        if mine:
            return mine
        for h, completion, ended in self.step():
            if h in handles:
                mine.append((h, completion, ended))
            else:
                held[h] = (completion, ended or held.get(h, (None, False))[1])
        return mine

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        handles: list[str] = []
        done: dict[str, Completion] = {}
        try:
            for i, r in enumerate(requests):
                try:
                    handles.append(self.add(r))
                except Exception as err:
                    err.add_note(f"(request {i} of the batch; none of the batch was answered)")
                    raise
            wanted = set(handles)
            while len(done) < len(handles):
                done.update((h, c) for h, c, ended in self._reports(wanted - set(done)) if ended)
        finally:
            for h in set(handles) - set(done):  # refused or interrupted: the others leave the engine too
                self._drop(h)
        return [done[h] for h in handles]

    def stream(self, request: GenerationRequest) -> Generator[str, None, Completion]:
        handle = self.add(request)
        ended = False

        def answers() -> Iterator[tuple[Completion, bool]]:
            nonlocal ended
            while not ended:
                for _, completion, finished in self._reports({handle}):
                    ended = finished
                    yield completion, finished

        try:
            return (yield from text_deltas(answers()))
        finally:
            if not ended:  # the reader stopped early
                self._drop(handle)

    def _drop(self, handle: str) -> None:
        self.abort(handle)
        self.__dict__.get("_held_reports", {}).pop(handle, None)


def settled_delta(shown: str, text: str, done: bool) -> str:
    """What `text` (a growing answer) adds to the `shown` part, once it has settled: text that may still change (an
    incomplete multi-byte character at its end) is held back until it does."""
    if (done or not text.endswith("\ufffd")) and len(text) > len(shown) and text.startswith(shown):
        return text[len(shown) :]
    return ""


def text_deltas(answers: Iterable[tuple[Completion, bool]]) -> Generator[str, None, Completion | None]:
    """The new part of a growing answer each time it settles, for `Runtime.stream`: `answers` gives the answer so far
    and whether it has ended; the last one is returned."""
    shown, last = "", None
    for last, done in answers:
        if delta := settled_delta(shown, last.text, done):
            yield delta
            shown = last.text
    return last


class Synthesizer(Backend):
    """Samples the teacher's completions with its top-k log-probabilities, for self-study.

    Token ids are in the student model's tokenizer: a synthesizer serves the same model as the student, which
    `identity()` reports (field by field) or a probe of ids and log-probs proves before any synthesis.
    """

    capabilities: ClassVar[SynthesizerCapabilities] = SynthesizerCapabilities()

    @classmethod
    def capabilities_for(cls, options: dict[str, Any]) -> SynthesizerCapabilities:
        """What it can do with these options, known before its engine starts (so settings it cannot serve are
        refused first). Override when an option changes it, e.g. how many log-probs a server returns."""
        cls.parse_options(options)
        return cls.capabilities

    @abstractmethod
    def complete(self, requests: Sequence[SynthesisRequest]) -> list[Completion]:
        """Continue each request's `prompt_ids`; fill `top_ids`/`top_logprobs` when `top_logprobs` > 0."""

    def identity(self) -> ModelIdentity | None:
        """The identity of the model it samples from, or None when it cannot tell (then a probe decides)."""
        return None

    def describe(self) -> str:
        """How messages name it: the class, plus what tells one instance from another (e.g. its model and server)."""
        return type(self).__name__

    def score(self, prefix_ids: Sequence[int], sequences: Sequence[Sequence[int]], top_k: int) -> list[tuple[Any, Any]]:
        """Teacher top-k ``(ids, logprobs)`` arrays ``[len(seq) - 1, k]`` predicting tokens 1.. of each sequence
        placed after `prefix_ids` (when ``capabilities.score``)."""
        raise PluginError(
            f"{type(self).__name__} cannot score sequences, which targets='all' and document_windows > 0 need; "
            "use targets='assistant' and document_windows=0, or a synthesizer that can score."
        )


class Trainer(Backend):
    """Trains a cartridge from a self-study dataset."""

    @abstractmethod
    def fit(
        self, init: Cartridge, dataset: Any, model: LM, config: TrainConfig | None = None, *,
        output_dir: Any = None, progress: bool = True,
    ) -> Cartridge:
        """Train `init` (bound to `model`) on `dataset`; with `output_dir`, checkpoint there and resume from it."""


T = TypeVar("T", bound=Backend)


class Registry(Generic[T]):
    """Names -> implementations of one interface, from entry points plus anything registered at run time."""

    def __init__(self, group: str, base: type[T], kind: str):
        self.group = group
        self.base = base
        self.kind = kind
        self._extra: dict[str, str | type[T]] = {}

    def register(self, name: str, target: str | type[T], *, replace: bool = False) -> None:
        """Add an implementation by class or by ``"module:Class"`` string (handy for tests and notebooks).

        A name already taken (by an installed plugin or an earlier call) is refused unless ``replace=True``.
        """
        if not replace and name in self.names():
            raise PluginError(
                f"A {self.kind} named {name!r} is already registered ({self._target(name)}); "
                "pick another name, or pass replace=True to override it on purpose."
            )
        self._extra[name] = target

    def _entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        found: dict[str, importlib.metadata.EntryPoint] = {}
        for ep in importlib.metadata.entry_points(group=self.group):
            if ep.name in found and found[ep.name].value != ep.value:
                raise PluginError(
                    f"Two installed plugins register a {self.kind} named {ep.name!r} in {self.group!r}: "
                    f"{found[ep.name].value} ({_dist(found[ep.name])}) and {ep.value} ({_dist(ep)}); uninstall one."
                )
            found[ep.name] = ep
        return found

    def names(self) -> list[str]:
        return sorted(set(self._entry_points()) | set(self._extra))

    def _target(self, name: str) -> str:
        target = self._extra.get(name) or self._entry_points()[name].value
        return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"

    def get(self, name: str) -> type[T]:
        """The class registered as `name`, imported now."""
        target: Any = self._extra.get(name)
        if target is None:
            ep = self._entry_points().get(name)
            if ep is None:
                hint = (
                    " The built-in backends are registered by installing cartridges-sdk (pip install -e .)."
                    if not self._entry_points()
                    else " `cartridges backends` lists what is installed."
                )
                raise PluginError(f"No {self.kind} named {name!r}; available: {self.names() or 'none'}.{hint}")
            target = ep.value
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            try:
                target = getattr(importlib.import_module(module), attr)
            except Exception as err:
                raise BackendUnavailableError(
                    f"The {self.kind} plugin {name!r} ({module}:{attr}) failed to import: "
                    f"{type(err).__name__}: {err}. Install or fix that backend package."
                ) from err
        if not (isinstance(target, type) and issubclass(target, self.base)):
            raise PluginError(f"Plugin {name!r} in {self.group!r} is {target!r}, not a subclass of {self.base.__name__}.")
        return target

    def create(self, name: str, model: LM, /, **options: Any) -> T:
        """Build the backend `name` for `model`; options are checked against what it declares before it starts."""
        cls = self.get(name)
        cls.parse_options(options, label=f"{self.kind} {name!r}")
        return cls.create(model, **options)  # type: ignore[return-value]

    def resolve(self, spec: str | T, model: LM, options: dict[str, Any] | None = None) -> tuple[T, bool]:
        """`spec` as a backend: a name is built with `options` (returns it and True: the caller owns and closes
        it); an object is used as it is (options must be empty; returns it and False)."""
        if options is not None:
            require(f"{self.kind}_options", options, dict, "a dict of option names to values")
        if isinstance(spec, self.base):
            if options:
                raise ConfigError(f"{self.kind}_options go with a {self.kind} name; a {self.kind} object is already configured.")
            return spec, False
        if not isinstance(spec, str):
            raise ConfigError(f"{self.kind}={spec!r} must be a registered name ({self.names()}) or a {self.base.__name__}.")
        return self.create(spec, model, **(options or {})), True

    def describe(self) -> list[dict[str, Any]]:
        """For each registered name: where it comes from, whether it imports (and the error if not), its options."""
        rows = []
        eps = self._entry_points()
        for name in self.names():
            row: dict[str, Any] = {"name": name, "target": self._target(name),
                                   "distribution": _dist(eps[name]) if name in eps and name not in self._extra else None}
            try:
                cls = self.get(name)
            except PluginError as err:
                row.update(ok=False, error=str(err))
            else:
                row.update(ok=True, options=cls.option_names())
                if isinstance(getattr(cls, "capabilities", None), SynthesizerCapabilities):
                    row["capabilities"] = attrs.asdict(cls.capabilities)
            rows.append(row)
        return rows


def _dist(ep: importlib.metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else None


runtimes: Registry[Runtime] = Registry("cartridges_sdk.runtimes", Runtime, "runtime")
synthesizers: Registry[Synthesizer] = Registry("cartridges_sdk.synthesizers", Synthesizer, "synthesizer")
trainers: Registry[Trainer] = Registry("cartridges_sdk.trainers", Trainer, "trainer")
REGISTRIES = {"runtimes": runtimes, "synthesizers": synthesizers, "trainers": trainers}
