"""cartridges-sdk: turn a large corpus into a small trained KV cache (a cartridge) that a frozen LLM reads as context.

The public API: what is imported here is promised to stay. Backends also use `cartridges_sdk.kit`; the package's
layers are drawn in docs/architecture.md.
"""

from .making.compaction import CompactionConfig
from .making.corpus import Corpus, Document
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
from .identity import ModelIdentity
from .lm import LM
from .models import default_cache_dir, load_model
from .plugins import Backend, ContinuousRuntime, Runtime, Synthesizer, SynthesizerCapabilities, Trainer, TrainerCapabilities
from .requests import Completion, GenerationParams, GenerationRequest, SynthesisRequest
from .serve.store import CartridgeStore
from .serve.sync import SyncConfig, SyncReport

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
    "Document",
    "GenerationParams",
    "GenerationRequest",
    "IncompatibleCartridgeError",
    "ModelIdentity",
    "ModelNotAvailableError",
    "NotInStoreError",
    "PluginError",
    "RateLimitedError",
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
    "default_cache_dir",
    "load_model",
]
