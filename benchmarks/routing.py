"""Routing among many cartridges: how often a question reaches its own document's cartridge, and, with ``--tokens P``,
what answering through the routed cartridge is worth against the oracle one and against RAG.

Accuracy: each question of each document, routed among all the documents' cartridges, goes to its own document's
cartridge (top-1), or has it among the top 3. Also reported over the questions that name a word only their own
document uses (`distinctive`), the ones a router reading nothing but the question can be expected to place; the
others ("What baselines do they compare to?") fit any paper. Routing reads only the corpus texts, so the accuracy
run uses 4-token cartridges.

Closure (``--tokens P``): every document compacted to a P-token cartridge (`Cartridge.compact`, no training; kept in
the work folder, so a rerun reuses them). On each question, gold-answer NLL with: no context, the whole own document
in context (ICL), the own document's cartridge (oracle), the top-1 routed cartridge, and a BM25 RAG baseline that puts
the best-matching passages of all the documents in context up to the same P tokens the cartridge occupies. Gap
closure = (NLL_none - NLL_method) / (NLL_none - NLL_icl), over all questions.

    python -m benchmarks.routing [--data scientific_qa_dev.jsonl] [--docs all]
    python -m benchmarks.routing --tokens 256
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from cartridges_sdk import Cartridge, CartridgeStore, load_model
from cartridges_sdk.errors import ConfigError
from cartridges_sdk.making.evaluation import answer_logprobs, nll
from cartridges_sdk.files import atomic_write_json
from cartridges_sdk.lm import LM

from . import provenance
from .data import DEFAULT_DATA, Corpus, load_corpora, only_own_words

PASSAGE_WORDS = 64  # RAG passages: short, so the budget holds several


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="L-Eval-format JSONL")
    parser.add_argument("--docs", default="all", help="comma-separated document indices, or 'all'")
    parser.add_argument("--tokens", type=int, default=None,
                        help="measure gap closure with P-token compacted cartridges (and RAG at P tokens)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/routing[-pP].json")
    args = parser.parse_args()

    count = sum(1 for line in args.data.open() if line.strip())
    docs = ",".join(map(str, range(count))) if args.docs == "all" else args.docs
    corpora = load_corpora(args.data, docs)
    lm = load_model()
    out = args.out or Path(f"benchmarks/results/routing{f'-p{args.tokens}' if args.tokens else ''}.json")
    if args.tokens is None:
        with tempfile.TemporaryDirectory() as tmp:
            store = _store(lm, corpora, Path(tmp), lambda c: Cartridge.from_prefix(lm, c.text, 4))
            rows = accuracy_rows(store, corpora)
        distinctive = [r for r in rows if r["only_own_words"]]
        summary = {"data": args.data.name, "documents": len(corpora), "questions": len(rows), **_rates(rows),
                   "distinctive_questions": len(distinctive),
                   **{f"distinctive_{key}": value for key, value in _rates(distinctive).items()}}
    else:
        work = out.with_suffix(".work") / args.data.stem
        store = _store(lm, corpora, work, lambda c: Cartridge.compact(lm, c.text, args.tokens, progress=False, report=False))
        rows = closure_rows(lm, store, corpora, args.tokens)
        summary = {"data": args.data.name, "documents": len(corpora), "questions": len(rows), "tokens": args.tokens,
                   **_closures(rows)}
    print(json.dumps(summary))
    atomic_write_json(out, {**summary, "rows": rows, "model": lm.name, "commit": provenance.commit(),
                            "dirty": provenance.dirty(), "machine": provenance.machine()})
    print(f"wrote {out}")


def _store(lm: LM, corpora: list[Corpus], folder: Path, make) -> CartridgeStore:
    """A store with one cartridge per document (made by `make` unless the folder already holds it)."""
    store = CartridgeStore(folder, lm)
    for c in tqdm(corpora, desc="cartridges", unit="doc"):
        if c.name not in store:
            store.add(c.name, make(c), corpus=c.text)
    return store


def accuracy_rows(store: CartridgeStore, corpora: list[Corpus]) -> list[dict]:
    rows = []
    for c in corpora:
        others = [o.text for o in corpora if o is not c]
        for q in c.questions:
            try:
                ranked = [r.name for r in store.route(q.question, k=3)]
            except ConfigError:  # shares no word with any document: a miss, not the end of the run
                ranked = []
            rows.append({"doc": c.name, "question": q.question, "top1": ranked[:1] == [c.name], "top3": c.name in ranked,
                         "routed": ranked, "only_own_words": only_own_words(q.question, c.text, others)})
    return rows


def closure_rows(lm: LM, store: CartridgeStore, corpora: list[Corpus], tokens: int) -> list[dict]:
    import bm25s

    passages = [(c.name, " ".join(words[i : i + PASSAGE_WORDS])) for c in corpora
                for words in [c.text.split()] for i in range(0, len(words), PASSAGE_WORDS)]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([p for _, p in passages], stopwords="en", show_progress=False),
                    show_progress=False)
    rows = []
    questions = [(c, q) for c in corpora for q in c.questions]
    for c, q in tqdm(questions, desc="questions", unit="q"):
        start = time.perf_counter()
        try:
            routed = store.route(q.question, k=1)[0].name
        except ConfigError:  # shares no word with any paper: answered with none, as a router that finds nothing would
            routed = None
        found, _ = retriever.retrieve(bm25s.tokenize([q.question], stopwords="en", show_progress=False),
                                      k=min(len(passages), 4 * tokens // PASSAGE_WORDS), show_progress=False)
        rag_ids: list[int] = []
        for i in found[0].tolist():  # best first, until the budget is spent (the last passage cut to fit)
            rag_ids += lm.encode(passages[i][1] + "\n\n")[: tokens - len(rag_ids)]
            if len(rag_ids) >= tokens:
                break

        def score(question: str = q.question, answer: str = q.answer, **where) -> float:
            return nll(answer_logprobs(lm, question, answer, **where), lm, answer)

        rows.append({"doc": c.name, "question": q.question, "routed": routed, "none": score(),
                     "icl": score(document=c.text), "oracle": score(cartridges=[store.get(c.name)]),
                     "routed_cartridge": score(cartridges=[store.get(routed)] if routed else None),
                     "rag": score(document=rag_ids),
                     "rag_docs": sorted({passages[i][0] for i in found[0].tolist()[:3]}), "rag_tokens": len(rag_ids),
                     "icl_tokens": len(lm.encode(c.text)), "seconds": round(time.perf_counter() - start, 2)})
    return rows


def _closures(rows: list[dict]) -> dict[str, float]:
    mean = lambda key: sum(r[key] for r in rows) / len(rows)
    gap = mean("none") - mean("icl")
    figures = {f"nll_{key}": round(mean(key), 4) for key in ("none", "icl", "oracle", "routed_cartridge", "rag")}
    figures.update({f"closure_{key}": round((mean("none") - mean(key)) / gap, 3)
                    for key in ("oracle", "routed_cartridge", "rag")})
    figures["routed_top1"] = round(sum(r["routed"] == r["doc"] for r in rows) / len(rows), 3)
    figures["icl_tokens_mean"] = round(mean("icl_tokens"))
    return figures


def _rates(rows: list[dict]) -> dict[str, float | None]:
    if not rows:
        return {"top1": None, "top3": None}
    return {key: round(sum(r[key] for r in rows) / len(rows), 3) for key in ("top1", "top3")}


if __name__ == "__main__":
    main()
