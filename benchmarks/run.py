"""One benchmark run: build every method's cartridge for each corpus, measure everything, write the report.

Stages are resumable: synthesis datasets, training checkpoints, finished cartridges and scores live in
``<out>/work`` and are reused by a re-run with the same settings (a run with other settings is refused there).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import time
from pathlib import Path
from typing import Any

import attrs

from cartridges_sdk import Cartridge, load_model
from cartridges_sdk.errors import ConfigError
from cartridges_sdk.files import atomic_write_json
from cartridges_sdk.lm import LM

from . import measure, methods, provenance, report
from .data import Corpus, load_corpora
from .profiles import Profile

SCORES = "scores.json"


def _log(msg: str) -> None:
    print(f"[{_dt.datetime.now():%H:%M:%S}] {msg}", flush=True)


def check_work(work: Path, identity: dict[str, Any]) -> None:
    """A work folder belongs to one set of settings; resuming with others would mix incomparable results."""
    path = work / "settings.json"
    identity = json.loads(json.dumps(identity))  # compare as stored (tuples become lists)
    if path.is_file():
        old = json.loads(path.read_text())
        if old != identity:
            diff = sorted(k for k in set(old) | set(identity) if old.get(k) != identity.get(k))
            raise ConfigError(
                f"{work} holds a run with other settings (differing: {diff}); pass another --out, "
                "or delete that folder to start over."
            )
    else:
        work.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, identity)


def check_fits(lm: LM, corpus: Corpus, n_tokens: int) -> None:
    limit = getattr(lm.model.config, "max_position_embeddings", None)
    if limit and n_tokens + 512 > limit:
        raise ConfigError(
            f"{corpus.name} has {n_tokens} tokens; with a question and answer that exceeds {lm.name}'s context of "
            f"{limit} tokens, so ICL (the reference) cannot be computed. Concatenate fewer documents or use a model "
            "with a longer context (--model)."
        )


def build_cartridges(lm: LM, corpus: Corpus, ids: list[int], sizes: list[int], work: Path, profile: Profile,
                     seed: int, costs: methods.CostBook) -> dict[tuple[str, int], Cartridge]:
    """Every cartridge the run scores: untrained prefixes, the compacted document, then the three trained methods
    (from the compacted start) at each size."""
    carts: dict[tuple[str, int], Cartridge] = {("untrained", p): Cartridge.from_prefix(lm, ids, p) for p in sizes}
    for p in sizes:
        _log(f"{corpus.name}: compacting to p={p}")
        carts[("compact", p)] = methods.compact_method(lm, p, ids, work, costs)
    if not sizes:  # a document shorter than every size: only ICL and no context apply
        return carts
    data = {}
    for kind in ("selfstudy", "generic"):
        _log(f"{corpus.name}: self-study synthesis ({kind})")
        data[kind] = methods.synthesize_data(lm, corpus.text, work, kind, profile, seed, costs)
    budget = sum(c.num_tokens for c in data["selfstudy"])
    doc_ids = methods.document_ids(lm, corpus.text)
    data["ntp"] = methods.raw_windows(doc_ids, max(1, math.ceil(budget / methods.NTP_WINDOW)), seed)
    costs.set("data:ntp", sequences=len(data["ntp"]), tokens=sum(c.num_tokens for c in data["ntp"]))
    for kind in methods.TRAINED:
        for p in sizes:
            _log(f"{corpus.name}: training {methods.METHODS[kind]} at p={p}")
            carts[(kind, p)] = methods.train_method(lm, kind, p, data[kind], carts[("compact", p)], work, profile, seed,
                                                         costs)
    return carts


def score_corpus(lm: LM, corpus: Corpus, ids: list[int], sizes: list[int],
                 carts: dict[tuple[str, int], Cartridge], work: Path) -> dict[str, dict[str, list]]:
    path = work / SCORES
    contexts = {"icl": measure.Context(document=tuple(ids)), "none": measure.Context()}
    for p in sizes:
        contexts[f"truncated:{p}"] = measure.Context(document=tuple(ids[:p]))
        for kind in ("untrained", "compact", *methods.TRAINED):
            contexts[f"{kind}:{p}"] = measure.Context(cartridge=carts[(kind, p)])
    if path.is_file():
        saved = json.loads(path.read_text())
        if set(saved) == set(contexts):
            return saved
    _log(f"{corpus.name}: scoring {len(contexts)} methods x sizes on {len(corpus.questions)} questions")
    scores = measure.score_questions(lm, corpus.questions, contexts, desc=f"scoring {corpus.name}")
    atomic_write_json(path, scores)
    return scores


def summarize(lm: LM, corpus: Corpus, n_tokens: int, sizes: list[int], scores: dict[str, dict[str, list]],
              costs: methods.CostBook, peak: float, raw_decode: float, mmlu: dict[str, float]) -> dict[str, Any]:
    per_token = measure.kv_bytes_per_token(lm)
    icl_bytes = n_tokens * per_token
    nll_none, nll_icl = measure.mean(scores["none"]["nll"]), measure.mean(scores["icl"]["nll"])
    gap = nll_none - nll_icl
    rows = []
    for key, s in scores.items():
        kind, _, size = key.partition(":")
        p = int(size) if size else None
        kv = {"icl": icl_bytes, "none": 0}.get(kind, (p or 0) * per_token)
        nll_m = measure.mean(s["nll"])
        kl_m = measure.mean(s["kl"])
        untrained_kl = measure.mean(scores[f"untrained:{p}"]["kl"]) if p else None
        row = {
            "method": kind, "p": p, "kv_bytes": kv, "kv_fraction_of_icl": kv / icl_bytes,
            "nll": nll_m, "closure": (nll_none - nll_m) / gap if gap else None, "kl": kl_m,
            "kl_vs_untrained": kl_m / untrained_kl if untrained_kl else None,
            "mc_accuracy": measure.mean([float(c) for c in s["correct"]]) if s["correct"] else None,
            "mmlu": mmlu.get(key),
        }
        if kind in methods.TRAINED:
            c = costs.get(f"training:{kind}:p{p}")
            synth = costs.get(f"synthesis:{kind}") if kind != "ntp" else {"seconds": 0.0, "generated_tokens": 0}
            row["cost"] = {
                "synthesis_s": synth["seconds"], "generated_tokens": synth.get("generated_tokens", 0),
                "training_s": c["seconds"], "training_tokens": c.get("tokens"), "steps": c.get("steps"),
                "training_tokens_per_s": c["tokens"] / c["seconds"] if c.get("tokens") and c["seconds"] else None,
                "training_flops_per_s": c["flops"] / c["seconds"] if c.get("flops") and c["seconds"] else None,
            }
            fps = row["cost"]["training_flops_per_s"]
            row["cost"]["fraction_of_matmul_peak"] = fps / peak if fps else None
            gen = synth.get("generated_tokens", 0)
            row["cost"]["synthesis_tokens_per_s"] = gen / synth["seconds"] if gen and synth["seconds"] else None
            row["cost"]["fraction_of_raw_decode"] = (
                row["cost"]["synthesis_tokens_per_s"] / raw_decode if row["cost"]["synthesis_tokens_per_s"] else None)
        rows.append(row)
    order = list(methods.METHODS)
    rows.sort(key=lambda r: (order.index(r["method"]), r["p"] or 0))
    diffs = [abs(a - b) for p in sizes for a, b in zip(scores[f"truncated:{p}"]["nll"], scores[f"untrained:{p}"]["nll"])]
    mc = corpus.multiple_choice
    return {
        "name": corpus.name, "doc_indices": list(corpus.doc_indices), "tokens": n_tokens,
        "questions": len(corpus.questions), "multiple_choice": mc,
        "chance": measure.mean([1 / len(q.options) for q in corpus.questions]) if mc else None,
        "sizes": sizes, "nll_none": nll_none, "nll_icl": nll_icl, "rows": rows,
        # truncated ICL and the untrained prefix cartridge are the same mathematics (the exactness property)
        "max_nll_diff_truncated_vs_untrained": max(diffs) if diffs else None,
        "per_question": scores,
    }


def run(*, profile: Profile, data: Path, docs: str | None, concat: bool, model: str | LM | None, seed: int,
        out: Path, mmlu: bool = True, throughput: bool = True) -> dict[str, Any]:
    """Everything `python -m benchmarks run` does; `model` is a `load_model` spec or an already loaded `LM`."""
    started = time.perf_counter()
    code = {"commit": provenance.commit(), "dirty": provenance.dirty()}  # the code that runs, not what is there at the end
    corpora = load_corpora(data, docs, concat=concat)
    if mmlu:
        mmlu_questions = measure.mmlu_subset(profile.mmlu_per_topic, seed)  # fails now, not after an hour
    if isinstance(model, LM):
        lm = model
    else:
        _log(f"loading model {model or 'default'}")
        lm = load_model(model)
    work_root = out / "work"
    budgets = {k: v for k, v in attrs.asdict(profile).items() if k != "expected_minutes_per_document"}
    identity = {"profile": budgets, "model": lm.identity.fingerprint, "seed": seed,
                "data": str(Path(data).resolve()), "concat": concat}
    check_work(work_root, identity)
    peak = measure.matmul_peak(lm.dtype)
    _log(f"matmul peak ({str(lm.dtype).removeprefix('torch.')}, 2048^3): {peak / 1e9:.1f} GFLOP/s")
    mmlu_none = None
    if mmlu:
        mmlu_none = measure.mmlu_accuracy(lm, mmlu_questions, None, "MMLU, no cartridge")
    tokenized = [(corpus, lm.encode(corpus.text)) for corpus in corpora]
    for corpus, ids in tokenized:  # every corpus is checked before the first one's half hour of work
        check_fits(lm, corpus, len(ids))
    raw_decode = measure.synthesis_yardstick(lm, tokenized[0][1], methods.synthesis_config("selfstudy", profile, seed))
    _log(f"raw batched decode where synthesis decodes: {raw_decode:.1f} tokens/s")
    results = []
    first: tuple[Corpus, list[int], dict[tuple[str, int], Cartridge]] | None = None
    for corpus, ids in tokenized:
        sizes = [p for p in profile.sizes if p < len(ids)]
        skipped = [p for p in profile.sizes if p >= len(ids)]
        if skipped:
            _log(f"{corpus.name}: {len(ids)} tokens; sizes {skipped} do not apply (not smaller than the document)")
        work = work_root / corpus.name
        costs = methods.CostBook(work / "cost.json")
        carts = build_cartridges(lm, corpus, ids, sizes, work, profile, seed, costs)
        scores = score_corpus(lm, corpus, ids, sizes, carts, work)
        retention: dict[str, float] = {}
        if mmlu:
            retention = _mmlu_cached(lm, mmlu_questions, carts, sizes, work / "mmlu.json")
            retention["none"] = mmlu_none
        summary = summarize(lm, corpus, len(ids), sizes, scores, costs, peak, raw_decode, retention)
        summary["skipped_sizes"] = skipped
        results.append(summary)
        first = first or (corpus, ids, carts)
    speed = _throughput(lm, *first, profile) if throughput and first else None
    result = {
        "profile": attrs.asdict(profile), "data": str(data), "docs": docs, "concat": concat, "seed": seed,
        "model": {"name": lm.name, "fingerprint": lm.identity.fingerprint, "dtype": str(lm.dtype).removeprefix("torch.")},
        **code, "machine": provenance.machine(), "matmul_peak_flops": peak, "raw_decode_tokens_per_s": raw_decode,
        "mmlu": {"questions": len(mmlu_questions), "per_topic": profile.mmlu_per_topic, "chance": 0.25,
                 "none": mmlu_none} if mmlu else None,
        "corpora": results, "throughput": speed,
        "finished": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "seconds": time.perf_counter() - started,
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", result)
    (out / "results.md").write_text(report.markdown(result))
    plots = report.plots(result, out)
    _log(f"wrote {out / 'results.json'}, {out / 'results.md'}" + "".join(f", {p}" for p in plots))
    return result


def _mmlu_cached(lm: LM, questions, carts: dict[tuple[str, int], Cartridge], sizes: list[int],
                 path: Path) -> dict[str, float]:
    done = json.loads(path.read_text()) if path.is_file() else {}
    for kind in methods.TRAINED:
        for p in sizes:
            key = f"{kind}:{p}"
            if key not in done:
                done[key] = measure.mmlu_accuracy(lm, questions, carts[(kind, p)], f"MMLU, {kind} p={p}")
                atomic_write_json(path, done)
    return dict(done)


def _throughput(lm: LM, corpus: Corpus, ids: list[int], carts: dict[tuple[str, int], Cartridge],
                profile: Profile) -> dict[str, Any]:
    """ICL and cartridges in the same runtime (the SDK's Hugging Face one) and the same run, at one KV budget.

    The untrained cartridges stand for every method of their size: decode cost depends on shapes, not values."""
    budget = int(profile.kv_budget_gib * 2**30)
    prompt = measure.throughput_prompt(lm, corpus.questions[0].question)
    _log(f"decode throughput at a {profile.kv_budget_gib:g} GiB KV budget")
    curves = {"icl": measure.throughput_curve(lm, Cartridge.from_prefix(lm, ids, len(ids)), prompt,
                                              profile.decode_tokens, budget, "throughput ICL")}
    for (kind, p), cartridge in carts.items():
        if kind == "untrained":
            curves[f"cartridge:{p}"] = measure.throughput_curve(
                lm, cartridge, prompt, profile.decode_tokens, budget, f"throughput p={p}")
    return {"corpus": corpus.name, "runtime": "hf", "kv_budget_bytes": budget, "prompt_tokens": len(prompt),
            "decode_tokens": profile.decode_tokens, "curves": curves}
