"""Self-study as a user runs it: `from_corpus` on real documents, scored on their real questions.

For each document: gold-answer NLL with no context, with the whole document in context (ICL, computed here),
with the untrained prefix cartridge, the compacted start (when self-study starts from one) and the trained one; gap
closure and KL(ICL || cartridge) for each; wall-clock time of the build, and of its training alone (the rest is the
compacted start and synthesis). Work folders are kept (one per model and settings), so a re-run resumes; a run
whose settings differ from an earlier one's in training settings only (`lr`, `batch_tokens`, `epochs`, ...) trains
on that run's synthesized data and compacted start, copied, so variants of the training differ in nothing else.
With several documents it also prints the closure pooled over all their questions (`--questions N`: each
document's first N, as `benchmarks.vs_rag` asks them).

    python -m benchmarks.selfstudy [--docs 1] [--questions N] [--tokens 256] [--conversations 16] [--epochs 1]
        [--recipe reader] [--set lr=0.01 ...] [--compaction chunk_questions=8 ...] [--model qwen2.5-coder-0.5b]

``--recipe`` stands for the flags its recipe spells out (`RECIPES`), with the given flags over them, and names its
work folder as those flags would: a run with ``--recipe reader`` resumes or reuses one with the flags written out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

from cartridges_sdk import Cartridge, load_model
from cartridges_sdk.cli.common import compaction_config, parse_settings
from cartridges_sdk.making.checkpoint import RUN_LOG
from cartridges_sdk.making.evaluation import score
from cartridges_sdk.making.selfstudy import COMPACT_START
from cartridges_sdk.making.settings import DEFAULT_CONVERSATIONS, RECIPES, TRAINING_SETTINGS, CompactionConfig

from . import provenance
from .data import DEFAULT_DATA
from .naming import recipe_flags

START_AND_TRAINING = TRAINING_SETTINGS | {"init", "num_frozen"}  # what the synthesized data does not depend on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="L-Eval-format JSONL (input, instructions, outputs)")
    parser.add_argument("--docs", default="1", help="comma-separated document indices")
    parser.add_argument("--questions", type=int, default=None, help="each document's first N questions (default: all)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--conversations", type=int, default=None, help=f"default: the recipe's, else "
                        f"{DEFAULT_CONVERSATIONS}")
    parser.add_argument("--epochs", type=int, default=None, help="default: the recipe's, else 1")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                        help="a named recipe's settings (docs/self-study.md, \"Recipes\"), the other flags over them")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="any from_corpus setting (repeatable)")
    parser.add_argument("--compaction", action="append", metavar="KEY=VALUE",
                        help="a CompactionConfig setting for the compacted start (repeatable), e.g. chunk_questions=8")
    parser.add_argument("--work", type=Path, default=Path("benchmarks/results/selfstudy.work"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/selfstudy.json"))
    parser.add_argument("--model", default=None, help="a named model, GGUF file or model folder (default: the "
                        "embedded one)")
    args = parser.parse_args()

    settings, start = recipe_flags(args.recipe)
    conversations, epochs = settings.pop("num_conversations", DEFAULT_CONVERSATIONS), settings.pop("epochs", 1)
    if args.conversations is None:  # the flags given win over the recipe
        args.conversations = conversations
    if args.epochs is None:
        args.epochs = epochs
    settings |= parse_settings(args.set)
    # checked before the model loads
    start_config = compaction_config(args.compaction, base=CompactionConfig(**start) if start else None)
    compaction = start | parse_settings(args.compaction)  # as given, for the work folder's name and the result
    lm = load_model(args.model) if args.model else load_model()
    lines = args.data.read_text(encoding="utf-8").splitlines()
    rows = []
    for d in (int(x) for x in args.docs.split(",")):
        doc = json.loads(lines[d])
        text, qa = doc["input"], list(zip(doc["instructions"], doc["outputs"]))[:args.questions]
        start = time.perf_counter()
        # a folder per model and settings: a run with other settings must not resume this one's work
        named = [lm.name, args.conversations, args.epochs, settings] + ([compaction] if compaction else [])
        work = args.work / f"{args.data.stem}-{d}-p{args.tokens}-s{args.seed}-{_tag(named)}"
        # ... but one that differs in training settings only trains on the same data (and start, if made alike)
        data = [lm.name, args.conversations, {k: v for k, v in settings.items() if k not in START_AND_TRAINING}]
        begin = [settings.get(k) for k in sorted(START_AND_TRAINING - TRAINING_SETTINGS)] + [compaction]
        reuse_synthesis(work, {"data": _tag(data), "start": _tag(data + begin)})
        trained = Cartridge.from_corpus(
            text, lm, num_tokens=args.tokens, num_conversations=args.conversations, epochs=args.epochs,
            seed=args.seed, output_dir=work, compaction=start_config, **settings,
        )
        seconds = time.perf_counter() - start
        logged = [json.loads(line) for p in work.rglob(RUN_LOG) for line in p.read_text().splitlines() if line]
        train_s = max((r["elapsed_s"] for r in logged if "elapsed_s" in r), default=None)
        starts = sorted(work.rglob(COMPACT_START))
        cartridges = [Cartridge.from_prefix(lm, text, args.tokens)] + \
            ([Cartridge.load(starts[0], lm)] if starts else []) + [trained]
        scored = score(lm, text, cartridges, qa)
        untrained, got = scored[0], scored[-1]
        row = {
            "doc": d, "corpus_tokens": len(lm.encode(text)), "questions": len(qa), "seconds": round(seconds, 1),
            "training_seconds": train_s and round(train_s, 1),
            "work_dtype": (trained.meta.training or {}).get("work_dtype"),
            "synthesis_dtype": (trained.meta.training or {}).get("synthesis_dtype"), "nll_none": got.nll_none, "nll_icl": got.nll_icl,
            "untrained": {"nll": untrained.nll_cartridge, "closure": untrained.gap_closure, "kl": untrained.kl_icl_cartridge},
            "trained": {"nll": got.nll_cartridge, "closure": got.gap_closure, "kl": got.kl_icl_cartridge},
        }
        if starts:
            row["compacted_start"] = {"nll": scored[1].nll_cartridge, "closure": scored[1].gap_closure,
                                      "kl": scored[1].kl_icl_cartridge}
            print(f"doc {d}: compacted start closure {scored[1].gap_closure:.3f}, KL {scored[1].kl_icl_cartridge:.3f}; "
                  f"training {train_s or 0:.0f} s of {seconds:.0f} s, in {row['work_dtype']}", flush=True)
        rows.append(row)
        print(f"doc {d} ({row['corpus_tokens']} tokens, {len(qa)} questions, {seconds:.0f} s): closure "
              f"{untrained.gap_closure:.3f} -> {got.gap_closure:.3f}, KL {untrained.kl_icl_cartridge:.3f} -> "
              f"{got.kl_icl_cartridge:.3f}", flush=True)
    pooled = None
    n = sum(r["questions"] for r in rows)
    gap = sum(r["questions"] * (r["nll_none"] - r["nll_icl"]) for r in rows)
    if len(rows) > 1 and gap > 0:  # as benchmarks.vs_rag pools: each question weighs alike
        pooled = {"questions": n, "closure": sum(r["questions"] * (r["nll_none"] - r["trained"]["nll"]) for r in rows) / gap,
                  "kl": sum(r["questions"] * r["trained"]["kl"] for r in rows) / n}
        print(f"all {len(rows)} documents, {n} questions: trained closure {pooled['closure']:.3f}, "
              f"KL {pooled['kl']:.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "data": str(args.data), "tokens": args.tokens, "conversations": args.conversations, "epochs": args.epochs,
        "seed": args.seed, "settings": settings, "compaction": compaction, "model": lm.name, "commit": provenance.commit(), "machine": provenance.machine(),
        "rows": rows, "pooled": pooled,
    }, indent=2))
    print(f"wrote {args.out}")


def _tag(named: list) -> str:
    return hashlib.sha256(json.dumps(named, sort_keys=True, default=str).encode()).hexdigest()[:8]


def reuse_synthesis(work: Path, tags: dict[str, str]) -> None:
    """Give `work` the dataset of a sibling folder whose data were made alike (`tags["data"]`), and its compacted
    start if that was made alike too (`tags["start"]`), unless `work` has a dataset of its own. `from_corpus` checks
    the copied dataset's header against this run's settings, so a wrong copy is refused, never trained on; a copy
    of a synthesis that was stopped midway is completed by this run's."""
    (work / "train").mkdir(parents=True, exist_ok=True)
    (work / "made.json").write_text(json.dumps(tags))
    if (work / "data").exists():
        return
    for other in sorted(work.parent.glob(f"{work.name.rsplit('-', 1)[0]}-*")):
        made = json.loads((other / "made.json").read_text()) if (other / "made.json").is_file() else {}
        if other == work or not (other / "data").is_dir() or made.get("data") != tags["data"]:
            continue
        shutil.copytree(other / "data", work / "data")
        start = made.get("start") == tags["start"] and (other / "train" / COMPACT_START).is_file()
        if start:
            shutil.copy2(other / "train" / COMPACT_START, work / "train" / COMPACT_START)
        print(f"{work.name}: training on the data{' and start' * start} of {other.name}", flush=True)
        return


if __name__ == "__main__":
    main()
