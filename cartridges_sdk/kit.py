"""The backend kit: everything a backend (a runtime, synthesizer or trainer plugin) may use, and all it should.

Backends import from here and from the public API (``cartridges_sdk``) only; the rest of the package may change
between releases, this module's names may not. A test checks every module under ``backends/`` against this rule,
and the built-in HF backend (``cartridges_sdk.hf``) keeps it too. `docs/writing-a-backend.md` says how each piece
is meant to be used.
"""

from __future__ import annotations

from .cartridge import Cartridge
from .checks import PATH, at_least_one, boolean, count, fraction, is_loopback, non_negative, one_of, optional_int, \
    positive, require, unit_interval
from .errors import (BackendError, BackendUnavailableError, CartridgeError, CartridgeFormatError, ConfigError,
                     IncompatibleCartridgeError, ModelNotAvailableError, PluginError, RateLimitedError,
                     TransientBackendError, UnsupportedModelError)
from .fileformat import CartridgeMeta, layer_tensors, tensor_name
from .files import atomic_write, atomic_write_json
from .generation import (Completion, GenerationParams, GenerationRequest, Message, SynthesisRequest, check_fits,
                         settled_delta, text_deltas)
from .identity import ModelIdentity, architecture_of, tokenizer_fingerprint
from .kv import Layers, PackedRows, Recent, concat_layers, decoding_kernels, join_layers, prefix_cache, refuse_foreign, rows_prefix_cache
from .lm import LM, autocast, resolve_dtype, rope_inv_freq
from .models import default_model_gguf
from .net import free_port
from .plugins import (Backend, ContinuousRuntime, NoOptions, Runtime, Synthesizer, SynthesizerCapabilities, Trainer,
                      TrainerCapabilities, runtimes, synthesizers, trainers)
from .probe import PROBE_TOLERANCE, PROBE_TOP_K, check_probe, probe_gap, probe_request
from .protocols import KVPrefix, ModelFacts, RunningModel
from .rope import INTERLEAVED, ROTATE_HALF, key_layout, shift_keys
from .sampling import ends_answer, sample_next
from .trainer_inputs import SEED_KIND_DOCUMENT, Conversation, TrainConfig, TrainingData

__all__ = [
    # the contract: what a backend implements and what flows through it
    "Backend", "Runtime", "ContinuousRuntime", "Synthesizer", "Trainer", "NoOptions", "SynthesizerCapabilities",
    "TrainerCapabilities",
    # the registries, by name (a plugin's tests build their backend as users do)
    "runtimes", "synthesizers", "trainers",
    "GenerationRequest", "GenerationParams", "SynthesisRequest", "Completion", "Message",
    # what a trainer is given: its settings and the self-study conversations (document windows: SEED_KIND_DOCUMENT)
    "TrainConfig", "TrainingData", "Conversation", "SEED_KIND_DOCUMENT",
    # the nouns
    "LM", "Cartridge", "CartridgeMeta", "ModelIdentity", "architecture_of", "tokenizer_fingerprint", "autocast",
    "resolve_dtype",
    "default_model_gguf",
    # what the contract's signatures name of a model and a cartridge (an `LM` and a `Cartridge` are both)
    "RunningModel", "ModelFacts", "KVPrefix",
    # rules every engine follows (the prompt rule is `LM.prompt_ids`)
    "check_fits", "refuse_foreign", "ends_answer", "sample_next", "settled_delta", "text_deltas",
    # KV and RoPE
    "Layers", "PackedRows", "Recent", "concat_layers", "join_layers", "prefix_cache", "rows_prefix_cache", "decoding_kernels", "tensor_name", "layer_tensors",
    "ROTATE_HALF", "INTERLEAVED", "key_layout", "rope_inv_freq", "shift_keys",
    # vetting a teacher: the same-model probe
    "PROBE_TOLERANCE", "PROBE_TOP_K", "check_probe", "probe_gap", "probe_request",
    # options, files, servers
    "PATH", "at_least_one", "boolean", "count", "fraction", "non_negative", "one_of", "optional_int", "positive",
    "require", "unit_interval", "is_loopback", "atomic_write", "atomic_write_json", "free_port",
    # errors
    "CartridgeError", "ConfigError", "ModelNotAvailableError", "IncompatibleCartridgeError", "CartridgeFormatError",
    "PluginError", "UnsupportedModelError", "BackendError", "BackendUnavailableError", "TransientBackendError",
    "RateLimitedError",
]
