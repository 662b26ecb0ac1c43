"""The cartridge file: one ``.safetensors`` file of per-layer tensors plus `CartridgeMeta` as JSON in its header.

Tensors are named ``layers.{i}.keys`` and ``layers.{i}.values`` (`tensor_name`), ``[kv_heads, tokens, head_dim]``
each; the header holds ``format``, ``format_version`` and ``meta``. Reading never unpickles anything, and a file
from a newer format version is refused by name. Every metadata field is type-checked, so crafted metadata is
refused on load rather than failing later inside whatever reads it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from .checks import at_least_one, count
from .errors import CartridgeFormatError, ConfigError
from .files import atomic_write
from .identity import ModelIdentity
from .rope import DEFAULT_KEY_LAYOUT, check_key_layout

FORMAT_NAME = "cartridges-sdk"
FORMAT_VERSION = 1
# the identity fields that decide a KV cache's shape: a cartridge whose metadata lacks them is refused by every model
SHAPE_FIELDS = ("num_layers", "num_kv_heads", "head_dim")
ORIGINS = ("prefix", "compact", "random_text", "random", "composed", "imported", "trained")


def sdk_version() -> str:
    try:
        from importlib.metadata import version

        return version("cartridges-sdk")
    except Exception:
        return "unknown"


def _check_num_frozen(inst: CartridgeMeta, attribute, value: int) -> None:
    count(inst, attribute, value)
    if value > inst.num_tokens:
        raise ConfigError(f"num_frozen={value} cannot exceed the cartridge's num_tokens={inst.num_tokens}.")


def _check_init(_inst, _attr, value: str) -> None:
    if value not in ORIGINS:
        raise ConfigError(f"init={value!r} is not one of {ORIGINS}.")


def _optional_dict(_inst, attribute, value) -> None:
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"{attribute.name}={value!r:.80} must be an object (a dict) or null.")


def _check_parts(_inst, _attr, value: tuple) -> None:
    for i, part in enumerate(value):
        spans = isinstance(part, dict) and [part.get("offset"), part.get("num_tokens")]
        if not spans or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in spans):
            raise ConfigError(f"parts[{i}]={part!r:.80} must be an object with int 'offset' and 'num_tokens' >= 0.")


@attrs.frozen
class CartridgeMeta:
    """Everything a cartridge file says about itself besides its tensors. Every field is type-checked, so a file
    with crafted metadata is refused on load rather than failing later inside whatever reads it."""

    model: ModelIdentity = attrs.field(validator=attrs.validators.instance_of(ModelIdentity))
    num_tokens: int = attrs.field(validator=at_least_one)
    num_frozen: int = attrs.field(default=1, validator=_check_num_frozen)
    dtype: str = attrs.field(default="float32", validator=attrs.validators.instance_of(str))
    init: str = attrs.field(default="prefix", validator=_check_init)
    corpus: dict[str, Any] | None = attrs.field(default=None, validator=_optional_dict)
    training: dict[str, Any] | None = attrs.field(default=None, validator=_optional_dict)
    parts: tuple[dict[str, Any], ...] = attrs.field(default=(), converter=tuple, validator=_check_parts)
    extra: dict[str, Any] = attrs.field(factory=dict, validator=attrs.validators.instance_of(dict))
    # how keys are stored (RoPE applied for positions 0..p-1, and which dimensions pair up); files written before
    # this field existed were all in the Hugging Face rotate-half layout, which is the default
    key_layout: dict[str, Any] = attrs.field(factory=lambda: dict(DEFAULT_KEY_LAYOUT), converter=check_key_layout)
    created: str = attrs.field(factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    sdk_version: str = attrs.field(factory=sdk_version)
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self, recurse=False)
        d["model"] = self.model.to_dict()
        d["parts"] = list(self.parts)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CartridgeMeta:
        data = dict(data)
        data["model"] = ModelIdentity.from_dict(data.get("model") or {"name": "unknown"})
        fields = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


def tensor_name(layer: int, kind: str) -> str:
    """The name of layer `layer`'s ``"keys"`` or ``"values"`` in a cartridge file (and in every engine's copy of it)."""
    return f"layers.{layer}.{kind}"


def layer_tensors(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-layer keys and values as the file's named CPU tensors."""
    return {tensor_name(i, kind): t.detach().to("cpu").contiguous()
            for i, (k, v) in enumerate(zip(keys, values)) for kind, t in (("keys", k), ("values", v))}


def write_file(path: str | os.PathLike, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               meta: CartridgeMeta) -> Path:
    """Write the file atomically (a crash leaves the old file or none, never half of one)."""
    from safetensors.torch import save_file

    tensors = layer_tensors(keys, values)
    metadata = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "meta": json.dumps(meta.to_dict())}
    return atomic_write(Path(path), lambda tmp: save_file(tensors, tmp, metadata=metadata))


# safetensors' dtype names, for tensors described but not read (`read_file(data=False)`)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_file(path: Path, *, data: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor], CartridgeMeta]:
    """Keys, values and metadata of a cartridge file; every way a file can be wrong is a `CartridgeFormatError`.
    With ``data=False`` only the header is read (the file's size is still checked against it): the tensors come back
    on the ``meta`` device, with their shapes and dtypes, for a store that checks many files and loads few."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            names = set(f.keys())
            tensors = {n: f.get_tensor(n) if data else _described(f.get_slice(n)) for n in names}
    except Exception as err:
        if _looks_like_torch_save(path):
            raise CartridgeFormatError(
                f"{str(path)!r} is a PyTorch file (torch.save), not a cartridge file. If it is a cache from the "
                "paper authors' code, import it with Cartridge.from_authors_pt(path, model=lm) and save it."
            ) from None
        raise CartridgeFormatError(
            f"{str(path)!r} is not a readable cartridge file (truncated or corrupt?): {err}. "
            "Re-create or re-copy it."
        ) from err
    if header.get("format") != FORMAT_NAME or "meta" not in header:
        raise CartridgeFormatError(
            f"{str(path)!r} is a safetensors file but not a cartridge (no {FORMAT_NAME!r} metadata)."
        )
    version = header.get("format_version", "0")
    version = int(version) if version.isdigit() else FORMAT_VERSION + 1  # unreadable: from no version we know
    if version > FORMAT_VERSION:
        raise CartridgeFormatError(
            f"{str(path)!r} has format version {version}, newer than this cartridges-sdk ({FORMAT_VERSION}); upgrade it."
        )
    try:
        meta = CartridgeMeta.from_dict(json.loads(header["meta"]))
    except Exception as err:  # noqa: BLE001 - any malformed field is the file's fault, said as such
        raise CartridgeFormatError(
            f"{str(path)!r} has unreadable cartridge metadata ({type(err).__name__}: {err}); re-create the file."
        ) from err
    num_layers = sum(1 for n in names if n.endswith(".keys"))
    expected = {tensor_name(i, kind) for i in range(num_layers) for kind in ("keys", "values")}
    if not num_layers or names != expected:
        raise CartridgeFormatError(
            f"{str(path)!r} has tensors {sorted(names)[:4]}... but a cartridge needs layers.<i>.keys/values "
            f"for i in 0..{max(num_layers - 1, 0)}."
        )
    keys = [tensors[tensor_name(i, "keys")] for i in range(num_layers)]
    values = [tensors[tensor_name(i, "values")] for i in range(num_layers)]
    return keys, values, meta


def _described(view) -> torch.Tensor:
    dtype = _DTYPES.get(view.get_dtype())
    if dtype is None:
        raise ValueError(f"tensor dtype {view.get_dtype()} is not a cartridge's")
    return torch.empty(view.get_shape(), dtype=dtype, device="meta")


def _looks_like_torch_save(path: Path) -> bool:
    """torch.save writes a zip archive (or, in old versions, a pickle starting with protocol byte 0x80)."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"
