"""Routing's second look: how likely the reader finds the question with each candidate cartridge before it.

BM25 sees words. A question that several documents share words with ("What baselines do they compare to?" in a
folder of papers) is routed by word weights that say little about which document it is about. The reader can say
more: with a cartridge of the right document in front of it, the question reads as one about what it just read.

The likelihood alone is not the signal, though: some cartridges make any question likelier (on five QASPER papers
one of them won 20 of 25 questions by raw likelihood). So each cartridge's own lift is measured once, as the mean
per-token log-likelihood of a few questions about nothing in particular (`NEUTRAL`), and taken off. The calibrated
likelihood and BM25's score are then put on one scale (each standardized over the candidates) and added: the two
err on different questions. A forward pass over the question's few tokens per candidate: milliseconds on a GPU, a
fraction of a second per candidate for a small reader on a CPU. Measured in docs/vs-rag.md.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

# questions no document is about: what a cartridge does to their likelihood is its lift for any question
NEUTRAL = ("What time is it?", "Tell me a joke.", "How are you today?", "What is the capital of France?")
_LIFT: dict[tuple[str, str], float] = {}  # (model name, cartridge fingerprint) -> lift, measured once


@torch.inference_mode()
def question_logprob(lm: Any, question: str, cartridge: Any) -> float:
    """Mean log-probability per token of the question's chat turn after `cartridge` (its first token excepted:
    nothing before it is scored)."""
    ids = lm.prompt_ids([{"role": "user", "content": question}], after_cartridge=True)
    logp = lm.logits(ids, [cartridge]).log_softmax(-1)
    target = torch.tensor(ids[1:], device=logp.device)
    return float(logp[:-1].gather(-1, target[:, None]).mean())


def lift(lm: Any, cartridge: Any) -> float:
    """How much likelier `cartridge` makes any question: its mean `question_logprob` over `NEUTRAL`."""
    key = (lm.name, cartridge.fingerprint)
    if key not in _LIFT:
        if len(_LIFT) >= 4096:
            _LIFT.clear()
        _LIFT[key] = statistics.fmean(question_logprob(lm, q, cartridge) for q in NEUTRAL)
    return _LIFT[key]


def _standard(scores: Sequence[float]) -> list[float]:
    mean, spread = statistics.fmean(scores), statistics.pstdev(scores)
    return [(s - mean) / spread if spread > 0 else 0.0 for s in scores]


def rerank(store: Any, question: str, routes: Sequence[Any]) -> list[tuple[str, float]]:
    """`routes` (BM25's candidates: `Route`s of `store`) ranked again, best first, by BM25's score plus the
    question's likelihood after each less the cartridge's lift, both standardized over the candidates."""
    if len(routes) < 2:
        return [(r.name, r.score) for r in routes]
    lm = store.model
    calibrated = []
    for r in routes:
        cartridge = store.get(r.name)
        calibrated.append(question_logprob(lm, question, cartridge) - lift(lm, cartridge))
    fused = [a + b for a, b in zip(_standard([r.score for r in routes]), _standard(calibrated))]
    return sorted(((r.name, f) for r, f in zip(routes, fused)), key=lambda item: (-item[1], item[0]))
