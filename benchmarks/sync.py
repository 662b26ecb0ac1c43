"""Per-document cartridges kept in step with a folder: what an edit costs, and how one document's cartridge holds up
when composed with others.

``incremental``: the dev documents of the given files (default QASPER and QuALITY: 20 documents, about 105k tokens)
written one per file into a folder and synced into a store; then one document is edited and the store synced
again. Reports both times, the counts, and whether the answers about the untouched documents stayed the same, bit for
bit (same files, same greedy answers).

``composition``: on that store, each question's own cartridge composed (repositioned) with k - 1 others, k = 1, 2,
4, 8, 16: the others drawn at random (the right one at a random place among them), and the top k that BM25 routing
picks (the right one may be missing). Gap closure of gold-answer NLL against the document in context, pooled over
questions whose document fits the context beside them.

``self-studied``: the same curve for a few documents' self-studied cartridges (against their compacted ones), each
among the same k - 1 random compacted others; with ``--distractors N``, also for the same documents self-studied
among up to N of the store's other cartridges (composition-aware training, making/distractors.py).

``pairs``: two QASPER papers in one budget: one cartridge of their concatenation, against the two papers'
half-size cartridges composed, and against each question routed to its paper's cartridge; closure against the pair
in context.

``corpus``: the whole corpus behind each question within one budget: routed per-document cartridges composed up to
it, one cartridge of the whole corpus compacted to it, BM25 RAG passages up to it, and the best truncation that fits
the context; closure against the question's own document in context.

    python -m benchmarks.sync incremental --store /tmp/sync-bench
    python -m benchmarks.sync composition --store /tmp/sync-bench
    python -m benchmarks.sync composition --store /tmp/sync-bench --variant off-topic
    python -m benchmarks.sync self-studied --store /tmp/sync-bench --documents 2 --questions-per-doc 3
    python -m benchmarks.sync self-studied --store /tmp/sync-bench --documents 2 --questions-per-doc 4 --distractors 7
    python -m benchmarks.sync self-studied --store /tmp/sync-bench --documents 2 --distractors 7 --set alone_share=0.5
    python -m benchmarks.sync pairs --store /tmp/sync-bench --questions-per-doc 4
    python -m benchmarks.sync corpus --store /tmp/sync-bench --questions-per-doc 1 --budget 1024
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import time
from pathlib import Path

from cartridges_sdk import Cartridge, load_model
from cartridges_sdk.making.evaluation import answer_logprobs, nll
from cartridges_sdk.cli.common import parse_settings
from cartridges_sdk.serve.store import CartridgeStore
from cartridges_sdk.making.settings import CompactionConfig
from cartridges_sdk.serve.settings import SyncConfig

from . import provenance
from .data import EVALDATA, load_corpora
from .naming import settings_tag

DATA = [EVALDATA / "scientific_qa_dev.jsonl", EVALDATA / "quality_dev.jsonl"]
ROOM = 512  # positions kept for a question and its answer beside a document in context
KS = (1, 2, 4, 8, 16)
# questions no document here is about: their queries, as reference queries, ask compaction to match what the whole
# document does when a question is about something else (what a distractor in a composition sees)
OFF_TOPIC = (
    "What is the boiling point of water at sea level?",
    "How do I reverse a list in Python?",
    "Who wrote the novel Pride and Prejudice?",
    "What is the capital city of Australia?",
    "How many legs does a spider have?",
    "What is 17 multiplied by 23?",
)
VARIANTS = {"default": CompactionConfig(), "off-topic": CompactionConfig(probe_questions=OFF_TOPIC)}


def corpora(files: list[Path]):
    """(file name, corpus) for every document of every file."""
    out = []
    for path in files:
        count = sum(1 for line in path.read_text("utf-8").splitlines() if line.strip())
        for corpus in load_corpora(path, list(range(count))):
            out.append((f"{corpus.name}.txt", corpus))
    return out


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def incremental(lm, docs, store_dir: Path, tokens: int) -> dict:
    folder = store_dir / "documents"
    shutil.rmtree(store_dir, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, corpus in docs:
        (folder / name).write_text(corpus.text, "utf-8")
    store = CartridgeStore(store_dir / "store", lm)
    config = SyncConfig(tokens=tokens)
    full = store.sync(folder, config)
    again = store.sync(folder, config)
    questions = {name: corpus.questions[0].question for name, corpus in docs}
    before = {name: store.ask(q, cartridges=[name], max_new_tokens=32).text for name, q in questions.items()}
    files_before = {p.name: _digest(p) for p in (store_dir / "store").glob("*.safetensors")}
    edited = docs[0][0]
    with open(folder / edited, "a", encoding="utf-8") as f:
        f.write("\n\nAddendum: this document was revised after publication.\n")
    edit = store.sync(folder, config)
    after = {name: store.ask(q, cartridges=[name], max_new_tokens=32).text for name, q in questions.items()}
    files_after = {p.name: _digest(p) for p in (store_dir / "store").glob("*.safetensors")}
    untouched = [name for name, _ in docs if name != edited]
    return {
        "documents": len(docs), "corpus_tokens": sum(len(lm.encode(c.text)) for _, c in docs), "tokens": tokens,
        "full_sync": {"seconds": full.seconds, **full.counts()},
        "unchanged_sync": {"seconds": again.seconds, **again.counts()},
        "one_edit_sync": {"seconds": edit.seconds, **edit.counts(), "updated": list(edit.updated)},
        "speedup": round(full.seconds / edit.seconds, 1),
        "untouched_files_identical": all(files_before[f"{n}.safetensors"] == files_after[f"{n}.safetensors"]
                                         for n in untouched),
        "untouched_answers_identical": all(before[n] == after[n] for n in untouched),
        "edited_file_changed": files_before[f"{edited}.safetensors"] != files_after[f"{edited}.safetensors"],
    }


def composition(lm, docs, store_dir: Path, per_doc: int, seed: int, variant: str, tokens: int) -> dict:
    names = [name for name, _ in docs]
    if variant == "default":
        store = CartridgeStore(store_dir / "store", lm)
        built = None
    else:  # the same documents compacted another way, in a store of their own
        store = CartridgeStore(store_dir / f"store-{variant}", lm)
        built = store.sync(store_dir / "documents", SyncConfig(tokens=tokens, compaction=VARIANTS[variant])).seconds
    missing = [n for n in names if n not in store]
    if missing:
        raise SystemExit(f"the store lacks {missing[:3]}...; run `python -m benchmarks.sync incremental` first")
    limit = lm.max_context or 10**9
    ks = [k for k in KS if k <= len(names)]
    rows = []
    for name, corpus in docs:
        doc_ids = lm.encode(corpus.text)
        if len(doc_ids) + ROOM > limit:
            continue  # no in-context reference to close the gap to
        for q, row, others, rng in _asked(lm, name, corpus, doc_ids, per_doc, seed, names):
            for k in ks:
                chosen = rng.sample(others, k - 1)
                chosen.insert(rng.randrange(k), name)
                routed = [r.name for r in store.route(q.question, k=k)]
                for kind, picked in (("random", chosen), ("routed", routed)):
                    row[f"{kind}_{k}"] = _composed_nll(lm, q, [store.get(n) for n in picked])
                row[f"routed_{k}_has_own"] = name in routed
            rows.append(_shown(row))
    return {"variant": variant, "build_seconds": built, "questions": len(rows),
            "documents": len({r["doc"] for r in rows}), **_curves(rows, ("random", "routed"), ks),
            "routed_has_own": {k: round(sum(r[f"routed_{k}_has_own"] for r in rows) / len(rows), 3) for k in ks},
            "rows": rows}


def _asked(lm, name: str, corpus, doc_ids: list[int], per_doc: int, seed: int, names: list[str]):
    """The document's first `per_doc` questions, each with its row (the answer's NLL alone and with the document in
    context), the other documents, and the seeded draw its compositions take (the same for every variant)."""
    for i, q in enumerate(corpus.questions[:per_doc]):
        row = {"doc": name, "none": nll(answer_logprobs(lm, q.question, q.answer), lm, q.answer),
               "icl": nll(answer_logprobs(lm, q.question, q.answer, document=doc_ids), lm, q.answer)}
        yield q, row, [n for n in names if n != name], random.Random(f"{seed}-{name}-{i}")


def _composed_nll(lm, q, parts: list) -> float:
    """The gold answer's NLL behind `parts` composed in order (repositioned)."""
    cart = parts[0] if len(parts) == 1 else Cartridge.compose(parts, reposition=True, model=lm)
    return nll(answer_logprobs(lm, q.question, q.answer, cartridges=[cart]), lm, q.answer)


def _shown(row: dict) -> dict:
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return row


def _closure(rows: list[dict], key: str) -> float:
    """Gap closure of `key`'s NLL, pooled over the questions."""
    return round(sum(r["none"] - r[key] for r in rows) / sum(r["none"] - r["icl"] for r in rows), 3)


def _curves(rows: list[dict], kinds: tuple[str, ...], ks: list[int]) -> dict:
    """Closure for each kind and k, and the share of its k = 1 closure kept at k = 8."""
    curve = {kind: {k: _closure(rows, f"{kind}_{k}") for k in ks} for kind in kinds}
    return {"closure": curve, "kept_at_8": {kind: round(curve[kind][8] / curve[kind][1], 3) for kind in curve if 8 in ks}}


def self_studied(lm, docs, store_dir: Path, per_doc: int, seed: int, tokens: int, count: int,
                 settings: dict | None = None, distractors: int = 0, among_settings: dict | None = None) -> dict:
    """The composition curve of self-studied cartridges: the first `count` documents that fit the context beside a
    question are self-studied (`store.self_study`, defaults unless `settings`), each into a store of its own kind;
    each question's own cartridge, compacted or self-studied, among the same k - 1 random compacted others. With
    `distractors` N, also self-studied among up to N of the store's others (a copy of the base store), the kind
    ``among`` (its own `among_settings` on top, e.g. ``alone_share``); each row then counts the others at each k that
    were not in its training pool (``among_K_unseen``)."""
    names = [name for name, _ in docs]
    base = CartridgeStore(store_dir / "store", lm)
    missing = [n for n in names if n not in base]
    if missing:
        raise SystemExit(f"the store lacks {missing[:3]}...; run `python -m benchmarks.sync incremental` first")
    limit = lm.max_context or 10**9
    chosen = [(n, c) for n, c in docs if len(lm.encode(c.text)) + ROOM <= limit][:count]
    studied = CartridgeStore(store_dir / "store-self-study", lm)
    config = SyncConfig(tokens=tokens)
    texts = {n: c.text for n, c in chosen}
    # sync deletes what its source lacks: keep the documents an earlier run (say with more `count`) studied here
    kept = studied.records()
    studied.sync({n: c.text for n, c in docs if n in texts or n in kept}, config, progress=False)
    seconds = {}
    start = time.perf_counter()
    trained = studied.self_study(texts, config, settings or {}, progress=True)
    seconds["self_study"] = round(time.perf_counter() - start, 1)
    stores = {"compact": base, "self_study": studied}
    pools: dict[str, list[str]] = {}
    if distractors:
        among = _among_store(lm, store_dir, among_name(distractors, among_settings), {n: c.text for n, c in docs},
                             config)
        start = time.perf_counter()
        trained += among.self_study(texts, config, {**(settings or {}), **(among_settings or {})},
                                    distractors=distractors, progress=True)
        seconds["among"] = round(time.perf_counter() - start, 1)
        stores["among"] = among
        # a document trained later may have drawn one trained earlier: its cartridge now in the copy, not the base's
        fingerprints = {store.get(n).fingerprint: n for store in (base, among) for n in names}
        pools = {n: [fingerprints.get(f, "?") for f in among.get(n).meta.training["distractors"]["content"]]
                 for n in texts}
    ks = [k for k in KS if k <= len(names)]
    rows = []
    for name, corpus in chosen:
        doc_ids = lm.encode(corpus.text)
        for q, row, others, rng in _asked(lm, name, corpus, doc_ids, per_doc, seed, names):
            for k in ks:
                picked = rng.sample(others, k - 1)
                at = rng.randrange(k)
                others_here = [base.get(n) for n in picked]
                for kind, store in stores.items():
                    row[f"{kind}_{k}"] = _composed_nll(lm, q, others_here[:at] + [store.get(name)] + others_here[at:])
                if pools:
                    row[f"among_{k}_unseen"] = sum(n not in pools[name] for n in picked)
            rows.append(_shown(row))
    return {"documents": [n for n, _ in chosen], "self_studied": list(trained), "training_seconds": seconds,
            "distractors": distractors, "pools": pools, "questions": len(rows),
            **_curves(rows, tuple(stores), ks), "rows": rows}


def among_name(distractors: int, settings: dict | None) -> str:
    """What names a run among others: its store's folder and its result file."""
    return f"among-{distractors}" + (f"-{settings_tag(settings)}" if settings else "")


def _among_store(lm, store_dir: Path, name: str, texts: dict[str, str], config: SyncConfig) -> CartridgeStore:
    """A copy of the base store (every document's compacted cartridge), where self-study trains among the others;
    synced with the documents as given (`incremental` left one edited in the base store)."""
    folder = store_dir / f"store-{name}"
    if not folder.is_dir():
        shutil.copytree(store_dir / "store", folder.with_name(folder.name + ".partial"), dirs_exist_ok=True)
        folder.with_name(folder.name + ".partial").rename(folder)
    store = CartridgeStore(folder, lm)
    store.sync(texts, config, progress=False)
    return store


def pairs(lm, store_dir: Path, count: int, per_doc: int, tokens: int) -> dict:
    """Two QASPER papers in one budget of `tokens`: one cartridge of the pair's concatenation, the two papers'
    cartridges of half the size composed, and each question routed (BM25, between the two) to its paper's cartridge
    of the full size; also the question's own paper's cartridge (what perfect routing gives). Closure against the
    pair in context."""
    docs = dict(corpora([EVALDATA / "scientific_qa_dev.jsonl"]))
    limit = lm.max_context or 10**9
    names = sorted(docs)
    ids = {n: lm.encode(docs[n].text) for n in names}
    chosen: list[tuple[str, str]] = []
    used: set[str] = set()
    for a in names:  # disjoint pairs, in order, whose two papers fit in context together beside a question
        for b in names:
            if a < b and not {a, b} & used and len(ids[a]) + len(ids[b]) + ROOM <= limit:
                chosen.append((a, b))
                used |= {a, b}
                break
    chosen = chosen[:count]
    synced = CartridgeStore(store_dir / "store", lm)
    synced = synced if all(r.get("size") == tokens for r in synced.records().values()) else {}
    rows = []
    for a, b in chosen:
        pair_ids = lm.encode(docs[a].text + "\n\n" + docs[b].text)
        whole = Cartridge.compact(lm, pair_ids, tokens, progress=False, report=False)
        halves = [Cartridge.compact(lm, ids[n], tokens // 2, progress=False, report=False) for n in (a, b)]
        composed = Cartridge.compose(halves, reposition=True, model=lm)
        full = {n: synced.get(n) if n in synced else Cartridge.compact(lm, ids[n], tokens, progress=False, report=False)
                for n in (a, b)}  # the store's, when `incremental` made them at this size
        router = CartridgeStore(store_dir / f"pair-{a}-{b}", lm)
        for n in (a, b):
            router.add(n, full[n], corpus=docs[n].text, replace=True)
        for own in (a, b):
            for q in docs[own].questions[:per_doc]:
                def at(**context) -> float:
                    return nll(answer_logprobs(lm, q.question, q.answer, **context), lm, q.answer)

                routed = router.route(q.question, k=1)[0].name
                row = {"pair": [a, b], "none": at(), "icl": at(document=pair_ids), "whole": at(cartridges=[whole]),
                       "composed": at(cartridges=[composed]), "routed": at(cartridges=[full[routed]]),
                       "own": at(cartridges=[full[own]]), "routed_right": routed == own}
                rows.append(_shown(row))

    return {"pairs": chosen, "tokens": tokens, "questions": len(rows),
            "closure": {k: _closure(rows, k) for k in ("whole", "composed", "routed", "own")},
            "routed_right": round(sum(r["routed_right"] for r in rows) / len(rows), 3), "rows": rows}


def whole_corpus(lm, docs, store_dir: Path, per_doc: int, budget: int) -> dict:
    """The whole corpus behind each question, in `budget` cartridge or prompt tokens: per-document cartridges routed
    and composed up to the budget, one cartridge of the whole corpus compacted to the budget, BM25 RAG passages up to
    the budget, and the best truncation of the corpus that fits the context (no budget: as much as fits). Closure
    against the question's own document in context."""
    import bm25s

    store = CartridgeStore(store_dir / "store", lm)
    ids = lm.encode("\n\n".join(c.text for _, c in docs))
    cached = store_dir / f"whole-{budget}.safetensors"
    start = time.perf_counter()
    if cached.exists():
        whole = Cartridge.load(cached, model=lm)
    else:
        whole = Cartridge.compact(lm, ids, budget, report=False)
        whole.save(cached)
    seconds = round(time.perf_counter() - start, 1)
    fits = (lm.max_context or len(ids)) - ROOM
    passages = [(name, " ".join(words[i: i + 64])) for name, c in docs for words in [c.text.split()]
                for i in range(0, len(words), 64)]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([t for _, t in passages], stopwords="en", show_progress=False), show_progress=False)
    limit = lm.max_context or 10**9
    rows = []
    for name, corpus in docs:
        doc_ids = lm.encode(corpus.text)
        if len(doc_ids) + ROOM > limit:
            continue
        for q in corpus.questions[:per_doc]:
            def at(**context) -> float:
                return nll(answer_logprobs(lm, q.question, q.answer, **context), lm, q.answer)

            routed = [r.name for r in store.within(q.question, budget)]
            parts = [store.get(n) for n in routed]
            found, _ = retriever.retrieve(bm25s.tokenize([q.question], stopwords="en", show_progress=False),
                                          k=min(len(passages), 4 * budget // 64), show_progress=False)
            rag: list[int] = []
            for i in found[0].tolist():  # best first until the budget is spent (the last passage cut to fit)
                rag += lm.encode(passages[i][1] + "\n\n")[: budget - len(rag)]
                if len(rag) >= budget:
                    break
            composed = parts[0] if len(parts) == 1 else Cartridge.compose(parts, reposition=True, model=lm)
            row = {"doc": name, "none": at(), "icl": at(document=doc_ids), "routed": at(cartridges=[composed]),
                   "whole_cartridge": at(cartridges=[whole]), "rag": at(document=rag),
                   "truncated_first": at(document=ids[:fits]), "truncated_last": at(document=ids[-fits:]),
                   "routed_names": routed, "routed_has_own": name in routed}
            rows.append(_shown(row))

    figures = {k: _closure(rows, k) for k in ("routed", "whole_cartridge", "rag", "truncated_first", "truncated_last")}
    figures["truncated_best"] = max(figures.pop("truncated_first"), figures.pop("truncated_last"))
    return {"corpus_tokens": len(ids), "budget": budget, "truncation_tokens": fits, "questions": len(rows),
            "whole_cartridge_seconds": seconds, "closure": figures,
            "routed_has_own": round(sum(r["routed_has_own"] for r in rows) / len(rows), 3),
            "routed_cartridges_mean": round(sum(len(r["routed_names"]) for r in rows) / len(rows), 2), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["incremental", "composition", "self-studied", "pairs", "corpus"])
    parser.add_argument("--data", type=Path, action="append", help="L-Eval JSONL files (default QASPER + QuALITY dev)")
    parser.add_argument("--store", type=Path, required=True, help="a scratch folder (incremental replaces it)")
    parser.add_argument("--tokens", type=int, default=256, help="cartridge tokens per document")
    parser.add_argument("--questions-per-doc", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", type=int, default=3, help="pairs: how many pairs of papers")
    parser.add_argument("--documents", type=int, default=2, help="self-studied: how many documents to self-study")
    parser.add_argument("--distractors", type=int, default=0,
                        help="self-studied: also train among up to N of the store's other cartridges (0: not)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", default=[],
                        help="self-studied: a training setting for the run among others, e.g. alone_share=0.5")
    parser.add_argument("--budget", type=int, default=1024, help="corpus: cartridge or prompt tokens per question")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="default",
                        help="composition: how the cartridges are compacted (off-topic: with off-topic probe questions)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    among_settings = parse_settings(args.set)  # before the model loads: a malformed --set fails at once
    docs = corpora(args.data or DATA)
    lm = load_model()
    start = time.perf_counter()
    if args.mode == "incremental":
        result = incremental(lm, docs, args.store, args.tokens)
    elif args.mode == "corpus":
        result = whole_corpus(lm, docs, args.store, args.questions_per_doc, args.budget)
    elif args.mode == "self-studied":
        result = self_studied(lm, docs, args.store, args.questions_per_doc, args.seed, args.tokens, args.documents,
                              distractors=args.distractors, among_settings=among_settings)
    elif args.mode == "pairs":
        result = pairs(lm, args.store, args.pairs, args.questions_per_doc, args.tokens)
    else:
        result = composition(lm, docs, args.store, args.questions_per_doc, args.seed, args.variant, args.tokens)
    result.update({"mode": args.mode, "model": lm.name, "seconds": round(time.perf_counter() - start, 1),
                   "commit": provenance.commit(), "dirty": provenance.dirty(), "machine": provenance.machine()})
    suffix = f"-{args.variant}" if args.mode == "composition" else ""
    if args.mode == "self-studied" and args.distractors:
        suffix = "-" + among_name(args.distractors, among_settings)
    provenance.save(result, args.out or Path("benchmarks/results") / f"sync-{args.mode}{suffix}.json")


if __name__ == "__main__":
    main()
