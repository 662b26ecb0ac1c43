"""Syncing a store with a folder of documents: one cartridge per document keyed by its content hash, only changes
rebuilt, removed documents deleted, bad files skipped with one line each and nothing lost; one writer at a time;
a sync killed with SIGKILL leaves a store that serves and that the next sync completes; servers watching a folder
pick up changes and name the document versions that answered."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch

from cartridges_sdk import Cartridge, ConfigError, load_model
from cartridges_sdk.errors import StoreBusyError
from cartridges_sdk.cli import main
from cartridges_sdk.files import folder_lock
from cartridges_sdk.serve import documents
from cartridges_sdk.serve import sync as sync_module
from cartridges_sdk.serve.documents import content_hash
from cartridges_sdk.serve.settings import SyncConfig
from cartridges_sdk.serve.store import CartridgeStore
from cartridges_sdk.serve.sync import LOCK
from cartridges_sdk.serve.watch import Watcher

TEXTS = {
    "lighthouse.txt": "The Harrow Point lighthouse was built in 1871 by the engineer Margaret Ellison. " * 3,
    "orchard.md": "The orchard at Fenwick grows seven kinds of apple; the cider press runs every October. " * 3,
    "railway.txt": "The branch railway to Colby opened in 1889 and hauled slate down the valley. " * 3,
}
SMALL = SyncConfig(tokens=48)


def _write(folder: Path, texts: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, "utf-8")
    return folder


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file() and not p.name.startswith(".")}


def test_only_what_changed_is_rebuilt_and_what_is_gone_is_deleted(tmp_path, tiny_llama):
    folder = _write(tmp_path / "docs", {**TEXTS, "notes/keepers.txt": "Keepers lived below."})
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    first = store.sync(folder, SMALL, progress=False)
    assert first.added == ("lighthouse.txt", "notes.keepers.txt", "orchard.md", "railway.txt")
    assert first.counts() == {"num_added": 4, "num_updated": 0, "num_skipped": 0, "num_deleted": 0, "num_rejected": 0}
    records = store.records()
    assert records["notes.keepers.txt"]["origin"] == "notes/keepers.txt"
    assert records["orchard.md"]["sha256"] == content_hash(TEXTS["orchard.md"])
    assert records["orchard.md"]["method"] == "compact" and records["notes.keepers.txt"]["method"] == "whole"
    assert (store.root / "orchard.md.corpus.txt").read_text("utf-8") == TEXTS["orchard.md"]
    # a document kept whole is exactly the document in context
    whole = store.get("notes.keepers.txt")
    assert whole.num_tokens == len(tiny_llama.encode("Keepers lived below."))

    before = _files(store.root)
    assert store.sync(folder, SMALL, progress=False).counts()["num_skipped"] == 4
    assert _files(store.root) == before  # nothing rewritten

    (folder / "orchard.md").write_text("The orchard at Fenwick was sold in 1990 and is now a park. " * 3, "utf-8")
    (folder / "railway.txt").unlink()
    (folder / "harbour.txt").write_text("The harbour at Colby shipped slate to Liverpool. " * 3, "utf-8")
    third = store.sync(folder, SMALL, progress=False)
    assert (third.added, third.updated, third.deleted) == (("harbour.txt",), ("orchard.md",), ("railway.txt",))
    assert set(third.skipped) == {"lighthouse.txt", "notes.keepers.txt"}
    after = _files(store.root)
    for name in ("lighthouse.txt.safetensors", "notes.keepers.txt.safetensors"):
        assert after[name] == before[name]  # untouched documents: the same bytes
    assert "railway.txt.safetensors" not in after and "railway.txt.corpus.txt" not in after
    assert store.records()["orchard.md"]["sha256"] == content_hash((folder / "orchard.md").read_text("utf-8"))
    answer = store.ask("Where did the harbour ship slate?", k=1, max_new_tokens=4)
    assert answer.cartridges == ("harbour.txt",) and answer.versions == (store.records()["harbour.txt"]["sha256"],)

    # an emptied folder (an unmounted share looks the same) deletes nothing: it is refused
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no documents, so this sync would delete all 4 synced cartridges"):
        store.sync(empty, SMALL, progress=False)
    assert len(store) == 4

    # another size rebuilds everything; a mapping is a source too, and sync never touches what it did not make
    store.add("manual", Cartridge.from_prefix(tiny_llama, "A cartridge added by hand.", 8))
    store.add("copy", store.get("lighthouse.txt"))  # its record names the original: not sync's to delete
    resized = store.sync({"alpha": "First unit of text, long enough to compact. " * 3}, SyncConfig(tokens=32),
                         progress=False)
    assert resized.added == ("alpha",) and len(resized.deleted) == 4 and "manual" in store
    assert store.names() == ["alpha", "copy", "manual"]


def test_a_question_about_many_documents_gets_as_many_as_the_budget_holds(tmp_path, tiny_llama):
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    store.sync({"harrow": "Slate from Harrow went by sea. " * 4, "colby": "Slate from Colby went by rail. " * 4,
                "fenwick": "Apples from Fenwick went by cart. " * 4, "short": "Slate."}, SMALL, progress=False)
    assert [r.name for r in store.route("Where did the slate go?", k=4)] == ["colby", "harrow", "short"]
    assert [r.name for r in store.within("Where did the slate go?", 100)] == ["colby", "harrow"]  # 48 + 48 tokens
    assert [r.name for r in store.within("Where did the slate go?", 60)] == ["colby", "short"]  # 48 + 6: a smaller
    assert [r.name for r in store.within("Where did the slate go?", 200)] == ["colby", "harrow", "short"]  # fits
    assert [r.name for r in store.within("Where did the slate go?", 1)] == ["colby"]  # the best one at least
    answer = store.ask("Where did the slate go?", budget=100, max_new_tokens=2)
    assert answer.cartridges == ("colby", "harrow") and len(answer.versions) == 2
    with pytest.raises(ConfigError, match="budget=0 must be a positive number"):
        store.within("slate", 0)


def test_a_renamed_or_copied_document_reuses_its_cartridge(tmp_path, tiny_llama, monkeypatch):
    a, b = TEXTS["lighthouse.txt"], TEXTS["railway.txt"]
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    store.sync({"a": a, "b": b}, SMALL, progress=False)
    keys = {name: store.get(name).keys[0].clone() for name in ("a", "b")}

    def no_builds(*_args, **_kwargs):
        raise AssertionError("a document whose content the store holds was built again")

    monkeypatch.setattr(sync_module, "build", no_builds)
    report = store.sync({"c": a, "b": b, "d": b}, SMALL, progress=False)  # a renamed to c, b copied to d
    assert (report.added, report.skipped, report.deleted) == (("c", "d"), ("b",), ("a",))
    assert torch.equal(store.get("c").keys[0], keys["a"]) and torch.equal(store.get("d").keys[0], keys["b"])
    assert store.records()["c"] == {**store.records()["c"], "origin": "c", "sha256": content_hash(a),
                                    "method": "compact"}
    assert store.ask("Who built the lighthouse?", k=1, max_new_tokens=2).cartridges == ("c",)
    monkeypatch.undo()
    assert store.sync({"c": a, "b": b}, SMALL, progress=False).deleted == ("d",)
    # contents swapped: b takes c's cartridge; c's new content sat only in b's, rewritten by then, so c is built
    report = store.sync({"c": b, "b": a}, SMALL, progress=False)
    assert report.updated == ("b", "c")
    assert torch.equal(store.get("b").keys[0], keys["a"]) and torch.equal(store.get("c").keys[0], keys["b"])
    assert {n: r["sha256"] for n, r in store.records().items()} == {"b": content_hash(a), "c": content_hash(b)}


def test_changing_the_size_rebuilds_and_a_hand_added_name_is_refused(tmp_path, tiny_llama):
    folder = _write(tmp_path / "docs", TEXTS)
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    store.add("orchard.md", Cartridge.from_prefix(tiny_llama, "hand made", 6))
    report = store.sync(folder, SMALL, progress=False)
    assert report.added == ("lighthouse.txt", "railway.txt")
    assert [r.path for r in report.rejected] == ["orchard.md"]
    assert "sync did not make; remove it from the store or rename the document" in report.rejected[0].why
    assert store.get("orchard.md").num_tokens == 6  # untouched
    assert store.sync(folder, SyncConfig(tokens=40), progress=False).updated == ("lighthouse.txt", "railway.txt")


def test_changing_the_compaction_rebuilds_the_compacted_cartridges_and_nothing_else(tmp_path, tiny_llama):
    """Each compacted cartridge records its settings; a sync asked for others compacts it again (a document kept
    whole has none to change), and a copied document does not reuse a cartridge compacted otherwise."""
    from cartridges_sdk.making.settings import CompactionConfig

    texts = {"long": TEXTS["lighthouse.txt"], "short": "Tides turn twice daily."}
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    config = SyncConfig(tokens=24)
    other = attrs.evolve(config, compaction=CompactionConfig(corpus_queries=32))
    assert store.sync(texts, config, progress=False).added == ("long", "short")
    # not where its chunks fell; the settings that follow the model as this model filled them in
    assert store.records()["long"]["compaction"] == attrs.asdict(CompactionConfig().for_model(tiny_llama))
    assert "compaction" not in store.records()["short"]
    report = store.sync(texts, other, progress=False)
    assert (report.updated, report.skipped) == (("long",), ("short",))
    assert store.get("long").meta.extra["compaction"]["corpus_queries"] == 32
    assert store.sync(texts, other, progress=False).skipped == ("long", "short")
    # a record written before records held the settings: the file's own header says how it was compacted
    old = store.get("long")
    record = {k: v for k, v in old.meta.extra["document"].items() if k != "compaction"}
    store.add("long", Cartridge(old.keys, old.values, attrs.evolve(old.meta, extra={**old.meta.extra,
                                                                                    "document": record})),
              corpus=texts["long"], replace=True)
    assert "compaction" not in store.records()["long"]
    assert store.sync(texts, other, progress=False).skipped == ("long", "short")
    # "long" renamed: its cartridge was compacted with 32 corpus queries, so the defaults compact it again
    report = store.sync({"copy": texts["long"], "short": texts["short"]}, config, progress=False)
    assert (report.added, report.deleted) == (("copy",), ("long",))
    assert store.get("copy").meta.extra["compaction"]["corpus_queries"] == 2048


def test_the_question_settings_follow_the_model_and_a_store_recompacts_when_the_model_counts_as_a_reader(
        tiny_llama, tmp_path, monkeypatch):
    """`chunk_questions` and `keep_surprising` left at None are the reader's pair for a model whose parameters are in
    READER_PARAMETERS' span and off outside it; what is given stays. A cartridge records what ran, so a store
    compacted as a small model's is compacted again once the same settings mean the reader's (and one from before
    the settings existed is taken as made with them off)."""
    from cartridges_sdk.making import settings
    from cartridges_sdk.making.settings import CompactionConfig

    small = CompactionConfig(ridge=0.5).for_model(tiny_llama)
    assert (small.chunk_questions, small.keep_surprising, small.ridge) == (0, 0.0, 0.5)
    assert settings.made_with({}, CompactionConfig(), tiny_llama)  # a record older than both settings: both off
    texts = {"long": TEXTS["lighthouse.txt"]}
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    config = SyncConfig(tokens=24, report=False)
    assert store.sync(texts, config, progress=False).added == ("long",)
    made = store.get("long").meta.extra["compaction"]
    assert (made["chunk_questions"], made["keep_surprising"]) == (0, 0.0)
    count = tiny_llama.num_parameters
    monkeypatch.setattr(settings, "READER_PARAMETERS", (count + 1, count + 2))
    assert CompactionConfig().for_model(tiny_llama).chunk_questions == 0  # below the span
    monkeypatch.setattr(settings, "READER_PARAMETERS", (count - 1, count))
    assert CompactionConfig().for_model(tiny_llama).chunk_questions == 0  # above it
    monkeypatch.setattr(settings, "READER_PARAMETERS", (count, count + 1))
    reader = CompactionConfig(chunk_questions=0).for_model(tiny_llama)
    assert (reader.chunk_questions, reader.keep_surprising) == (0, 0.45)  # the one given stays
    assert not settings.made_with({}, CompactionConfig(), tiny_llama)
    assert store.sync(texts, attrs.evolve(config, compaction=CompactionConfig(chunk_questions=2)),
                      progress=False).updated == ("long",)
    made = store.get("long").meta.extra["compaction"]
    assert (made["chunk_questions"], made["keep_surprising"]) == (2, 0.45)
    # the size follows the model too: a reader's cartridges are small, its answers fill a budget with passages
    from cartridges_sdk.serve.settings import READER_TOKENS

    assert store.sync(texts, SyncConfig(report=False), progress=False).updated == ("long",)
    assert store.records()["long"]["size"] == READER_TOKENS


def test_bad_files_are_skipped_with_one_line_each_and_nothing_is_lost(tmp_path, tiny_llama, caplog, monkeypatch):
    folder = _write(tmp_path / "docs", TEXTS)
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    store.sync(folder, SMALL, progress=False)
    kept = _files(store.root)
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (folder / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (folder / "huge.txt").write_text("x" * 5000)
    (folder / "a name with spaces.txt").write_text("spaces are not served")
    (folder / "auto").write_text("the name routing uses")
    (folder / "empty.txt").write_text("  \n")
    (folder / ".hidden").write_text("passed over silently")
    os.symlink("loop", folder / "loop")
    os.symlink(".", folder / "here")
    os.mkfifo(folder / "pipe")
    real_open = open

    def unreadable(path, *args, **kwargs):  # root reads any file, so the refusal is staged
        if str(path).endswith(("lighthouse.txt", "secret.txt")):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    (folder / "secret.txt").write_text("no access")
    monkeypatch.setattr(documents, "open", unreadable, raising=False)
    with caplog.at_level(logging.WARNING, logger="cartridges_sdk.store"):
        report = store.sync(folder, SyncConfig(tokens=48, max_bytes=4096), progress=False)
    why = {r.path: r.why for r in report.rejected}
    assert why == {
        "a name with spaces.txt": why["a name with spaces.txt"], "auto": why["auto"], "empty.txt": "it is empty",
        "here": why["here"], "huge.txt": why["huge.txt"], "image.png": "it is binary (it holds NUL bytes), not text",
        "latin1.txt": "it is not UTF-8 text (byte 3 is not UTF-8)", "lighthouse.txt": why["lighthouse.txt"],
        "loop": why["loop"], "pipe": "it is not a regular file (a socket, a device or a pipe)",
        "secret.txt": why["secret.txt"]}
    assert "cannot be a cartridge's" in why["a name with spaces.txt"] and "taken by routing" in why["auto"]
    assert "already read" in why["here"] and "cannot be followed" in why["loop"]
    assert "5,000 bytes, over the limit of 4,096" in why["huge.txt"]
    assert "cannot be read (Permission denied)" in why["lighthouse.txt"]
    lines = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(lines) == len(why) and all(len(line.splitlines()) == 1 for line in lines)
    # the unreadable document keeps its cartridge: a sync never loses what it cannot read this time
    assert report.deleted == () and _files(store.root)["lighthouse.txt.safetensors"] == kept["lighthouse.txt.safetensors"]
    assert store.names() == ["lighthouse.txt", "orchard.md", "railway.txt"]
    # a folder that cannot be read keeps the cartridges of everything under it
    _write(folder, {"notes/a.txt": "Notes on the keepers' log. " * 3})
    monkeypatch.setattr(documents, "open", real_open, raising=False)
    assert set(store.sync(folder, SMALL, progress=False).added) == {"huge.txt", "notes.a.txt", "secret.txt"}
    real_scandir = os.scandir
    monkeypatch.setattr(documents.os, "scandir", lambda path: (_ for _ in ()).throw(PermissionError(13, "Permission denied"))
                        if str(path).endswith("notes") else real_scandir(path))
    report = store.sync(folder, SMALL, progress=False)
    assert "notes" in {r.path for r in report.rejected} and report.deleted == () and "notes.a.txt" in store


def test_a_document_longer_than_the_context_is_compacted_in_parts_that_compose(tmp_path, tiny_llama):
    text = "".join(f"Entry {i}: the tide rose {i % 7} feet at the Harrow quay. " for i in range(80))
    assert len(tiny_llama.encode(text)) > tiny_llama.max_context
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    store.sync({"tides": text}, SyncConfig(tokens=64), progress=False)
    cart = store.get("tides")
    assert cart.num_tokens == 64 and len(cart.meta.parts) >= 2
    assert sum(p["num_tokens"] for p in cart.meta.parts) == 64


def test_one_writer_at_a_time(tmp_path, tiny_llama):
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    with folder_lock(store.root, name=LOCK):
        with pytest.raises(StoreBusyError, match="Another sync is writing to the store .* wait for it to finish"):
            store.sync({"a": "some text here " * 5}, SMALL, progress=False)
    assert store.sync({"a": "some text here " * 5}, SMALL, progress=False).added == ("a",)


def test_a_folder_per_unit(tmp_path, tiny_llama):
    folder = _write(tmp_path / "patients", {"p001/2026-01-03.txt": "Seen for a cough; prescribed rest. " * 2,
                                             "p001/2026-02-10.txt": "Cough resolved. " * 2,
                                             "p002/intake.txt": "New patient, allergic to penicillin. " * 2})
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    assert store.sync(folder, SyncConfig(tokens=48, unit="folder"), progress=False).added == ("p001", "p002")
    corpus = (store.root / "p001.corpus.txt").read_text("utf-8")
    assert "### p001/2026-01-03.txt" in corpus and "### p001/2026-02-10.txt" in corpus
    # a unit one of whose files cannot be read keeps its cartridge whole rather than losing that file's part
    (folder / "p001" / "scan.pdf").write_bytes(b"%PDF\x00\x01")
    report = store.sync(folder, SyncConfig(tokens=48, unit="folder"), progress=False)
    assert [r.path for r in report.rejected] == ["p001", "p001/scan.pdf"] and report.updated == ()
    assert (store.root / "p001.corpus.txt").read_text("utf-8") == corpus
    with pytest.raises(ConfigError, match=r"unit='patient' must be one of \('file', 'folder'\)"):
        SyncConfig(unit="patient")
    with pytest.raises(ConfigError, match="is not a folder"):
        store.sync(tmp_path / "nowhere", progress=False)


def test_a_codebase_synced_by_pattern(tmp_path, tiny_llama):
    """A package's source: its modules (names starting with '_' included) are documents, its caches are not."""
    folder = _write(tmp_path / "pkg", {"__init__.py": "from ._client import Client\n",
                                       "_client.py": 'class Client:\n    """Sends requests."""\n',
                                       "_transports/default.py": 'def send():\n    """Opens a socket."""\n',
                                       "README.md": "Not code, but worth a cartridge."})
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "_client.cpython-311.pyc").write_bytes(b"\x00\x01compiled")
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    report = store.sync(folder, SyncConfig(tokens=48, include=("*.py",)), progress=False)
    assert report.added == ("__init__.py", "_client.py", "_transports.default.py") and report.rejected == ()
    # without patterns the README is a document too (and the cache a binary file, skipped with its reason)
    report = store.sync(folder, SyncConfig(tokens=48), progress=False)
    assert report.added == ("README.md",) and [r.path for r in report.rejected] == ["__pycache__/_client.cpython-311.pyc"]
    # a document that stops matching goes like a removed file
    assert store.sync(folder, SyncConfig(tokens=48, include=("*.py",)), progress=False).deleted == ("README.md",)
    with pytest.raises(ConfigError, match=r"holds no documents matching \*.rs, so this sync would delete all 3"):
        store.sync(folder, SyncConfig(include=("*.rs",)), progress=False)
    with pytest.raises(ConfigError, match="include holds ''; each pattern is a non-empty glob"):
        SyncConfig(include=("*.py", ""))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny_llama):
    """The tiny model as a folder, for the command (it loads the model it is given)."""
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama.model.save_pretrained(path)
    tiny_llama.tokenizer.save_pretrained(path)
    return path


def test_the_command(tmp_path, tiny_dir, capsys):
    folder = _write(tmp_path / "docs", {**TEXTS, "blob.bin": "\x00binary"})
    args = ["sync", str(folder), "--store", str(tmp_path / "store"), "--model", str(tiny_dir), "--tokens", "48"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["num_added"], out["num_rejected"], out["rejected"]) == (3, 1, {"blob.bin": out["rejected"]["blob.bin"]})
    (folder / "railway.txt").unlink()
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "added 0, updated 0, skipped 2 (unchanged), deleted 1, rejected 1 in" in captured.out
    assert main(["sync", str(folder), "--store", str(tmp_path / "store"), "--tokens", "0"]) == 2
    assert "tokens=0" in capsys.readouterr().err
    # --compaction says how each document is compacted; a name CompactionConfig lacks is refused
    other = ["sync", str(folder), "--store", str(tmp_path / "store-q"), "--model", str(tiny_dir), "--tokens", "48"]
    assert main([*other, "--compaction", "corpus_queries=64"]) == 0
    capsys.readouterr()
    store = CartridgeStore(tmp_path / "store-q", load_model(str(tiny_dir)))
    assert {store.get(n).meta.extra["compaction"]["corpus_queries"] for n in store.names()} == {64}
    assert main([*other, "--compaction", "queries=64"]) == 2
    assert "--compaction 'queries' is not a compaction setting" in capsys.readouterr().err
    assert main([*args, "--set", "lr=0.1"]) == 2
    assert "--set gives self-study settings; add --self-study" in capsys.readouterr().err
    assert main([*args, "--recipe", "reader"]) == 2
    assert "--recipe reader names self-study settings; add --self-study, or drop --recipe" in capsys.readouterr().err
    serve = ["serve", "--store", str(tmp_path / "store"), "--model", str(tmp_path / "no-model"), "--watch", str(folder)]
    assert main([*serve, "--watch-every", "0"]) == 2  # refused before the model (there is none there) loads
    assert "--watch-every=0.0 must be a positive number of seconds" in capsys.readouterr().err
    study = [f"--set={k}={v}" for k, v in {"num_conversations": 2, "conversations_per_chunk": 2, "min_chunk": 60,
                                            "max_chunk": 100, "max_tokens_a": 6, "max_tokens_b": 6,
                                            "document_windows": 2, "window_tokens": 16, "top_k": 4}.items()]
    assert main([*args, "--distractors", "1"]) == 2
    assert "--distractors trains self-studied cartridges among others; add --self-study" in capsys.readouterr().err
    assert main([*args, "--json", "--self-study", *study, "--distractors", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_skipped"] == 2 and out["self_studied"] == ["lighthouse.txt", "orchard.md"]
    # each trained among up to one of the store's other cartridges at a time
    trained = Cartridge.load(tmp_path / "store" / "orchard.md.safetensors")
    assert trained.meta.training["distractors"]["most"] == 1
    # with the reader's recipe: sync compacts as the recipe starts, --compaction key by key over it, and self-study
    # starts from that very cartridge (not from the recipe's own start, compacted again)
    recipe = ["sync", str(folder), "--store", str(tmp_path / "store-r"), "--model", str(tiny_dir), "--tokens", "48",
              "--json", "--self-study", "--recipe", "reader", "--compaction", "chunk_questions=1", "--set", "epochs=1"]
    assert main([*recipe, *study]) == 0
    assert json.loads(capsys.readouterr().out)["self_studied"] == ["lighthouse.txt", "orchard.md"]
    trained = Cartridge.load(tmp_path / "store-r" / "orchard.md.safetensors")
    started = trained.meta.extra["compaction"]
    assert (started["chunk_questions"], started["keep_surprising"]) == (1, 0.45)
    training = trained.meta.training
    assert (training["synthesis"]["b_context"], training["config"]["lr"]) == ("document", 0.01)


@pytest.mark.slow  # a minute; a sync worker killed mid-run (tests/test_sync_workers.py) stays in the default tier
def test_a_sync_killed_at_random_points_leaves_a_store_that_serves_and_the_next_sync_completes(tmp_path, tiny_dir,
                                                                                              tiny_llama):
    texts = {f"doc{i:02d}.txt": f"Record {i}. " + f"The keeper logged {i} ships passing the point. " * 6
             for i in range(24)}
    versions = {name: {content_hash(text)} for name, text in texts.items()}  # every version ever written
    folder = _write(tmp_path / "docs", texts)
    store_dir = tmp_path / "store"
    command = [sys.executable, "-m", "cartridges_sdk.cli", "sync", str(folder), "--store", str(store_dir),
               "--model", str(tiny_dir), "--tokens", "48", "--json"]
    rng = random.Random(0)
    kills = 0
    for round_ in range(4):
        if round_:  # edit some documents between kills: each run has work to do, old and new
            for name in rng.sample(sorted(texts), 8):
                texts[name] += f" Revised in round {round_}."
                versions[name].add(content_hash(texts[name]))
            _write(folder, texts)
        started = time.time()
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:  # wait until it is writing cartridges
            if any(p.stat().st_mtime > started for p in store_dir.glob("*.safetensors")):
                break
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.2))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait()
        store = CartridgeStore(store_dir, tiny_llama)  # what a server would see now
        assert store.refused() == {}, store.refused()
        for name, record in store.records().items():  # every file whole, saying which version it is
            assert record["sha256"] in versions[name]
            assert store.get(name).ask("How many ships?", max_new_tokens=2) is not None
    assert kills >= 3
    store = CartridgeStore(store_dir, tiny_llama)
    finished = store.sync(folder, SyncConfig(tokens=48), progress=False)
    assert len(finished.added) + len(finished.updated) + len(finished.skipped) == 24 and finished.rejected == ()
    assert store.sync(folder, SyncConfig(tokens=48), progress=False).counts()["num_skipped"] == 24
    for name, text in texts.items():
        assert store.records()[name]["sha256"] == content_hash(text)


def test_servers_watching_one_store_pick_up_changes_and_name_the_versions(tmp_path, tiny_llama):
    import httpx

    from cartridges_sdk.serve.background import serving
    from cartridges_sdk.serve.server import create_app

    folder = _write(tmp_path / "docs", TEXTS)
    served, other = (CartridgeStore(tmp_path / "store", tiny_llama) for _ in range(2))  # two servers, one folder
    with Watcher(served, folder, SMALL, every=0.2) as first, Watcher(other, folder, SMALL, every=0.2) as second, \
            serving(create_app(served, tiny_llama.get_runtime("hf"))) as url:
        _until(lambda: len(served) == 3 and len(other) == 3)
        (folder / "harbour.txt").write_text("The harbour at Colby shipped slate to Liverpool. " * 3, "utf-8")
        version = content_hash((folder / "harbour.txt").read_text("utf-8"))
        _until(lambda: all(s.records().get("harbour.txt", {}).get("sha256") == version for s in (served, other)))
        body = {"model": "harbour.txt", "messages": [{"role": "user", "content": "Where?"}], "max_tokens": 3}
        data = httpx.post(f"{url}/chat/completions", json=body, timeout=60).json()
        assert data["cartridges"] == ["harbour.txt"] and data["versions"] == [version]
        assert other.ask("Where?", cartridges=["harbour.txt"], max_new_tokens=3).versions == (version,)
        body = {"model": "auto", "messages": [{"role": "user", "content": "Which places had slate?"}],
                "max_tokens": 2, "budget": 96}  # two 48-token cartridges: the question needs several documents
        data = httpx.post(f"{url}/chat/completions", json=body, timeout=60).json()
        assert sorted(data["cartridges"]) == ["harbour.txt", "railway.txt"] and len(data["versions"]) == 2
        # the budget shared: one 48-token cartridge, then passages of the whole store filling the other 48
        shared = httpx.post(f"{url}/chat/completions", json={**body, "passages": 40}, timeout=60).json()
        assert len(shared["cartridges"]) == 1 and shared["usage"]["cartridge_tokens"] == 48
        assert shared["passages"] and {p["source"] for p in shared["passages"]} <= {"harbour.txt", "railway.txt"}
        assert shared["usage"]["prompt_tokens"] >= 48 + data["usage"]["prompt_tokens"]
        for extra, param in (({"budget": "all"}, "budget"), ({"k": 2}, "k"), ({"model": "harbour.txt"}, "budget"),
                             ({"passages": 96}, "passages"), ({"passages": -1}, "passages"),
                             ({"retrieval": "dense"}, "retrieval"), ({"passages": 8, "passages_from": "web"},
                                                                     "passages_from")):
            bad = httpx.post(f"{url}/chat/completions", json={**body, **extra}, timeout=60)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (extra, bad.text)

        (folder / "harbour.txt").write_text("The harbour at Colby closed in 1962. " * 3, "utf-8")
        new = content_hash((folder / "harbour.txt").read_text("utf-8"))
        _until(lambda: all(s.records().get("harbour.txt", {}).get("sha256") == new for s in (served, other)))
        body = {"model": "auto", "messages": [{"role": "user", "content": "When did the harbour close?"}],
                "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks[0]["cartridges"] == ["harbour.txt"] and chunks[0]["versions"] == [new]
        assert first.syncs + second.syncs >= 3  # both looked, and each change was synced by one of them


def _until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


# self-study in seconds on the tiny model
STUDY = dict(num_conversations=2, conversations_per_chunk=2, min_chunk=60, max_chunk=100, max_tokens_a=6,
             max_tokens_b=6, document_windows=2, window_tokens=16, top_k=4)


def test_self_study_replaces_a_compacted_cartridge_unless_its_document_changed(tmp_path, tiny_llama, monkeypatch):
    texts = {"a": TEXTS["lighthouse.txt"], "b": TEXTS["railway.txt"], "tiny": "Short."}
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    config = SyncConfig(tokens=24)
    store.sync(texts, config, progress=False)
    compacted = (store.root / "a.safetensors").read_bytes()
    assert store.self_study(texts, config, STUDY, limit=1, progress=False) == ("a",)
    record = store.records()["a"]
    assert record["method"] == "self-study" and record["sha256"] == content_hash(texts["a"])
    assert (store.root / "a.safetensors").read_bytes() != compacted and store.get("a").meta.training is not None
    assert not list((store.root / ".work").iterdir())  # its work folder is gone once it is swapped in
    # a self-studied cartridge is current: sync leaves it, and self-study does not train it again
    assert store.sync(texts, config, progress=False).skipped == ("a", "b", "tiny")
    # renamed, and back: the self-studied cartridge goes with its content
    renamed = store.sync({("a2" if n == "a" else n): t for n, t in texts.items()}, config, progress=False)
    assert (renamed.added, renamed.deleted) == (("a2",), ("a",)) and store.records()["a2"]["method"] == "self-study"
    assert store.sync(texts, config, progress=False).added == ("a",) and store.records()["a"]["method"] == "self-study"

    real = Cartridge.from_corpus

    def edited_meanwhile(*args, **kwargs):  # another writer syncs a new version of b while b trains
        trained = real(*args, **kwargs)
        store.sync({**texts, "b": "The railway reopened in 2020 as a footpath. " * 3}, config, progress=False)
        return trained

    monkeypatch.setattr(Cartridge, "from_corpus", edited_meanwhile)
    assert store.self_study(texts, config, STUDY, progress=False) == ()  # 'tiny' is kept whole: nothing to train
    assert store.records()["b"]["method"] == "compact"
    assert store.records()["b"]["sha256"] != content_hash(texts["b"])  # the newer version stayed
    with pytest.raises(ConfigError, match=r"\['num_tokens'\] are set by sync"):
        store.self_study(texts, config, {"num_tokens": 4})


def test_self_study_starts_from_the_cartridge_sync_compacted(tmp_path, tiny_llama, monkeypatch):
    """Sync's compacted cartridge is self-study's start (the document is not compacted twice), unless the start
    asked for is another compaction."""
    from cartridges_sdk.making import selfstudy
    from cartridges_sdk.making.settings import RECIPES, CompactionConfig

    texts = {"a": TEXTS["lighthouse.txt"], "b": TEXTS["railway.txt"]}
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    config = SyncConfig(tokens=24)
    store.sync(texts, config, progress=False)
    calls = []
    real = selfstudy.compact_corpus
    monkeypatch.setattr(selfstudy, "compact_corpus", lambda *a, **k: calls.append(k.get("config")) or real(*a, **k))
    assert store.self_study(texts, config, STUDY, limit=1, progress=False) == ("a",)
    assert calls == []
    other = CompactionConfig(keep_surprising=0.5)
    assert store.self_study(texts, attrs.evolve(config, compaction=other), STUDY, progress=False) == ("b",)
    assert calls == [other]
    # a recipe's own start, which the store's cartridge is not: compacted anew as the recipe says, its settings
    # under those given beside it
    texts["c"] = TEXTS["orchard.md"]
    store.sync(texts, config, progress=False)
    assert store.self_study(texts, config, {**STUDY, "recipe": "reader", "epochs": 1}, progress=False) == ("c",)
    assert calls[-1] == RECIPES["reader"]["compaction"]
    training = store.get("c").meta.training
    assert (training["synthesis"]["b_context"], training["synthesis"]["num_conversations"]) == ("document", 2)
    assert (training["config"]["lr"], training["config"]["epochs"]) == (0.01, 1)
    # the text is read stripped, as self-study reads it: trailing blank lines do not push a document past the size
    padded = CartridgeStore(tmp_path / "padded", tiny_llama)
    text = "Tides turn twice daily."
    assert padded.sync({"p": text + "\n" * 8}, config, progress=False).added == ("p",)
    assert padded.records()["p"]["method"] == "whole" and padded.records()["p"]["tokens"] == len(tiny_llama.encode(text))


def test_a_watching_server_self_studies_in_the_background(tmp_path, tiny_llama):
    folder = _write(tmp_path / "docs", {"a.txt": TEXTS["orchard.md"]})
    store = CartridgeStore(tmp_path / "store", tiny_llama)
    with Watcher(store, folder, SyncConfig(tokens=24), every=0.1, self_study=STUDY) as watcher:
        _until(lambda: watcher.studied == ["a.txt"], timeout=120)  # said once the swap is done
        assert store.records()["a.txt"]["method"] == "self-study"
        assert store.ask("What does the orchard grow?", cartridges=["a.txt"], max_new_tokens=2).versions == (
            content_hash(TEXTS["orchard.md"]),)
