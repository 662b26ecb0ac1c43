"""What every results file records about where its figures came from: the commit and the machine."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:  # no git on this machine
        return ""


def commit() -> str:
    return _git("rev-parse", "--short", "HEAD")


def dirty() -> bool:
    """Whether the working tree differs from the commit (then the commit alone does not reproduce the figures)."""
    return bool(_git("status", "--porcelain", "--untracked-files=no"))


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}


def save(result: dict[str, Any], out: Path) -> None:
    """Print a run's figures (without its per-question rows) and write all of it, as JSON, to `out`."""
    import json

    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
