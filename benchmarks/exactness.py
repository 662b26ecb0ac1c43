"""Measure how close an untrained prefix cartridge is to the same tokens in context, in float32.

For every document, prefix size p and question: max |logits(q | cartridge) - logits(prefix + q)[p:]|.
The two paths compute the same mathematics; what remains is float32 rounding, which differs because the prefix's
attention reductions run over a different total length. Prints a summary and writes JSON.

    python -m benchmarks.exactness [--docs 3] [--out benchmarks/results/exactness.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cartridges_sdk import Cartridge, load_model

from . import provenance
from .data import DEFAULT_DATA


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="L-Eval-format JSONL (input + instructions)")
    parser.add_argument("--docs", type=int, default=3, help="how many documents")
    parser.add_argument("--sizes", default="17,64,100,256,333,512,1000")
    parser.add_argument("--questions", type=int, default=3, help="questions per document")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/exactness.json"))
    args = parser.parse_args()

    lm = load_model()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with args.data.open() as f:
        docs = [json.loads(line) for _, line in zip(range(args.docs), f)]
    for d, doc in enumerate(docs):
        ids = lm.encode(doc["input"])
        for p in sizes:
            if p >= len(ids):
                continue
            c = Cartridge.from_prefix(lm, ids, p)
            for question in doc["instructions"][: args.questions]:
                q = lm.prompt_ids([{"role": "user", "content": question}], after_cartridge=True)
                diff = (lm.logits(q, [c]) - lm.logits(ids[:p] + q)[p:]).abs().max().item()
                rows.append({"doc": d, "p": p, "question_tokens": len(q), "max_abs_diff": diff})
    diffs = torch.tensor([r["max_abs_diff"] for r in rows])
    summary = {
        "cases": len(rows),
        "max": diffs.max().item(),
        "median": diffs.median().item(),
        "over_1e-4": int((diffs > 1e-4).sum()),
        "exactly_equal": int((diffs == 0).sum()),
    }
    result = {
        "model": lm.name,
        "dtype": str(lm.dtype),
        "data": str(args.data),
        "commit": provenance.commit(),
        "machine": provenance.machine(),
        "summary": summary,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
