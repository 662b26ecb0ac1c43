"""Who a model is, and short fingerprints of models, token sequences and cartridge contents.

Compatibility is decided by what shapes a KV cache (architecture, RoPE, vocabulary, tokenizer), never by a name:
the same weights may be called many things, and two different models may share a name.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

# the architecture fields `architecture_of` records; a strict comparison needs every one of them on both sides
ARCHITECTURE_FIELDS = (
    "model_type", "num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size", "rope", "partial_rotary_factor",
)
# the `source` of the embedded default model (`load_model()` with no argument): a name, not a path or hub id
DEFAULT_MODEL_SOURCE = "default"


@attrs.frozen
class ModelIdentity:
    """Who a cartridge belongs to. Compatibility is decided by `architecture` and `tokenizer`, never by name."""

    name: str = attrs.field(validator=attrs.validators.instance_of(str))
    source: str | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str)))
    revision: str | None = attrs.field(default=None,
                                       validator=attrs.validators.optional(attrs.validators.instance_of(str)))
    architecture: dict[str, Any] = attrs.field(factory=dict, validator=attrs.validators.instance_of(dict))
    tokenizer: str | None = attrs.field(default=None,
                                        validator=attrs.validators.optional(attrs.validators.instance_of(str)))

    @property
    def fingerprint(self) -> str:
        blob = json.dumps({"architecture": self.architecture, "tokenizer": self.tokenizer}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def mismatch(self, other: ModelIdentity, *, strict: bool = False) -> str | None:
        """Describe why a cartridge for `self` cannot run on `other`, or None if it can.

        Lenient (the default, for cartridges): fields missing on either side are not compared, so an import that only
        knew tensor shapes still binds. Strict (for a synthesizer that must serve the student's own model): every
        architecture field and the tokenizer fingerprint must be present on both sides and equal; a missing field is
        a mismatch, because nothing proves it matches.
        """
        problems = []
        keys = set(ARCHITECTURE_FIELDS) | set(self.architecture) | set(other.architecture) if strict else (
            set(self.architecture) & set(other.architecture))
        for key in sorted(keys):
            mine, theirs = self.architecture.get(key, _MISSING), other.architecture.get(key, _MISSING)
            if mine is _MISSING or theirs is _MISSING:
                problems.append(f"{key}: {_show(mine)} vs {_show(theirs)}")
            elif mine != theirs:
                problems.append(f"{key}: {mine!r} vs {theirs!r}")
        if strict and not (self.tokenizer and other.tokenizer):
            problems.append(f"tokenizer vocabulary: {self.tokenizer or 'not reported'} vs {other.tokenizer or 'not reported'}")
        elif self.tokenizer and other.tokenizer and self.tokenizer != other.tokenizer:
            problems.append(f"tokenizer vocabulary: {self.tokenizer} vs {other.tokenizer}")
        return "; ".join(problems) or None

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self) | {"fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelIdentity:
        fields = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


_MISSING = object()


def _show(value: Any) -> str:
    return "not reported" if value is _MISSING else repr(value)


def _num(x: Any) -> Any:
    """Normalise numbers so that configs read from GGUF (floats) and JSON (ints) fingerprint alike."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, dict):
        return {str(k): _num(v) for k, v in sorted(x.items())}
    if isinstance(x, (list, tuple)):
        return [_num(v) for v in x]
    return str(x)


def architecture_of(config: Any) -> dict[str, Any]:
    """The parts of a transformers config that decide whether a KV cache from one model is valid in another."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    rope = getattr(text, "rope_parameters", None)
    if rope is None:
        rope = {"rope_theta": getattr(text, "rope_theta", None), **(getattr(text, "rope_scaling", None) or {})}
    return {
        "model_type": text.model_type,
        "num_layers": int(text.num_hidden_layers),
        "num_kv_heads": int(getattr(text, "num_key_value_heads", None) or heads),
        "head_dim": int(head_dim),
        "hidden_size": int(text.hidden_size),
        "vocab_size": int(text.vocab_size),
        "rope": _num(dict(rope)),
        "partial_rotary_factor": _num(getattr(text, "partial_rotary_factor", 1.0)),
    }


def tokenizer_fingerprint(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def text_fingerprint(text: str) -> str:
    """A short hash of a text: names a corpus (`Corpus.fingerprint`, a dataset's header) without storing it."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def token_fingerprint(ids: Sequence[int]) -> str:
    """A short hash of a token sequence: names the corpus a cartridge came from without storing it."""
    return hashlib.sha256(torch.as_tensor(list(ids), dtype=torch.int64).numpy().tobytes()).hexdigest()[:16]


def content_fingerprint(tensors: Iterable[torch.Tensor], facts: dict[str, Any]) -> str:
    """A stable hash of tensors (bytes, shapes, dtypes) and JSON-able facts: equal content gives an equal hash,
    whenever and wherever it was made, so engines can key what they have installed on it."""
    h = hashlib.sha256(json.dumps(facts, sort_keys=True).encode())
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:32]
