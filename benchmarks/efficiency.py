"""How close self-study runs to the machine's limit: two ratios, measured in one run.

- **Training**: useful FLOP/s of cartridge training (forward, plus a backward that computes input gradients only,
  since the model is frozen; `methods.training_flops`) over the measured matmul peak in the same dtype.
- **Synthesis**: generated tokens/s of self-study synthesis (both participants' tokens) over the model's raw
  batched decode throughput where synthesis decodes (`measure.synthesis_yardstick`: greedy, a batch of
  `conversations_per_chunk` rows, each after its own copy of a chunk of the mean sampled length, or of the whole
  corpus with `b_context="document"`).

    python -m benchmarks.efficiency [--doc 3] [--dtype bfloat16] [--train-windows 32] [--conversations 32]
        [--model qwen2.5-coder-0.5b]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from cartridges_sdk import Cartridge, load_model
from cartridges_sdk.lm import resolve_dtype
from cartridges_sdk.plugins import synthesizers, trainers
from cartridges_sdk.making.settings import SynthesisConfig
from cartridges_sdk.making.synthesis import synthesize
from cartridges_sdk.making.memory import process_memory_mb
from cartridges_sdk.trainer_inputs import TrainConfig

from . import methods, provenance
from .measure import matmul_peak, synthesis_yardstick
from .data import DEFAULT_DATA


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--doc", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="work dtype")
    parser.add_argument("--tokens", type=int, default=256, help="cartridge size p")
    parser.add_argument("--train-windows", type=int, default=32, help="256-token windows to train on")
    parser.add_argument("--conversations", type=int, default=32, help="conversations to synthesize")
    parser.add_argument("--model", default=None, help="a named model, GGUF file or model folder (default: the "
                        "embedded one)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/efficiency.json"))
    args = parser.parse_args()

    lm = load_model(args.model) if args.model else load_model()
    work = lm.in_dtype(resolve_dtype(args.dtype))
    dtype = getattr(torch, args.dtype)
    text = json.loads(args.data.read_text(encoding="utf-8").splitlines()[args.doc])["input"]
    ids = methods.document_ids(lm, text)
    peak = matmul_peak(dtype)
    print(f"{args.dtype} matmul peak: {peak / 1e9:.1f} GFLOP/s", flush=True)

    # training: next-token windows of the document, so no synthesis is needed to time the step
    windows = methods.raw_windows(ids, args.train_windows, seed=0)
    config = TrainConfig(objective="ntp", eval_fraction=0.0)
    start_cart = Cartridge.from_prefix(lm, ids, args.tokens).bind(work)
    trainer = trainers.create("torch", work)
    resident = process_memory_mb() or 0.0  # 0 where /proc is missing
    start = time.perf_counter()
    trainer.fit(start_cart, windows, work, config, progress=False)
    train_s = time.perf_counter() - start
    train_peak = max(h["peak_memory_mb"] for h in trainer.history)  # restarts when fit starts (Linux)
    train_flops = methods.training_flops(lm, windows, args.tokens, 1)
    train_ratio = train_flops / train_s / peak
    print(f"training: {sum(c.num_tokens for c in windows)} tokens in {train_s:.1f} s, "
          f"{train_flops / train_s / 1e9:.1f} useful GFLOP/s = {train_ratio:.2f} of peak; peak memory "
          f"{train_peak:.0f} MB, {train_peak - resident:.0f} MB above the {resident:.0f} MB resident before", flush=True)

    # synthesis against raw decoding, same model and dtype
    synth_config = SynthesisConfig(num_conversations=args.conversations, document_windows=0, seed=0)
    raw = synthesis_yardstick(work, ids, synth_config)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        ds = synthesize(text, work, Path(tmp) / "data", synth_config, synthesizer=synthesizers.create("hf", work),
                        progress=False)
        synth_s = time.perf_counter() - start
        generated = methods.generated_tokens(lm, list(ds))
    synth_rate = generated / synth_s
    synth_ratio = synth_rate / raw
    print(f"raw batched decode: {raw:.1f} tok/s; synthesis: {generated} tokens in {synth_s:.1f} s = "
          f"{synth_rate:.1f} tok/s = {synth_ratio:.2f} of raw", flush=True)
    result = {
        "dtype": args.dtype, "doc": args.doc, "tokens": args.tokens, "matmul_peak_flops": peak,
        "training": {"seconds": train_s, "useful_flops": train_flops, "ratio": train_ratio,
                     "tokens": sum(c.num_tokens for c in windows), "resident_before_mb": resident,
                     "peak_memory_mb": train_peak},
        "synthesis": {"seconds": synth_s, "generated_tokens": generated, "tokens_per_s": synth_rate,
                      "raw_decode_tokens_per_s": raw, "ratio": synth_ratio},
        "model": lm.name, "commit": provenance.commit(), "machine": provenance.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
