"""The ``cartridges`` command: make, inspect, compose and query cartridge files from a shell.

The parser (`parser.py`) hands each command to its function: on cartridge files in `files.py`, self-study in
`selfstudy.py`, asking, serving and the backends in `use.py`; what they share is in `common.py`.
"""

# The CLI imports lazily only where that keeps heavy things (uvicorn, fastapi) out of `cartridges --help`.
from __future__ import annotations

import sys

from ..errors import CartridgeError
from .parser import build_parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # what `--nproc` starts again as each rank
    if getattr(args, "init", None) == "prefix" and args.command == "init" and not args.text:
        parser.error("init --init prefix needs a text file")
    try:
        return args.func(args)
    except CartridgeError as err:
        print(f"error: {err}", file=sys.stderr)
        for note in getattr(err, "__notes__", []):
            print(f"note: {note}", file=sys.stderr)
        return 2
    except (OSError, UnicodeError) as err:  # a file the user named cannot be read or written
        print(f"error: {err}", file=sys.stderr)
        return 2
