"""Cutting a cartridge to the tokens a question reads most (`trim="attention"`).

`trim=True` keeps a cartridge's first tokens, whatever the question. Here the question (with its first answer, when
one was drafted) is read once after the whole cartridge, and each layer and kv head keeps its sinks and the tokens
its queries put the most attention on. On QASPER dev papers it closed more of the gap than the first tokens, and on
held-out papers only by one odd question (docs/vs-rag.md, "Cutting by the question's attention"); it costs a pass
and a cartridge per answer, so it is asked for by name rather than being what `trim=True` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..making.recording import recording


def attention_mass(lm: Any, cartridge: Any, ids: Sequence[int]) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, tokens]``: the attention the queries of `ids`, read after `cartridge`, put on each of
    its tokens, summed over the positions and over each kv head's query heads. Each query's weights are a softmax
    over the cartridge's keys alone, so that what it reads of its own text does not decide what it reads here. The
    model's body alone runs (`LM.hidden`, which checks the ids and the context as scoring does): the queries are
    all it needs, not next-token logits."""
    with recording(lm) as recorder:
        lm.hidden(ids, [cartridge])
    mass = []
    for layer, keys in enumerate(cartridge.keys):
        queries = torch.cat(recorder.queries[layer], dim=1).to(keys.device)  # [heads, positions, head_dim], RoPE'd
        heads, kv_heads = queries.shape[0], keys.shape[0]
        shared = keys.float().repeat_interleave(heads // kv_heads, dim=0)
        weights = (queries @ shared.transpose(1, 2) * recorder.scaling[layer]).softmax(-1)
        mass.append(weights.sum(1).view(kv_heads, heads // kv_heads, -1).sum(1))
    return mass


def attended(lm: Any, cartridge: Any, ids: Sequence[int], num_tokens: int) -> Any:
    """`cartridge` cut to `num_tokens` tokens a layer and kv head: its sinks and those the queries of `ids` read
    most (`attention_mass`), in their order (`Cartridge.selected`); itself when it has no more."""
    if num_tokens >= cartridge.num_tokens:
        return cartridge
    kept = []
    for mass in attention_mass(lm, cartridge, ids):
        mass[:, cartridge.sinks] = float("inf")
        kept.append(mass.topk(num_tokens, dim=-1).indices.sort(-1).values)
    return cartridge.selected(kept)
