"""The dtype self-study computes in (`work_dtype`): the model's own, one named, or ``"fastest"``, measured on this
machine at the start of a run; and the copy of the model in that dtype (`work_model`)."""

from __future__ import annotations

import copy
import logging
import time

import torch

from ..lm import LM, resolve_dtype

log = logging.getLogger(__name__)

FASTEST = "fastest"  # work_dtype: bfloat16 where this machine multiplies matrices in it clearly faster, else the model's


def fastest_dtype(lm: LM, *, size: int = 1024, rounds: int = 5, margin: float = 1.3) -> torch.dtype:
    """bfloat16 when a `size`-cubed matrix product runs at least `margin` times faster in it than in the model's own
    float32 on `lm`'s device, measured now; else the model's dtype. bf16 is 2x faster than float32 on some CPUs and
    slower on others (docs/self-study.md), so it is measured, not assumed: `rounds` alternating products of each
    (about 0.2 s), the best of each kept, so a moment's load on the machine does not decide it."""
    if lm.dtype != torch.float32:
        return lm.dtype
    pairs = {dtype: (torch.randn(size, size, dtype=dtype, device=lm.device),
                     torch.randn(size, size, dtype=dtype, device=lm.device)) for dtype in (torch.float32, torch.bfloat16)}
    best = dict.fromkeys(pairs, float("inf"))
    for round_ in range(rounds + 1):
        for dtype, (a, b) in pairs.items():
            start = time.perf_counter()
            (a @ b).sum().item()  # .item() waits for the device
            took = time.perf_counter() - start
            if round_:  # the first round warms up
                best[dtype] = min(best[dtype], took)
    chosen = torch.bfloat16 if best[torch.float32] >= margin * best[torch.bfloat16] else lm.dtype
    log.info("work_dtype='fastest': %s (a %d^3 product: float32 %.1f ms, bfloat16 %.1f ms)", chosen, size,
             best[torch.float32] * 1e3, best[torch.bfloat16] * 1e3)
    return chosen


def resolve_work_dtype(lm: LM, dtype: str | torch.dtype | None) -> torch.dtype | None:
    """`dtype` as a torch dtype ("fastest" measured once, here, so both stages use the same), or None."""
    return fastest_dtype(lm) if isinstance(dtype, str) and dtype.lower() == FASTEST else resolve_dtype(dtype)


def work_model(lm: LM, dtype: str | torch.dtype | None) -> LM:
    """The model to synthesize and train with: `lm` itself, or a copy in another dtype."""
    dtype = resolve_work_dtype(lm, dtype)
    if dtype is None or dtype == lm.dtype:
        return lm
    return LM(copy.deepcopy(lm.model).to(dtype), lm.tokenizer, name=lm.name, source=lm.identity.source,
              revision=lm.identity.revision, files=lm.files)
