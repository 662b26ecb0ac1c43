"""cartridges-sdk: turn a large corpus into a small trained KV cache (a cartridge) that a frozen LLM reads as context.

The public API: what is imported here is promised to stay. Backends also use `cartridges_sdk.kit`; the package's
layers are drawn in docs/architecture.md. The names of the making and serve layers (`Corpus`, `CartridgeStore`, ...)
are imported on first use (`__getattr__`), so importing the package, or the kit every backend imports, loads neither
layer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .cartridge import Cartridge
from .errors import (
    BackendError,
    BackendUnavailableError,
    CartridgeError,
    CartridgeFormatError,
    ConfigError,
    IncompatibleCartridgeError,
    ModelNotAvailableError,
    NotInStoreError,
    PluginError,
    RateLimitedError,
    TransientBackendError,
    UnsupportedModelError,
)
from .fileformat import CartridgeMeta
from .generation import Completion, GenerationParams, GenerationRequest, SynthesisRequest
from .identity import ModelIdentity
from .lm import LM
from .models import default_cache_dir, load_model
from .plugins import Backend, ContinuousRuntime, Runtime, Synthesizer, SynthesizerCapabilities, Trainer, TrainerCapabilities

if TYPE_CHECKING:
    from .making.corpus import Corpus, Document
    from .making.report import CorpusReport, check_quality
    from .making.settings import CompactionConfig, ReportConfig
    from .serve.settings import SyncConfig
    from .serve.store import CartridgeStore
    from .serve.sync import SyncReport

# public names of the layers above the core, by the module that defines them (the same as the imports above)
_LAZY = {
    "CompactionConfig": "making.settings",
    "ReportConfig": "making.settings",
    "CorpusReport": "making.report",
    "check_quality": "making.report",
    "Corpus": "making.corpus",
    "Document": "making.corpus",
    "CartridgeStore": "serve.store",
    "SyncConfig": "serve.settings",
    "SyncReport": "serve.sync",
}


def __getattr__(name: str) -> Any:
    """A making- or serve-layer name, imported when first asked for (PEP 562) and kept."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "LM",
    "Backend",
    "BackendError",
    "BackendUnavailableError",
    "Cartridge",
    "CartridgeError",
    "CartridgeFormatError",
    "CartridgeMeta",
    "CartridgeStore",
    "CompactionConfig",
    "Completion",
    "ConfigError",
    "ContinuousRuntime",
    "Corpus",
    "CorpusReport",
    "Document",
    "GenerationParams",
    "GenerationRequest",
    "IncompatibleCartridgeError",
    "ModelIdentity",
    "ModelNotAvailableError",
    "NotInStoreError",
    "PluginError",
    "RateLimitedError",
    "ReportConfig",
    "Runtime",
    "SyncConfig",
    "SyncReport",
    "SynthesisRequest",
    "Synthesizer",
    "SynthesizerCapabilities",
    "Trainer",
    "TrainerCapabilities",
    "TransientBackendError",
    "UnsupportedModelError",
    "check_quality",
    "default_cache_dir",
    "load_model",
]
