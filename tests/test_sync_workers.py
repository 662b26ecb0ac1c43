"""`cartridges sync --workers N`: torchrun ranks share one sync's building. Two workers leave the store one leaves
(the same files, bit-identical tensors), and a worker killed mid-run (either rank) loses nothing: every file left is
whole, and the next run builds only what is missing, to the same store."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors import safe_open

WORDS = ["harbor", "lamp", "reef", "keeper", "storm", "colza", "tower", "ledger", "signal", "granite", "tide", "mast"]
DOCS = 40


def write_folder(folder: Path) -> None:
    folder.mkdir()
    for i in range(DOCS):
        rng = random.Random(i)
        (folder / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(250)) + ".\n")


def sync_command(folder: Path, store: Path, workers: int) -> list[str]:
    return [sys.executable, "-m", "cartridges_sdk.cli", "sync", str(folder), "--store", str(store), "--model",
            "tiny-random", "--tokens", "32", "--no-report", "--json", "--workers", str(workers)]


def run_sync(folder: Path, store: Path, workers: int) -> dict:
    # one thread everywhere: torchrun gives each rank one, and sums split over more threads may round differently
    done = subprocess.run(sync_command(folder, store, workers), capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout[done.stdout.index("{"):])


def contents(store: Path) -> dict[str, object]:
    """Every file of the store: a cartridge as its tensors' bytes and its metadata less the time it was written; any
    other file as its bytes."""
    out: dict[str, object] = {}
    for path in sorted(p for p in store.iterdir() if p.is_file() and not p.name.startswith(".")):
        if path.suffix != ".safetensors":
            out[path.name] = path.read_bytes()
            continue
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["meta"])
            meta.pop("created")
            out[path.name] = (meta, {k: f.get_tensor(k).numpy().tobytes() for k in sorted(f.keys())})
    return out


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("one")
    write_folder(root / "docs")
    report = run_sync(root / "docs", root / "store", 1)
    assert report["num_added"] == DOCS
    return root / "docs", contents(root / "store")


def test_two_workers_build_the_store_one_worker_builds(one_worker, tmp_path):
    folder, expected = one_worker
    report = run_sync(folder, tmp_path / "store", 2)
    assert report["num_added"] == DOCS and report["num_rejected"] == 0
    assert contents(tmp_path / "store") == expected
    again = run_sync(folder, tmp_path / "store", 2)  # nothing changed: nothing built
    assert (again["num_added"], again["num_updated"], again["num_skipped"]) == (0, 0, DOCS)


# rank 1 killed is the slow tier's (50 s each); rank 0 killed, the one that prepared the run, stays in the default tier
@pytest.mark.parametrize("rank", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_worker_killed_mid_run_loses_nothing(one_worker, tmp_path, rank):
    folder, expected = one_worker
    store = tmp_path / "store"
    job = subprocess.Popen(sync_command(folder, store, 2), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while len(list(store.glob("*.safetensors"))) < 4:  # a few built, most not
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
            time.sleep(0.01)
        ranks = [p for p in psutil.Process(job.pid).children(recursive=True)
                 if p.environ().get("RANK") == str(rank) and "cartridges_sdk.cli" in p.cmdline()]
        assert len(ranks) == 1, [p.cmdline() for p in psutil.Process(job.pid).children(recursive=True)]
        ranks[0].send_signal(signal.SIGKILL)
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode != 0, "the job went on without its killed worker"
    built = {p.name for p in store.glob("*.safetensors")}
    assert 4 <= len(built) < DOCS, f"the kill landed after the job ended: {len(built)} built"
    partial = contents(store)
    assert all(partial[name] == expected[name] for name in built)  # each file left is whole and right
    report = run_sync(folder, store, 2)
    assert (report["num_skipped"], report["num_added"] + report["num_updated"]) == (len(built), DOCS - len(built))
    assert contents(store) == expected


def test_bad_worker_counts_are_refused_before_any_work(tmp_path):
    (tmp_path / "docs").mkdir()
    for workers, said in (("0", "--workers 0 must be at least 1"),):
        done = subprocess.run(sync_command(tmp_path / "docs", tmp_path / "store", 1)[:-1] + [workers],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode != 0 and said in done.stderr, done.stderr[-2000:]
    both = subprocess.run(sync_command(tmp_path / "docs", tmp_path / "store", 2) + ["--self-study"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert both.returncode != 0 and "then again with --self-study" in both.stderr, both.stderr[-2000:]
    assert not (tmp_path / "store").exists()
