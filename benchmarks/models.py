"""What each model costs on this machine: load time (first load, which converts the GGUF, and a load from the
converted copy), peak memory, and prefill and decode tokens/s. Each load runs in a process of its own, so one
model's memory never counts against another's.

    python -m benchmarks.models [--models default qwen2.5-coder-0.5b qwen2.5-coder-1.5b] [--dtype float32]

Named models are pulled first if they are not in the cache (`cartridges models pull`); the pull is timed apart.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import provenance
from .data import DEFAULT_DATA

MODELS = ["default", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


def child(name: str, cache: Path, dtype: str, prefill: int, decode: int) -> dict:
    """One process's figures for `name`: load seconds, peak memory, and (if asked) prefill and decode tokens/s."""
    import torch

    from cartridges_sdk import Cartridge, load_model
    from cartridges_sdk.making.memory import process_memory_mb

    from .measure import decode_throughput

    start = time.perf_counter()
    lm = load_model(None if name == "default" else name, cache_dir=cache, dtype=dtype)
    out = {"load_seconds": round(time.perf_counter() - start, 1), "model": lm.name,
           "parameters": lm.num_parameters, "max_context": lm.max_context}
    if prefill:
        text = json.loads(DEFAULT_DATA.read_text(encoding="utf-8").splitlines()[0])["input"]
        ids = lm.encode(text)[:prefill]
        with torch.inference_mode():
            lm.logits(ids[:32], [])  # warm up
            start = time.perf_counter()
            lm.logits(ids, [])
            out["prefill_tokens_per_s"] = round(len(ids) / (time.perf_counter() - start), 1)
        cartridge = Cartridge.from_prefix(lm, ids, min(256, len(ids)))
        prompt = lm.encode("What is this paper about?")
        out["decode_tokens_per_s"] = round(decode_throughput(lm, cartridge, 1, prompt, decode), 2)
    out["peak_memory_mb"] = round(process_memory_mb("VmHWM") or 0.0)
    return out


def run_child(name: str, cache: Path, dtype: str, prefill: int, decode: int) -> dict:
    command = [sys.executable, "-m", "benchmarks.models", "--child", name, "--cache", str(cache), "--dtype", dtype,
               "--prefill", str(prefill), "--decode", str(decode)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=Path(__file__).parent.parent)
    if done.returncode != 0:
        raise SystemExit(f"{name}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, help=f"default, or named models (default {MODELS})")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prefill", type=int, default=1024, help="tokens of one forward pass, timed")
    parser.add_argument("--decode", type=int, default=32, help="greedy tokens after a 256-token cartridge, timed")
    parser.add_argument("--cache", type=Path, default=None, help="the model cache (default: the SDK's)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/models.json"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.cache, args.dtype, args.prefill, args.decode)))
        return

    from cartridges_sdk.models import default_cache_dir
    from cartridges_sdk.named_models import pull, pulled_path

    cache = args.cache or default_cache_dir()
    rows = {}
    for name in args.models:
        row: dict = {}
        if name != "default":
            start = time.perf_counter()
            gguf = pull(name, cache)
            row["pull_seconds"] = round(time.perf_counter() - start, 1)
        with tempfile.TemporaryDirectory() as fresh:  # a cache with nothing converted: the first load converts
            if name != "default":  # ...the file pulled above, not a second pull into the fresh cache
                linked = pulled_path(name, Path(fresh))
                linked.parent.mkdir()
                linked.symlink_to(gguf)
            first = run_child(name, Path(fresh), args.dtype, 0, 0)
            row["first_load_seconds"], row["first_load_peak_memory_mb"] = first["load_seconds"], first["peak_memory_mb"]
            row.update(run_child(name, Path(fresh), args.dtype, args.prefill, args.decode))
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    provenance.save({"dtype": args.dtype, "prefill_tokens": args.prefill, "decode_tokens": args.decode,
                     "models": rows, "commit": provenance.commit(), "dirty": provenance.dirty(),
                     "machine": provenance.machine()}, args.out)


if __name__ == "__main__":
    main()
