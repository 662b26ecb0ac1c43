"""Self-study as a user runs it: `from_corpus` on real documents, scored on their real questions.

For each document: gold-answer NLL with no context, with the whole document in context (ICL, computed here),
with the untrained prefix cartridge and with the trained one; gap closure and KL(ICL || cartridge) for both
cartridges; wall-clock time of synthesis + training. Work folders are kept, so a re-run resumes.

    python -m benchmarks.selfstudy [--docs 1] [--tokens 256] [--conversations 256] [--set lr=0.01 ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cartridges_sdk import Cartridge, load_model
from cartridges_sdk.cli.common import parse_settings
from cartridges_sdk.making.evaluation import score

from . import provenance
from .data import DEFAULT_DATA


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="L-Eval-format JSONL (input, instructions, outputs)")
    parser.add_argument("--docs", default="1", help="comma-separated document indices")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--conversations", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="any from_corpus setting (repeatable)")
    parser.add_argument("--work", type=Path, default=Path("benchmarks/results/selfstudy.work"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/selfstudy.json"))
    args = parser.parse_args()

    lm = load_model()
    settings = parse_settings(args.set)
    lines = args.data.read_text(encoding="utf-8").splitlines()
    rows = []
    for d in (int(x) for x in args.docs.split(",")):
        doc = json.loads(lines[d])
        text, qa = doc["input"], list(zip(doc["instructions"], doc["outputs"]))
        start = time.perf_counter()
        trained = Cartridge.from_corpus(
            text, lm, num_tokens=args.tokens, num_conversations=args.conversations, epochs=args.epochs,
            seed=args.seed, output_dir=args.work / f"{args.data.stem}-{d}-p{args.tokens}-s{args.seed}", **settings,
        )
        seconds = time.perf_counter() - start
        untrained, got = score(lm, text, [Cartridge.from_prefix(lm, text, args.tokens), trained], qa)
        row = {
            "doc": d, "corpus_tokens": len(lm.encode(text)), "questions": len(qa), "seconds": round(seconds, 1),
            "nll_none": got.nll_none, "nll_icl": got.nll_icl,
            "untrained": {"nll": untrained.nll_cartridge, "closure": untrained.gap_closure, "kl": untrained.kl_icl_cartridge},
            "trained": {"nll": got.nll_cartridge, "closure": got.gap_closure, "kl": got.kl_icl_cartridge},
        }
        rows.append(row)
        print(f"doc {d} ({row['corpus_tokens']} tokens, {len(qa)} questions, {seconds:.0f} s): closure "
              f"{untrained.gap_closure:.3f} -> {got.gap_closure:.3f}, KL {untrained.kl_icl_cartridge:.3f} -> "
              f"{got.kl_icl_cartridge:.3f}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "data": str(args.data), "tokens": args.tokens, "conversations": args.conversations, "epochs": args.epochs,
        "seed": args.seed, "settings": settings, "model": lm.name, "commit": provenance.commit(), "machine": provenance.machine(),
        "rows": rows,
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
