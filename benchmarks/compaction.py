"""KV compaction against the untrained first-p start, on real documents and their questions.

For each document: gold-answer gap closure and KL(ICL || cartridge) of the first-p prefix cartridge and of the
compacted one, and the seconds compaction took. The in-context and no-context references are computed once per
document and shared by every variant, so several settings can be compared in one run:

    python -m benchmarks.compaction --docs 0,1,2,3 [--tokens 256] [--model NAME] [--variant '{"select": "mean"}' ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cartridges_sdk import Cartridge, load_model
from cartridges_sdk.making.settings import CompactionConfig
from cartridges_sdk.making.evaluation import answer_logprobs, kl, nll

from . import provenance
from .data import DEFAULT_DATA


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="L-Eval-format JSONL (input, instructions, outputs)")
    parser.add_argument("--docs", default="0,1,2,3", help="comma-separated document indices")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--model", default=None, help="a named model (default: the embedded 135M)")
    parser.add_argument("--variant", action="append", default=None, metavar="JSON",
                        help="CompactionConfig settings as JSON (repeatable; default: the defaults)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compaction.json"))
    args = parser.parse_args()
    variants = [json.loads(v) for v in args.variant or ["{}"]]
    configs = [CompactionConfig(**v) for v in variants]  # refuse a bad setting before any work

    lm = load_model(args.model)
    lines = args.data.read_text(encoding="utf-8").splitlines()
    rows = []
    for d in (int(x) for x in args.docs.split(",")):
        doc = json.loads(lines[d])
        text, qa = doc["input"], list(zip(doc["instructions"], doc["outputs"]))
        ids = lm.encode(text)
        icl = [answer_logprobs(lm, q, a, document=text) for q, a in qa]
        nll_icl = sum(nll(lp, lm, a) for lp, (_, a) in zip(icl, qa)) / len(qa)
        nll_none = sum(nll(answer_logprobs(lm, q, a), lm, a) for q, a in qa) / len(qa)

        def quality(c: Cartridge) -> dict[str, float]:
            got = [answer_logprobs(lm, q, a, cartridges=[c]) for q, a in qa]
            mean_nll = sum(nll(lp, lm, a) for lp, (_, a) in zip(got, qa)) / len(qa)
            return {"closure": round((nll_none - mean_nll) / (nll_none - nll_icl), 4),
                    "kl": round(sum(kl(r, g) for r, g in zip(icl, got)) / len(qa), 4)}

        row = {"doc": d, "corpus_tokens": len(ids), "questions": len(qa), "nll_none": nll_none, "nll_icl": nll_icl,
               "prefix": quality(Cartridge.from_prefix(lm, ids, args.tokens)), "compact": []}
        print(f"doc {d} ({len(ids)} tokens, {len(qa)} questions), first {args.tokens} tokens: closure "
              f"{row['prefix']['closure']:.3f}, KL {row['prefix']['kl']:.3f}", flush=True)
        for settings, config in zip(variants, configs):
            start = time.perf_counter()
            c = Cartridge.compact(lm, ids, args.tokens, config=config, progress=False, report=False)
            got = {"settings": settings, "seconds": round(time.perf_counter() - start, 1), **quality(c)}
            row["compact"].append(got)
            print(f"doc {d} compacted {settings or '(defaults)'} in {got['seconds']:.0f} s: closure "
                  f"{got['closure']:.3f}, KL {got['kl']:.3f}", flush=True)
        rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "data": str(args.data), "tokens": args.tokens, "model": lm.name, "commit": provenance.commit(),
        "machine": provenance.machine(), "rows": rows,
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
