"""A store as it grows: synthetic folders of 1,000, 10,000 and 100,000 documents synced with a tiny model that needs no
download (``--model tiny-random``: every step runs, in milliseconds, so what is timed is the store, not a reader).

At each size it measures: the first build; a re-sync of the unchanged folder (a fresh process's work: the store read,
the folder read and hashed, nothing built); a sync after one document is edited; the server's start (``cartridges
serve`` until it answers); how long after a new document's cartridge lands a running server answers from it (the
slowest of five landings); routing latency (median and 99th percentile of ``store.route`` over distinct questions);
and the server's resident memory once it has routed, with a 64 MB budget for the cartridge tensors it keeps. Then
how each figure grows with the size (a line through the sizes: a fixed cost, and a cost per 1,000 documents).

    python -m benchmarks.scale [--sizes 1000,10000,100000] [--model tiny-random] [--workers 2] [--work DIR]

Folders and stores are kept in ``--work`` (default benchmarks/results/scale.work), so a rerun reuses what it built.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from cartridges_sdk import Cartridge, CartridgeStore, load_model

from . import provenance

PLACES = ["harbor", "ridge", "valley", "delta", "island", "canyon", "meadow", "glacier", "marsh", "plateau"]
THINGS = ["lamps", "ledgers", "boats", "bells", "maps", "looms", "kilns", "mills", "carts", "clocks"]
TOKENS = 64  # cartridge tokens per document: the tiny model's character tokens, so a document is kept whole
SERVER_MEMORY_MB = 64  # the server's budget for cartridge tensors it keeps loaded (`cartridges serve --memory-mb`)
LANDINGS = 5  # new cartridges landing while the server runs; the slowest to be answered is the figure


def code_word(i: int) -> str:
    """A word only document `i` uses (letters from its number), which a routed question names."""
    letters = ""
    n = i + 26**3
    while n:
        n, r = divmod(n, 26)
        letters += chr(ord("a") + r)
    return "q" + letters


def document(i: int) -> str:
    rng = random.Random(i)
    return f"The {rng.choice(PLACES)} keeps {rng.randint(2, 99)} {rng.choice(THINGS)}; code {code_word(i)}.\n"


def write_folder(folder: Path, size: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    present = {p.name for p in folder.iterdir()}
    for i in range(size):
        name = f"d{i:06d}.txt"
        if name not in present:
            (folder / name).write_text(document(i))


def sync_cli(folder: Path, store: Path, model: str, workers: int) -> float:
    """A `cartridges sync` process, as a user runs it: its wall seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "cartridges_sdk.cli", "sync", str(folder), "--store", str(store), "--model",
                    model, "--tokens", str(TOKENS), "--no-report", "--json", "--workers", str(workers)],
                   check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


def ask(url: str, name: str) -> int:
    """The status of a one-token answer from cartridge `name`."""
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Which code?"}],
                       "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def resident_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def serve_figures(store_dir: Path, model: str, lm, new_doc: int) -> dict:
    """Start a server on the store; time its start, how soon it answers from a cartridge that lands while it runs,
    and its memory after routing."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "cartridges_sdk.cli", "serve", "--store", str(store_dir),
                               "--model", model, "--port", str(port), "--memory-mb", str(SERVER_MEMORY_MB)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while get(f"{url}/health", 1.0)[0] != 200:
            if server.poll() is not None:
                raise RuntimeError("the server exited: " + server.stderr.read().decode()[-2000:])
            time.sleep(0.05)
        started = time.perf_counter() - start
        first_route = time.perf_counter()
        assert ask(url, "auto") == 200
        first_route = time.perf_counter() - first_route
        # new documents' cartridges land (one atomic rename each, as sync writes them), at random moments of the
        # server's once-a-second look; how long until it answers from each
        store = CartridgeStore(store_dir, lm, memory_budget=SERVER_MEMORY_MB * 2**20)
        rng, waits, names = random.Random(new_doc), [], []
        for j in range(LANDINGS):
            time.sleep(rng.uniform(0, 1.5))
            name, text = f"new{new_doc + j}.txt", document(new_doc + j)
            ids = lm.encode(text)
            store.add(name, Cartridge.from_prefix(lm, ids, len(ids), num_frozen=1), corpus=text, replace=True)
            landed = time.perf_counter()
            while ask(url, name) != 200:
                time.sleep(0.02)
            waits.append(time.perf_counter() - landed)
            names.append(name)
        memory = resident_mb(server.pid)
        for name in names:
            store.remove(name)
    finally:
        server.terminate()
        server.wait(30)
    return {"server_start_s": round(started, 2), "first_routed_answer_s": round(first_route, 2),
            "new_cartridge_answered_after_s": round(max(waits), 3),
            "new_cartridge_answered_median_s": round(statistics.median(waits), 3), "server_rss_mb": round(memory, 1),
            "server_memory_budget_mb": SERVER_MEMORY_MB}


def route_latency(store: CartridgeStore, size: int, questions: int = 300) -> dict:
    rng = random.Random(0)
    docs = rng.sample(range(size), min(questions, size))
    start = time.perf_counter()
    store.route(f"Which {PLACES[0]} has code {code_word(docs[0])}?")  # builds the index
    build = time.perf_counter() - start
    seconds, right = [], 0
    for i in docs:
        t = time.perf_counter()
        routes = store.route(f"How many things does the place with code {code_word(i)} keep?")
        seconds.append(time.perf_counter() - t)
        right += bool(routes) and routes[0].name == f"d{i:06d}.txt"
    seconds.sort()
    return {"route_index_build_s": round(build, 2), "route_median_ms": round(1000 * statistics.median(seconds), 2),
            "route_p99_ms": round(1000 * seconds[min(len(seconds) - 1, math.ceil(0.99 * len(seconds)) - 1)], 2),
            "routed_right": f"{right}/{len(docs)}"}


def growth(sizes: list[int], values: list[float]) -> str:
    """How a figure grows, in words: the least-squares line ``fixed + per_doc * size`` through the sizes measured
    (a process's start is a fixed cost that a log-log slope would read as slow growth)."""
    n = len(sizes)
    if n < 2:
        return "n/a"
    mx, my = sum(sizes) / n, sum(values) / n
    per_doc = sum((x - mx) * (y - my) for x, y in zip(sizes, values)) / sum((x - mx) ** 2 for x in sizes)
    fixed = my - per_doc * mx
    top = max(sizes)
    share = per_doc * top / (fixed + per_doc * top) if fixed + per_doc * top else 0.0
    word = "constant" if share < 0.1 else "linear" if share > 0.9 else "a fixed cost plus linear"
    return f"{word}: {fixed:.3g} + {per_doc * 1000:.3g} per 1,000 documents"


# the goals at 100,000 documents (issue: a store of 100,000 documents), drawn on the plot
GOALS = {"resync_unchanged_s": 30.0, "new_cartridge_answered_after_s": 2.0, "route_p99_ms": 50.0,
         "server_rss_mb": 2048.0}
PANELS = [("resync_unchanged_s", "re-sync, folder unchanged (s)"), ("sync_one_edit_s", "sync after one edit (s)"),
          ("server_start_s", "server start (s)"), ("new_cartridge_answered_after_s", "new cartridge answered after (s)"),
          ("route_p99_ms", "routing p99 (ms)"), ("server_rss_mb", "server memory (MB)")]


def plot(result: dict, path: Path) -> Path:
    """Each figure against the number of documents (log-log), with its goal at 100,000 where it has one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["documents"] for r in result["rows"]]
    fig, axes = plt.subplots(2, 3, figsize=(11, 6))
    for ax, (key, title) in zip(axes.flat, PANELS):
        ax.plot(sizes, [r[key] for r in result["rows"]], marker="o")
        if key in GOALS:
            ax.axhline(GOALS[key], color="red", lw=0.8, ls="--", label="goal at 100k")
            ax.legend(fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{title}\n{result['growth'][key]}", fontsize=9)
        ax.set_xlabel("documents", fontsize=8)
    fig.suptitle(f"A store as it grows ({result['model']}, {result['machine']['cpus']} cores)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--workers", type=int, default=2, help="`cartridges sync --workers` for the first build")
    parser.add_argument("--work", type=Path, default=Path("benchmarks/results/scale.work"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scale.json"))
    parser.add_argument("--plot", type=Path, default=None, help="also draw the figures here (e.g. docs/img/scale.png)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    lm = load_model(args.model)
    rows = []
    for size in sizes:
        folder, store_dir = args.work / f"{size}" / "docs", args.work / f"{size}" / "store"
        write_folder(folder, size)
        row: dict = {"documents": size}
        built_before = len(list(store_dir.glob("*.safetensors"))) if store_dir.is_dir() else 0
        row["first_build_s"] = round(sync_cli(folder, store_dir, args.model, args.workers), 1)
        row["first_build_built"] = size - built_before
        row["resync_unchanged_s"] = round(sync_cli(folder, store_dir, args.model, 1), 2)
        edited = folder / f"d{size // 2:06d}.txt"
        original = edited.read_text()
        edited.write_text(original.replace("keeps", "now keeps"))
        row["sync_one_edit_s"] = round(sync_cli(folder, store_dir, args.model, 1), 2)
        edited.write_text(original)
        sync_cli(folder, store_dir, args.model, 1)
        store = CartridgeStore(store_dir, lm, memory_budget=SERVER_MEMORY_MB * 2**20)
        row.update(route_latency(store, size))
        del store
        row.update(serve_figures(store_dir, args.model, lm, size + 1))
        print(json.dumps(row), flush=True)
        rows.append(row)
    keys = ["resync_unchanged_s", "sync_one_edit_s", "server_start_s", "new_cartridge_answered_after_s",
            "route_median_ms", "route_p99_ms", "server_rss_mb"]
    result = {"commit": provenance.commit(), "dirty": provenance.dirty(), "machine": provenance.machine(),
              "model": args.model, "workers": args.workers, "rows": rows,
              "growth": {k: growth([r["documents"] for r in rows], [r[k] for r in rows]) for k in keys}}
    provenance.save(result, args.out)
    if args.plot is not None:
        print(f"drew {plot(result, args.plot)}")
    return result


if __name__ == "__main__":
    main()
