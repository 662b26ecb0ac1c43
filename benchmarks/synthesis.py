"""Self-study synthesis speed by synthesizer backend: the same settings, corpus and dataset size on each.

For each backend: engine start-up, then synthesis wall clock, conversations/s and generated tokens/s (A's and B's
tokens; document windows are counted as sequences, not generated tokens). Run it alone on the machine.
``openai:N`` starts N local vLLM OpenAI servers (cartridges_vllm.server), each bound to its own share of the cores,
and synthesizes through them over HTTP; their start-up is counted as the engine's.

    python -m benchmarks.synthesis [--docs 0] [--conversations 64] [--windows 32] [--synthesizers hf,vllm,openai:2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

from cartridges_sdk import load_model
from cartridges_sdk.cli.common import parse_settings
from cartridges_sdk.files import atomic_write_json
from cartridges_sdk.plugins import synthesizers
from cartridges_sdk.making.settings import SynthesisConfig
from cartridges_sdk.making.synthesis import synthesize

from . import provenance
from .data import DEFAULT_DATA, load_corpora
from .methods import generated_tokens


@contextlib.contextmanager
def synthesizer(spec: str, lm):
    """The backend `spec` names, with the servers it needs for the run's duration."""
    name, _, count = spec.partition(":")
    if name != "openai":
        with synthesizers.create(name, lm) as synth:
            yield synth
        return
    from cartridges_vllm.server import VLLMServer

    with contextlib.ExitStack() as stack:
        logs = Path(tempfile.gettempdir())
        n = int(count or 1)
        # several servers on one machine split its cores (each bound to its own), as servers on separate machines
        # would each have their own; one server uses them all
        cores = os.cpu_count() or 1
        share = [f"{i * cores // n}-{(i + 1) * cores // n - 1}" for i in range(n)] if 1 < n <= cores else [None] * n
        servers = [stack.enter_context(VLLMServer(lm.files, cpus=share[i],
                                                  log_file=str(logs / f"benchmark-vllm-server-{i}.log")))
                   for i in range(n)]
        yield stack.enter_context(synthesizers.create("openai", lm, base_url=[s.url for s in servers]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="L-Eval-format JSONL (input, instructions, outputs)")
    parser.add_argument("--docs", default="0", help="document index")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--windows", type=int, default=32, help="document windows")
    parser.add_argument("--synthesizers", default="hf,vllm,openai,openai:2",
                        help="comma-separated backend names; openai:N runs N local vLLM servers")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="any synthesis setting (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/synthesis.json"))
    args = parser.parse_args()

    (corpus,) = load_corpora(args.data, args.docs)
    config = SynthesisConfig(num_conversations=args.conversations, document_windows=args.windows,
                             **parse_settings(args.set))
    lm = load_model()
    rows = []
    for name in args.synthesizers.split(","):
        start = time.perf_counter()
        with synthesizer(name, lm) as synth, tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter() - start
            begin = time.perf_counter()
            dataset = synthesize(corpus.text, lm, Path(tmp) / "data", config, synthesizer=synth)
            seconds = time.perf_counter() - begin
            conversations = list(dataset)
            tokens = generated_tokens(lm, conversations)
        rows.append({"synthesizer": name, "start_s": round(started, 1), "synthesis_s": round(seconds, 1),
                     "sequences": len(conversations), "conversations_per_s": round(args.conversations / seconds, 3),
                     "generated_tokens": tokens, "generated_tokens_per_s": round(tokens / seconds, 1)})
        print(json.dumps(rows[-1]))
    result = {"corpus": corpus.name, "config": {"conversations": args.conversations, "windows": args.windows,
              **parse_settings(args.set)}, "rows": rows, "commit": provenance.commit(), "dirty": provenance.dirty(),
              "machine": provenance.machine()}
    atomic_write_json(args.out, result)
    print("| synthesizer | start s | synthesis s | conversations/s | generated tokens/s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['synthesizer']} | {r['start_s']} | {r['synthesis_s']} | {r['conversations_per_s']} | "
              f"{r['generated_tokens_per_s']} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":  # vLLM starts worker processes
    main()
