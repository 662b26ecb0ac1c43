"""Self-study of a synced store: training, one document at a time, the cartridges sync compacted, and swapping each
in when it is done if its document has not changed meanwhile.

Training runs without the store's lock (it takes minutes to hours); only the swap takes it. Its work (the dataset and
checkpoints) is kept in ``.work/NAME-HASH``, so a killed run resumes.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ..cartridge import Cartridge
from ..errors import ConfigError
from ..files import folder_lock
from ..making.settings import DEFAULT_START, with_recipe
from .documents import SUFFIX, read_documents
from .records import with_record
from .settings import SyncConfig
from .sync import LOCK, WORK, SyncedStore, current

log = logging.getLogger("cartridges_sdk.store")

DISTRACTOR_POOL = 16  # the other cartridges one document's self-study draws its distractors from


def self_study(store: SyncedStore, source: str | os.PathLike | Mapping[str, str], config: SyncConfig | None = None,
               settings: Mapping[str, Any] | None = None, *, limit: int | None = None, distractors: int = 0,
               progress: bool = True) -> tuple[str, ...]:
    """Train by self-study the cartridge of each document that sync compacted (at most `limit` of them), replacing
    the compacted one when its training ends, unless the document changed meanwhile. `settings` go to
    `Cartridge.from_corpus` (``num_conversations``, ``lr``, ``recipe``, ...). With `distractors` N > 0, each trains
    among up to N of the store's other cartridges at a time (`among_others`). Returns the names replaced."""
    config = (config or SyncConfig()).for_model(store.model)
    settings = dict(settings or {})
    taken = {"num_tokens", "output_dir", "progress", "distractors", "max_distractors", "report",
             "compaction"} & set(settings)
    if taken:
        raise ConfigError(f"self-study settings {sorted(taken)} are set by sync (the size is SyncConfig.tokens, the "
                          "distractors its distractors= argument, the report SyncConfig.report, the compacted start "
                          "SyncConfig.compaction).")
    if isinstance(distractors, bool) or not isinstance(distractors, int) or distractors < 0:
        raise ConfigError(f"distractors={distractors!r} must be a whole number >= 0 (0 trains each cartridge alone).")
    # a recipe's own start, where it has one (its name is checked here, before any document): then the store's
    # cartridge is the start only if sync compacted alike (as `cartridges sync --recipe` does); else one is made anew
    start_compaction = with_recipe(settings).get("compaction", config.compaction)
    documents, _ = read_documents(source, unit=config.unit, max_bytes=config.max_bytes, include=config.include)
    improved: list[str] = []
    for doc in documents:
        if limit is not None and len(improved) >= limit:
            break
        store.refresh()
        record = store.records().get(doc.name)
        if (record is None or record.get("method") != "compact"
                or not current(store, doc, record, config, compaction=False)):
            continue
        work = store.root / WORK / f"{doc.name}-{doc.sha256[:16]}"
        among = ({"distractors": among_others(store, doc.name, work), "max_distractors": distractors}
                 if distractors else {})
        try:
            # starting from the corpus compacted as sync compacts it (unless the settings start elsewhere): from the
            # very cartridge sync made, rather than compacting the document a second time
            start = {}
            if settings.get("init", DEFAULT_START) == "compact":
                start = {"compaction": start_compaction}
                keep_start(work, store.get(doc.name))
            trained = Cartridge.from_corpus(doc.text, store.model, num_tokens=config.tokens, output_dir=work,
                                            progress=progress, report=config.report, **among, **start, **settings)
        except ConfigError:
            raise  # a bad setting fails every document alike: say it once
        except Exception as err:  # noqa: BLE001 - one document that fails to train must not stop the others
            log.warning("self-study %s: %s failed to train (%s: %s); it keeps its compacted cartridge", store.root,
                        doc.name, type(err).__name__, err)
            continue
        with folder_lock(store.root, name=LOCK, timeout=-1):  # waits for a running sync: the swap is quick
            store.refresh()
            now = store.records().get(doc.name)
            if now is None or now.get("sha256") != doc.sha256 or now.get("size") != config.tokens:
                log.warning("self-study %s: %s changed while it trained; its result is dropped", store.root, doc.name)
                continue
            tokens = int(record.get("tokens", 0))
            store.add(doc.name, with_record(store.model, trained, doc, "self-study", tokens, config.tokens),
                      corpus=doc.text, replace=True)
        shutil.rmtree(work, ignore_errors=True)
        improved.append(doc.name)
    return tuple(improved)


def keep_start(work: Path, compacted: Cartridge) -> None:
    """Leave `compacted` where self-study keeps its compacted start, so training starts from it. Self-study checks
    a kept start before using it (size, corpus, compaction settings) and compacts anew when it does not match."""
    from ..making.selfstudy import COMPACT_START

    kept = work / "train" / COMPACT_START
    if not kept.exists():
        kept.parent.mkdir(parents=True, exist_ok=True)
        # how it was made, and nothing the store added (record, subject, quality report): training passes a start's
        # metadata on to the trained cartridge
        meta = attrs.evolve(compacted.meta, extra={"compaction": compacted.meta.extra.get("compaction", {})})
        Cartridge(compacted.keys, compacted.values, meta).save(kept)


def among_others(store: SyncedStore, name: str, work: Path) -> list[Cartridge]:
    """The distractors `name` trains among: up to ``DISTRACTOR_POOL`` of the store's other cartridges, drawn once
    and kept in its work folder, so a resumed training meets the same ones whatever the store became meanwhile."""
    kept = work / "distractors"
    if not kept.is_dir():
        others = [n for n in store.names() if n != name]
        chosen = sorted(random.Random(f"distractors:{name}").sample(others, min(DISTRACTOR_POOL, len(others))))
        staging = work / "distractors.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for n in chosen:
            store.get(n).save(staging / f"{n}{SUFFIX}")
        staging.rename(kept)  # all of them or none: a kill while copying leaves no half set
    return [Cartridge.load(p, store.model) for p in sorted(kept.glob(f"*{SUFFIX}"))]
