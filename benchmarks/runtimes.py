"""Which runtime answers fastest on this machine, per model: what `runtime="auto"` picks, measured.

For each model and each installed runtime asked for: the seconds to start it, then the quick start's three questions
about its sample (greedy, up to 60 new tokens each) answered the ways a user asks them: with a cartridge of a quarter
of the text (one question, then the three in one call) and with the whole text in context (the three in one call);
new tokens per second over those calls; the same cartridge asked by nine users at once (a server's load: HF batches
them, llama.cpp answers one after another); and how many answers are word for word the HF runtime's (llama.cpp runs the
GGUF's quantized weights, HF a float32 copy of them: close, not identical). It prints a table and what "auto" picks:

    python -m benchmarks.runtimes --models default,qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

from cartridges_sdk import Cartridge, load_model
from cartridges_sdk.plugins import runtimes

from . import provenance
from .measure import timed

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "examples" / "data" / "harrow_point.txt"
QUESTIONS = ["When was the Harrow Point lighthouse built, and by whom?",
             "How many ships were lost on the Skerra Reef between 1850 and 1870?",
             "What fuel did the original lamp burn?"]
NEW_TOKENS = 60
USERS = 9  # requests at once, as a server meets them


def measure(lm, name: str, cartridge: Cartridge, text: str) -> dict:
    """One runtime on one model: start, then each way of asking, timed in the order a user meets them."""
    runtime, start = timed(lm.device, lambda: lm.get_runtime(name))
    gen = dict(runtime=runtime, max_new_tokens=NEW_TOKENS)
    one, one_s = timed(lm.device, lambda: cartridge.ask(QUESTIONS[0], **gen))
    three, three_s = timed(lm.device, lambda: cartridge.ask(QUESTIONS, **gen))
    whole, whole_s = timed(lm.device, lambda: lm.ask(QUESTIONS, document=text, **gen))
    answers = [one, *three, *whole]
    tokens = sum(len(lm.encode(a)) for a in answers)
    # a server's load: USERS requests at once (HF and vLLM batch them, llama.cpp answers one after another)
    many, many_s = timed(lm.device, lambda: cartridge.ask(QUESTIONS * (USERS // len(QUESTIONS)), **gen))
    return {"runtime": name, "start_s": round(start, 2), "cartridge_one_s": round(one_s, 2),
            "cartridge_three_s": round(three_s, 2), "whole_text_three_s": round(whole_s, 2),
            "tokens_per_s": round(tokens / (one_s + three_s + whole_s), 1),
            "users_at_once_s": round(many_s, 2),
            "users_tokens_per_s": round(sum(len(lm.encode(a)) for a in many) / many_s, 1), "answers": answers}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,qwen2.5-coder-0.5b",
                        help="comma-separated load_model names ('default': the embedded model)")
    parser.add_argument("--runtimes", default="hf,llamacpp", help="comma-separated runtime names")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/runtimes.json"))
    args = parser.parse_args(argv)
    names = [n for n in args.runtimes.split(",") if n]
    missing = [n for n in names if n not in runtimes.names()]
    if missing:
        parser.error(f"--runtimes: {missing} not installed (installed: {runtimes.names()}); ./scripts/setup.sh "
                     "installs every backend")
    text = SAMPLE.read_text(encoding="utf-8")
    rows = []
    for model in [m for m in args.models.split(",") if m]:
        lm = load_model() if model == "default" else load_model(model)
        p = max(32, -(-len(lm.encode(text)) // 4))
        cartridge = Cartridge.compact(lm, text, p, report=False)
        auto = lm.auto_runtime
        measured = [measure(lm, name, cartridge, text) for name in names]
        reference = next((m["answers"] for m in measured if m["runtime"] == "hf"), None)
        for m in measured:
            same = None if reference is None else sum(a == b for a, b in zip(m["answers"], reference))
            rows.append({"model": lm.name, "cartridge_tokens": p, "auto": auto, **m, "same_as_hf": same,
                         "answers_compared": len(m["answers"])})
        lm.close()
        del lm, cartridge
        gc.collect()

    print(f"\n| model | runtime | start s | cartridge, 1 question s | cartridge, 3 questions s | whole text, 3 "
          f"questions s | new tokens/s | {USERS} users at once s (tokens/s) | answers as HF's | auto picks |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = "-" if r["same_as_hf"] is None else f"{r['same_as_hf']}/{r['answers_compared']}"
        print(f"| {r['model']} | {r['runtime']} | {r['start_s']} | {r['cartridge_one_s']} | {r['cartridge_three_s']} "
              f"| {r['whole_text_three_s']} | {r['tokens_per_s']} | {r['users_at_once_s']} ({r['users_tokens_per_s']}) "
              f"| {same} | {r['auto']} |")
    result = {"commit": provenance.commit(), "dirty": provenance.dirty(), "machine": provenance.machine(),
              "new_tokens": NEW_TOKENS, "users": USERS, "rows": rows}
    provenance.save(result, args.out)
    return result


if __name__ == "__main__":
    main()
