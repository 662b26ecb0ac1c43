"""How a run's settings name its folders and result files, so a run with other settings never reuses them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from cartridges_sdk.making.settings import CompactionConfig, with_recipe


def settings_tag(settings: Mapping[str, Any] | None) -> str:
    """``k=v`` for each setting, sorted by name and joined with ``-`` ("" for none)."""
    return "-".join(f"{k}={plain(v)}" for k, v in sorted((settings or {}).items()))


def plain(value: Any) -> str:
    """A setting's value as part of a path: a mapping's or list's repr would put quotes, braces and spaces in it
    (``seed_weights={'question': 1}``), so its items are joined plainly (``seed_weights=question:1``)."""
    if isinstance(value, Mapping):
        return "+".join(f"{k}:{plain(v)}" for k, v in sorted(value.items()))
    if isinstance(value, (list, tuple)):
        return "+".join(plain(v) for v in value)
    return str(value)


def recipe_flags(name: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``--set`` settings and ``--compaction`` keys a recipe (`making.settings.RECIPES`) stands for, as those
    flags parse, so a run with ``--recipe`` names its folders and results as the run with the flags spelled out
    does, and reuses its work. An unknown name raises the SDK's `ConfigError`, naming the recipes."""
    if name is None:
        return {}, {}
    settings = with_recipe({"recipe": name})
    start = settings.pop("compaction", None) or CompactionConfig()
    return settings, attrs.asdict(start, filter=lambda field, value: value != field.default)
