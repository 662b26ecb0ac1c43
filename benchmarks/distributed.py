"""Data-parallel speed: self-study sequences/s of `cartridges synthesize` and training tokens/s of `cartridges train`,
each with 1 and with N processes on this machine, on a QASPER paper with the default model.

Each rank is a whole process with the frozen model (replicated, or sharded across the ranks with FSDP2 in a third
training run); on a CPU machine the ranks share its cores (each gets cores/N threads), so this measures what
splitting the work costs or saves here, not what N GPUs would do.

    python -m benchmarks.distributed [--nproc 2] [--conversations 64] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from cartridges_sdk.making.dataset import SelfStudyDataset
from cartridges_sdk.files import atomic_write_json

from . import provenance
from .data import DEFAULT_DATA, load_corpora


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256, help="cartridge size p")
    parser.add_argument("--doc", default="0")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/distributed.json"))
    args = parser.parse_args()

    work = args.out.with_suffix(".work")
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "paper.txt"
    corpus.write_text(load_corpora(DEFAULT_DATA, args.doc)[0].text)
    cli = [sys.executable, "-m", "cartridges_sdk.cli"]
    cores = os.cpu_count() or 1
    synthesis = []
    for nproc in (1, args.nproc):
        folder = work / f"data-{nproc}"
        start = time.perf_counter()
        subprocess.run([*cli, "synthesize", str(corpus), "-o", str(folder), "--conversations", str(args.conversations),
                        "--restart", "--nproc", str(nproc)],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": str(max(1, cores // nproc))})
        seconds = time.perf_counter() - start
        sequences = len(SelfStudyDataset(folder))
        row = {"stage": "synthesis", "processes": nproc, "threads_each": max(1, cores // nproc),
               "sequences": sequences, "wall_s": round(seconds, 1), "sequences_per_s": round(sequences / seconds, 3)}
        synthesis.append(row)
        print(json.dumps(row), flush=True)
    # the same sampled tokens whichever way the work was split (log-probabilities may differ in the last digits:
    # matmul sums split over another number of threads round differently)
    same = [sorted((c.conv_id, c.input_ids.tolist()) for c in SelfStudyDataset(work / f"data-{n}"))
            for n in (1, args.nproc)]
    print(f"same sequences from 1 and {args.nproc} processes: {same[0] == same[1]}", flush=True)
    data = work / "data-1"
    rows = []
    for nproc, sharded in ((1, False), (args.nproc, False), (args.nproc, True)):
        run = work / f"train-{nproc}{'-sharded' if sharded else ''}"
        start = time.perf_counter()
        subprocess.run([*cli, "train", str(data), "-o", str(run / "c.safetensors"), "--tokens", str(args.tokens),
                        "--init", "prefix", "--work-dir", str(run), "--restart", "--nproc", str(nproc),
                        "--set", f"grad_accum={args.nproc}",  # micro-batches per step over all ranks: one global batch
                        *(["--backend-option", "shard_model=true"] if sharded else [])],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": str(max(1, cores // nproc))})
        log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
        tokens = log[-1]["tokens_per_s"] * log[-1]["elapsed_s"]
        row = {"processes": nproc, "model": "sharded (FSDP2)" if sharded else "replicated",
               "peak_memory_mb_rank0": round(max(r["peak_memory_mb"] for r in log)),
               "threads_each": max(1, cores // nproc), "steps": log[-1]["step"],
               "training_tokens": round(tokens), "train_s": round(log[-1]["elapsed_s"], 1),
               "tokens_per_s": round(log[-1]["tokens_per_s"], 1), "wall_s": round(time.perf_counter() - start, 1),
               "final_loss": round(log[-1]["loss"], 4)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    atomic_write_json(args.out, {"rows": rows, "synthesis": synthesis, "same_sequences": same[0] == same[1],
                                 "conversations": args.conversations, "tokens": args.tokens,
                                 "commit": provenance.commit(), "dirty": provenance.dirty(),
                                 "machine": provenance.machine()})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
