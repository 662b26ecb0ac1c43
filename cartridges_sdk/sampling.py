"""Decoding rules for engines that pick tokens themselves (the HF loop, llama.cpp): how the next token is drawn
from logits under `GenerationParams`, and when an answer ends. Engines with their own sampler (vLLM) get the same
settings passed through and `Completion.from_ids` applies the same cut."""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import TYPE_CHECKING

import torch

from .generation import GenerationParams

if TYPE_CHECKING:
    from .protocols import RunningModel


def sample_next(logits: torch.Tensor, params: GenerationParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from ``[batch, vocab]`` logits."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    # inverse-CDF sampling: one uniform per row against the cumulative probabilities (in float64, so the sum over a
    # large vocabulary stays exact enough). It draws as multinomial does, which draws a random number per
    # vocabulary entry on CPU and took a tenth of synthesis time.
    cdf = logits.softmax(-1).double().cumsum(-1)
    u = torch.rand((cdf.shape[0], 1), generator=generator, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(cdf.shape[-1] - 1)


def ends_answer(lm: RunningModel, ids: Sequence[int], stop: Sequence[str], eos: Container[int]) -> bool:
    """The stop rule: an answer ends at an end-of-turn token (`eos`) or once its text holds one of the `stop`
    strings (the text is cut before it by `Completion.from_ids`)."""
    if ids and ids[-1] in eos:
        return True
    return bool(stop) and any(s in lm.tokenizer.decode(list(ids), skip_special_tokens=True) for s in stop)
