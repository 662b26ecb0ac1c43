"""How much work a benchmark run does: `quick` fits one document in half an hour on a 2-core CPU, `full` is the
measurement we quote. Every figure a run writes names its profile, so the two are never mixed up."""

from __future__ import annotations

import attrs

from cartridges_sdk.checks import at_least_one, positive
from cartridges_sdk.errors import ConfigError


def _sizes(_inst, _attr, value: tuple[int, ...]) -> None:
    if not value or any(not isinstance(p, int) or p < 2 for p in value):
        raise ConfigError(f"sizes={value!r} must be one or more cartridge sizes >= 2 tokens.")


@attrs.frozen
class Profile:
    """Budgets of one run. Self-study synthesis is shared by all sizes (the teacher never sees the cartridge);
    next-token prediction on the raw document gets as many training tokens as full self-study, so the two
    trained baselines are compared at equal training compute."""

    name: str
    sizes: tuple[int, ...] = attrs.field(default=(128, 512, 2048), converter=tuple, validator=_sizes)
    conversations: int = attrs.field(default=128, validator=at_least_one)  # full self-study (the SDK's default)
    document_windows: int = attrs.field(default=96, validator=at_least_one)  # full self-study (the SDK's default)
    generic_conversations: int = attrs.field(default=128, validator=at_least_one)
    epochs: int = attrs.field(default=1, validator=at_least_one)
    mmlu_per_topic: int = attrs.field(default=4, validator=at_least_one)  # 57 topics
    kv_budget_gib: float = attrs.field(default=2.0, validator=positive)  # serving memory for all users' KV
    decode_tokens: int = attrs.field(default=32, validator=at_least_one)
    expected_minutes_per_document: int = 0  # what we measured; shown in --help and in the docs


PROFILES = {
    "quick": Profile(
        "quick", conversations=48, document_windows=48, generic_conversations=48, mmlu_per_topic=1,
        decode_tokens=8, expected_minutes_per_document=26,  # measured: 25.6 min on QASPER paper 0
    ),
    "full": Profile("full", expected_minutes_per_document=60),  # estimated from the quick run's rates
}


def get_profile(name: str, **overrides) -> Profile:
    """A named profile with some budgets changed; a changed profile is renamed so its figures are not mistaken."""
    if name not in PROFILES:
        raise ConfigError(f"--profile {name!r} is not one of {sorted(PROFILES)}.")
    known = {f.name for f in attrs.fields(Profile)} - {"name", "expected_minutes_per_document"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"Unknown profile setting(s) {unknown}; known: {sorted(known)}.")
    if not overrides:
        return PROFILES[name]
    return attrs.evolve(PROFILES[name], name=f"{name}+custom", **overrides)
