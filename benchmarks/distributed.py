"""Data-parallel training speed: training tokens/s of `cartridges train` with 1 and with N processes on this machine,
on one self-study dataset of a QASPER paper (synthesized once, kept in the work folder), default model.

Each rank is a whole process with the frozen model; on a CPU machine the ranks share its cores (each gets
cores/N threads), so this measures what splitting the work costs or saves here, not what N GPUs would do.

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
    data = work / "data"
    cli = [sys.executable, "-m", "cartridges_sdk.cli"]
    subprocess.run([*cli, "synthesize", str(corpus), "-o", str(data), "--conversations", str(args.conversations)],
                   check=True)
    cores = os.cpu_count() or 1
    rows = []
    for nproc in (1, args.nproc):
        run = work / f"train-{nproc}"
        start = time.perf_counter()
        subprocess.run([*cli, "train", str(data), "-o", str(run / "c.safetensors"), "--tokens", str(args.tokens),
                        "--init", "prefix", "--work-dir", str(run), "--restart", "--nproc", str(nproc),
                        "--set", f"grad_accum={args.nproc // nproc}"],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": str(max(1, cores // nproc))})
        log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
        tokens = log[-1]["tokens_per_s"] * log[-1]["elapsed_s"]
        row = {"processes": nproc, "threads_each": max(1, cores // nproc), "steps": log[-1]["step"],
               "training_tokens": round(tokens), "train_s": round(log[-1]["elapsed_s"], 1),
               "tokens_per_s": round(log[-1]["tokens_per_s"], 1), "wall_s": round(time.perf_counter() - start, 1),
               "final_loss": round(log[-1]["loss"], 4)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    atomic_write_json(args.out, {"rows": rows, "conversations": args.conversations, "tokens": args.tokens,
                                 "commit": provenance.commit(), "dirty": provenance.dirty(),
                                 "machine": provenance.machine()})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
