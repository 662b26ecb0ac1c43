"""The making stage's settings: how conversations are sampled (`SynthesisConfig`), how a corpus is compacted
(`CompactionConfig`), where training starts (`StartConfig`), and the flat keyword settings of `Cartridge.from_corpus`
and the CLI's ``--set`` split between the stages and validated in one place (`check_settings`).

One module below every module that reads them, so the stage's modules take their settings from below themselves.
How a cartridge is trained (`TrainConfig`) is the trainer's input and lives in the core (`trainer_inputs.py`), beside
the `Trainer` contract. The names and defaults here are what dataset headers and cartridge metadata record.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

import attrs

from ..cartridge import Cartridge
from ..checks import at_least_one, boolean, count, non_negative, one_of, optional_int, positive
from ..errors import ConfigError
from ..trainer_inputs import TrainConfig
from .corpus import ChunkSampler
from .seeds import DEFAULT_WEIGHTS, check_weights

# -- synthesis ---------------------------------------------------------------------------------------------------


def _text(_inst, attribute, value):
    if not isinstance(value, str):
        raise ConfigError(f"{attribute.name}={value!r:.60} must be a string.")


def _weights(_inst, _attribute, value):
    check_weights(value)


# the default data budget: mostly document windows, which cost one forward pass of the teacher where a
# conversation costs two decodes; with 16 conversations instead of 128 the dev papers closed as much of the gap
# (docs/self-study.md)
DEFAULT_CONVERSATIONS = 16
DEFAULT_DOCUMENT_WINDOWS = 96


@attrs.frozen
class SynthesisConfig:
    """How self-study conversations are sampled. Defaults suit a small model on a CPU."""

    num_conversations: int = attrs.field(default=DEFAULT_CONVERSATIONS, validator=at_least_one)
    rounds: int = attrs.field(default=1, validator=at_least_one)
    min_chunk: int = attrs.field(default=512, validator=at_least_one)
    max_chunk: int = attrs.field(default=1024, validator=at_least_one)  # CPU-sized; the sampler allows 4096
    description: str | None = attrs.field(default=None, validator=attrs.validators.optional(_text))
    conversations_per_chunk: int = attrs.field(default=16, validator=at_least_one)
    seed_weights: Mapping[str, float] = attrs.field(factory=lambda: dict(DEFAULT_WEIGHTS), converter=dict, validator=_weights)
    temperature_a: float = attrs.field(default=0.7, validator=non_negative)
    temperature_b: float = attrs.field(default=0.5, validator=non_negative)
    max_tokens_a: int = attrs.field(default=48, validator=at_least_one)
    max_tokens_b: int = attrs.field(default=64, validator=at_least_one)
    top_k: int = attrs.field(default=20, validator=at_least_one)
    targets: str = attrs.field(default="assistant")
    a_context: str = attrs.field(default="message")
    b_context: str = attrs.field(default="chunk")
    document_windows: int = attrs.field(default=DEFAULT_DOCUMENT_WINDOWS, validator=count)
    window_tokens: int = attrs.field(default=256)
    windows_per_chunk: int = attrs.field(default=4, validator=at_least_one)
    seed: int = attrs.field(default=0, validator=optional_int)

    @a_context.validator
    def _check_a_context(self, _attribute, value):
        if value not in ("message", "prefix"):
            raise ConfigError(f"a_context={value!r} must be 'message' (chunk inside A's prompt) or 'prefix' (before the chat).")

    @b_context.validator
    def _check_b_context(self, _attribute, value):
        if value not in ("chunk", "document"):
            raise ConfigError(f"b_context={value!r} must be 'chunk' (the teacher reads A's chunk) or 'document' "
                              "(the teacher reads the whole corpus, as the document in context would be read).")

    @window_tokens.validator
    def _check_window_tokens(self, _attribute, value):
        if not isinstance(value, int) or value < 2:
            raise ConfigError(f"window_tokens={value!r} must be an integer >= 2: a window needs a token to predict after its first.")

    @targets.validator
    def _check_targets(self, _attribute, value):
        if value not in ("assistant", "all"):
            raise ConfigError(f"targets={value!r} must be 'assistant' (B's answers) or 'all' (every token after the first).")

    def __attrs_post_init__(self):
        ChunkSampler(self.min_chunk, self.max_chunk)  # validates the pair


# -- compaction --------------------------------------------------------------------------------------------------


@attrs.frozen
class CompactionConfig:
    """How the compact cache is fitted. The defaults were chosen on QASPER papers (docs/compaction.md);
    `chunk_questions` and `keep_surprising` left at None follow the model (`for_model`): the pair won on every dev
    set with the 0.5B, where the embedded 135M's questions gained nothing steady and the 1.5B gained little for five
    times the seconds (docs/compaction.md, "The defaults follow the model")."""

    corpus_queries: int = attrs.field(default=2048, validator=count)  # corpus positions used as references
    probe_questions: tuple[str, ...] = attrs.field(default=())  # e.g. making.compaction.PROBE_QUESTIONS
    answer_tokens: int = attrs.field(default=32, validator=count)  # greedy answer tokens per probe question
    # questions the model asks itself about each chunk (self-study's question seeds, sampled), then answers greedily:
    # probes that are the chunk's own, where generic ones miss its details (docs/compaction.md)
    chunk_questions: int | None = attrs.field(default=None, validator=attrs.validators.optional(count))
    ridge: float = attrs.field(default=1e-2, validator=positive)  # relative to the mean diagonal of the system
    # corpus queries are moved to positions T + [0, spread): where a user's question and answer sit after the corpus
    spread: int = attrs.field(default=64, validator=count)
    # restore the attention mass of the dropped keys (see `making.compaction.fit_layer`)
    mass: bool = attrs.field(default=True, validator=boolean)
    # which keys stay: those with the highest mean or highest peak attention weight over the reference queries
    select: str = attrs.field(default="max", validator=one_of("max", "mean"))
    max_chunk_tokens: int | None = attrs.field(default=None)  # None: the model's context minus room for a probe
    # this share of each chunk's budget goes to the tokens the model least expected (a rare name, a number), kept in
    # every layer whatever the references attend to: a reader copies such a token and cannot rebuild it from the gist
    keep_surprising: float | None = attrs.field(default=None)

    @probe_questions.validator
    def _check_probes(self, _attr, value) -> None:
        if isinstance(value, str) or not isinstance(value, (tuple, list)):
            raise ConfigError(f"probe_questions={value!r} must be a list of questions, e.g. [{value!r}].")
        if any(not isinstance(q, str) or not q.strip() for q in value):
            raise ConfigError(f"probe_questions={value!r} must be non-empty strings.")

    @max_chunk_tokens.validator
    def _check_chunk(self, _attr, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
            raise ConfigError(f"max_chunk_tokens={value!r} must be None or an int >= 2.")

    @keep_surprising.validator
    def _check_keep(self, _attr, value: float | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1):
            raise ConfigError(f"keep_surprising={value!r} must be a share of the budget in [0, 1), e.g. 0.25, or None "
                              "for the model's default.")

    def __attrs_post_init__(self) -> None:
        if self.corpus_queries == 0 and not self.probe_questions and not self.chunk_questions:
            raise ConfigError("corpus_queries=0 with no probe_questions or chunk_questions leaves no reference "
                              "queries to fit to.")

    def for_model(self, lm: Any) -> CompactionConfig:
        """These settings with the model's defaults filled in: what a compaction with `lm` runs and records."""
        auto = READER_COMPACTION if is_reader(lm) else PLAIN_COMPACTION
        return attrs.evolve(self, **{k: v for k, v in auto.items() if getattr(self, k) is None})


# a model with parameters in [low, high) is a reader that asks good questions of a chunk and reads a plainly
# compacted one poorly enough that they pay (the 0.5B counts 630M as loaded from its GGUF; below, the embedded 135M
# asks poor ones; above, the 1.5B's 1.78B read the plain cartridge almost as well, at a fifth of the seconds):
# `CompactionConfig`'s None settings become `READER_COMPACTION` for it, else `PLAIN_COMPACTION` (what every
# compaction did before those settings followed the model)
READER_PARAMETERS = (300_000_000, 1_000_000_000)
READER_COMPACTION = {"chunk_questions": 8, "keep_surprising": 0.45}
PLAIN_COMPACTION = {"chunk_questions": 0, "keep_surprising": 0.0}


def is_reader(lm: Any) -> bool:
    """Whether `lm` is a reader (`READER_PARAMETERS`): the kind of model the settings that follow it were measured
    on."""
    low, high = READER_PARAMETERS
    return low <= lm.num_parameters < high


def made_with(made: Mapping[str, Any], config: CompactionConfig, lm: Any) -> bool:
    """Whether a compaction with `lm` whose cartridge records `made` (its ``meta.extra["compaction"]``, tuples saved
    as lists) used `config`'s settings, the model's filled in; a setting it predates had what it did before the
    setting existed (each new setting's default, or `PLAIN_COMPACTION`'s for those that follow the model)."""
    def as_saved(c: CompactionConfig) -> dict[str, Any]:
        return json.loads(json.dumps(attrs.asdict(c)))

    config = config.for_model(lm)
    defaults = as_saved(CompactionConfig(**PLAIN_COMPACTION))
    made = json.loads(json.dumps(made))  # as saved, also when read from a cartridge not yet saved
    return all(made.get(k, defaults[k]) == v for k, v in as_saved(config).items())


# -- self-study: where training starts, and the flat settings of both stages ---------------------------------------

# the cartridges self-study training may start from (`init=`): a subset of the `init` values a cartridge's
# metadata records (fileformat.ORIGINS), which also name how a cartridge was made afterwards ("trained", "composed")
STARTS = ("compact", "prefix", "random_text", "random")
# where training starts: the corpus compacted (measured best, docs/self-study.md)
DEFAULT_START = "compact"


# -- the quality report -------------------------------------------------------------------------------------------


@attrs.frozen
class ReportConfig:
    """How a cartridge is checked against its own corpus after it is made (`making.report`). The defaults keep it
    to about one more read of a corpus of a few thousand tokens."""

    questions: int = attrs.field(default=8, validator=at_least_one)  # held-out questions the model asks itself
    answer_tokens: int = attrs.field(default=32, validator=at_least_one)  # longest in-context answer scored
    window_tokens: int = attrs.field(default=4096, validator=at_least_one)  # a longer corpus is read in stretches
    windows: int = attrs.field(default=2, validator=at_least_one)  # how many stretches, spread over it
    seed: int = attrs.field(default=90_001, validator=count)  # not a seed synthesis or compaction draws from
    # what it computes in: "fastest" (self-study's synthesis-stage measurement: bfloat16 for the 0.5B here), a dtype
    # name, or None for the model's own (every figure exact to the model, e.g. 1.0 for the text's own prefix)
    dtype: str | None = attrs.field(default="fastest", validator=attrs.validators.optional(
        one_of("fastest", "float32", "bfloat16", "float16")))


@attrs.frozen
class StartConfig:
    """The cartridge training starts from: `num_tokens` tokens made by `init` (one of `STARTS`; `seed` picks the
    unrelated text or the random vectors), the first `num_frozen` never trained."""

    num_tokens: int
    init: str = DEFAULT_START
    num_frozen: int = 1
    seed: int = attrs.field(default=0, validator=optional_int)
    compaction: CompactionConfig | None = None  # how init="compact" compacts (None: CompactionConfig's, the model's)

    def __attrs_post_init__(self) -> None:
        if self.compaction is not None and not isinstance(self.compaction, CompactionConfig):
            raise ConfigError(f"compaction={self.compaction!r} must be a CompactionConfig, e.g. "
                              "CompactionConfig(keep_surprising=0.45).")
        if self.compaction is not None and self.init != "compact":
            raise ConfigError(f"compaction= says how init='compact' compacts; this run starts from init={self.init!r}.")
        if self.init not in STARTS:
            raise ConfigError(f"init={self.init!r} must be one of {STARTS}.")
        Cartridge.check_size(self.num_tokens, self.num_frozen)
        if self.init == "compact" and self.num_frozen > 1:
            raise ConfigError(f"num_frozen={self.num_frozen}: init='compact' keeps one attention sink; use "
                              "num_frozen=1 or 0, or init='prefix'.")


SYNTHESIS_SETTINGS = {f.name for f in attrs.fields(SynthesisConfig)} - {"num_conversations", "seed"}
TRAINING_SETTINGS = {f.name for f in attrs.fields(TrainConfig)} - {"epochs", "seed"}
# arguments of their own (keywords of from_corpus, flags of the CLI), never given as flat settings
OWN_ARGUMENTS = ("num_tokens", "num_conversations", "epochs", "seed", "init", "num_frozen")


def split_settings(settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Flat keyword settings -> (synthesis, training) settings, refusing unknown names."""
    own = sorted(set(settings) & set(OWN_ARGUMENTS))
    if own:
        flags = ", ".join(f"--{k.removeprefix('num_').replace('_', '-')}" for k in own)
        raise ConfigError(f"{own} are arguments of their own ({flags} on the command line), not --set settings.")
    unknown = sorted(set(settings) - SYNTHESIS_SETTINGS - TRAINING_SETTINGS)
    if unknown:
        raise ConfigError(
            f"Unknown setting(s) {unknown}. Synthesis settings: {sorted(SYNTHESIS_SETTINGS)}; "
            f"training settings: {sorted(TRAINING_SETTINGS)}."
        )
    return (
        {k: v for k, v in settings.items() if k in SYNTHESIS_SETTINGS},
        {k: v for k, v in settings.items() if k in TRAINING_SETTINGS},
    )


def check_settings(
    settings: dict[str, Any], *, num_tokens: int, num_conversations: int = DEFAULT_CONVERSATIONS, epochs: int = 1,
    init: str = DEFAULT_START, seed: int = 0, num_frozen: int = 1, compaction: CompactionConfig | None = None,
) -> tuple[StartConfig, SynthesisConfig, TrainConfig]:
    """Every self-study setting of both stages, validated in one place before any model work; returns the configs.

    Each error names the setting, the bad value and the fix (`--set lr=abc` -> ``lr='abc' must be a finite number``).
    """
    synth_settings, train_settings = split_settings(settings)
    start = StartConfig(num_tokens, init, num_frozen, seed, compaction)
    return (start, SynthesisConfig(num_conversations=num_conversations, seed=seed, **synth_settings),
            TrainConfig(epochs=epochs, seed=seed, **train_settings))


def check_training_settings(
    settings: dict[str, Any], *, num_tokens: int, epochs: int = 1, init: str = DEFAULT_START, seed: int = 0,
    num_frozen: int = 1, compaction: CompactionConfig | None = None,
) -> tuple[StartConfig, TrainConfig]:
    """The training stage's settings alone, validated (a synthesis setting is refused by name); returns the configs."""
    _, train_settings = split_settings(settings)
    if any(k not in TRAINING_SETTINGS for k in settings):
        raise ConfigError(f"{sorted(set(settings) - TRAINING_SETTINGS)} are synthesis settings; training takes "
                          f"{sorted(TRAINING_SETTINGS)}.")
    return (StartConfig(num_tokens, init, num_frozen, seed, compaction),
            TrainConfig(epochs=epochs, seed=seed, **train_settings))


# -- recipes ---------------------------------------------------------------------------------------------------------

# named sets of self-study settings, each the best measured for a kind of model: ``recipe="reader"`` to
# `Cartridge.from_corpus` (``--recipe reader`` on the command line) stands for all of them, and a setting given beside
# it wins over the recipe's. The defaults suit the embedded 135M, which asks poor questions.
RECIPES: Mapping[str, Mapping[str, Any]] = {
    # a reader that asks useful questions (qwen2.5-coder-0.5b and up): 48 conversations that are all questions,
    # weighing twice a window, 48 windows, the teacher reading the whole corpus, a start compacted with each chunk's
    # own questions and its least expected words, two epochs at lr 0.01. On QASPER dev papers 0-9 (0.5B reader, 256
    # tokens) it closes 0.747 of the gap to the paper in context, BM25 RAG 0.553 (docs/self-study.md)
    "reader": {
        "num_conversations": 48, "epochs": 2, "lr": 0.01, "seed_weights": {"question": 1},
        "conversation_weight": 2.0, "document_windows": 48, "b_context": "document",
        "compaction": CompactionConfig(chunk_questions=8, keep_surprising=0.45),
    },
}


def with_recipe(settings: Mapping[str, Any]) -> dict[str, Any]:
    """`from_corpus` keywords with their ``recipe`` (a name in `RECIPES`, or None) spelled out: the recipe's
    settings, then `settings` over them. A given ``compaction`` replaces the recipe's whole, and another ``init``
    drops it."""
    settings = dict(settings)
    name = settings.pop("recipe", None)
    if name is None:
        return settings
    if not isinstance(name, str) or name not in RECIPES:
        raise ConfigError(f"recipe={name!r} is not a recipe; use one of {sorted(RECIPES)} (docs/self-study.md, "
                          "\"Recipes\"), or None for the defaults.")
    recipe = copy.deepcopy(dict(RECIPES[name]))
    if settings.get("init", DEFAULT_START) != "compact":
        recipe.pop("compaction", None)  # says how the recipe's start is compacted; a start given beside it wins
    return {**recipe, **settings}
