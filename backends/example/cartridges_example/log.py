"""Where the example backends write: the `cartridges_example` logger, and optionally a JSON-lines file."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import attrs

logger = logging.getLogger("cartridges_example")


def _writable_path(_inst, attribute, value) -> None:
    from cartridges_sdk import ConfigError

    if value is not None and Path(value).is_dir():
        raise ConfigError(f"{attribute.name}={value!r} is a directory; give a file path for the JSON-lines log.")


@attrs.frozen
class LogOptions:
    # also append one JSON object per call to this file (None: only the `cartridges_example` logger)
    log_file: str | None = attrs.field(default=None, validator=_writable_path)


def record(log_file: str | None, event: dict[str, Any]) -> None:
    line = json.dumps(event, sort_keys=True)
    logger.info(line)
    if log_file is not None:
        with open(log_file, "a", encoding="utf-8") as f:
            f.write(line + "\n")
