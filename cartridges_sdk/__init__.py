"""cartridges-sdk: turn a large corpus into a small trained KV cache (a cartridge) that a frozen LLM reads as context."""

from .cartridge import Cartridge, CartridgeMeta
from .compaction import CompactionConfig
from .corpus import Corpus, Document
from .errors import (
    BackendError,
    BackendUnavailableError,
    CartridgeError,
    CartridgeFormatError,
    ConfigError,
    IncompatibleCartridgeError,
    ModelNotAvailableError,
    PluginError,
    RateLimitedError,
    TransientBackendError,
    UnsupportedModelError,
)
from .models import LM, ModelIdentity, default_cache_dir, load_model
from .plugins import (
    Backend,
    Completion,
    ContinuousRuntime,
    GenerationParams,
    GenerationRequest,
    Runtime,
    SynthesisRequest,
    Synthesizer,
    SynthesizerCapabilities,
    Trainer,
)
from .store import CartridgeStore

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
    "PluginError",
    "RateLimitedError",
    "Runtime",
    "SynthesisRequest",
    "Synthesizer",
    "SynthesizerCapabilities",
    "Trainer",
    "TransientBackendError",
    "UnsupportedModelError",
    "default_cache_dir",
    "load_model",
]
