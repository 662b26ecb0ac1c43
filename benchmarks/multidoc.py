"""Several documents with compacted cartridges: composition of two, and a corpus longer than the model's context.

``pair``: two papers, each compacted to p tokens. On the union of their questions (each needs one of the two
papers, so together they need both), gold-answer NLL of: no context, each cartridge alone, the two composed, the
pair truncated to the composition's 2p tokens in context (the first p of each), and the whole pair in context.

``long``: papers concatenated past the model's context, compacted per chunk to p tokens, against the best
truncation that fits (the first and the last tokens that fit beside a question; the better of the two is
reported). Whole-corpus ICL cannot run, so the figure is NLL, not gap closure.

    python -m benchmarks.multidoc pair --docs 1,2 --tokens 256
    python -m benchmarks.multidoc long --docs 4,5,6,7,8 --tokens 2048 --questions-per-doc 3
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from cartridges_sdk import Cartridge, load_model
from cartridges_sdk.making.evaluation import answer_logprobs, nll

from . import provenance
from .data import DEFAULT_DATA, load_corpora

ROOM = 512  # positions kept for a question and its answer next to truncated text


def mean_nll(lm, qa, **context) -> float:
    return sum(nll(answer_logprobs(lm, q, a, **context), lm, a) for q, a in qa) / len(qa)


def pair(lm, corpora, p: int) -> dict:
    a, b = corpora
    ids_a, ids_b = lm.encode(a.text), lm.encode(b.text)
    qa = [(q.question, q.answer) for c in corpora for q in c.questions]
    start = time.perf_counter()
    ca, cb = (Cartridge.compact(lm, ids, p, progress=False, report=False) for ids in (ids_a, ids_b))
    seconds = time.perf_counter() - start
    both = a.text + "\n\n" + b.text
    both_ids = lm.encode(both)
    out = {
        "none": mean_nll(lm, qa),
        "icl_pair": mean_nll(lm, qa, document=both) if len(both_ids) + ROOM <= (lm.max_context or 10**9) else None,
        "truncated_pair": mean_nll(lm, qa, document=ids_a[:p] + ids_b[:p]),
        "first_alone": mean_nll(lm, qa, cartridges=[ca]),
        "second_alone": mean_nll(lm, qa, cartridges=[cb]),
        "composed": mean_nll(lm, qa, cartridges=[Cartridge.compose([ca, cb], reposition=True)]),
        "composed_in_place": mean_nll(lm, qa, cartridges=[Cartridge.compose([ca, cb])]),
    }
    return {"tokens": [len(ids_a), len(ids_b)], "questions": len(qa), "compaction_seconds": round(seconds, 1),
            "nll": out}


def long(lm, corpora, p: int, per_doc: int) -> dict:
    text = "\n\n".join(c.text for c in corpora)
    ids = lm.encode(text)
    qa = [(q.question, q.answer) for c in corpora for q in c.questions[:per_doc]]
    fits = (lm.max_context or len(ids)) - ROOM
    start = time.perf_counter()
    cart = Cartridge.compact(lm, ids, p, report=False)
    seconds = time.perf_counter() - start
    out = {
        "none": mean_nll(lm, qa),
        "cartridge": mean_nll(lm, qa, cartridges=[cart]),
        "truncated_first": mean_nll(lm, qa, document=ids[:fits]),
        "truncated_last": mean_nll(lm, qa, document=ids[-fits:]),
    }
    out["truncated_best"] = min(out["truncated_first"], out["truncated_last"])
    return {"corpus_tokens": len(ids), "chunks": cart.meta.extra["compaction"]["chunks"], "truncation_tokens": fits,
            "questions": len(qa), "compaction_seconds": round(seconds, 1), "nll": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["pair", "long"])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--docs", required=True, help="comma-separated document indices (two for pair)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--questions-per-doc", type=int, default=100, help="long: questions kept per document")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    corpora = load_corpora(args.data, args.docs)
    if args.mode == "pair" and len(corpora) != 2:
        parser.error("pair takes exactly two --docs")
    lm = load_model()
    result = pair(lm, corpora, args.tokens) if args.mode == "pair" else long(lm, corpora, args.tokens, args.questions_per_doc)
    result.update({"mode": args.mode, "docs": args.docs, "tokens": args.tokens, "model": lm.name,
                   "commit": provenance.commit(), "machine": provenance.machine()})
    provenance.save(result, args.out or Path("benchmarks/results") /
                    f"multidoc-{args.mode}-{args.docs.replace(',', '+')}-p{args.tokens}.json")


if __name__ == "__main__":
    main()
