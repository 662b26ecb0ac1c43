"""`runtime="auto"`, the default wherever a runtime is named: the fastest installed runtime for the model here.

On a CPU, llama.cpp runs a GGUF reader's quantized weights with its own kernels and answers several times faster than
the HF runtime's float32 copy of them (docs/runtimes.md has the figures and the command that measures them); for any
other model, or on a GPU, the HF runtime. Exactness (a cartridge of a text's first tokens answers as the text in
context) holds inside each runtime, so a comparison is only fair when both sides use the same one, as they do when
both say "auto" for the same model.
"""

from __future__ import annotations

import warnings
from typing import Any

from .errors import BackendUnavailableError, ConfigError, PluginError
from .plugins import runtimes

AUTO = "auto"
FALLBACK = "hf"
# runtimes tried before the fallback, fastest first; each says itself whether it serves a model fast
# (`Runtime.serves_fast`)
PREFERRED = ("llamacpp",)


def choose_runtime(lm: Any) -> str:
    """The runtime name `"auto"` stands for with `lm`: the first of `PREFERRED` that is installed and serves `lm` fast,
    else the HF runtime. A preferred runtime that is registered but cannot be imported is passed over with a warning
    that names the error, so a broken install is seen, not silently slower."""
    installed = set(runtimes.names())
    for name in PREFERRED:
        if name not in installed:
            continue
        try:
            cls = runtimes.get(name)
        except (BackendUnavailableError, PluginError) as err:
            warnings.warn(f'runtime="auto" passed over {name!r}, which failed to import ({err}); answering with '
                          f'{FALLBACK!r}, which is slower here. Fix or uninstall that backend.', stacklevel=3)
            continue
        try:
            fast = cls.serves_fast(lm)
        except Exception as err:  # a plugin's bug must not break every default call
            warnings.warn(f'runtime="auto" passed over {name!r}: its serves_fast raised {type(err).__name__}: {err}; '
                          f'answering with {FALLBACK!r}.', stacklevel=3)
            continue
        if fast:
            return name
    return FALLBACK


def runtime_name(name: str, lm: Any, options: dict[str, Any] | None = None) -> str:
    """`name`, with `"auto"` resolved for `lm`. Options belong to one runtime, so they need its name: with "auto" they
    are refused, naming the runtime it picked."""
    if name != AUTO:
        return name
    chosen = lm.auto_runtime  # chosen once per model (`choose_runtime`)
    if options:
        raise ConfigError(f"runtime options {sorted(options)} need a runtime name: runtime='auto' picks {chosen!r} for "
                          f"{lm.name!r} here, so pass runtime={chosen!r} (CLI: --runtime {chosen}) with them.")
    return chosen
