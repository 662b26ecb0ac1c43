"""cartridges-sdk: turn a large corpus into a small trained KV cache (a cartridge) that a frozen LLM reads as context."""

from .cartridge import Cartridge, CartridgeMeta
from .build.compaction import CompactionConfig
from .build.corpus import Corpus, Document
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
from .models import default_cache_dir, load_model
from .lm import LM
from .identity import ModelIdentity
from .plugins import Backend, ContinuousRuntime, Runtime, Synthesizer, SynthesizerCapabilities, Trainer
from .requests import Completion, GenerationParams, GenerationRequest, SynthesisRequest
from .serve.store import CartridgeStore

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
