"""Seed prompts: the instruction that starts each self-study conversation (participant A's private prompt).

Five generic kinds after the Cartridges paper (structuring, summarization, question, use case, creative) plus one
generic prompt for ablations. None mentions any domain, so the same set works for code, records or books.
Add your own with `register_seed`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping

from ..errors import ConfigError
from ..trainer_inputs import SEED_KIND_DOCUMENT

SeedFn = Callable[[random.Random], str]

DATA_FORMATS = ("JSON", "YAML", "TOML", "INI", "XML", "a Markdown table", "a bulleted outline", "CSV")


def structuring(rng: random.Random) -> str:
    fmt = rng.choice(DATA_FORMATS)
    return (
        f"Write one message asking an assistant to reorganise a specific part of the text above as {fmt}. "
        "Name the part you mean clearly (a heading, a topic, a person or an item it discusses) and ask for every "
        "exact detail it contains: names, numbers, dates and quantities. Reply with that message only."
    )


def _one_of(*prompts: str) -> SeedFn:
    """A seed kind that picks one of `prompts` (a kind with a single prompt draws nothing from the generator)."""
    if len(prompts) == 1:
        return lambda rng: prompts[0]
    return lambda rng: rng.choice(prompts)


summarization = _one_of(
    "Write one message asking an assistant to summarise a particular passage of the text above. Say precisely "
    "which passage you mean, using the names, titles or dates that appear in it. Reply with that message "
    "only.",
    "Write a short request for a summary of one section of the text above, identifying the section so that "
    "nobody could mistake it for another. Reply with the request only.",
)
QUESTION_PROMPTS = (  # also what compaction asks the model, for a chunk's own probe questions
    "Ask one question that checks whether someone really knows the text above. Mention the specific names, "
    "numbers or terms the question is about. Reply with the question only.",
    "Write a single question about a concrete fact stated in the text above, phrased so that it makes sense "
    "to someone who cannot see the text. Reply with the question only.",
    "You are quizzing a student on the passage above. Ask them one precise question about it, including "
    "enough detail that the question is unambiguous. Reply with the question only.",
)
question = _one_of(*QUESTION_PROMPTS)
use_case = _one_of(
    "Think about what a person who has this text at hand might actually be trying to get done with it: a "
    "decision, a task, a piece of work. Write the request or question that person would type to an assistant "
    "while doing it. Reply with that request only.",
)
creative = _one_of(
    "Start an imaginative conversation inspired by the text above with one open question to your partner. "
    "Reply with the question only.",
    "Invite your partner to think about the text above from an unusual angle, in one short message. Reply "
    "with the message only.",
)
generic = _one_of(
    "Write one chat message that opens a conversation about the information in the text above: ask a question "
    "about it or make a request. Reply with the message only.",
)


_REGISTRY: dict[str, SeedFn] = {
    "structuring": structuring,
    "summarization": summarization,
    "question": question,
    "use_case": use_case,
    "creative": creative,
    "generic": generic,
}

DEFAULT_WEIGHTS: Mapping[str, float] = {
    "structuring": 1.0,
    "summarization": 1.0,
    "question": 1.0,
    "use_case": 1.0,
    "creative": 1.0,
}
GENERIC_WEIGHTS: Mapping[str, float] = {"generic": 1.0}


def register_seed(name: str, fn: SeedFn) -> None:
    """Add (or replace) a seed prompt kind; `fn(rng)` returns the prompt text."""
    if not callable(fn):
        raise ConfigError(f"Seed prompt {name!r} must be a callable taking a random.Random, got {fn!r}.")
    if name == SEED_KIND_DOCUMENT:
        raise ConfigError(f"The seed kind {name!r} is reserved for document windows; register the prompt under another name.")
    _REGISTRY[name] = fn


def seed_kinds() -> list[str]:
    return sorted(_REGISTRY)


def check_weights(weights: Mapping[str, float]) -> dict[str, float]:
    if not isinstance(weights, Mapping) or not all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights.values()
    ):
        raise ConfigError(f"seed_weights={weights!r:.80} must map seed kinds to finite numbers, e.g. {{'question': 1.0}}.")
    unknown = sorted(set(weights) - set(_REGISTRY))
    if unknown:
        raise ConfigError(f"Unknown seed prompt kind(s) {unknown}; known: {seed_kinds()} (add with register_seed).")
    if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ConfigError(f"Seed weights {dict(weights)} must be >= 0 with a positive sum.")
    return {k: float(w) for k, w in weights.items() if w > 0}


def sample_seed(rng: random.Random, weights: Mapping[str, float] = DEFAULT_WEIGHTS) -> tuple[str, str]:
    """A ``(kind, prompt)`` pair drawn with the given weights."""
    weights = check_weights(weights)
    kinds = sorted(weights)
    kind = rng.choices(kinds, weights=[weights[k] for k in kinds])[0]
    return kind, _REGISTRY[kind](rng)
