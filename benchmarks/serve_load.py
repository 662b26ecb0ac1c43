"""`cartridges serve` under load: concurrent clients over a store of cartridges, versus each request carrying its
document in the prompt (ICL), through the same server and runtime.

A real uvicorn server on 127.0.0.1 (this process), called by `--clients` concurrent threads with the openai client;
each client asks one question (greedy, `--decode` new tokens) about one of `--docs` QASPER papers, with that paper's
cartridge (a prefix cartridge of `--tokens` tokens: speed does not depend on what the tensors hold), or with the
bare model and the paper in the message. Prints requests/s and p50/p99 latency. Run it alone on the machine.

    python -m benchmarks.serve_load [--docs 0,1,2,3,4,5,6,7] [--clients 64] [--icl-clients 8] [--tokens 512]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from cartridges_sdk import Cartridge, CartridgeStore, load_model
from cartridges_sdk.files import atomic_write_json
from cartridges_sdk.serve.server import create_app
from cartridges_sdk.serve.settings import ServeConfig
from cartridges_sdk.serve.background import serving

from . import provenance
from .data import DEFAULT_DATA, load_corpora


def _load(url: str, jobs: list[dict], clients: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)

    def one(job):
        start = time.perf_counter()
        out = client.chat.completions.create(**job)
        return time.perf_counter() - start, out.usage.completion_tokens

    begin = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, jobs))
    wall = time.perf_counter() - begin
    latency = np.array([r[0] for r in results])
    return {"requests": len(jobs), "clients": clients, "wall_s": round(wall, 2),
            "requests_per_s": round(len(jobs) / wall, 3), "p50_s": round(float(np.percentile(latency, 50)), 2),
            "p99_s": round(float(np.percentile(latency, 99)), 2),
            "new_tokens_per_s": round(sum(r[1] for r in results) / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--docs", default="0,1,2,3,4,5,6,7")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--icl-clients", type=int, default=8, help="ICL requests (each prefills a whole paper)")
    parser.add_argument("--tokens", type=int, default=512, help="cartridge size p")
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--runtime", default="hf")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve_load.json"))
    args = parser.parse_args()

    lm = load_model()
    corpora = load_corpora(args.data, args.docs)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = CartridgeStore(tmp, lm)
        for c in corpora:
            store.add(c.name, Cartridge.from_prefix(lm, c.text, args.tokens), corpus=c.text)
        app = create_app(store, lm.get_runtime(args.runtime), ServeConfig(max_queue=1024, max_batch=64))
        with serving(app) as url:
            def job(i, icl):
                c = corpora[i % len(corpora)]
                q = c.questions[(i // len(corpora)) % len(c.questions)].question
                content = f"{c.text}\n\n{q}" if icl else q
                return {"model": lm.name if icl else c.name, "messages": [{"role": "user", "content": content}],
                        "max_tokens": args.decode, "temperature": 0}

            for method, n in (("cartridge", args.clients), ("icl", args.icl_clients)):
                row = {"runtime": args.runtime, "method": method,
                       **_load(url, [job(i, method == "icl") for i in range(n)], n)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    atomic_write_json(args.out, {"docs": args.docs, "tokens": args.tokens, "decode": args.decode, "rows": rows,
                                 "commit": provenance.commit(), "dirty": provenance.dirty(),
                                 "machine": provenance.machine()})
    print(f"wrote {args.out}")
    lm.close()


if __name__ == "__main__":
    main()
