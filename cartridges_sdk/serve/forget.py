"""Forgetting a document: its cartridge, corpus text and self-study work deleted from the store, under the lock
sync writes with, and (when asked) the document itself from the folder, so no sync builds it again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import ConfigError, StoreBusyError
from ..files import folder_lock
from .catalog import discard_catalog
from .documents import CORPUS_SUFFIX, SUFFIX, name_problem
from .sync import LOCK, WORK, SyncedStore


def forget(store: SyncedStore, name: str, documents: str | os.PathLike | None = None, *,
           timeout: float = 0) -> list[Path]:
    """`CartridgeStore.forget`: see its docstring."""
    if not isinstance(name, str) or name_problem(name) is not None:
        raise ConfigError(f"name={name!r} is not a cartridge name (letters, digits, '.', '_', '-').")
    busy = f"A sync is writing to the store at {store.root}; wait for it, or pass a timeout."
    with folder_lock(store.root, name=LOCK, timeout=timeout, error=StoreBusyError, busy=busy):
        store.refresh()
        record = (store.records().get(name) or {})
        discard_catalog(store.root)  # it holds the record too (serve/catalog.py)
        removed: list[Path] = []
        if documents is not None and record:
            removed += _remove_document(Path(documents), record["origin"], name)
        work = store.root / WORK
        for folder in sorted(work.glob("*")) if work.is_dir() else ():
            if folder.name.rpartition("-")[0] == name or any(folder.glob(f"distractors*/{name}{SUFFIX}")):
                shutil.rmtree(folder)  # its checkpoints were trained among it: that training starts again
                removed.append(folder)
        corpus = store.root / f"{name}{CORPUS_SUFFIX}"
        for path in (corpus, store.root / f"{name}{SUFFIX}"):  # the cartridge last: killed between, sync sees it
            if path.exists() or path.is_symlink():
                path.unlink()
                removed.append(path)
        if not removed and name not in store:
            store.get(name)  # raises, naming what the store holds
        store._drop(name)
        return removed


def _remove_document(folder: Path, origin: str, name: str) -> list[Path]:
    """Delete the document at `origin` (as sync recorded it) in `folder`; a link is removed itself, never what it
    points to (another patient's file, a mount outside)."""
    if not origin or os.path.isabs(origin) or os.path.normpath(origin).split(os.sep)[0] == "..":
        raise ConfigError(f"The document of {name!r} ({origin!r}) is not inside {folder}; delete it by hand.")
    source = folder / os.path.normpath(origin)
    if source.is_symlink() or source.is_file():
        source.unlink()
    elif source.is_dir():
        shutil.rmtree(source)  # does not follow links inside it
    else:
        return []
    return [source]
