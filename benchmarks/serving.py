"""Serving throughput: N users, each with their own document, answered with their cartridges versus with their
documents in context (ICL), in the same runtime and the same run, and how many such users fit a KV budget.

One request per user (a question, greedy, `--decode` new tokens), all in one batch; the time includes prefill, which
is what ICL pays per request and a cartridge does not. Cartridges here are untrained prefix cartridges: speed does not
depend on what the tensors hold. Run it alone on the machine.

    python -m benchmarks.serving [--docs 0,1,2,3] [--sizes 128,512,2048] [--decode 32] [--runtimes llamacpp,vllm,hf]

llama.cpp answers one request after another (one sequence) from the default model's GGUF (Q4_1 weights, f16 KV).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cartridges_sdk import Cartridge, GenerationParams, GenerationRequest, load_model
from cartridges_sdk.files import atomic_write_json

from . import provenance
from .data import DEFAULT_DATA, load_corpora


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="L-Eval-format JSONL (input, instructions, outputs)")
    parser.add_argument("--docs", default="0,1,2,3", help="comma-separated document indices: one user each")
    parser.add_argument("--sizes", default="128,512,2048", help="cartridge sizes p")
    parser.add_argument("--decode", type=int, default=32, help="new tokens per answer")
    parser.add_argument("--runtimes", default="llamacpp,vllm,hf")
    parser.add_argument("--kv-gib", type=int, default=2, help="KV budget for the users-that-fit figure (and vLLM's cache)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serving.json"))
    args = parser.parse_args()

    lm = load_model()
    corpora = load_corpora(args.data, args.docs)
    docs = [lm.encode(c.text) for c in corpora]
    questions = [[{"role": "user", "content": c.questions[0].question}] for c in corpora]
    params = GenerationParams(max_new_tokens=args.decode)
    a = lm.identity.architecture
    kv_values_per_token = a["num_layers"] * a["num_kv_heads"] * a["head_dim"] * 2
    methods = {"icl": [GenerationRequest(q, [], params, prefix_ids=d) for q, d in zip(questions, docs)]}
    for p in (int(s) for s in args.sizes.split(",")):
        methods[f"cartridge p={p}"] = [GenerationRequest(q, [Cartridge.from_prefix(lm, d[:p], min(p, len(d)))], params)
                                       for q, d in zip(questions, docs)]
    rows = []
    for name in args.runtimes.split(","):
        options = {"vllm": {"kv_cache_gib": args.kv_gib}, "llamacpp": {"n_ctx": lm.max_context}}.get(name, {})
        # llama.cpp keeps its KV in f16, the others in the model's dtype
        budget_tokens = args.kv_gib * 2**30 // (kv_values_per_token * (2 if name == "llamacpp" else lm.dtype.itemsize))
        start = time.perf_counter()
        runtime = lm.get_runtime(name, **options)
        started = time.perf_counter() - start
        for method, requests in methods.items():
            begin = time.perf_counter()
            outs = runtime.generate(requests)
            seconds = time.perf_counter() - begin
            per_user = sum(len(r.prefix_ids) + sum(c.num_tokens for c in r.cartridges) for r in requests) / len(requests)
            rows.append({
                "runtime": name, "method": method, "users": len(requests), "engine_start_s": round(started, 1),
                "seconds": round(seconds, 2), "new_tokens": sum(len(o.token_ids) for o in outs),
                "tokens_per_s": round(sum(len(o.token_ids) for o in outs) / seconds, 1),
                "context_tokens_per_user": round(per_user), "users_fit_budget": int(budget_tokens // (per_user + 64 + args.decode)),
            })
            print(json.dumps(rows[-1]), flush=True)
        lm.close()
    atomic_write_json(args.out, {"docs": args.docs, "decode": args.decode, "kv_gib": args.kv_gib, "rows": rows,
                                 "commit": provenance.commit(), "dirty": provenance.dirty(), "machine": provenance.machine()})
    print("| runtime | method | context tokens/user | batch s | new tokens/s | users in a "
          f"{args.kv_gib} GiB KV budget |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['runtime']} | {r['method']} | {r['context_tokens_per_user']:,} | {r['seconds']} | "
              f"{r['tokens_per_s']} | {r['users_fit_budget']} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":  # vLLM starts worker processes
    main()
