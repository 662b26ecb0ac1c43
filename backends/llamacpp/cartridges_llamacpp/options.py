"""The runtime's options, validated when built, with errors that name the bad value."""

from __future__ import annotations

from pathlib import Path

import attrs

from cartridges_sdk import ConfigError
from cartridges_sdk.kit import at_least_one, boolean


def _gguf(_inst, attribute, value) -> None:
    if value is not None and not Path(value).is_file():
        raise ConfigError(f"{attribute.name}={value!r} is not a file; give the path of the model's .gguf.")


def _threads(_inst, attribute, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{attribute.name}={value!r} must be a positive int (or None: llama.cpp's default).")


@attrs.frozen
class LlamaCppOptions:
    # the GGUF llama.cpp runs; default: the one the student was loaded from (the embedded model, a named model or a
    # .gguf path). It must be the student's model:
    # its architecture is checked against the student's when the runtime starts
    gguf: str | None = attrs.field(default=None, validator=_gguf)
    # positions one sequence may hold: cartridge + conversation + answer; None: the model's own context, as the HF
    # runtime allows (its f16 KV cache for all of it is allocated at start: 0.4 GB for the 0.5B reader's 32k)
    n_ctx: int | None = attrs.field(default=None, validator=attrs.validators.optional(at_least_one))
    # CPU threads for decoding; None: llama.cpp's default
    n_threads: int | None = attrs.field(default=None, validator=_threads)
    # llama.cpp's flash attention (its V cache is then stored untransposed); either way cartridges load exactly
    flash_attn: bool = attrs.field(default=False, validator=boolean)
    # llama.cpp's own log on stderr (why it refused a state, timings)
    verbose: bool = attrs.field(default=False, validator=boolean)
