"""The dtypes self-study computes in (`work_dtype`): the model's own, one named, or ``"fastest"``, measured per stage
on this machine at the start of a run (the model's copy in a stage's dtype is `LM.in_dtype`)."""

from __future__ import annotations

import contextlib
import logging
import platform
import time
import weakref

import torch

from ..errors import ConfigError
from ..lm import LM, resolve_dtype

log = logging.getLogger(__name__)

FASTEST = "fastest"  # work_dtype: per stage, bfloat16 where this machine runs that stage clearly faster in it


STAGES = ("synthesis", "training")


def _synthesis_probe(lm: LM, context: int = 128, rows: int = 16, steps: int = 8):
    """Synthesis in miniature, through the HF synthesizer itself: `rows` answers after one shared `context`-token
    chunk, `steps` tokens each with the teacher's top-20. (A model of the stage from a prefill's and a decode step's
    timings ranked the two dtypes wrongly for the 0.5B model: its real synthesis gains more from bf16.)"""
    from ..generation import SynthesisRequest
    from ..hf import HFSynthesizer

    sampler = HFSynthesizer(lm)
    vocab = lm.identity.architecture["vocab_size"]
    chunk = [t % vocab for t in range(100, 100 + context)]
    requests = [SynthesisRequest(prompt_ids=chunk + [(7 * r) % vocab, (11 * r + 1) % vocab], max_tokens=steps,
                                 temperature=0.0, top_logprobs=min(20, vocab), group=0) for r in range(rows)]

    def run() -> float:
        start = time.perf_counter()
        sampler.complete(requests)
        return time.perf_counter() - start

    return run


def _training_probe(lm: LM, tokens: int = 256, targets: int = 64):
    """A training step in miniature: forward and backward through the frozen model on `tokens` positions whose
    inputs need a gradient (as the cartridge's keys and values do), the loss on the last `targets`."""
    embed = lm.model.get_input_embeddings()
    ids = torch.arange(100, 100 + tokens, device=lm.device)[None] % embed.num_embeddings

    def step() -> float:
        start = time.perf_counter()
        inputs = embed(ids).detach().requires_grad_()
        logits = lm.model(inputs_embeds=inputs, logits_to_keep=targets).logits
        logits.float().logsumexp(-1).sum().backward()
        inputs.grad.sum().item()  # waits for the device
        return time.perf_counter() - start

    return step


# how much faster bf16 must run a stage's miniature to be chosen: the synthesis probe ranks the 135M model's dtypes
# less clearly (1.16-1.33x for bf16 in the probe, 0.8x in real synthesis) than the 0.5B's (2x in both)
MARGINS = {"synthesis": 1.3, "training": 1.2}


def fastest_dtypes(lm: LM, *, rounds: int = 2, stages: tuple[str, ...] = STAGES) -> dict[str, torch.dtype]:
    """Per stage, bfloat16 where that stage's own work, run in miniature on `lm` and on a bfloat16 copy of it, is
    faster by the stage's margin (`MARGINS`); else the model's dtype.

    bf16 matrix products are 2x faster than float32 on this project's CPUs, but decoding a small model attends over
    the chunk with elementwise work that bf16 slows: the 135M model synthesizes 0.8x as fast in bf16 and trains 1.8x
    as fast, where the 0.5B does both 1.7-2x as fast (docs/self-study.md). So each stage is measured, not assumed:
    a warm-up, then `rounds` alternating runs of each dtype, the best of each kept (10-30 s on 2 cores for both
    `stages`; the quality report asks for synthesis alone)."""
    if lm.dtype != torch.float32:
        return dict.fromkeys(stages, lm.dtype)
    models = {torch.float32: lm, torch.bfloat16: lm.in_dtype(torch.bfloat16)}
    make = {"synthesis": _synthesis_probe, "training": _training_probe}
    probes = {stage: {dtype: make[stage](m) for dtype, m in models.items()} for stage in stages}
    chosen = {}
    for stage, runs in probes.items():
        best = dict.fromkeys(runs, float("inf"))
        for round_ in range(rounds + 1):
            for dtype, run in runs.items():
                with torch.inference_mode() if stage == "synthesis" else contextlib.nullcontext():
                    took = run()
                if round_:  # the first round warms up
                    best[dtype] = min(best[dtype], took)
        faster = best[torch.float32] / best[torch.bfloat16]
        chosen[stage] = torch.bfloat16 if faster >= MARGINS[stage] else lm.dtype
        log.info("work_dtype='fastest', %s: %s (float32 %.0f ms, bfloat16 %.0f ms)", stage, chosen[stage],
                 best[torch.float32] * 1e3, best[torch.bfloat16] * 1e3)
    return chosen


WorkDtypes = dict[str, torch.dtype | None]

X86 = {"x86_64", "amd64", "i386", "i686", "x86"}


def bf16_in_hardware(device: torch.device) -> bool:
    """Whether `device` may compute bfloat16 faster than float32, so "fastest" is worth measuring there.

    An x86 CPU with neither AVX512-BF16 nor AMX converts every bf16 value to float32 and back: on such a 2-core
    machine the 135M model trained 2.4x and synthesized 1.1x slower in bf16, and measuring that took a minute of
    every process that compacts with a report or builds. Other devices and CPUs (and a torch that cannot tell) are
    measured."""
    if torch.device(device).type != "cpu" or platform.machine().lower() not in X86:
        return True
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check is None or check() for check in checks)


# models smaller than this compute in their own dtype under "fastest", unmeasured: the test models and toys, whose
# runs take less time than measuring would (and whose tests would then depend on a moment's timing)
SMALLEST_MEASURED = 50_000_000
# model -> its measured choice: one measurement per model and process (a page of examples builds several)
_CHOSEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def resolve_work_dtype(lm: LM, dtype: str | torch.dtype | WorkDtypes | None, *,
                       stages: tuple[str, ...] = STAGES) -> WorkDtypes:
    """`dtype` for each of `stages`: "fastest" measured here, once per model, stage and process, so a run's stages
    are decided together (and the quality report, which only synthesizes, does not time training), or the model's
    own unmeasured where bf16 cannot win (`bf16_in_hardware`); a named dtype or None (the model's) for all."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ConfigError(f"stages={stages!r}: {unknown[0]!r} is not one of {STAGES}.")
    if isinstance(dtype, dict):  # already resolved (by from_corpus, for its training stage)
        return dtype
    if isinstance(dtype, str) and dtype.lower() == FASTEST:
        from .distributed import under_torchrun

        # ranks timing alone could choose differently and train one cartridge in two dtypes: under torchrun the
        # model's own dtype, unless work_dtype names one
        if (under_torchrun() or lm.num_parameters < SMALLEST_MEASURED
                or not bf16_in_hardware(lm.device)):
            return dict.fromkeys(stages, None)
        chosen = _CHOSEN.setdefault(lm.model, {})
        missing = tuple(s for s in stages if s not in chosen)
        if missing:
            chosen.update(fastest_dtypes(lm, stages=missing))
        return {s: chosen[s] for s in stages}
    return dict.fromkeys(stages, resolve_dtype(dtype))

