"""Keeping a store in step with a folder of documents: one cartridge per document, rebuilt only when it changed.

Each synced cartridge records, inside its own file (``meta.extra["document"]``), the document it stands for, the
SHA-256 of that document's text and how it was built. A sync reads the folder, skips every document whose record
matches, builds the new and changed ones (a renamed or copied one reuses the cartridge of its content), and deletes
the cartridges (with their corpus text) of documents that are gone. Cartridges the store got some other way
(`store.add`) are never touched.

Why this is crash-safe without a journal: the record travels in the cartridge file, which is replaced by one atomic
rename, so a store killed at any point holds, for each document, the old cartridge or the new one, each saying which
version it is. The next sync sees what is stale and finishes the job. One writer at a time holds ``.sync.lock`` in
the store's folder (the operating system's lock, released when its holder dies); readers never need it.
Under torchrun (``cartridges sync --workers N``, or ranks on several machines sharing the folder) the ranks share one
sync's building: the one writer is the job, whose rank 0 holds the lock (`_ranks`, docs/scale.md).

`store_selfstudy.self_study` then trains the cartridges sync compacted, in ``.work/NAME-HASH`` (`WORK`), and swaps
each in under the lock.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs

from ..cartridge import Cartridge
from ..errors import CartridgeFormatError, ConfigError, StoreBusyError
from ..files import folder_lock
from ..lm import LM
from ..fileformat import read_file
from ..making.settings import made_with
from .documents import SUFFIX, NotADocument, SourceDocument, content_hash, read_documents, store_name
from .records import with_record
from .settings import SyncConfig

log = logging.getLogger("cartridges_sdk.store")

LOCK = ".sync.lock"
STALE_SECONDS = 60  # a temporary file this old was left by a writer that died
WORK = ".work"  # self-study's work folders, one per document version


class SyncedStore(Protocol):
    """What sync reads and changes of a store: `CartridgeStore` is one (it calls sync, so sync names only this)."""

    root: Path
    model: LM

    def __contains__(self, name: object) -> bool: ...
    def names(self) -> list[str]: ...
    def get(self, name: str) -> Cartridge: ...
    def add(self, name: str, cartridge: Cartridge, *, corpus: str | None = None, replace: bool = False) -> Path: ...
    def remove(self, name: str) -> None: ...
    def refresh(self) -> dict[str, list[str]]: ...
    def records(self) -> dict[str, dict[str, Any]]: ...
    def corpus_path(self, name: str) -> Path | None: ...
    def save_catalog(self) -> None: ...
    def _drop(self, name: str) -> None: ...  # forget a name whose files sync deleted itself


@attrs.frozen
class SyncReport:
    """What a sync did, by cartridge name (LangChain's indexing counts are `counts()`)."""

    added: tuple[str, ...]
    updated: tuple[str, ...]
    skipped: tuple[str, ...]  # unchanged
    deleted: tuple[str, ...]
    rejected: tuple[NotADocument, ...]  # paths that are not documents, or failed to build; the store kept theirs
    seconds: float

    def counts(self) -> dict[str, int]:
        return {"num_added": len(self.added), "num_updated": len(self.updated), "num_skipped": len(self.skipped),
                "num_deleted": len(self.deleted), "num_rejected": len(self.rejected)}

    def __str__(self) -> str:
        return (f"added {len(self.added)}, updated {len(self.updated)}, skipped {len(self.skipped)} (unchanged), "
                f"deleted {len(self.deleted)}, rejected {len(self.rejected)} in {self.seconds:.1f} s")


def sync(store: SyncedStore, source: str | os.PathLike | Mapping[str, str], config: SyncConfig | None = None, *,
         timeout: float = 0, progress: bool = True, ranks: bool = False) -> SyncReport:
    """`CartridgeStore.sync`: see the module docstring. With `ranks`, every rank of the torchrun job calls it and
    they share the building (`_ranks`); without, this process syncs alone, whatever job it is part of."""
    config = (config or SyncConfig()).for_model(store.model)
    store.model.check_context(config.tokens, f"A {config.tokens}-token cartridge per document", "pass a smaller tokens")
    if ranks:
        import torch

        from ..making.distributed import process_group

        with process_group(torch.device("cpu")) as (rank, world):
            if world > 1:
                return _ranks(store, source, config, timeout, progress, rank, world)
    start = time.perf_counter()
    with _lead(store, timeout):
        todo, plan = _plan_sync(store, source, config)
        added, updated = _build_all(store, todo, plan.rejected, config, progress)
        return _finish(store, plan, added, updated, config, start)


@attrs.define
class _Plan:
    """What the writer holding the lock read, and what only it finishes: deleting the cartridges of documents gone."""

    documents: list[SourceDocument]
    records: dict[str, dict[str, Any]]
    skipped: list[str]
    rejected: list[NotADocument]


# one document to build: the document, whether it replaces a cartridge, and the name and record of a cartridge of the
# same content to reuse (a renamed or copied document), or None
Todo = tuple[SourceDocument, bool, str | None, dict[str, Any] | None]


def _lead(store: SyncedStore, timeout: float):
    busy = (f"Another sync is writing to the store at {store.root} (it holds {LOCK}); wait for it to finish, or pass "
            "a timeout to wait. Only one sync writes at a time; servers keep reading meanwhile.")
    return folder_lock(store.root, name=LOCK, timeout=timeout, busy=busy, error=StoreBusyError)


def _plan_sync(store: SyncedStore, source: str | os.PathLike | Mapping[str, str],
               config: SyncConfig) -> tuple[list[Todo], _Plan]:
    """Read the folder and the store (the caller holds the lock): what to build, and the rest of the plan."""
    _clear_stale(store.root)
    store.refresh()
    documents, rejected = read_documents(source, unit=config.unit, max_bytes=config.max_bytes, include=config.include)
    records = store.records()
    if not documents and records:  # an unmounted or emptied folder looks like every document deleted
        raise ConfigError(f"{source if not isinstance(source, Mapping) else 'The source'} holds no documents"
                          f"{' matching ' + ', '.join(config.include) if config.include else ''}, so "
                          f"this sync would delete all {len(records)} synced cartridges of the store at "
                          f"{store.root}; check the folder, or delete them on purpose with store.remove(name).")
    todo, skipped = _plan(store, documents, records, rejected, config)
    for line in rejected:
        log.warning("sync %s: skipping %s: %s", store.root, line.path, line.why)
    return todo, _Plan(documents, records, skipped, rejected)


def _finish(store: SyncedStore, plan: _Plan, added: list[str], updated: list[str], config: SyncConfig,
            start: float) -> SyncReport:
    """Delete the cartridges of documents gone and old work folders (the caller holds the lock); the report."""
    rejected = plan.rejected
    # what could not be read this time keeps its cartridge; a folder that could not be read keeps all under it
    kept = {store_name(r.path.split("/", 1)[0] if config.unit == "folder" else r.path) for r in rejected}
    present = {doc.name for doc in plan.documents}
    deleted = sorted(n for n in plan.records if n not in present and n not in kept
                     and not any(n.startswith(k + ".") for k in kept))
    for name in deleted:  # a document that could not be read this time keeps its cartridge: nothing is lost
        store.remove(name)
    _clear_old_work(store.root, plan.documents, kept)
    if added or updated or deleted:  # the next process to open the store reads the catalog, not every header
        store.refresh()  # what other ranks wrote, too
        store.save_catalog()
    return SyncReport(tuple(sorted(added)), tuple(sorted(updated)), tuple(plan.skipped), tuple(deleted),
                      tuple(sorted(rejected, key=lambda r: r.path)), round(time.perf_counter() - start, 3))


def _ranks(store: SyncedStore, source: str | os.PathLike | Mapping[str, str], config: SyncConfig, timeout: float,
           progress: bool, rank: int, world: int) -> SyncReport:
    """One sync shared by the ranks of a torchrun job (`cartridges sync --workers N`, or torchrun on several machines
    sharing the store's folder). Rank 0 takes the store's lock for the whole job, plans, and hands rank r every
    world-th document to build (the documents are disjoint; each cartridge is written by one atomic rename, as one
    writer writes it). When all are done, rank 0 deletes what is gone and lets go of the lock. A killed rank stops the
    job (torchrun stops the others) and releases nothing half-written: the next sync builds what is left."""
    import contextlib

    from ..making.distributed import gather_from_ranks, lead_does, patient_group, scatter_from_lead

    start = time.perf_counter()
    with contextlib.ExitStack() as held, patient_group() as waits:
        def plan_all() -> tuple[list[list[Todo]], _Plan]:
            held.enter_context(_lead(store, timeout))
            todo, plan = _plan_sync(store, source, config)
            return [todo[r::world] for r in range(world)], plan

        planned = lead_does(plan_all)
        mine = scatter_from_lead(planned[0] if planned is not None else None, waits)
        if any(same is not None and same not in store for _, _, same, _ in mine):
            store.refresh()  # a cartridge to reuse that this rank's store has not read yet
        rejected: list[NotADocument] = []
        added, updated = _build_all(store, mine, rejected, config, progress and rank == 0)
        done = gather_from_ranks((added, updated, rejected), waits)

        def finish() -> SyncReport:
            plan = planned[1]
            plan.rejected += [r for _, _, rs in done for r in rs]
            return _finish(store, plan, [n for a, _, _ in done for n in a], [n for _, u, _ in done for n in u],
                           config, start)

        return gather_from_ranks(lead_does(finish), waits)[0]  # every rank returns rank 0's report


def _plan(store: SyncedStore, documents: list[SourceDocument], records: dict[str, dict[str, Any]],
          rejected: list[NotADocument], config: SyncConfig) -> tuple[list[Todo], list[str]]:
    """The documents to build and the names of those unchanged; a name the store holds a cartridge of that sync did
    not make joins `rejected`. A renamed or copied document reuses the cartridge of its content (a self-studied one
    stays self-studied) when no document of this sync rewrites that cartridge: then which worker builds what, and in
    what order, changes nothing."""
    changed: list[tuple[SourceDocument, bool]] = []
    skipped = []
    for doc in documents:
        record = records.get(doc.name)
        if doc.name in store and record is None:
            rejected.append(NotADocument(doc.origin, f"the store holds a cartridge {doc.name!r} that sync did not "
                                                     "make; remove it from the store or rename the document"))
        elif record is not None and current(store, doc, record, config):
            skipped.append(doc.name)
        else:  # a file the store left out (another model's, say) is replaced too
            changed.append((doc, doc.name in records or (store.root / f"{doc.name}{SUFFIX}").exists()))
    rewritten = {doc.name for doc, _ in changed}
    by_content = {(r["sha256"], r.get("size")): name for name, r in records.items() if name not in rewritten}
    todo: list[Todo] = []
    for doc, replaces in changed:
        same = by_content.get((doc.sha256, config.tokens))
        if same is not None and not _compacted_as(store, same, records[same], config):
            same = None  # compacted otherwise than asked: built anew (checked only for a match, not every record)
        todo.append((doc, replaces, same, records[same] if same is not None else None))
    return todo, skipped


def _build_all(store: SyncedStore, todo: list[Todo], rejected: list[NotADocument], config: SyncConfig,
               progress: bool) -> tuple[list[str], list[str]]:
    """Build and store each document of `todo`: the names added and updated. One that fails to build joins
    `rejected` and the store keeps what it had."""
    added: list[str] = []
    updated: list[str] = []
    for doc, replaces, same, record in _bar(todo, progress):
        try:
            if same is not None:
                log.info("sync %s: %s has the content of %s; its cartridge is reused", store.root, doc.origin, same)
                cartridge = with_record(store.model, store.get(same), doc, record["method"],
                                        int(record.get("tokens", 0)), config.tokens)
            else:
                cartridge = build(store.model, doc, config)
        except Exception as err:  # noqa: BLE001 - one document that fails to build must not stop the sync
            why = f"it failed to build ({type(err).__name__}: {err}); the store keeps what it had"
            log.warning("sync %s: skipping %s: %s", store.root, doc.origin, why)
            rejected.append(NotADocument(doc.origin, why))
            continue
        store.add(doc.name, cartridge, corpus=doc.text, replace=True)
        (updated if replaces else added).append(doc.name)
    return added, updated


def _clear_old_work(root: Path, documents: list[SourceDocument], kept: set[str]) -> None:
    """Delete self-study's work folders of document versions that are gone (a document `kept` keeps its own)."""
    current = {doc.name: doc.sha256 for doc in documents}
    for work in sorted((root / WORK).glob("*")):
        name, _, version = work.name.rpartition("-")
        if name not in kept and current.get(name, "")[:16] != version:
            shutil.rmtree(work, ignore_errors=True)


def build(lm: Any, doc: SourceDocument, config: SyncConfig) -> Cartridge:
    """One document's cartridge, its record inside: the whole text's KV when it fits in `tokens`, else compacted
    (per chunk and composed when the document is longer than the model's context). The text is read stripped, as
    self-study's corpus reads it, so self-study can start from this very cartridge."""
    ids = lm.encode(doc.text.strip() or doc.text)
    if len(ids) <= config.tokens:
        lm.check_context(len(ids), f"The {len(ids)}-token document {doc.origin!r}", "raise --tokens no further")
        cartridge = Cartridge.from_prefix(lm, ids, len(ids), num_frozen=1 if len(ids) > 1 else 0)
        method = "whole"
    else:
        cartridge = Cartridge.compact(lm, ids, config.tokens, config=config.compaction, progress=False,
                                      report=config.report)
        method = "compact"
    return with_record(lm, cartridge, doc, method, len(ids), config.tokens)


def current(store: SyncedStore, doc: SourceDocument, record: dict[str, Any], config: SyncConfig, *,
            compaction: bool = True) -> bool:
    """Whether the stored cartridge stands for this version of the document, built at this size, and its corpus
    text (what routing reads) is this version too; with `compaction`, a compacted one was also compacted with
    `config`'s settings (self-study, which compacts anew for a start made otherwise, asks without)."""
    if record.get("sha256") != doc.sha256 or record.get("size") != config.tokens:
        return False
    if compaction and not _compacted_as(store, doc.name, record, config):
        return False
    corpus = store.corpus_path(doc.name)
    try:
        return corpus is not None and content_hash(corpus.read_text("utf-8")) == doc.sha256
    except (OSError, UnicodeDecodeError):
        return False


def _compacted_as(store: SyncedStore, name: str, record: dict[str, Any], config: SyncConfig) -> bool:
    """Whether a cartridge sync compacted used `config.compaction`'s settings (one kept whole or self-studied is not
    rebuilt for them: training is not thrown away for a setting of its start). A record from before records held
    the settings is checked against the file's own header."""
    if record.get("method") != "compact":
        return True
    made = record.get("compaction")
    if not isinstance(made, dict):
        try:
            made = read_file(store.root / f"{name}{SUFFIX}", data=False)[2].extra.get("compaction", {})
        except CartridgeFormatError:  # a file that cannot be read is rebuilt
            return False
    return made_with(made, config.compaction, store.model)


def _clear_stale(root: Path) -> None:
    """Temporary files of atomic writes whose writer died (killed mid-write): never served, but never cleaned up."""
    now = time.time()
    for tmp in root.glob(".*.tmp"):
        try:
            if now - tmp.stat().st_mtime > STALE_SECONDS:
                tmp.unlink()
        except FileNotFoundError:
            pass


def _bar(todo: list, progress: bool):
    if not progress or not todo:
        return todo
    from tqdm.auto import tqdm

    return tqdm(todo, desc="building cartridges", unit="doc")
