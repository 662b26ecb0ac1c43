"""KV-cache plumbing shared by the runtime, scoring and composition: cartridges -> transformers cache, RoPE shifts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .errors import IncompatibleCartridgeError, UnsupportedModelError

if TYPE_CHECKING:
    from .cartridge import Cartridge
    from .models import LM

# RoPE variants whose rotation angle is position * inv_freq, so a shift by d positions is one extra rotation.
POSITION_ADDITIVE_ROPE = {"default", "linear", "llama3", "yarn"}


def concat_layers(lm: LM, cartridges: Sequence[Cartridge]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer keys/values of several cartridges placed one after another, on the model's device and dtype."""
    for c in cartridges:
        problem = c.meta.model.mismatch(lm.identity)
        if problem:
            raise IncompatibleCartridgeError(
                f"Cartridge for model {c.meta.model.name!r} cannot run on model {lm.name!r} ({problem}). "
                f"Load it with the model it was made for."
            )
    layers = []
    for i in range(lm.num_layers):
        ks = [c.keys[i].to(lm.device, lm.dtype) for c in cartridges]
        vs = [c.values[i].to(lm.device, lm.dtype) for c in cartridges]
        layers.append((torch.cat(ks, dim=1) if len(ks) > 1 else ks[0], torch.cat(vs, dim=1) if len(vs) > 1 else vs[0]))
    return layers


def prefix_cache(lm: LM, cartridges: Sequence[Cartridge], batch_size: int):
    """A fresh transformers cache holding `cartridges` for `batch_size` rows, and its length (0 and None if empty).

    A new cache is built per call because transformers appends to caches in place.
    """
    if not cartridges:
        return None, 0
    from transformers import DynamicCache

    layers = concat_layers(lm, cartridges)
    data = [(k[None].expand(batch_size, -1, -1, -1), v[None].expand(batch_size, -1, -1, -1)) for k, v in layers]
    cache = DynamicCache(ddp_cache_data=data, config=lm.model.config)
    return cache, layers[0][0].shape[1]


def rope_inv_freq(lm: LM) -> torch.Tensor:
    """The model's RoPE inverse frequencies, refusing RoPE variants where a position shift is not a rotation."""
    rope = lm.identity.architecture.get("rope") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in POSITION_ADDITIVE_ROPE:
        raise UnsupportedModelError(
            f"Model {lm.name!r} uses rope_type={rope_type!r}, whose angles are not position * frequency, so keys "
            f"cannot be moved exactly; compose with reposition=False (supported: {sorted(POSITION_ADDITIVE_ROPE)})."
        )
    for name, buf in lm.model.named_buffers():
        if name.endswith("inv_freq") and "original" not in name:
            return buf.detach().float()
    raise UnsupportedModelError(
        f"Model {lm.name!r} has no RoPE inv_freq buffer; repositioning needs rotary position embeddings."
    )


def shift_keys(keys: torch.Tensor, shift: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate post-RoPE keys ``[..., tokens, head_dim]`` as if each token sat `shift` positions later.

    Uses the rotate-half layout of Hugging Face models; with partial rotary embeddings only the leading
    ``2 * len(inv_freq)`` dims rotate, as in the model.
    """
    if shift == 0:
        return keys.clone()
    rot = 2 * inv_freq.numel()
    angles = shift * inv_freq.to(device=keys.device, dtype=torch.float64)
    cos = torch.cat([angles.cos(), angles.cos()])
    sin = torch.cat([angles.sin(), angles.sin()])
    k = keys.to(torch.float64)
    head, tail = k[..., :rot], k[..., rot:]
    x1, x2 = head[..., : rot // 2], head[..., rot // 2 :]
    rotated = head * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated, tail], dim=-1).to(keys.dtype)
