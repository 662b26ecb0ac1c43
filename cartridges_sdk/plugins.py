"""Backend interfaces (small ABCs), what a synthesizer can do, and the entry-point registry that builds backends by name.

A backend distribution registers classes under the entry-point groups ``cartridges_sdk.runtimes``,
``cartridges_sdk.synthesizers`` and ``cartridges_sdk.trainers``; the built-in Hugging Face backend registers the
same way (see ``pyproject.toml``). Nothing is imported until a name is asked for, so ``import cartridges_sdk``
never imports vllm or llama_cpp.

Every backend is built the same way, ``registry.create(name, model, **options)``: the student model (an `LM`)
plus the options its ``Options`` class declares; an unknown option is refused with the list of valid ones.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from abc import ABC, abstractmethod
from collections.abc import Container, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import attrs

from .checks import count, require
from .errors import BackendUnavailableError, ConfigError, PluginError
from .generation import Completion, GenerationRequest, SynthesisRequest, text_deltas
from .generation import GenerationParams, Message, settled_delta  # noqa: F401  (importable from here, as before)
from .trainer_inputs import TrainConfig, TrainingData

if TYPE_CHECKING:
    from .identity import ModelIdentity
    from .protocols import KVPrefix, RunningModel

# this repository's backend packages by plugin name, with the command that installs a missing one (the quick start
# installs the core only; scripts/setup.sh all of them, llama.cpp built without the AMX kernels that crash some VMs)
PROJECT_BACKENDS = {"vllm": "pip install -e 'backends/vllm[cpu]'", "llamacpp": "./scripts/setup.sh --core --llamacpp",
                    "openai": "pip install -e backends/openai", "example": "pip install -e backends/example"}


@attrs.frozen
class SynthesizerCapabilities:
    """What a synthesizer can do; the SDK refuses settings it cannot serve before the first conversation."""

    max_top_logprobs: int = attrs.field(default=0, validator=count)  # top-k it returns per sampled token
    score: bool = False  # teacher top-k for given sequences (document windows and targets="all" need it)
    prefix_reuse: bool = False  # a group's shared prompt is prefilled once
    # the longest prompt and completion its engine takes, if less than the model's context (vLLM's max_model_len)
    max_context: int | None = attrs.field(default=None, validator=attrs.validators.optional(count))


@attrs.frozen
class TrainerCapabilities:
    """What a trainer can do; the SDK asks this, never the class or its name."""

    # under torchrun it joins the process group and trains data-parallel, every rank starting from the cartridge
    # rank 0 made (`cartridges self-study --nproc N` needs it)
    distributed: bool = False
    # `fit(distractors=[...])`: it trains among frozen cartridges of other documents (making/distractors.py)
    distractors: bool = False


@attrs.frozen
class NoOptions:
    """The options of a backend that takes none."""


class Backend(ABC):
    """What every backend shares: one way to be built, from the student model and named options, and closed.

    Declare options as a frozen attrs class in ``Options`` (validators give errors that name the bad value). The
    constructor receives the model positionally and each option as a keyword, and calls ``super().__init__(model,
    **options)``, which keeps ``self.lm`` and the validated ``self.options`` (and ``self.capabilities``, when an
    option changes them). Override `create` only when building needs more than that.
    """

    Options: ClassVar[type] = NoOptions

    def __init__(self, lm: RunningModel, /, **options: Any):
        self.lm = lm
        self.options = self.parse_options(options)
        capabilities = self.capabilities_with(self.options)
        if capabilities is not None:
            self.capabilities = capabilities

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
    def capabilities_for(cls, options: dict[str, Any]) -> Any:
        """What it can do with these options, known before its engine starts, so settings it cannot serve are refused
        first: the class's ``capabilities``, or what `capabilities_with` makes of the options."""
        return cls.capabilities_with(cls.parse_options(options))

    @classmethod
    def capabilities_with(cls, options: Any) -> Any:
        """Override when an option changes what it can do (e.g. how many log-probs a server returns); `__init__` sets
        the instance's ``capabilities`` from it, so the instance says what `capabilities_for` said."""
        return getattr(cls, "capabilities", None)

    @classmethod
    def create(cls, model: RunningModel, /, **options: Any) -> Backend:
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

    @classmethod
    def serves_fast(cls, lm: RunningModel) -> bool:
        """Whether ``runtime="auto"`` should pick this runtime for `lm` over the HF runtime, on this machine (only the
        runtimes in `runtime_choice.PREFERRED` are asked); it must not start an engine to tell."""
        return False

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
        held = self._held_reports
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

    @functools.cached_property
    def _held_reports(self) -> dict[str, tuple[Completion, bool]]:
        """Reports `step` gave for requests no caller was waiting on yet, kept until one asks (made on first use,
        so a subclass need not call an ``__init__`` here)."""
        return {}

    def _drop(self, handle: str) -> None:
        self.abort(handle)
        self._held_reports.pop(handle, None)


class Synthesizer(Backend):
    """Samples the teacher's completions with its top-k log-probabilities, for self-study.

    Token ids are in the student model's tokenizer: a synthesizer serves the same model as the student, which
    `identity()` reports (field by field) or a probe of ids and log-probs proves before any synthesis.
    """

    capabilities: ClassVar[SynthesizerCapabilities] = SynthesizerCapabilities()

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


C = TypeVar("C", bound="KVPrefix")  # the cartridge class a trainer is given is the one it returns (a `Cartridge`)


class Trainer(Backend):
    """Trains a cartridge from a self-study dataset."""

    capabilities: ClassVar[TrainerCapabilities] = TrainerCapabilities()

    @abstractmethod
    def fit(
        self, init: C, dataset: TrainingData, model: RunningModel, config: TrainConfig | None = None, *,
        output_dir: Any = None, progress: bool = True, distractors: Any = (),
    ) -> C:
        """Train `init` (bound to `model`) on `dataset` (the self-study `Conversation`s: a dataset folder or a list)
        with `config` (None for its defaults); with `output_dir`, checkpoint there and resume from it. A trainer whose
        capabilities say ``distractors`` trains among `distractors` (cartridges of other documents); the SDK passes
        them to no other."""


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
                if name in PROJECT_BACKENDS:
                    hint = (f" It is this project's {name!r} backend, not installed here: install it with "
                            f"`{PROJECT_BACKENDS[name]}` from the repository, or run `./scripts/setup.sh` for "
                            "every backend.")
                elif not self._entry_points():
                    hint = " The built-in backends are registered by installing cartridges-sdk (pip install -e .)."
                else:
                    hint = " `cartridges backends` lists what is installed."
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

    def create(self, name: str, model: RunningModel, /, **options: Any) -> T:
        """Build the backend `name` for `model`; options are checked against what it declares before it starts."""
        cls = self.get(name)
        cls.parse_options(options, label=f"{self.kind} {name!r}")
        return cls.create(model, **options)  # type: ignore[return-value]

    def resolve(self, spec: str | T, model: RunningModel, options: dict[str, Any] | None = None) -> tuple[T, bool]:
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
                if attrs.has(type(getattr(cls, "capabilities", None))):
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
