"""A thread that keeps a store in step with a folder while the store is served (`cartridges serve --watch`).

It looks at the folder every few seconds (sizes and modification times only, so it also works on network
folders where change notifications do not) and syncs when something changed. Several servers may watch one store:
the one that takes the store's sync lock does the work, the others find the lock held, leave it, and serve the new
files as they land (the store re-reads its folder).

With self-study settings, the watcher trains the compacted cartridges between looks, one document at a time, and
swaps each in when done (`CartridgeStore.self_study`). A change that lands during one document's training is synced
when that training ends.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, StoreBusyError
from .documents import snapshot
from .settings import SyncConfig
from .sync import SyncReport

if TYPE_CHECKING:
    from .store import CartridgeStore

log = logging.getLogger("cartridges_sdk.store")


def interval(every: float, name: str = "every") -> float:
    """`every` as seconds between looks at the folder, or a ConfigError naming `name`."""
    if isinstance(every, bool) or not isinstance(every, (int, float)) or not math.isfinite(every) or every <= 0:
        raise ConfigError(f"{name}={every!r} must be a positive number of seconds between looks at the folder.")
    return float(every)


class Watcher:
    """Syncs `source` into `store` at start and whenever it changes, in a daemon thread, until `close()`;
    `on_sync` hears of every sync that changed something. With `self_study` (settings for `Cartridge.from_corpus`,
    ``{}`` for the defaults), compacted cartridges are then trained one by one and swapped in, each among up to
    `distractors` of the store's others (`CartridgeStore.self_study`)."""

    def __init__(self, store: CartridgeStore, source: str | os.PathLike | Mapping[str, str],
                 config: SyncConfig | None = None, *, every: float = 2.0,
                 on_sync: Callable[[SyncReport], object] | None = None,
                 self_study: Mapping[str, Any] | None = None, distractors: int = 0):
        every = interval(every)
        if not isinstance(source, Mapping) and not os.path.isdir(source):
            raise ConfigError(f"{str(source)!r} is not a folder; a watcher keeps a store in step with a folder of "
                              "documents.")
        self.store, self.source, self.config, self.every = store, source, config or SyncConfig(), every
        self.last: SyncReport | None = None  # the last sync this watcher ran
        self.syncs = 0
        self.on_sync = on_sync
        self.self_study = None if self_study is None else dict(self_study)
        self.distractors = distractors
        self.studied: list[str] = []  # the cartridges this watcher's self-study replaced
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cartridges-watch", daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def close(self, timeout: float = 10) -> None:
        """Stop looking. A sync or a training still running after `timeout` seconds is left to die with the process
        (the thread is a daemon): a killed sync leaves the store whole, and the next one finishes it."""
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self) -> Watcher:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.close()

    def _run(self) -> None:
        synced = studied = failed = None
        while True:
            try:
                seen = snapshot(self.source)
                if seen != synced:
                    self.last = self.store.sync(self.source, self.config, progress=False)
                    self.syncs += 1
                    synced = seen
                    log.info("watch %s: %s", self.source, self.last)
                    if self.on_sync is not None and any((self.last.added, self.last.updated, self.last.deleted)):
                        self.on_sync(self.last)
            except StoreBusyError as err:  # another server syncs: it does the work, this store reads the files
                log.info("watch %s: %s", self.source, err)
            except Exception as err:  # noqa: BLE001 - the server goes on serving what it has; the next look retries
                if failed != str(err):  # said once, not at every look
                    log.exception("watch %s: the sync failed; trying again at every look", self.source)
                    failed = str(err)
            else:
                failed = None
                if self.self_study is not None and studied != seen:
                    studied = self._study(seen)
            if self._stop.wait(self.every):
                return

    def _study(self, seen: object) -> object:
        """Self-study one compacted cartridge; the snapshot once nothing is left to train (or training failed), so
        that the next document waits for the next change; else None."""
        try:
            done = self.store.self_study(self.source, self.config, self.self_study, limit=1,
                                         distractors=self.distractors, progress=False)
        except Exception:  # noqa: BLE001 - serving goes on with the compacted cartridge
            log.exception("watch %s: self-study failed; the compacted cartridges stay until the next change",
                          self.source)
            return seen
        self.studied.extend(done)
        return None if done else seen
