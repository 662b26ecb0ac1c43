"""RoPE maths on stored keys: moving keys to other positions, and converting between key layouts.

A cartridge stores keys after RoPE. Hugging Face models rotate dimension pairs ``(i, i + rot/2)`` ("rotate half");
other engines rotate adjacent pairs ``(2i, 2i + 1)`` ("interleaved"; e.g. llama.cpp after the HF -> GGUF conversion
permutes Llama-family Q/K rows). Both describe the same rotation on differently ordered dimensions, so a layout
change is a fixed permutation of each head's dimensions and loses nothing. A model's frequencies come from
`lm.rope_inv_freq`, which reads its buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .errors import CartridgeFormatError, UnsupportedModelError

# RoPE variants whose rotation angle is position * inv_freq, so a shift by d positions is one extra rotation.
POSITION_ADDITIVE_ROPE = {"default", "linear", "llama3", "yarn"}

ROTATE_HALF = "rotate_half"
INTERLEAVED = "interleaved"
PAIRINGS = (ROTATE_HALF, INTERLEAVED)


def key_layout(pairing: str = ROTATE_HALF) -> dict[str, Any]:
    """How a cartridge file stores its keys: RoPE already applied, for positions 0..p-1, with this pairing."""
    if pairing not in PAIRINGS:
        raise CartridgeFormatError(f"Key pairing {pairing!r} is not one of {PAIRINGS}.")
    return {"rope_applied": True, "positions": "0..p-1", "pairing": pairing}


DEFAULT_KEY_LAYOUT = key_layout(ROTATE_HALF)  # what every file without the field was written in


def check_key_layout(layout: dict[str, Any]) -> dict[str, Any]:
    """`layout` if this SDK understands it; otherwise an error that names the field and value it does not."""
    if not isinstance(layout, dict):
        raise CartridgeFormatError(f"key_layout must be an object, got {layout!r}.")
    want = key_layout(layout.get("pairing", ROTATE_HALF))
    for field, value in want.items():
        if layout.get(field, value) != value:
            raise CartridgeFormatError(
                f"key_layout {field}={layout.get(field)!r} is not supported (expected {value!r}); "
                "convert the keys to post-RoPE keys for positions 0..p-1 before loading."
            )
    return want


def convert_pairing(keys: torch.Tensor, source: str, target: str, rotary_dims: int | None = None) -> torch.Tensor:
    """Re-lay keys ``[..., head_dim]`` from one pairing to the other; the first `rotary_dims` dims rotate
    (all by default), the rest stay where they are. Exact: a permutation of dimensions."""
    key_layout(source), key_layout(target)
    if source == target:
        return keys.clone()
    rot = keys.shape[-1] if rotary_dims is None else rotary_dims
    if rot % 2 or rot > keys.shape[-1]:
        raise UnsupportedModelError(f"rotary_dims={rot} must be even and at most head_dim={keys.shape[-1]}.")
    half = torch.arange(rot // 2)
    interleaved_from_half = torch.stack([half, half + rot // 2], dim=-1).reshape(-1)  # new[2i], new[2i+1] = old[i], old[i+rot/2]
    order = interleaved_from_half if target == INTERLEAVED else torch.argsort(interleaved_from_half)
    order = torch.cat([order, torch.arange(rot, keys.shape[-1])]).to(keys.device)
    return keys.index_select(-1, order)


def shift_keys(keys: torch.Tensor, shift: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate post-RoPE keys ``[..., tokens, head_dim]`` (rotate-half layout) as if each token sat `shift` positions
    later; `shift` is one int for all tokens or a tensor ``[tokens]`` of per-token shifts. Queries rotate the same
    way. With partial rotary embeddings only the leading ``2 * len(inv_freq)`` dims rotate, as in the model."""
    if not torch.is_tensor(shift) and shift == 0:
        return keys.clone()
    rot = 2 * inv_freq.numel()
    freq = inv_freq.to(device=keys.device, dtype=torch.float64)
    if torch.is_tensor(shift):
        shift = shift.reshape(-1)
        if shift.numel() != keys.shape[-2]:
            raise ValueError(f"{shift.numel()} per-token shifts for {keys.shape[-2]} tokens.")
    angles = (shift.to(keys.device, torch.float64)[:, None] * freq) if torch.is_tensor(shift) else shift * freq
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    k = keys.to(torch.float64)
    head, tail = k[..., :rot], k[..., rot:]
    x1, x2 = head[..., : rot // 2], head[..., rot // 2 :]
    rotated = head * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated, tail], dim=-1).to(keys.dtype)


def one_after_another(parts: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], inv_freq: torch.Tensor | None,
                      dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Several caches (each a list of per-layer ``(keys, values)``, rotate-half keys) as one, read one after another.

    With `inv_freq`, each part's keys are rotated to the positions that follow the parts before it, exactly as if
    computed there; with None they keep the positions they were made at. `dtype` (if given) is applied after the
    rotation. Composition at serving time and training among others both build their prefix with this."""
    keys: list[list[torch.Tensor]] = [[] for _ in parts[0]]
    values: list[list[torch.Tensor]] = [[] for _ in parts[0]]
    offset = 0
    for part in parts:
        for layer, (k, v) in enumerate(part):
            k = shift_keys(k, offset, inv_freq) if inv_freq is not None and offset else k
            keys[layer].append(k if dtype is None else k.to(dtype))
            values[layer].append(v if dtype is None else v.to(dtype))
        offset += part[0][0].shape[-2]
    return [(torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)) for ks, vs in zip(keys, values)]
