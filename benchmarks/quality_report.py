"""How far to trust the quality report: its score against gold-answer closure, on documents that have gold answers.

For each document of each set, cartridges of a few sizes (compacted; the smaller, the worse) are scored twice: by
the quality report (`making/report.py`: no gold answers, the questions the model asks itself) and by gold-answer gap
closure on the document's own questions (what docs/vs-rag.md reports). The figure users need is the rank
correlation between the two (Spearman), over every (document, size) and within each size across documents:

    python -m benchmarks.quality_report --model qwen2.5-coder-0.5b --sets qasper:0-4,quality:0-2,tpo:0-2 \
      --sizes 64,256 --questions 5

The text in context is an exact prefix cartridge of the document, read once and shared by the gold scoring.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
from scipy.stats import spearmanr

from cartridges_sdk import Cartridge, load_model
from cartridges_sdk.errors import ConfigError
from cartridges_sdk.making.evaluation import answer_logprobs, kl, nll
from cartridges_sdk.making.report import check_quality
from cartridges_sdk.making.settings import ReportConfig

from . import provenance
from .data import EVALDATA, load_corpora
from .measure import mean

DATASETS = {"qasper": "scientific_qa_dev.jsonl", "quality": "quality_dev.jsonl", "tpo": "tpo_dev.jsonl"}


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Rank correlation (ties get their mean rank); None with fewer than three points or a constant side."""
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return round(float(spearmanr(xs, ys).statistic), 3)


def parse_sets(spec: str) -> list[tuple[str, list[int]]]:
    """``qasper:0-5,tpo:0-3`` -> [("qasper", [0..5]), ("tpo", [0..3])]."""
    out = []
    for part in spec.split(","):
        name, _, span = part.partition(":")
        if name not in DATASETS or not span:
            raise ConfigError(f"--sets part {part!r} must be SET:FIRST-LAST with SET one of {sorted(DATASETS)}.")
        first, _, last = span.partition("-")
        out.append((name, list(range(int(first), int(last or first) + 1))))
    return out


def gold_closure(lm, cart: Cartridge, questions, none: list[float], icl: list) -> dict:
    got = [answer_logprobs(lm, q.question, q.answer, cartridges=[cart]) for q in questions]
    nll_cart = mean([nll(lp, lm, q.answer) for lp, q in zip(got, questions)])
    nll_icl = mean([nll(lp, lm, q.answer) for lp, q in zip(icl, questions)])
    gap = mean(none) - nll_icl
    return {"closure": round((mean(none) - nll_cart) / gap, 4) if gap > 0 else None,
            "kl": round(mean([kl(r, g) for r, g in zip(icl, got)]), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a named model, or 'default' (the 135M)")
    parser.add_argument("--sets", default="qasper:0-4,quality:0-2,tpo:0-2", help="SET:FIRST-LAST, comma-separated")
    parser.add_argument("--data-dir", type=Path, default=EVALDATA)
    parser.add_argument("--sizes", default="64,256", help="cartridge sizes in tokens, comma-separated")
    parser.add_argument("--questions", type=int, default=5, help="gold questions per document, at most")
    parser.add_argument("--report-questions", type=int, default=ReportConfig().questions)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quality_report.json"))
    args = parser.parse_args()
    sets = parse_sets(args.sets)
    sizes = [int(s) for s in args.sizes.split(",")]
    config = ReportConfig(questions=args.report_questions)
    lm = load_model(None if args.model == "default" else args.model)
    rows, start = [], time.perf_counter()
    for name, docs in sets:
        for doc, corpus in zip(docs, load_corpora(args.data_dir / DATASETS[name], docs)):
            ids = lm.encode(corpus.text)
            questions = list(corpus.questions)[: args.questions]
            text_cart = Cartridge.from_prefix(lm, ids, len(ids))
            icl = [answer_logprobs(lm, q.question, q.answer, cartridges=[text_cart]) for q in questions]
            none = [nll(answer_logprobs(lm, q.question, q.answer), lm, q.answer) for q in questions]
            for size in sizes:
                if size >= len(ids):
                    continue
                t = time.perf_counter()
                cart = Cartridge.compact(lm, ids, size, progress=False, report=False)
                built = time.perf_counter() - t
                report = check_quality(lm, ids, cart, config)
                row = {"set": name, "doc": doc, "tokens": len(ids), "size": size, "questions": len(questions),
                       **gold_closure(lm, cart, questions, none, icl), "compact_s": round(built, 1),
                       "report": report.to_dict()}
                rows.append(row)
                print(f"{name} {doc} ({len(ids)} tokens) p={size}: gold closure {row['closure']}, report recovered "
                      f"{report.recovered:.3f} (gain {report.gain:.2f} nats/token, KL {report.kl:.2f}, agreement {report.agreement:.2f}); compaction "
                      f"{built:.0f} s, report {report.seconds:.0f} s", flush=True)
    result = {"model": lm.name, "sizes": sizes, "report_config": attrs.asdict(config), "rows": rows, "correlation": correlations(rows, sizes), "seconds": round(time.perf_counter() - start, 1),
              "commit": provenance.commit(), "dirty": provenance.dirty(), "machine": provenance.machine()}
    provenance.save(result, args.out)
    print(table(result))


def correlations(rows: list[dict], sizes: Sequence[int]) -> dict:
    """Spearman of the report's `recovered` (and agreement, and -KL) with gold closure: over all rows and per size."""
    def rho(subset: list[dict], key) -> float | None:
        pairs = [(key(r), r["closure"]) for r in subset if r["closure"] is not None and key(r) is not None]
        return spearman([a for a, _ in pairs], [b for _, b in pairs])

    keys = {"recovered": lambda r: r["report"]["recovered"], "agreement": lambda r: r["report"]["agreement"],
            "-kl": lambda r: -r["report"]["kl"] if r["report"]["kl"] is not None else None}
    out = {"all": {k: rho(rows, f) for k, f in keys.items()}, "points": len(rows)}
    for size in sizes:
        out[f"p={size}"] = {k: rho([r for r in rows if r["size"] == size], f) for k, f in keys.items()}
    return out


def table(result: dict) -> str:
    lines = ["| set | doc | p | gold closure | report recovered | report KL | agreement |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        rep = r["report"]
        fig = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"| {r['set']} | {r['doc']} | {r['size']} | {fig(r['closure'])} | {fig(rep['recovered'])} | "
                     f"{fig(rep['kl'])} | {fig(rep['agreement'])} |")
    lines.append("")
    for scope, figures in result["correlation"].items():
        if scope != "points":
            lines.append(f"Spearman with gold closure, {scope}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
