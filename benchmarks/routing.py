"""Routing accuracy of a cartridge store: each question of each document, routed among all the documents' cartridges,
goes to its own document's cartridge (top-1), or has it among the top 3.

The cartridges are tiny prefix cartridges: routing reads only each cartridge's corpus text (BM25 over its chunks).

    python -m benchmarks.routing [--data scientific_qa_dev.jsonl] [--docs all]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from cartridges_sdk import Cartridge, CartridgeStore, load_model
from cartridges_sdk.files import atomic_write_json

from . import provenance
from .data import DEFAULT_DATA, load_corpora


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="L-Eval-format JSONL")
    parser.add_argument("--docs", default="all", help="comma-separated document indices, or 'all'")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/routing.json"))
    args = parser.parse_args()

    count = sum(1 for line in args.data.open() if line.strip())
    docs = ",".join(map(str, range(count))) if args.docs == "all" else args.docs
    corpora = load_corpora(args.data, docs)
    lm = load_model()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = CartridgeStore(tmp, lm)
        for c in corpora:
            store.add(c.name, Cartridge.from_prefix(lm, c.text, 4), corpus=c.text)
        for c in corpora:
            for q in c.questions:
                ranked = [r.name for r in store.route(q.question, k=3)]
                rows.append({"doc": c.name, "question": q.question, "top1": ranked[0] == c.name,
                             "top3": c.name in ranked, "routed": ranked})
    top1 = sum(r["top1"] for r in rows) / len(rows)
    top3 = sum(r["top3"] for r in rows) / len(rows)
    firsts = [next(r for r in rows if r["doc"] == c.name) for c in corpora if c.questions]
    summary = {"data": args.data.name, "documents": len(corpora), "questions": len(rows), "top1": round(top1, 3),
               "top3": round(top3, 3), "first_question_top1": round(sum(r["top1"] for r in firsts) / len(firsts), 3)}
    print(json.dumps(summary))
    atomic_write_json(args.out, {**summary, "rows": rows, "commit": provenance.commit(), "dirty": provenance.dirty(),
                                 "machine": provenance.machine()})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
