"""What a store learned from its cartridge files' headers, kept beside them, so that a new process opening a store of
100,000 cartridges reads one file instead of 100,000 headers.

The catalog is a cache, never the truth: an entry is used only for a file whose size and modification time (in
nanoseconds) are the ones it was read at, and only by a store for the same model. A file replaced, a catalog from
another model, an unreadable or missing catalog: each is read afresh. Serving a cartridge always reads and checks
the file itself (`CartridgeStore.get`), so a wrong catalog can at worst route to a file that is then refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from ..files import atomic_write

log = logging.getLogger("cartridges_sdk.store")

CATALOG = ".catalog.json"
VERSION = 1
# a refresh that read at least this many headers writes the catalog (a server re-reading one new file does not)
WRITE_AFTER = 256


def model_key(identity: Any) -> str:
    """Which model the catalog's checks were made for: a hash of the model's identity as a store compares it."""
    return hashlib.sha256(repr(identity).encode()).hexdigest()[:32]


def read_catalog(root: Path, key: str) -> dict[str, dict[str, Any]]:
    """The catalog's entries by file name (each with the file's ``stamp``), or none if it is missing, unreadable,
    of another version or for another model."""
    try:
        data = json.loads((root / CATALOG).read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION or data.get("model") != key:
        return {}
    entries = data.get("entries")
    return {file: e for file, e in entries.items() if _well_formed(e)} if isinstance(entries, dict) else {}


def _well_formed(entry: Any) -> bool:
    """An entry a store can use as it is; any other (a catalog edited by hand, say) is read afresh from its file."""
    if not isinstance(entry, dict):
        return False
    stamp, tokens = entry.get("stamp"), entry.get("num_tokens")
    return (isinstance(stamp, list) and len(stamp) == 2 and all(type(x) is int for x in stamp)
            and type(tokens) is int and isinstance(entry.get("document"), (dict, type(None)))
            and isinstance(entry.get("subject"), (str, type(None))))


def discard_catalog(root: Path) -> None:
    """Delete the catalog: a cartridge deleted (forgotten) must leave nothing of its record behind, and rewriting a
    large catalog at each deletion would cost more than the next process reading the headers once."""
    (root / CATALOG).unlink(missing_ok=True)


def write_catalog(root: Path, key: str, entries: dict[str, dict[str, Any]]) -> None:
    """Replace the catalog, atomically. A store that cannot write it (a read-only folder) goes on without it."""
    text = json.dumps({"version": VERSION, "model": key, "entries": entries}, separators=(",", ":"))
    try:
        atomic_write(root / CATALOG, lambda tmp: Path(tmp).write_text(text, "utf-8"))
    except OSError as err:
        log.info("Store %s: could not write %s (%s); the next process reads every header", root, CATALOG, err)
