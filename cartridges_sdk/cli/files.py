"""The commands on cartridge files that need no self-study: ``init``, ``compact``, ``inspect``, ``eval`` and
``compose``."""

from __future__ import annotations

import argparse
import json
import time

from ..making.report import check_quality, report_of, reported, with_report
from ..making.settings import CompactionConfig, ReportConfig
from ..cartridge import SHAPE_FIELDS, Cartridge
from ..errors import CartridgeError
from . import common  # common.model_for is looked up at each call, so tests can replace it
from .common import bind_all, compaction_config, human_bytes, output_file, read_corpus, text_file


def cmd_init(args: argparse.Namespace) -> int:
    text = text_file(args.text) if args.init == "prefix" else None
    Cartridge.check_size(args.tokens, args.num_frozen)
    output_file(args.output)
    lm = common.model_for(args.model, device=args.device)
    if text is not None:
        c = Cartridge.from_prefix(lm, text, args.tokens, num_frozen=args.num_frozen)
    elif args.init == "random_text":
        c = Cartridge.from_random_text(lm, args.tokens, seed=args.seed, num_frozen=args.num_frozen)
    else:
        c = Cartridge.random(lm, args.tokens, seed=args.seed, num_frozen=args.num_frozen)
    c.save(args.output)
    print(f"wrote {args.output}: {c.num_tokens} tokens, {human_bytes(c.nbytes)}, init={c.meta.init}")
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    corpus = read_corpus(args)
    config = compaction_config(args.set, "--set") or CompactionConfig()
    Cartridge.check_size(args.tokens, args.num_frozen)
    output_file(args.output)
    lm = common.model_for(args.model, device=args.device)
    start = time.perf_counter()
    c = Cartridge.compact(lm, corpus, args.tokens, num_frozen=args.num_frozen, config=config, report=False)
    seconds = time.perf_counter() - start
    if not args.no_report:  # after the line on compaction's time, so each figure is its own
        c = reported(lm, corpus, c, True, progress=True)
    c.save(args.output)
    info = c.meta.extra["compaction"]
    print(f"wrote {args.output}: {c.num_tokens} tokens standing in for {info['corpus_tokens']} "
          f"({info['corpus_tokens'] / c.num_tokens:.1f}x fewer, {len(info['chunks'])} chunk(s)), "
          f"{human_bytes(c.nbytes)}, in {seconds:.0f} s; {info['chunk_questions']} own questions a chunk, "
          f"{info['keep_surprising']:.0%} of it kept for the least expected words (defaults follow the model: "
          "docs/compaction.md)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    c = Cartridge.load(args.path)
    meta = c.meta.to_dict()
    if args.json:
        print(json.dumps({**meta, "nbytes": c.nbytes, "num_layers": c.num_layers}, indent=2))
        return 0
    m = c.meta.model
    kv_heads, _, head_dim = c.keys[0].shape
    rows = [
        ("file", str(args.path)),
        ("model", f"{m.name}" + (f" (source: {m.source})" if m.source and m.source != m.name else "")
         + ("" if all(f in m.architecture for f in SHAPE_FIELDS) else " (architecture not reported: no model will "
            "take it)")),
        ("model fingerprint", m.fingerprint),
        ("tokens", f"{c.num_tokens} ({c.num_frozen} frozen)"),
        ("shape", f"{c.num_layers} layers x [{kv_heads} kv heads, {c.num_tokens} tokens, {head_dim} head dim]"),
        ("dtype", c.meta.dtype),
        ("size", human_bytes(c.nbytes)),
        ("init", c.meta.init),
    ]
    if c.meta.corpus:
        rows.append(("corpus", ", ".join(f"{k}={v}" for k, v in c.meta.corpus.items())))
    if c.meta.parts:
        spans = [f"[{p['offset']}:{p['offset'] + p['num_tokens']}]" for p in c.meta.parts]
        rows.append(("parts", f"{len(c.meta.parts)}: " + " ".join(spans)))
    if c.meta.training:
        rows.append(("training", json.dumps(c.meta.training)))
    report = report_of(c)
    rows.append(("quality", report.summary().removeprefix("quality report: ") if report else
                 "not checked (cartridges eval FILE --corpus PATH checks it against its corpus)"))
    rows += [("created", c.meta.created), ("sdk version", c.meta.sdk_version), ("format version", str(c.meta.format_version))]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    Cartridge.load(args.path)  # a damaged or foreign file is said before the model loads
    config = ReportConfig(questions=args.questions, **({} if args.seed is None else {"seed": args.seed}))
    corpus = read_corpus(args)
    lm = common.model_for(args.model, device=args.device)
    c = Cartridge.load(args.path, model=lm)  # refuses a cartridge made for another model, naming both
    report = check_quality(lm, corpus, c, config, progress=not args.json)
    if not args.no_save:
        with_report(c, report).save(args.path)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.summary())
        print("asked, for example: " + " | ".join(report.asked))
        print(f"{'kept the report in ' + args.path if not args.no_save else 'not saved (--no-save)'}")
    return 0


def cmd_compose(args: argparse.Namespace) -> int:
    parts = [Cartridge.load(p) for p in args.paths]
    lm = common.model_for(args.model, device=args.device) if args.reposition else None
    if lm is not None:
        parts = bind_all(parts, lm)
    c = Cartridge.compose(parts, reposition=args.reposition, model=lm)
    c.save(args.output)
    print(f"wrote {args.output}: {len(parts)} parts, {c.num_tokens} tokens, {human_bytes(c.nbytes)}")
    return 0
