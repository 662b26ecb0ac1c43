"""Routing accuracy of a cartridge store: each question of each document, routed among all the documents' cartridges,
goes to its own document's cartridge (top-1), or has it among the top 3.

The cartridges are tiny prefix cartridges: routing reads only each cartridge's corpus text. Also reported: the same
figures over the questions that name a word only their own document uses (`distinctive`), the ones a router reading
nothing but the question can be expected to place; the others ("What baselines do they compare to?") fit any paper.

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
from .data import DEFAULT_DATA, load_corpora, only_own_words


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
            others = [o.text for o in corpora if o is not c]
            for q in c.questions:
                ranked = [r.name for r in store.route(q.question, k=3)]
                rows.append({"doc": c.name, "question": q.question, "top1": ranked[0] == c.name,
                             "top3": c.name in ranked, "routed": ranked,
                             "only_own_words": only_own_words(q.question, c.text, others)})
    distinctive = [r for r in rows if r["only_own_words"]]
    summary = {"data": args.data.name, "documents": len(corpora), "questions": len(rows), **_rates(rows),
               "distinctive_questions": len(distinctive),
               **{f"distinctive_{key}": value for key, value in _rates(distinctive).items()}}
    print(json.dumps(summary))
    atomic_write_json(args.out, {**summary, "rows": rows, "commit": provenance.commit(), "dirty": provenance.dirty(),
                                 "machine": provenance.machine()})
    print(f"wrote {args.out}")


def _rates(rows: list[dict]) -> dict[str, float | None]:
    if not rows:
        return {"top1": None, "top3": None}
    return {key: round(sum(r[key] for r in rows) / len(rows), 3) for key in ("top1", "top3")}


if __name__ == "__main__":
    main()
