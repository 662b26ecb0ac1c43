"""Self-study conversations on disk: a folder of Parquet parts (one per chunk group) plus a JSON header.

One part per group makes writing incremental and resumable: a part is written to a temporary name and renamed,
so after a crash every part present is whole, and synthesis restarts at the first missing group.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ..errors import CartridgeFormatError, ConfigError
from ..files import atomic_write, atomic_write_json, folder_lock
from ..identity import text_fingerprint
from ..trainer_inputs import Conversation

HEADER = "header.json"
# the corpus's text, kept beside the conversations so training can start from it (a compacted or prefix start) with
# nothing but the dataset; datasets made before it was kept lack it and ask for the corpus instead
CORPUS_TEXT = "corpus.txt"
DATASET_FORMAT = "cartridges-sdk-selfstudy"
DATASET_VERSION = 1


def _schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("conv_id", pa.int64()),
            ("group", pa.int32()),
            ("chunk_start", pa.int32()),
            ("chunk_end", pa.int32()),
            ("seed_kind", pa.string()),
            ("input_ids", pa.list_(pa.int32())),
            ("role_mask", pa.list_(pa.int8())),
            ("target_positions", pa.list_(pa.int32())),
            ("topk", pa.int32()),
            ("topk_ids", pa.list_(pa.int32())),
            ("topk_logprobs", pa.list_(pa.float32())),
            ("messages", pa.string()),
        ]
    )


def describe_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> str:
    """``a: 1 -> 2, config.lr: ...``: the settings that differ between two nested dicts, with both values."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, "(unset)"), new.get(key, "(unset)")
        if isinstance(a, dict) and isinstance(b, dict):
            inner = describe_changes(a, b, f"{prefix}{key}.")
            out += [inner] if inner else []
        elif a != b:
            show = lambda v: repr(v) if len(repr(v)) <= 40 else f"{repr(v)[:37]}..."  # noqa: E731
            out.append(f"{prefix}{key}: {show(a)} -> {show(b)}")
    return ", ".join(out)


def _part_name(group: int) -> str:
    return f"group-{group:06d}.parquet"


def _whole_number(_inst, attribute, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"shard {attribute.name}={value!r} must be a whole number.")


@attrs.frozen
class Shard:
    """Shard `index` of `count`: the groups ``g`` with ``g % count == index``.

    Groups are numbered across the whole dataset and each is seeded by the synthesis seed and its number alone, so
    the shards of one synthesis are disjoint, any process makes a group the same, and their union is the dataset one
    process makes.
    """

    index: int = attrs.field(validator=_whole_number)
    count: int = attrs.field(validator=_whole_number)

    def __attrs_post_init__(self):
        if self.count < 1 or self.index >= self.count:
            raise ConfigError(f"shard {self.index}/{self.count}: the index must be below the count, from 0 "
                              f"(e.g. 0/{max(self.count, 2)} and 1/{max(self.count, 2)}).")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"I/N"`` (as ``--shard`` takes it)."""
        index, sep, count = text.partition("/")
        if not sep or not index.strip().isdecimal() or not count.strip().isdecimal():
            raise ConfigError(f"--shard {text!r} must be INDEX/COUNT, e.g. 0/4 for the first of four shards.")
        return cls(int(index), int(count))

    def owns(self, group: int) -> bool:
        return group % self.count == self.index


def group_counts(config: dict[str, Any]) -> tuple[int, int]:
    """How many groups of conversations, then of document windows, a synthesis with `config` (as a dict) makes."""
    return (math.ceil(config["num_conversations"] / config["conversations_per_chunk"]),
            math.ceil(config["document_windows"] / config["windows_per_chunk"]))


def _holds(header: dict[str, Any]) -> str:
    shard = header.get("shard")
    return f"shard {shard['index']} of {shard['count']}" if shard else "the whole dataset"


# synthesis settings added since datasets were first written, with the value older datasets were made with, so a
# dataset begun before the upgrade resumes and merges as made with the same settings
ADDED_SETTINGS = {"b_context": "chunk"}


def dataset_settings(header: dict[str, Any]) -> dict[str, Any]:
    """What makes datasets interchangeable: not when each was made, how its model was checked (a probe's figures
    vary a little) or which shard it holds."""
    settings = {k: v for k, v in header.items() if k not in ("created", "model_check", "shard")}
    if isinstance(settings.get("config"), dict):
        settings["config"] = {**ADDED_SETTINGS, **settings["config"]}
    return settings


class SelfStudyDataset:
    """A folder of self-study conversations. Open an existing one with `SelfStudyDataset(path)`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        header = self.path / HEADER
        if not header.is_file():
            raise CartridgeFormatError(
                f"{str(self.path)!r} is not a self-study dataset (no {HEADER}); create one with `cartridges synthesize`."
            )
        self.header: dict[str, Any] = json.loads(header.read_text())
        if self.header.get("format") != DATASET_FORMAT:
            raise CartridgeFormatError(f"{str(header)!r} is not a {DATASET_FORMAT} header.")
        self._cache: list[Conversation] | None = None

    # -- writing ---------------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, header: dict[str, Any], *, restart: bool = False,
               corpus_text: str | None = None) -> SelfStudyDataset:
        """Open `path` for writing; an existing dataset is reused only if it was made with the same settings.

        ``restart=True`` deletes an existing dataset there (its header, parts and kept corpus, nothing else) and starts
        anew. `corpus_text`, the text the dataset is made from, is kept in the folder (`keep_corpus`).
        """
        dataset = cls._create(Path(path), header, restart)
        if corpus_text is not None:
            dataset.keep_corpus(corpus_text)
        return dataset

    @classmethod
    def _create(cls, path: Path, header: dict[str, Any], restart: bool) -> SelfStudyDataset:
        header = {"format": DATASET_FORMAT, "format_version": DATASET_VERSION, **header}
        if restart and (path / HEADER).is_file():
            for part in path.glob("group-*.parquet"):
                part.unlink()
            (path / CORPUS_TEXT).unlink(missing_ok=True)
            (path / HEADER).unlink()
        if (path / HEADER).is_file():
            existing = json.loads((path / HEADER).read_text())
            mine, theirs = ({**dataset_settings(h), "shard": h.get("shard")} for h in (header, existing))
            if mine != theirs and dataset_settings(header) == dataset_settings(existing):  # --restart would lose work
                raise ConfigError(
                    f"{str(path)!r} holds {_holds(existing)}, not {_holds(header)}; use a folder for each shard and "
                    "gather them with `cartridges merge` (dataset.merge)."
                )
            if mine != theirs:
                raise ConfigError(
                    f"{str(path)!r} already holds a self-study dataset made with other settings "
                    f"({describe_changes(theirs, mine)}); start over with restart=True (--restart), or use another folder."
                )
            return cls(path)
        if path.exists() and any(p.name != ".lock" for p in path.iterdir()):
            raise ConfigError(f"{str(path)!r} exists and is not a self-study dataset; choose an empty or new folder.")
        path.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path / HEADER, header)
        return cls(path)

    def keep_corpus(self, text: str) -> None:
        """Keep the corpus's text in the folder, so training can start from the corpus compacted, or from its opening
        tokens, with the dataset alone. The text must be the one the header records; a kept copy that was changed or
        damaged is written again."""
        path = self.path / CORPUS_TEXT
        data = text.encode("utf-8")
        if path.is_file() and path.read_bytes() == data:
            return
        recorded = self.header.get("corpus", {}).get("fingerprint")
        if recorded and text_fingerprint(text) != recorded:
            raise ConfigError(f"The corpus text given is not the one {str(self.path)!r} records (fingerprint "
                              f"{text_fingerprint(text)}, not {recorded}).")
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))

    def corpus_text(self) -> str | None:
        """The corpus the dataset was synthesized from, as kept in its folder, checked against the header; None for a
        dataset made before datasets kept their corpus (training then needs the corpus given)."""
        path = self.path / CORPUS_TEXT
        if not path.is_file():
            return None
        text = path.read_bytes().decode("utf-8", errors="replace")
        recorded = self.header.get("corpus", {}).get("fingerprint")
        if recorded and text_fingerprint(text) != recorded:
            raise CartridgeFormatError(
                f"{str(path)!r} is not the corpus {str(self.path)!r} was synthesized from (fingerprint "
                f"{text_fingerprint(text)}, the header records {recorded}): it was changed or damaged. Delete it and "
                "give the corpus (--corpus; prefix_ids= in Python), or synthesize again."
            )
        return text

    def done_groups(self) -> set[int]:
        return {int(p.stem.split("-")[1]) for p in self.path.glob("group-*.parquet")}

    def holds(self) -> str:
        """What part of a synthesis this is, in words: "the whole dataset" or "shard I of N"."""
        return _holds(self.header)

    def missing_groups(self, shard: Shard | None = None) -> list[int]:
        """Groups the header's settings call for that are not here yet: of `shard`, else of the shard this folder
        holds, else all."""
        if shard is None:
            shard = Shard(**self.header["shard"]) if self.header.get("shard") else Shard(0, 1)
        done = self.done_groups()
        return [g for g in range(sum(group_counts(self.header["config"]))) if shard.owns(g) and g not in done]

    def drop_damaged(self) -> list[str]:
        """Delete parts that cannot be read back whole (a disk fault, a copy cut short), so they are made again;
        returns their names."""
        import pyarrow.parquet as pq

        damaged = []
        for part in sorted(self.path.glob("group-*.parquet")):
            try:
                pq.read_table(part)
            except Exception:  # noqa: BLE001 - whatever pyarrow says, the part is unusable
                damaged.append(part.name)
                part.unlink()
        self._cache = None
        return damaged

    def write_group(self, group: int, conversations: Sequence[Conversation]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = {name: [] for name in _schema().names}
        for c in conversations:
            rows["conv_id"].append(c.conv_id)
            rows["group"].append(c.group)
            rows["chunk_start"].append(c.chunk[0])
            rows["chunk_end"].append(c.chunk[1])
            rows["seed_kind"].append(c.seed_kind)
            rows["input_ids"].append(c.input_ids.astype(np.int32))
            rows["role_mask"].append(c.role_mask.astype(np.int8))
            rows["target_positions"].append(c.target_positions.astype(np.int32))
            rows["topk"].append(int(c.topk_ids.shape[1]) if c.topk_ids.ndim == 2 else 0)
            rows["topk_ids"].append(c.topk_ids.astype(np.int32).reshape(-1))
            rows["topk_logprobs"].append(c.topk_logprobs.astype(np.float32).reshape(-1))
            rows["messages"].append(json.dumps(list(c.messages)))
        table = pa.table(rows, schema=_schema())
        atomic_write(self.path / _part_name(group), lambda tmp: pq.write_table(table, tmp))
        self._cache = None

    # -- reading ---------------------------------------------------------------------------------------
    def conversations(self) -> list[Conversation]:
        if self._cache is None:
            self._cache = list(self._read())
        return self._cache

    def _read(self) -> Iterator[Conversation]:
        import pyarrow.parquet as pq

        for part in sorted(self.path.glob("group-*.parquet")):
            try:
                table = pq.read_table(part)
            except Exception as err:
                raise CartridgeFormatError(f"Cannot read {str(part)!r}: {err}; delete it and re-run synthesis.") from err
            for row in table.to_pylist():
                k = row["topk"]
                n_t = len(row["target_positions"])
                yield Conversation(
                    conv_id=row["conv_id"],
                    group=row["group"],
                    chunk=(row["chunk_start"], row["chunk_end"]),
                    seed_kind=row["seed_kind"],
                    input_ids=row["input_ids"],
                    role_mask=row["role_mask"],
                    target_positions=row["target_positions"],
                    topk_ids=np.asarray(row["topk_ids"], dtype=np.int32).reshape(n_t, k),
                    topk_logprobs=np.asarray(row["topk_logprobs"], dtype=np.float32).reshape(n_t, k),
                    messages=tuple(json.loads(row["messages"])),
                )

    def __len__(self) -> int:
        return len(self.conversations())

    def __iter__(self) -> Iterator[Conversation]:
        return iter(self.conversations())

    def __repr__(self) -> str:
        return f"SelfStudyDataset({str(self.path)!r}, {len(self)} conversations)"


def merge(sources: Sequence[str | os.PathLike], output: str | os.PathLike) -> SelfStudyDataset:
    """Gather datasets made with the same settings (the shards of one synthesis, run on several machines) into
    `output`: a new folder, or a dataset of those settings to add to. The sources are left as they are.

    Every group present in any source is copied once (the same group is the same conversations wherever it was
    made); groups none of them holds stay missing (`missing_groups()`), and running the same synthesis on `output`
    makes them. A source still being written is fine: its parts are whole or absent, and what it lacks is missing.
    """
    import pyarrow.parquet as pq

    if not sources:
        raise ConfigError("Give at least one dataset folder to merge.")
    output = Path(output)
    parts = [SelfStudyDataset(s) for s in sources]
    for part in parts:
        if part.path.resolve() == output.resolve():
            raise ConfigError(f"{str(output)!r} is both a source and the output; merge into another folder.")
        first, this = dataset_settings(parts[0].header), dataset_settings(part.header)
        if this != first:
            raise ConfigError(
                f"{str(part.path)!r} was made with other settings than {str(parts[0].path)!r} "
                f"({describe_changes(first, this)}); only shards of one synthesis merge."
            )
    header = {k: v for k, v in parts[0].header.items() if k not in ("format", "format_version", "shard")}
    with folder_lock(output):
        merged = SelfStudyDataset.create(output, header)
        have = merged.done_groups()
        for part in parts:
            for group in sorted(part.done_groups() - have):
                source = part.path / _part_name(group)
                try:
                    table = pq.read_table(source)
                except Exception as err:
                    raise CartridgeFormatError(
                        f"Cannot read {str(source)!r}: {err}; run that shard's synthesis again (it remakes damaged "
                        "parts), then merge."
                    ) from err
                atomic_write(merged.path / _part_name(group), lambda tmp, t=table: pq.write_table(t, tmp))
                have.add(group)
        kept = next((text for text in (part.corpus_text() for part in parts) if text is not None), None)
        if kept is not None:
            merged.keep_corpus(kept)
        merged._cache = None
    return merged

