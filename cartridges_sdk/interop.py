"""Import/export of other projects' cartridge formats: peft's CARTRIDGE adapter and the paper authors' ``.pt`` caches.

Everything here works on a cartridge's parts (keys, values, `CartridgeMeta`); `Cartridge.to_peft`, `from_peft` and
`from_authors_pt` wrap it (and check an import against the model it is given).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from .errors import CartridgeFormatError
from .fileformat import CartridgeMeta
from .files import atomic_write
from .identity import DEFAULT_MODEL_SOURCE, ModelIdentity

# a cartridge in parts: per-layer keys, per-layer values, metadata
Parts = tuple[list[torch.Tensor], list[torch.Tensor], CartridgeMeta]
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def _shape_identity(name: str, num_layers: int, kv_heads: int, head_dim: int) -> ModelIdentity:
    """What an import knows of its model when no model is given: only the tensor shapes."""
    return ModelIdentity(
        name=name, architecture={"num_layers": num_layers, "num_kv_heads": kv_heads, "head_dim": head_dim}
    )


def _imported(keys, values, num_frozen: int, identity: ModelIdentity, source: str) -> Parts:
    meta = CartridgeMeta(
        model=identity,
        num_tokens=keys[0].shape[1],
        num_frozen=num_frozen,
        dtype=str(keys[0].dtype).removeprefix("torch."),
        init="imported",
        extra={"imported_from": source},
    )
    return keys, values, meta


def _peft_base_name(identity: ModelIdentity) -> str:
    return identity.name if identity.source in (None, DEFAULT_MODEL_SOURCE) else identity.source


def save_peft(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], meta: CartridgeMeta, directory: Path) -> Path:
    """Write peft's layout: ``prompt_embeddings`` of shape ``[p, layers * 2 * kv_heads * head_dim]``, K then V per layer."""
    from safetensors.torch import save_file

    kv_heads, p, head_dim = keys[0].shape
    per_layer = []
    for k, v in zip(keys, values):
        per_layer += [k.transpose(0, 1), v.transpose(0, 1)]  # [p, kv_heads, head_dim] each
    embeddings = torch.stack(per_layer, dim=1).reshape(p, -1).contiguous().cpu()
    config = {
        "peft_type": "CARTRIDGE",
        "task_type": "CAUSAL_LM",
        # what peft would load as the base model: a path or hub id, never our "default" alias
        "base_model_name_or_path": _peft_base_name(meta.model),
        "revision": meta.model.revision,
        "inference_mode": True,
        "num_virtual_tokens": p,
        "num_frozen_tokens": meta.num_frozen,
        "token_dim": kv_heads * head_dim,
        "num_transformer_submodules": 1,
        "num_attention_heads": kv_heads,
        "num_layers": len(keys),
    }
    directory.mkdir(parents=True, exist_ok=True)
    # the SDK's own metadata rides along in the safetensors header so a round trip loses nothing
    header = {"format": "pt", "cartridges_sdk_meta": json.dumps(meta.to_dict())}
    for name, write in (
        (PEFT_WEIGHTS, lambda tmp: save_file({"prompt_embeddings": embeddings}, tmp, metadata=header)),
        (PEFT_CONFIG, lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2))),
    ):
        atomic_write(directory / name, write)
    return directory


def load_peft(directory: Path) -> Parts:
    from safetensors import safe_open

    config_path, weights_path = directory / PEFT_CONFIG, directory / PEFT_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise CartridgeFormatError(
            f"{str(directory)!r} is not a peft adapter directory: it needs {PEFT_CONFIG} and {PEFT_WEIGHTS}."
        )
    try:
        config = json.loads(config_path.read_text())
        with safe_open(str(weights_path), framework="pt") as f:
            header = f.metadata() or {}
            embeddings = f.get_tensor("prompt_embeddings")
    except Exception as err:
        raise CartridgeFormatError(f"Cannot read the peft adapter in {str(directory)!r}: {err}") from err
    if config.get("peft_type") != "CARTRIDGE":
        raise CartridgeFormatError(
            f"{str(directory)!r} holds a peft {config.get('peft_type')!r} adapter, not a CARTRIDGE adapter."
        )
    if config.get("num_transformer_submodules", 1) != 1:
        raise CartridgeFormatError("Only decoder-only (num_transformer_submodules=1) CARTRIDGE adapters are supported.")
    p, layers, heads = config["num_virtual_tokens"], config["num_layers"], config["num_attention_heads"]
    head_dim = config["token_dim"] // heads
    if tuple(embeddings.shape) != (p, layers * 2 * heads * head_dim):
        raise CartridgeFormatError(
            f"prompt_embeddings has shape {tuple(embeddings.shape)}, but the config implies {(p, layers * 2 * heads * head_dim)}."
        )
    grid = embeddings.view(p, layers * 2, heads, head_dim).permute(1, 2, 0, 3)  # [2L, heads, p, head_dim]
    keys = [grid[2 * i].contiguous() for i in range(layers)]
    values = [grid[2 * i + 1].contiguous() for i in range(layers)]
    if "cartridges_sdk_meta" in header:  # written by us: restore everything
        return keys, values, CartridgeMeta.from_dict(json.loads(header["cartridges_sdk_meta"]))
    identity = _shape_identity(config.get("base_model_name_or_path") or "unknown", layers, heads, head_dim)
    return _imported(keys, values, int(config.get("num_frozen_tokens", 1)), identity, f"peft adapter {str(directory)!r}")


def load_authors_pt(path: Path, name: str | None = None) -> Parts:
    """Read ``{trainable_keys, trainable_values, frozen_keys|fixed_keys, frozen_values|fixed_values}``.

    Each entry is a per-layer list of ``[1, kv_heads, tokens, head_dim]`` tensors; frozen tokens come first.
    Loaded with ``weights_only=True``, so no code in the file can run.
    """
    if not path.is_file():
        raise CartridgeFormatError(f"No file at {str(path)!r}.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        # torch's own message suggests weights_only=False, which would run whatever code the file holds: not said here
        raise CartridgeFormatError(
            f"{str(path)!r} was refused: it is not a file of plain tensors (it holds other Python objects, which could "
            "run code when loaded, or it is damaged). If you trust its source, convert it once, in a separate "
            "trusted step, to a dict of per-layer tensor lists (trainable_keys, trainable_values, frozen_keys, "
            "frozen_values) saved with torch.save, and import that with Cartridge.from_authors_pt."
        ) from None
    if not isinstance(state, dict) or "trainable_keys" not in state or "trainable_values" not in state:
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CartridgeFormatError(
            f"{str(path)!r} is not an authors' cartridge cache: expected trainable_keys/trainable_values, found {found}."
        )
    prefix = "frozen" if "frozen_keys" in state else "fixed" if "fixed_keys" in state else None

    def layers(name: str) -> list[torch.Tensor]:
        items = state[name]
        if not isinstance(items, (list, tuple)) or not items or any(t.ndim != 4 or t.shape[0] != 1 for t in items):
            raise CartridgeFormatError(f"{name} in {str(path)!r} must be a per-layer list of [1, kv_heads, tokens, head_dim] tensors.")
        return [t[0] for t in items]

    tk, tv = layers("trainable_keys"), layers("trainable_values")
    if prefix is not None:
        fk, fv = layers(f"{prefix}_keys"), layers(f"{prefix}_values")
        if len(fk) != len(tk):
            raise CartridgeFormatError(f"{str(path)!r} has {len(fk)} {prefix} layers but {len(tk)} trainable layers.")
        keys = [torch.cat([f, t], dim=1) for f, t in zip(fk, tk)]
        values = [torch.cat([f, t], dim=1) for f, t in zip(fv, tv)]
        num_frozen = fk[0].shape[1]
    else:
        keys, values, num_frozen = tk, tv, 0
    heads, _, head_dim = keys[0].shape
    identity = _shape_identity(name or path.stem, len(keys), heads, head_dim)
    return _imported(keys, values, num_frozen, identity, f"authors' cache {str(path)!r}")
