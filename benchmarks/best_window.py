"""How much of the gap one exact span of a document can close: a bound, not a method.

    python -m benchmarks.best_window --model qwen2.5-coder-0.5b --set qasper --docs 10 --only 5,6,7,8,9

Per question, every window of `--tokens` consecutive tokens of its own document (a new one each `--stride` tokens,
the last ending at the document's end) is put in front of the question as exact KV, and the window that gives the
gold answer the lowest NLL is kept. It is picked with the gold answer, so no method can pick it; its closure (as
`benchmarks.vs_rag` computes closure, over the same questions) bounds what any method that spends the budget on one
exact span of the document can reach (one passage, an opening). Where it stays short of a target, the answer this
reader gives with the document in context rests on more than one span of that size: a cartridge, which compresses
the whole document, or several passages may still reach it; one span cannot.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from cartridges_sdk import Cartridge, load_model
from cartridges_sdk.making.evaluation import answer_logprobs, nll

from . import provenance
from .data import EVALDATA, load_corpora
from .measure import mean
from .vs_rag import DATASETS, check_only


def starts(length: int, tokens: int, stride: int) -> list[int]:
    """Where each window begins: every `stride` tokens, and one ending at the document's end."""
    if length <= tokens:
        return [0]
    return sorted(set(range(0, length - tokens, stride)) | {length - tokens})


@torch.inference_mode()
def best_windows(lm, path: Path, docs: int, questions: int, tokens: int, stride: int,
                 only: list[int] | None = None) -> dict:
    """Per question of the scored documents: the NLL with nothing, with the whole document, and with its best
    window; and the closure of each, over all the questions."""
    check_only(only, docs)
    corpora = load_corpora(path, list(range(docs)))
    rows = []
    for d, c in enumerate(corpora):
        if only is not None and d not in only:
            continue
        ids = lm.encode(c.text)
        asked = c.questions[:questions]
        whole = Cartridge.from_prefix(lm, ids, len(ids))  # the document in context, one prefill (exactness)
        none = [nll(answer_logprobs(lm, q.question, q.answer), lm, q.answer) for q in asked]
        icl = [nll(answer_logprobs(lm, q.question, q.answer, cartridges=[whole]), lm, q.answer) for q in asked]
        best = [(float("inf"), -1)] * len(asked)
        for s in tqdm(starts(len(ids), tokens, stride), desc=c.name, unit="window"):
            window = Cartridge.from_prefix(lm, ids[s: s + tokens], min(tokens, len(ids) - s))
            for i, q in enumerate(asked):
                got = nll(answer_logprobs(lm, q.question, q.answer, cartridges=[window]), lm, q.answer)
                best[i] = min(best[i], (got, s))
        for q, n, i, (b, s) in zip(asked, none, icl, best):
            rows.append({"doc": c.name, "question": q.question[:120], "doc_tokens": len(ids), "best_start": s,
                         "nll": {"none": round(n, 4), "icl": round(i, 4), "best_window": round(b, 4)}})
            print(rows[-1], flush=True)
    gap = mean([r["nll"]["none"] - r["nll"]["icl"] for r in rows])
    closure = {m: round(mean([r["nll"]["none"] - r["nll"][m] for r in rows]) / gap, 3) if gap > 0 else None
               for m in ("none", "icl", "best_window")}
    per_doc = {}
    for name in dict.fromkeys(r["doc"] for r in rows):
        mine = [r for r in rows if r["doc"] == name]
        g = mean([r["nll"]["none"] - r["nll"]["icl"] for r in mine])
        per_doc[name] = round(mean([r["nll"]["none"] - r["nll"]["best_window"] for r in mine]) / g, 3) \
            if g > 0 else None
    return {"data": path.name, "docs": docs, "only": only, "questions": len(rows), "tokens": tokens,
            "stride": stride, "closure": closure, "closure_per_doc": per_doc, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a named model, or 'default' (the 135M)")
    parser.add_argument("--set", default="qasper", choices=sorted(DATASETS))
    parser.add_argument("--data-dir", type=Path, default=EVALDATA)
    parser.add_argument("--docs", type=int, default=5, help="the set's first documents")
    parser.add_argument("--only", default=None, help="comma-separated document numbers (0-based) of the first --docs")
    parser.add_argument("--questions", type=int, default=5, help="at most this many per document")
    parser.add_argument("--tokens", type=int, default=256, help="the window, and the budget it stands for")
    parser.add_argument("--stride", type=int, default=128, help="tokens between one window's start and the next's")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.tokens < 1 or args.stride < 1:
        parser.error(f"--tokens {args.tokens} and --stride {args.stride} must be 1 or more.")
    only = None if args.only is None else [int(d) for d in args.only.split(",")]
    lm = load_model(None if args.model == "default" else args.model)
    start = time.perf_counter()
    result = best_windows(lm, args.data_dir / DATASETS[args.set], args.docs, args.questions, args.tokens,
                          args.stride, only)
    result.update({"model": lm.name, "seconds": round(time.perf_counter() - start, 1),
                   "commit": provenance.commit(), "dirty": provenance.dirty(), "machine": provenance.machine()})
    out = args.out or Path("benchmarks/results") / f"best_window-{args.model}-{args.set}-{args.tokens}.json"
    provenance.save(result, out)


if __name__ == "__main__":
    main()
