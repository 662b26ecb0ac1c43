"""Backend interfaces (small ABCs) and the entry-point registry that finds their implementations.

A backend distribution registers classes under the entry-point groups ``cartridges_sdk.runtimes``,
``cartridges_sdk.synthesizers`` and ``cartridges_sdk.trainers``; the built-in Hugging Face runtime registers the
same way (see ``pyproject.toml``). Nothing is imported until a name is asked for, so ``import cartridges_sdk``
never imports vllm or llama_cpp.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs

from .checks import at_least_one, non_negative, unit_interval
from .errors import ConfigError, PluginError

if TYPE_CHECKING:
    from .cartridge import Cartridge

Message = dict[str, str]


@attrs.frozen
class GenerationParams:
    """How to sample an answer. ``temperature=0`` is greedy decoding."""

    max_new_tokens: int = attrs.field(default=256, validator=at_least_one)
    temperature: float = attrs.field(default=0.0, validator=non_negative)
    top_p: float = attrs.field(default=1.0, validator=unit_interval)
    top_k: int = attrs.field(default=0, validator=non_negative)
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=lambda s: (s,) if isinstance(s, str) else tuple(s))

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

    Synthesizers also fill `top_ids` / `top_logprobs`: per generated token, the model's top-k candidates and their
    log-probabilities before temperature (arrays of shape ``[tokens, k]``).
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    top_ids: Any = None
    top_logprobs: Any = None


@attrs.frozen
class SynthesisRequest:
    """One chat completion to sample for self-study.

    `context` (the corpus chunk) is placed before the chat as plain tokens, exactly where a cartridge sits when
    the student answers, so teacher and student differ only in chunk versus cartridge. Requests with the same
    `group` share their context, so an engine can prefill it once.
    """

    messages: tuple[Message, ...] = attrs.field(converter=tuple)
    context: str | None = None
    max_tokens: int = attrs.field(default=128, validator=at_least_one)
    temperature: float = attrs.field(default=1.0, validator=non_negative)
    top_logprobs: int = attrs.field(default=0, validator=non_negative)
    group: int | None = None
    seed: int | None = None


class Runtime(ABC):
    """Answers conversations with zero, one or several cartridges loaded as a cached prefix."""

    @abstractmethod
    def generate(
        self, cartridges: Sequence[Cartridge], messages: Sequence[Message], params: GenerationParams
    ) -> Completion: ...

    def generate_batch(
        self, cartridges: Sequence[Cartridge], conversations: Sequence[Sequence[Message]], params: GenerationParams
    ) -> list[Completion]:
        """Several conversations sharing the same cartridges; engines that batch override this."""
        return [self.generate(cartridges, m, params) for m in conversations]

    def stream(
        self, cartridges: Sequence[Cartridge], messages: Sequence[Message], params: GenerationParams
    ) -> Iterator[str]:
        """Yield the answer's text as it is produced; by default all at once for runtimes that cannot stream."""
        yield self.generate(cartridges, messages, params).text


class Synthesizer(ABC):
    """Samples chat completions with the teacher's top-k log-probabilities, for self-study.

    Token ids must be in the student model's tokenizer: a backend serves the same model as the student.
    """

    @abstractmethod
    def complete(self, requests: Sequence[SynthesisRequest]) -> list[Completion]: ...

    def identity(self) -> Any:
        """The `ModelIdentity` of the model it samples from, checked against the student before synthesis."""
        return None

    def score(self, context: str, sequences: Sequence[Sequence[int]], top_k: int) -> list[tuple[Any, Any]]:
        """Teacher top-k ``(ids, logprobs)`` arrays ``[len(seq) - 1, k]`` predicting tokens 1.. of each sequence
        placed after `context` (an optional ability, used for ``targets="all"`` and document windows)."""
        raise PluginError(
            f"{type(self).__name__} cannot score sequences, which targets='all' and document_windows > 0 need; "
            "use targets='assistant' and document_windows=0, or a synthesizer that implements score()."
        )


class Trainer(ABC):
    """Trains a cartridge from a self-study dataset (implemented by backends)."""

    @abstractmethod
    def fit(self, init: Cartridge, dataset: Any, model: Any) -> Cartridge: ...


T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> implementations of one interface, from entry points plus anything registered at run time."""

    def __init__(self, group: str, base: type[T]):
        self.group = group
        self.base = base
        self._extra: dict[str, str | type[T]] = {}

    def register(self, name: str, target: str | type[T]) -> None:
        """Add an implementation by class or by ``"module:Class"`` string (handy for tests and notebooks)."""
        self._extra[name] = target

    def _entry_points(self) -> dict[str, importlib.metadata.EntryPoint]:
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=self.group)}

    def names(self) -> list[str]:
        return sorted(set(self._entry_points()) | set(self._extra))

    def get(self, name: str) -> type[T]:
        target: Any = self._extra.get(name)
        if target is None:
            ep = self._entry_points().get(name)
            if ep is None:
                hint = (
                    " The built-in backends are registered by installing cartridges-sdk (pip install -e .)."
                    if not self._entry_points()
                    else ""
                )
                raise PluginError(
                    f"No {self.base.__name__} named {name!r} in entry-point group {self.group!r}; "
                    f"available: {self.names() or 'none'}.{hint}"
                )
            target = ep.value
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            try:
                target = getattr(importlib.import_module(module), attr)
            except Exception as err:
                raise PluginError(
                    f"{self.base.__name__} plugin {name!r} ({module}:{attr}) failed to import: "
                    f"{type(err).__name__}: {err}. Install or fix that backend package."
                ) from err
        if not (isinstance(target, type) and issubclass(target, self.base)):
            raise PluginError(f"Plugin {name!r} in {self.group!r} is {target!r}, not a subclass of {self.base.__name__}.")
        return target


runtimes: Registry[Runtime] = Registry("cartridges_sdk.runtimes", Runtime)
synthesizers: Registry[Synthesizer] = Registry("cartridges_sdk.synthesizers", Synthesizer)
trainers: Registry[Trainer] = Registry("cartridges_sdk.trainers", Trainer)
