"""Atomic file writes: every file the SDK writes is whole or absent, never half-written."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Call `write(tmp)` on a temporary file beside `path`, flush it to disk, then rename it over `path`.

    A crash or an exception leaves the previous file (or none) and no temporary file behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    """`data` as indented JSON, written atomically."""
    text = json.dumps(data, indent=2)
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))
