"""A folder of cartridges served by name, each checked against the model, and routing of a question to the cartridges
whose corpora answer it.

The folder holds ``NAME.safetensors`` (a cartridge) and, for routing, ``NAME.corpus.txt`` (the text it stands for).
A file that does not load, or was made for another model, is left out with one log line naming it and why; it is never
served, and it never stops the store (a server keeps answering from the others). `refresh` re-reads the folder, so
files dropped in or removed take effect without a restart. Loaded cartridges are kept within a memory budget, least
recently used first out; a cartridge left out of memory is read again from its file when asked for. `sync` keeps the
store in step with a folder of documents, one cartridge per document (`serve/sync.py`).

Routing (`route`, `ask`) ranks cartridges by BM25 with each cartridge's whole corpus as one document (the ``bm25s``
library; install the ``serve`` extra). Scoring whole corpora rather than passages is deliberate: a word's weight then
says how few *cartridges* use it, so a question naming what only one corpus talks about goes there, even when that
corpus repeats the word in every passage (passage-level weights rate a paper's own topic as common). Passages, which
`plan` and `ask` put after the routed cartridges within one budget, are ranked per passage (`serve/passages.py`).

Longer than 400 lines because it is the store's one public face (its files, routing, passages, answering, syncing,
forgetting) and each method must hold the store's lock and caches the same way; the work of syncing, forgetting
and planning passages lives in their own modules.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..cartridge import Cartridge
from ..errors import CartridgeError, ConfigError, NotInStoreError
from ..files import atomic_write
from ..kv import Recent
from ..lm import LM
from .catalog import WRITE_AFTER, discard_catalog, model_key, read_catalog, write_catalog
from .documents import CORPUS_SUFFIX, NAME, SUFFIX, name_problem
from .embedding import EMBEDDED_BYTES, Memo, embedder_folder
from .passages import FUSES, Passage, PassageIndex, Plan, check_draft, check_retrieval, drafted, plan
from .records import document_record, subject_of, versions, with_subject
from .subjects import check_subject
from .settings import SyncConfig
from .forget import forget
from .store_selfstudy import self_study
from .sync import SyncReport, sync
from .words import STOPWORDS, routing_text

log = logging.getLogger("cartridges_sdk.store")  # the name operators configure, kept from before serve/ existed


@attrs.frozen
class Route:
    """A cartridge a question was routed to, and its score (BM25 of its corpus)."""

    name: str
    score: float


@attrs.frozen
class StoreAnswer:
    """An answer from the store, which cartridges gave it (composed in this order), and for each the version of the
    document it stands for (its SHA-256; None for a cartridge that sync did not make); and the passages put after
    them, if any; and the first answer that picked those passages (`ask`'s `draft`), if one was written; and, with
    `trim`, the tokens of each cartridge that answered (`Plan.sizes`; empty: all of them)."""

    text: str
    cartridges: tuple[str, ...]
    versions: tuple[str | None, ...] = ()
    passages: tuple[Passage, ...] = ()
    draft: str | None = None
    sizes: tuple[int, ...] = ()


@attrs.frozen
class _Entry:
    path: Path
    stamp: tuple[int, int]  # size and mtime: a file replaced in place is read again
    corpus: Path | None
    corpus_stamp: tuple[int, int] | None = None  # an edited corpus text rebuilds the routing index
    document: dict[str, Any] | None = None  # what sync recorded in the file: the document and its hash
    num_tokens: int = 0  # the cartridge's size, for composing within a budget without loading it
    subject: str | None = None  # who or what it is about (records.subject_of), for routing without loading it
    inodes: tuple[int, int | None] = (0, None)  # the cartridge's and its corpus's: a file renamed over gets a new one


def _link_out_reason(name: str) -> str:
    return f"{name} is a link to a file outside the store's folder; copy the file in instead"


# a quick refresh (`refresh(quick=True)`) compares sizes and times too at least this often: a file rewritten in place
FULL_SCAN_SECONDS = 10.0


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _entry_stamp(entry: os.DirEntry) -> tuple[int, int]:
    st = entry.stat()  # follows a link, as Path.stat does (a link's target is judged by `_inside`)
    return st.st_size, st.st_mtime_ns


def _best(names: list[str], scores: Any, k: int) -> list[tuple[str, float]]:
    """The `k` best-scoring names with a score above 0, best first, ties by name. Only the candidates at or above
    the k-th score are sorted: ranking every corpus took a store of 100,000 a tenth of a second per question."""
    import numpy as np

    candidates = np.flatnonzero(scores > 0)
    if len(candidates) > k:
        kth = np.partition(scores[candidates], len(candidates) - k)[len(candidates) - k]
        candidates = candidates[scores[candidates] >= kth]
    return sorted(((names[i], float(scores[i])) for i in candidates.tolist()), key=lambda item: (-item[1], item[0]))[:k]


def check_draft_from(draft_from: Any, draft: int) -> None:
    """Refuse a `draft_from` that is not a store, or one given with no first answer (`draft` 0) for it to write."""
    if draft_from is not None and not isinstance(draft_from, CartridgeStore):
        raise ConfigError(f"draft_from={draft_from!r:.60} must be a CartridgeStore holding the same documents.")
    if draft_from is not None and not draft:
        raise ConfigError("draft_from says whose cartridges write the first answer, and draft=0 writes none; give "
                          "draft=N (its tokens), or drop draft_from.")


def _listing(root: Path) -> dict[str, os.DirEntry]:
    with os.scandir(root) as entries:
        return {e.name: e for e in entries}


class CartridgeStore:
    """Cartridges for one model, by name, from a folder (created if missing)."""

    def __init__(self, root: str | os.PathLike, model: LM, *, memory_budget: int = 2**30):
        if not isinstance(model, LM):
            raise ConfigError(f"model must be a model from load_model(), got {type(model).__name__}.")
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 1:
            raise ConfigError(f"memory_budget={memory_budget!r} must be a positive number of bytes.")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.memory_budget = memory_budget
        self._entries: dict[str, _Entry] = {}
        self._refused: dict[Path, tuple[tuple[int, int], str]] = {}  # said once per version of a bad file
        self._linked_out: set[Path] = set()  # refused because they (or their corpus) link out of the folder
        self._memory: Recent[Cartridge] = Recent(budget=memory_budget, cost=lambda c: c.nbytes)  # loaded, by name
        # routing's (bm25 retriever, name of each corpus) by the names routed among (None: all), and passage
        # indexes by ("passages", retrieval, among); built when first asked for after a change, emptied by every one
        self._index: dict[Any, Any] = {}
        # each document's passages embedded for dense retrieval, by its name (`embedding.embedded`): kept across
        # changes (`_index` is not), so a dense index rebuilt after a sync embeds only the documents that changed
        self._embedded: Memo = Recent(budget=EMBEDDED_BYTES, cost=lambda held: held[1].nbytes)
        self._lock = threading.RLock()
        self._model_key = model_key(model.identity)
        self._catalog_read = False  # the catalog is read at the first refresh only: after it, this store is newer
        self._full_scan = 0.0  # when the last refresh compared every file's size and time (time.monotonic)
        self.refresh()

    # ---- what it holds

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def subjects(self) -> dict[str, str]:
        """Who or what each cartridge is about, by name, for those that say."""
        with self._lock:
            return {name: e.subject for name, e in sorted(self._entries.items()) if e.subject is not None}

    def refused(self) -> dict[str, str]:
        """Files left out, and why."""
        with self._lock:
            return {path.name: why for path, (_, why) in sorted(self._refused.items())}

    def get(self, name: str) -> Cartridge:
        """The cartridge `name`, bound to the model (read from its file when it is not in memory)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                shown = ", ".join(self.names()[:20]) or "none"
                raise NotInStoreError(f"No cartridge {name!r} in the store at {self.root}; it holds: {shown}.")
            cartridge = self._memory.pop(name)
            if cartridge is None:
                cartridge, why = self._load(entry.path)
                if cartridge is None:  # replaced or deleted since the folder was read: left out
                    del self._entries[name]
                    self._index = {}
                    raise NotInStoreError(f"The cartridge {name!r} can no longer be read ({why}); it is left out.")
            self._remember(name, cartridge)
            return cartridge

    def _remember(self, name: str, cartridge: Cartridge) -> None:
        """Keep `cartridge` in memory as the most recently used, within the budget."""
        self._memory.put(name, cartridge)

    def _load(self, path: Path, *, data: bool = True) -> tuple[Cartridge | None, str | None]:
        """The file's cartridge, bound to the model (with `data` False, its header alone: the tensors on the meta
        device, every check but the bytes'); or None and why, said once in the log and remembered."""
        if not self._inside(path):  # checked again as it is read: the file may have become a link since the scan
            why = _link_out_reason(path.name)
            self._refuse(path, why)
            return None, why
        try:
            return Cartridge.load(path, model=self.model, data=data), None
        except Exception as err:  # noqa: BLE001 - a bad file must never stop the store
            why = str(err) if isinstance(err, CartridgeError) else f"{type(err).__name__}: {err}"
        self._refuse(path, why)
        return None, why

    def _refuse(self, path: Path, why: str) -> None:
        log.warning("Store %s: leaving out %s: %s", self.root, path.name, why)
        try:
            self._refused[path] = (_stamp(path), why)
        except FileNotFoundError:
            pass

    # ---- changing it

    def add(self, name: str, cartridge: Cartridge, *, corpus: str | None = None, replace: bool = False,
            subject: str | None = None) -> Path:
        """Save `cartridge` as ``NAME.safetensors`` (and its corpus text, for routing), atomically, saying who it is
        about if `subject` is given (a patient's name; docs/security.md, "Subjects")."""
        if not isinstance(name, str) or not NAME.match(name):
            raise ConfigError(f"name={name!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a letter "
                              "or digit (it becomes a file name and the API's model name).")
        if name == "auto":
            raise ConfigError("name='auto' is taken by routing (model='auto' picks cartridges per question).")
        cartridge.check_model(self.model, whose="the store's")
        try:
            cartridge = with_subject(cartridge, check_subject(subject)) if subject is not None else cartridge
        except ValueError as err:
            raise ConfigError(str(err)) from None
        with self._lock:
            path = self.root / f"{name}{SUFFIX}"
            if name in self._entries and not replace:
                raise ConfigError(f"The store already holds {name!r}; pass replace=True to overwrite it.")
            corpus_path = self.root / f"{name}{CORPUS_SUFFIX}"
            if corpus is not None:
                atomic_write(corpus_path, lambda tmp: Path(tmp).write_text(corpus, "utf-8"))
            cartridge.save(path)
            self._memory.pop(name)
            # this entry alone, from what is in hand: a sync of N documents must not re-read the folder N times
            corpus_path = corpus_path if corpus_path.is_file() else None
            self._entries[name] = _Entry(path, _stamp(path), corpus_path, corpus_path and _stamp(corpus_path),
                                         document_record(cartridge), cartridge.num_tokens, subject_of(cartridge))
            self._refused.pop(path, None)
            self._index = {}
            return path

    def remove(self, name: str) -> None:
        """Delete the cartridge and its corpus text."""
        with self._lock:
            if name not in self._entries:
                self.get(name)  # raises, naming what the store holds
            discard_catalog(self.root)  # first: killed after it, nothing of the record is left there
            for suffix in (CORPUS_SUFFIX, SUFFIX):  # the cartridge last: killed between, sync still sees it
                (self.root / f"{name}{suffix}").unlink(missing_ok=True)
            self._drop(name)

    def forget(self, name: str, documents: str | os.PathLike | None = None, *, timeout: float = 0) -> list[Path]:
        """Delete every file the store made from the document `name` (a patient's record, say): its cartridge, its
        corpus text, self-study's work folders for it, and the work folders of other documents' trainings that kept
        a copy of it as a distractor (they start again); and, given the folder the store syncs from (`documents`),
        the document itself, so the next sync does not build it again. Works from what is on disk, so a cartridge
        already dropped from the store is cleaned up too. Returns the paths removed. Holds the sync lock meanwhile
        (waiting `timeout` seconds for a running sync)."""
        return forget(self, name, documents, timeout=timeout)

    def _drop(self, name: str) -> None:
        """Forget `name` in memory: its entry, its loaded cartridge, its passages' embeddings, the routing and
        passage indexes (its files are gone), and the catalog, which held its record (sync writes a new one when it
        is done)."""
        with self._lock:
            discard_catalog(self.root)
            self._entries.pop(name, None)
            self._memory.pop(name)
            self._embedded.pop(name)
            self._refused = {p: v for p, v in self._refused.items() if p.exists()}
            self._index = {}

    def sync(self, source: str | os.PathLike | Mapping[str, str], config: SyncConfig | None = None, *,
             timeout: float = 0, progress: bool = True, ranks: bool = False) -> SyncReport:
        """Bring the store in step with `source`, a folder (one document per file, or per top-level entry with
        ``SyncConfig(unit="folder")``) or a mapping of name to text: one cartridge per document, built only when the
        document is new or changed, deleted when the document is gone. Bad files are skipped with one log line each
        and lose nothing already stored. Waits `timeout` seconds for another sync holding the store's lock (then
        raises `ConfigError`). With `ranks`, each rank of a torchrun job calls it and they share the building (rank 0
        holds the lock and plans; docs/scale.md). See docs/sync.md."""
        return sync(self, source, config, timeout=timeout, progress=progress, ranks=ranks)

    def self_study(self, source: str | os.PathLike | Mapping[str, str], config: SyncConfig | None = None,
                   settings: Mapping[str, Any] | None = None, *, limit: int | None = None, distractors: int = 0,
                   progress: bool = True) -> tuple[str, ...]:
        """Replace the compacted cartridges `sync` made with self-studied ones, one document at a time, each swapped in
        when its training ends if its document is unchanged; `settings` go to `Cartridge.from_corpus`. With
        `distractors` N > 0 each trains among up to N of the store's other cartridges, so it holds up when routing
        composes several (docs/sync.md). Serving goes on meanwhile. Returns the names replaced."""
        return self_study(self, source, config, settings, limit=limit, distractors=distractors, progress=progress)

    def records(self) -> dict[str, dict[str, Any]]:
        """The document each synced cartridge stands for (``name``, ``origin``, ``sha256``, ...), by name. A copy of a
        synced cartridge under another name (its record names the original) is not one: sync leaves it alone."""
        with self._lock:
            return {n: e.document for n, e in sorted(self._entries.items())
                    if e.document is not None and e.document.get("name") == n}

    def corpus_path(self, name: str) -> Path | None:
        """The corpus text routing reads for `name`, if it has one."""
        with self._lock:
            entry = self._entries.get(name)
            return entry.corpus if entry is not None else None

    def refresh(self, *, quick: bool = False) -> dict[str, list[str]]:
        """Re-read the folder: new and replaced files are checked and served, removed ones dropped. Returns the
        names added, removed and refused.

        `quick` (a server's once-a-second look) takes a file as unchanged while it is the same inode, which the
        folder's listing gives without a stat: every writer here replaces a file by renaming a new one over it, so a
        new or replaced file is seen at once. A file rewritten in place keeps its inode, and a filesystem may give a
        freed inode number to the next new file; either is seen at the first full scan, which a quick refresh makes
        once `FULL_SCAN_SECONDS` have passed since the last one."""
        with self._lock:
            full = not quick or time.monotonic() - self._full_scan > FULL_SCAN_SECONDS
            if full:
                self._full_scan = time.monotonic()
            seen: dict[str, _Entry] = {}
            changes: dict[str, list[str]] = {"added": [], "removed": [], "refused": []}
            # one listing of the folder, its entries' types and stats from it: a store of 100,000 cartridges is re-read
            # every second by a server, so a file costs a stat or two here, and a link a resolve
            listing = _listing(self.root)
            # what earlier processes read of these files' headers (serve/catalog.py), read once per store
            catalog = {} if self._catalog_read else read_catalog(self.root, self._model_key)
            headers, slow = 0, []  # headers read; names that were not in the steady state
            for file in [f for f in listing if f.endswith(SUFFIX)]:
                name = file.removesuffix(SUFFIX)
                old = self._entries.get(name)
                corpus_entry = listing.get(f"{name}{CORPUS_SUFFIX}")
                inodes = (listing[file].inode(), corpus_entry.inode() if corpus_entry is not None else None)
                linked = listing[file].is_symlink() or (corpus_entry is not None and corpus_entry.is_symlink())
                if not full and old is not None and old.inodes == inodes and not linked:
                    seen[name] = old  # the same files, by their inodes (a link's target is judged by a full scan)
                    continue
                try:
                    stamp = _entry_stamp(listing[file])
                    has_corpus = corpus_entry is not None and corpus_entry.is_file()
                    corpus_stamp = _entry_stamp(corpus_entry) if has_corpus else None
                except FileNotFoundError:  # removed while we looked
                    continue
                if old is not None and old.stamp == stamp and old.corpus_stamp == corpus_stamp and not linked:
                    # the steady state: no path built, nothing read
                    seen[name] = old if old.inodes == inodes else attrs.evolve(old, inodes=inodes)
                    continue
                path = self.root / file
                corpus = self.root / corpus_entry.name if has_corpus else None
                slow.append(name)
                links = [(path, listing[file])] + ([(corpus, corpus_entry)] if corpus is not None else [])
                outside = [p.name for p, e in links if e.is_symlink() and not self._inside(p)]
                if outside:  # a link to elsewhere would serve or index a file the store's owner never put there
                    if self._refused.get(path, (None,))[0] != stamp or path not in self._linked_out:
                        self._linked_out.add(path)
                        self._refuse(path, _link_out_reason(outside[0]))
                        changes["refused"].append(name)
                    continue
                if path in self._linked_out:  # the link is gone: the file is judged afresh
                    self._linked_out.discard(path)
                    self._refused.pop(path, None)
                if old is not None and old.stamp == stamp and old.path == path:
                    seen[name] = attrs.evolve(old, corpus=corpus, corpus_stamp=corpus_stamp, inodes=inodes)
                    continue
                known = catalog.get(file)
                if known is not None and known.get("stamp") == list(stamp) and name_problem(name) is None:
                    self._refused.pop(path, None)
                    seen[name] = _Entry(path, stamp, corpus, corpus_stamp, known.get("document"),
                                        int(known.get("num_tokens", 0)), known.get("subject"), inodes)
                    if old is None:
                        changes["added"].append(name)
                    continue
                if path in self._refused and self._refused[path][0] == stamp:
                    continue  # the same bad file: said once already
                if name_problem(name) is not None:
                    self._refuse(path, "its name cannot be served (letters, digits, '.', '_', '-'; not 'auto')")
                    changes["refused"].append(name)
                    continue
                cartridge, _ = self._load(path, data=False)  # its header: checked now, its tensors read when asked
                headers += 1
                if cartridge is None:
                    changes["refused"].append(name)
                    continue
                self._refused.pop(path, None)
                self._memory.pop(name)  # a replaced file: the old tensors go
                seen[name] = _Entry(path, stamp, corpus, corpus_stamp, document_record(cartridge),
                                    cartridge.num_tokens, subject_of(cartridge), inodes)
                if old is None:
                    changes["added"].append(name)
            changes["removed"] = sorted(set(self._entries) - set(seen))
            for name in changes["removed"]:
                self._memory.pop(name)
                self._embedded.pop(name)
            self._refused = {p: v for p, v in self._refused.items() if p.exists()}
            def corpus_of(entry: _Entry | None) -> tuple[Path | None, tuple[int, int] | None]:
                return (entry.corpus, entry.corpus_stamp) if entry is not None else (None, None)

            # a corpus added, replaced or gone makes the routing indexes stale (a file refused again does not)
            if changes["removed"] or any(corpus_of(self._entries.get(n)) != corpus_of(seen.get(n)) for n in slow):
                self._index = {}
            for said in changes.values():
                said.sort()
            self._entries = seen
            self._catalog_read = True
            if headers >= WRITE_AFTER:
                self.save_catalog()
            return changes

    def save_catalog(self) -> None:
        """Write what this store knows of its files' headers (serve/catalog.py), so the next process to open the
        folder reads one file instead of every header. Refresh calls it after reading many; sync after a build."""
        with self._lock:
            entries = {e.path.name: {"stamp": list(e.stamp), "document": e.document, "num_tokens": e.num_tokens,
                                     "subject": e.subject} for e in self._entries.values()}
        write_catalog(self.root, self._model_key, entries)

    def _inside(self, path: Path) -> bool:
        """Whether `path`, links followed, is in the store's folder (a file in it that is not a link is: one lstat)."""
        if path.parent == self.root and not path.is_symlink():
            return True
        return path.resolve().parent == self.root.resolve()

    # ---- routing

    def route(self, question: str, k: int = 1, *, among: Sequence[str] | None = None) -> list[Route]:
        """The `k` cartridges whose corpora best match `question` (BM25), best first. Cartridges without a corpus text
        are never routed to, nor are those sharing no word with the question (fewer than `k` may come back); a
        question sharing no word with any corpus is refused rather than answered by an arbitrary cartridge.

        `among` routes within those cartridges only, as if the store held nothing else: the index (and so every
        word's weight) is built from their corpora alone, so neither the answer nor the refusal says anything of the
        others (a clinician's key routes among their own patients)."""
        if not isinstance(question, str) or not question.strip():
            raise ConfigError("route needs a non-empty question.")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"k={k!r} must be a positive int.")
        import bm25s

        with self._lock:
            index = self._routing_index(None if among is None else frozenset(among))
        if index is None:
            raise ConfigError(f"No cartridge in the store at {self.root} has a corpus text ({CORPUS_SUFFIX}) to route "
                              "by; add cartridges with store.add(name, cartridge, corpus=text).")
        retriever, names = index
        words = bm25s.tokenize([routing_text(question)], stopwords=STOPWORDS, return_ids=False, show_progress=False)[0]
        known = [w for w in words if w in retriever.vocab_dict]
        ranked = _best(names, retriever.get_scores(known), k) if known else []
        if not ranked:
            raise ConfigError(f"The question {question[:80]!r} shares no word with the corpus of any cartridge in the "
                              f"store at {self.root}, so it cannot be routed; name the cartridges to use instead.")
        return [Route(name, score) for name, score in ranked]

    def _routing_index(self, among: frozenset[str] | None = None) -> Any:
        if among not in self._index:
            import bm25s

            named = [(name, entry.corpus) for name, entry in sorted(self._entries.items())
                     if entry.corpus is not None and self._inside(entry.corpus) and (among is None or name in among)]
            if len(self._index) >= 256:  # one per key's allow-list: bounded
                self._index.clear()
            if not named:
                return None
            retriever = bm25s.BM25()
            texts = [corpus.read_text("utf-8", errors="replace") for _, corpus in named]
            retriever.index(bm25s.tokenize([routing_text(t) for t in texts], stopwords=STOPWORDS, show_progress=False),
                            show_progress=False)
            owners = [name for name, _ in named]
            self._index[among] = (retriever, owners)
        return self._index[among]

    def within(self, question: str, budget: int, *, among: Sequence[str] | None = None) -> list[Route]:
        """The cartridges `question` is routed to, best first, as many as fit in `budget` tokens together (at least
        the best one): a question that needs several documents ("which modules use X?") gets as many as the budget
        holds. `among` as for `route`."""
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ConfigError(f"budget={budget!r} must be a positive number of cartridge tokens.")
        return self.fitting(self.route(question, k=max(len(self), 1), among=among), budget)

    def fitting(self, ranked: Sequence[Route], budget: int) -> list[Route]:
        """As many of `ranked`, best first, as fit in `budget` tokens together (at least the first), sized from the
        folder's records without loading them."""
        picked, used = [], 0
        with self._lock:
            for route in ranked:
                entry = self._entries.get(route.name)
                size = entry.num_tokens if entry is not None else budget + 1
                if picked and used + size > budget:
                    continue  # a smaller one further down may still fit
                picked.append(route)
                used += size
        return picked

    def passages(self, question: str, *, k: int = 8, retrieval: str = "bm25",
                 among: Sequence[str] | None = None) -> list[Passage]:
        """The best `k` passages of the stored corpora for `question`, best first (`passages.py`); only of the
        documents `among`, when given (the index is built over those alone, as routing's is)."""
        if not isinstance(question, str) or not question.strip():
            raise ConfigError("passages needs a non-empty question.")
        check_retrieval(retrieval)
        with self._lock:
            index = self._passage_index(retrieval, None if among is None else frozenset(among))
        return index.ranked(question, k)

    def _passage_index(self, retrieval: str, among: frozenset[str] | None) -> PassageIndex:
        """The passage index of the documents `among` (None: all) for `retrieval`, built once (under the lock);
        a fused one from the BM25 and dense indexes kept for the same documents."""
        key = ("passages", retrieval, among)
        if key not in self._index:
            if retrieval == "fused":
                embedder_folder(retrieval=retrieval)  # a missing embedder refused as fused's, not dense's
                index = PassageIndex.fusing([self._passage_index(kind, among) for kind in FUSES])
            else:
                texts = {name: entry.corpus.read_text("utf-8", errors="replace")
                         for name, entry in sorted(self._entries.items())
                         if entry.corpus is not None and self._inside(entry.corpus)
                         and (among is None or name in among)}
                index = PassageIndex.of(texts, retrieval, memo=self._embedded)
            if len(self._index) >= 256:
                self._index.clear()
            self._index[key] = index
        return self._index[key]

    def plan(self, question: str, *, k: int = 1, budget: int | None = None, passages: int | None = None,
             retrieval: str | None = None, passages_from: str | None = None, cartridges: Sequence[str] | None = None,
             among: Sequence[str] | None = None, rerank: int = 0, query: str | None = None,
             trim: bool | str = False) -> Plan:
        """The cartridges and passages that answer `question`, without answering (`passages.plan`): the named
        cartridges, or the best `k` routed, or as many as fit `budget` tokens; with `passages` tokens of passages
        the budget is shared (the cartridges fit in `budget - passages`, the passages fill what they leave). With
        `rerank` N, routing's best N are ranked again by the question's likelihood after each (`rerank.py`);
        passages are ranked against `query` (None: the question). With `trim`, cartridges larger than what the
        passages leave of `budget` are cut to their first tokens (`Cartridge.truncated`) to keep the budget; with
        ``trim="attention"``, to the tokens the question (`query`, when given) reads most (`serve/attended.py`)."""
        return plan(self, question, k=k, budget=budget, passages=passages, retrieval=retrieval,
                    passages_from=passages_from, cartridges=cartridges, among=among, rerank=rerank, query=query,
                    trim=trim)

    def ask(self, question: str, *, k: int = 1, budget: int | None = None, passages: int | None = None,
            retrieval: str | None = None, passages_from: str | None = None, cartridges: Sequence[str] | None = None,
            trim: bool | str = False, draft: int = 0, draft_from: CartridgeStore | None = None, runtime: Any = "auto",
            runtime_options: dict[str, Any] | None = None, **gen: Any) -> StoreAnswer:
        """Answer `question` with the named cartridges (composed in order), or with those it is routed to: the
        best `k`, or as many as fit in `budget` tokens (`within`); and, with `passages` tokens, passages of the
        stored corpora after them, the budget shared (`plan`). With `draft` N, a first answer of at most N tokens
        (greedy, from the same plan) is written before the answer, and the passages are ranked against the
        question and it: the cartridges put the document's own words for the answer into the search, where the
        question has only the user's (docs/vs-rag.md, "A first answer picks the passages"); `draft_from`, another
        store of the same documents whose cartridges alone write it (`drafted_plan`; this store itself: its
        cartridges whole, without passages, where `trim` cuts them for the answer). With `trim`, cartridges larger
        than what `passages` leave of `budget` are cut to fit (`plan`): to their first tokens, or with
        ``trim="attention"`` to those the question and its first answer read most."""
        settings = {"k": k, "budget": budget, "passages": passages, "retrieval": retrieval,
                    "passages_from": passages_from, "cartridges": cartridges, "trim": trim}
        plan, first = self.drafted_plan(question, draft, draft_from=draft_from, runtime=runtime,
                                        runtime_options=runtime_options, **settings)
        parts = plan.parts(self)
        text = self._answer(question, plan, runtime, runtime_options, parts=parts, **gen)
        return StoreAnswer(text=text, cartridges=plan.cartridges, versions=versions(parts[:len(plan.cartridges)]),
                           passages=plan.passages, draft=first, sizes=plan.sizes)

    def drafted_plan(self, question: str, draft: int, *, draft_from: CartridgeStore | None = None,
                     runtime: Any = "auto", runtime_options: dict[str, Any] | None = None,
                     **settings: Any) -> tuple[Plan, str | None]:
        """`plan(question, **settings)`, its passages ranked against the question and a first answer of at most
        `draft` tokens (`ask`'s `draft`), and that first answer; `draft` 0: the plan, and None. The first answer is
        the plan's own, or, with `draft_from`, that of the same documents' cartridges in that store alone (a
        self-studied store whose cartridges know the document better than this one's, for one)."""
        check_draft(self.model, draft, settings.get("passages"), settings.get("budget"))
        check_draft_from(draft_from, draft)
        if not draft:
            return self.plan(question, **settings), None
        if draft_from is None:  # this plan's cartridges and passages write the first answer
            source, drafting = self, self.plan(question, **settings)
        else:  # its cartridges alone: the passages found for the question would go unused
            routed = plan(self, question, **settings, find=False)
            source, drafting = draft_from, draft_from.plan(question, cartridges=list(routed.cartridges))
        first = source._answer(question, drafting, runtime, runtime_options, max_new_tokens=draft, temperature=0.0)
        return self.plan(question, **settings, query=drafted(question, first)), first

    def _answer(self, question: str, plan: Plan, runtime: Any, runtime_options: dict[str, Any] | None,
                parts: Sequence[Any] | None = None, **gen: Any) -> str:
        parts = plan.parts(self) if parts is None else parts
        return self.model.ask(question, cartridges=parts, document=list(plan.prefix_ids) or None, runtime=runtime,
                              runtime_options=runtime_options, **gen)
