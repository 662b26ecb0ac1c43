"""The model and the cartridge as the modules below `LM` and `Cartridge` see them: typing Protocols, no code.

`LM` answers through the runtimes of the registry, and a `Cartridge` is made from an `LM`, so the modules those two
stand on (generation requests, the backend ABCs, the KV helpers, the sampling rules) cannot import them without
an import cycle. They name these Protocols instead, each with only the attributes they read; `LM` and `Cartridge`
satisfy them, which a type checker verifies wherever one is passed.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .fileformat import CartridgeMeta
from .identity import ModelIdentity


class ModelFacts(Protocol):
    """Which model it is and how its KV cache is shaped: what the wrong-model check reads (`Cartridge.misfit`)."""

    @property
    def name(self) -> str: ...

    @property
    def identity(self) -> ModelIdentity: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


class RunningModel(ModelFacts, Protocol):
    """A loaded model (an `LM`): the transformers model and tokenizer, where and in what dtype it runs, and the
    tokens that end an answer. What a backend is built on, and what the KV helpers and the stop rule read."""

    @property
    def model(self) -> Any: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def eos_token_ids(self) -> set[int]: ...


class KVPrefix(Protocol):
    """A cartridge (a `Cartridge`) as a request carries it and a runtime installs it: per-layer keys and values, the
    metadata, the content fingerprint engines key installs on, the key pairing, and the wrong-model check."""

    @property
    def keys(self) -> list[torch.Tensor]: ...

    @property
    def values(self) -> list[torch.Tensor]: ...

    @property
    def meta(self) -> CartridgeMeta: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    def in_key_pairing(self, pairing: str) -> KVPrefix: ...

    def check_model(self, lm: ModelFacts, whose: str = ..., what: str = ...) -> None: ...
