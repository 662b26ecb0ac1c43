"""cartridges-sdk: turn a large corpus into a small trained KV cache (a cartridge) that a frozen LLM reads as context."""

from .cartridge import Cartridge, CartridgeMeta
from .corpus import Corpus, Document
from .errors import (
    CartridgeError,
    CartridgeFormatError,
    ConfigError,
    IncompatibleCartridgeError,
    ModelNotAvailableError,
    PluginError,
    UnsupportedModelError,
)
from .models import LM, ModelIdentity, default_cache_dir, load_model
from .plugins import Completion, GenerationParams, Runtime, Synthesizer, Trainer

__all__ = [
    "LM",
    "Cartridge",
    "CartridgeError",
    "CartridgeFormatError",
    "CartridgeMeta",
    "Completion",
    "ConfigError",
    "Corpus",
    "Document",
    "GenerationParams",
    "IncompatibleCartridgeError",
    "ModelIdentity",
    "ModelNotAvailableError",
    "PluginError",
    "Runtime",
    "Synthesizer",
    "Trainer",
    "UnsupportedModelError",
    "default_cache_dir",
    "load_model",
]
