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
from cartridges_sdk.serve.passages import PassageIndex
from cartridges_sdk.serve.rerank import _standard as standard, lift, question_logprob

from . import provenance
from .data import EVALDATA, load_corpora
from .vs_rag import DATASETS, check_only, closure


def starts(length: int, tokens: int, stride: int) -> list[int]:
    """Where each window begins: every `stride` tokens, and one ending at the document's end."""
    if length <= tokens:
        return [0]
    return sorted(set(range(0, length - tokens, stride)) | {length - tokens})


@torch.inference_mode()
def best_windows(lm, path: Path, docs: int, questions: int, tokens: int, stride: int,
                 only: list[int] | None = None, likely: bool = False) -> dict:
    """Per question of the scored documents: the NLL with nothing, with the whole document, and with its best
    window; and the closure of each, over all the questions. With `likely`, also with the windows a method could
    pick without the answer: BM25's best for the question, the one after which the reader finds the question
    likeliest less the window's lift (`serve.rerank`), and the best of the two scores added, each standardized
    over the windows (as `serve.rerank` fuses them for cartridges)."""
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
        spans = starts(len(ids), tokens, stride)
        answer = [[0.0] * len(spans) for _ in asked]  # the gold answer's NLL after each window
        likelihood = [[0.0] * len(spans) for _ in asked]  # the question's, less the window's lift
        for j, s in enumerate(tqdm(spans, desc=c.name, unit="window")):
            window = Cartridge.from_prefix(lm, ids[s: s + tokens], min(tokens, len(ids) - s))
            own = lift(lm, window) if likely else 0.0
            for i, q in enumerate(asked):
                answer[i][j] = nll(answer_logprobs(lm, q.question, q.answer, cartridges=[window]), lm, q.answer)
                if likely:
                    likelihood[i][j] = question_logprob(lm, q.question, window) - own
        index = PassageIndex([str(s) for s in spans], [lm.tokenizer.decode(ids[s: s + tokens]) for s in spans])
        for i, (q, n, icl_nll) in enumerate(zip(asked, none, icl)):
            picks = {"best_window": min(range(len(spans)), key=lambda j: answer[i][j])}
            if likely:
                words = {int(p.name): p.score for p in index.ranked(q.question, len(spans))}
                bm25 = [words.get(s, 0.0) for s in spans]
                picks["bm25_window"] = max(range(len(spans)), key=lambda j: bm25[j])
                picks["likeliest_window"] = max(range(len(spans)), key=lambda j: likelihood[i][j])
                fused = [a + b for a, b in zip(standard(bm25), standard(likelihood[i]))]
                picks["fused_window"] = max(range(len(spans)), key=lambda j: fused[j])
            rows.append({"doc": c.name, "question": q.question[:120], "doc_tokens": len(ids),
                         "start": {k: spans[j] for k, j in picks.items()},
                         "nll": {"none": round(n, 4), "icl": round(icl_nll, 4),
                                 **{k: round(answer[i][j], 4) for k, j in picks.items()}}})
            print(rows[-1], flush=True)
    kinds = list(rows[0]["nll"]) if rows else []
    per_doc = {name: {m: closure([r for r in rows if r["doc"] == name], m) for m in kinds[2:]}
               for name in dict.fromkeys(r["doc"] for r in rows)}
    return {"data": path.name, "docs": docs, "only": only, "questions": len(rows), "tokens": tokens,
            "stride": stride, "closure": {m: closure(rows, m) for m in kinds}, "closure_per_doc": per_doc,
            "rows": rows}


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
    parser.add_argument("--likeliest", action="store_true", help="also score the window the reader finds the "
                        "question likeliest after (less its lift): one a method could pick, without the answer")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.tokens < 1 or args.stride < 1:
        parser.error(f"--tokens {args.tokens} and --stride {args.stride} must be 1 or more.")
    only = None if args.only is None else [int(d) for d in args.only.split(",")]
    lm = load_model(None if args.model == "default" else args.model)
    start = time.perf_counter()
    result = best_windows(lm, args.data_dir / DATASETS[args.set], args.docs, args.questions, args.tokens,
                          args.stride, only, args.likeliest)
    result.update({"model": lm.name, "seconds": round(time.perf_counter() - start, 1),
                   "commit": provenance.commit(), "dirty": provenance.dirty(), "machine": provenance.machine()})
    out = args.out or Path("benchmarks/results") / f"best_window-{args.model}-{args.set}-{args.tokens}.json"
    provenance.save(result, out)


if __name__ == "__main__":
    main()
