"""Benchmarks of cartridges against ICL and the paper's baselines on long-document data.

    python -m benchmarks run --profile quick                      # QASPER paper 0, default model
    python -m benchmarks run --profile full --data FILE --docs 0,3 [--concat] [--model PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cartridges_sdk.cli.common import parse_settings
from cartridges_sdk.errors import CartridgeError

from .data import DEFAULT_DATA
from .profiles import PROFILES, get_profile


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="build, measure and report", description=(
        "Build one cartridge per corpus with each method, measure quality, memory, throughput, cost and MMLU "
        "retention, and write results.json, results.md and PNG plots. Profiles: "
        + "; ".join(f"{n}: about {pr.expected_minutes_per_document} min per document" for n, pr in PROFILES.items())
        + ". A re-run with the same --out resumes."))
    r.add_argument("--profile", default="quick", choices=sorted(PROFILES))
    r.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"L-Eval-format JSONL (default {DEFAULT_DATA})")
    r.add_argument("--docs", default="0", help="comma-separated line numbers of --data (default 0)")
    r.add_argument("--concat", action="store_true", help="concatenate the --docs into one corpus (one cartridge)")
    r.add_argument("--model", default=None, help="a model for load_model (default: the embedded SmolLM2-135M)")
    r.add_argument("--set", action="append", metavar="KEY=VALUE", help=(
        "change a profile budget (repeatable), e.g. --set sizes=[128,512] --set conversations=96; "
        "the fields are those of benchmarks.profiles.Profile"))
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", type=Path, default=None,
                   help="results folder (default benchmarks/results/<profile>-<data>-<docs>); its work/ resumes")
    r.add_argument("--no-mmlu", dest="mmlu", action="store_false", help="skip MMLU retention")
    r.add_argument("--no-throughput", dest="throughput", action="store_false", help="skip the decode throughput sweep")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from .run import run  # torch and transformers load only once arguments are known good

    try:
        profile = get_profile(args.profile, **parse_settings(args.set))
        docs = args.docs.replace(" ", "")
        out = args.out or Path("benchmarks/results") / (
            f"{profile.name}-{args.data.stem}-{docs.replace(',', '+')}{'-concat' if args.concat else ''}"
            + (f"-{Path(args.model).stem}" if args.model else "") + (f"-s{args.seed}" if args.seed else ""))
        run(profile=profile, data=args.data, docs=docs, concat=args.concat, model=args.model, seed=args.seed,
            out=out, mmlu=args.mmlu, throughput=args.throughput)
    except CartridgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
