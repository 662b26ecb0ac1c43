"""The medical-record bot, measured: multiple-choice questions about synthetic patients' records (answers from the
structured data each record was rendered from), answered with each patient's cartridge, against the whole record in
context and BM25 RAG over the record at the cartridge's size.

    python -m benchmarks.medical --patients 6 --model qwen2.5-coder-0.5b --tokens 256

Per question (four options, one right), for each method: the option letter the model ranks first (``correct``); the
option whose text it finds likeliest as the answer to the question asked without options (``likeliest``: how small
models are scored on multiple choice); and the gold answer's NLL:

- ``none``: the question alone (the options' prior);
- ``record``: the patient's whole record in context (the ceiling a cartridge stands in for);
- ``cartridge``: the patient's cartridge, made by the store's sync (compaction, no training);
- ``rag``: BM25's best paragraphs of the patient's own record, best first, up to the cartridge's token count.

Then routing: the share of questions (each names its patient) that `auto` routes to the right patient among the
asking clinician's own, and the KV memory each method holds per clinician's request.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cartridges_sdk import Cartridge, CartridgeStore, SyncConfig, load_model
from cartridges_sdk.making.evaluation import answer_logprobs, nll

from . import provenance
from .codebase import rag_context
from .data import Question
from .measure import Context, kv_bytes_per_token, mean, score_questions

APP = Path(__file__).resolve().parent.parent / "examples" / "medical_records"


def records_module():
    """The app's record generator (examples/medical_records/records.py)."""
    if str(APP) not in sys.path:
        sys.path.insert(0, str(APP))
    import records

    return records


def run(lm, work: Path, patients: int, seed: int, tokens: int, questions: int | None = None) -> dict:
    """`questions`: at most this many per patient (all of them by default)."""
    import bm25s

    records = records_module()
    made = records.simulate(patients, seed)
    store = CartridgeStore(work / f"store-{tokens}", lm)
    start = time.perf_counter()
    report = store.sync(records.lay_out(made, work / "records"), SyncConfig(tokens=tokens, unit="folder"))
    sync_seconds = round(time.perf_counter() - start, 1)
    names = [p.name for p in made]
    clinicians = [names[: (len(names) + 1) // 2], names[(len(names) + 1) // 2:]]
    rows, record_tokens = [], {}
    for p in made:
        record = store.corpus_path(p.name).read_text("utf-8")  # what sync made the cartridge from
        ids = lm.encode(record)
        record_tokens[p.name] = len(ids)
        # the record in context, as the KV of all its tokens: exactly the same scores (the exactness property), for
        # one prefill per patient instead of several per question
        whole = Context(cartridge=Cartridge.from_prefix(lm, ids, len(ids)))
        chunks = [c for c in record.split("\n\n") if c.strip()]
        retriever = bm25s.BM25()
        retriever.index(bm25s.tokenize(chunks, stopwords="en", show_progress=False), show_progress=False)
        own = next(c for c in clinicians if p.name in c)
        for q in p.questions[:questions]:
            question = Question(q["question"], q["answer"], tuple(q["options"]), q["gold"])
            passages = rag_context(lm, retriever, chunks, q["question"], tokens)
            contexts = {"record": whole, "none": Context(), "cartridge": Context(cartridge=store.get(p.name)),
                        "rag": Context(cartridge=Cartridge.from_prefix(lm, passages, len(passages)))}
            scores = score_questions(lm, [question], contexts, icl="record", desc=p.name)
            routed = store.route(q["question"], among=own)[0].name
            row = {"patient": p.name, "kind": q["kind"], "routed_right": routed == p.name,
                   **{f"{m}_correct": bool(s["correct"][0]) for m, s in scores.items()},
                   **{f"{m}_likeliest": likeliest(lm, q, ctx) == q["right"] for m, ctx in contexts.items()},
                   **{f"{m}_nll": round(s["nll"][0], 4) for m, s in scores.items()}}
            print(row, flush=True)
            rows.append(row)
    methods = ("none", "record", "cartridge", "rag")
    per_token = kv_bytes_per_token(lm)
    kinds = sorted({r["kind"] for r in rows})
    gap = sum(r["none_nll"] - r["record_nll"] for r in rows)
    return {
        "patients": len(made), "tokens": tokens, "sync": str(report), "sync_seconds": sync_seconds,
        "record_tokens": {"mean": round(mean(list(record_tokens.values()))), "min": min(record_tokens.values()),
                          "max": max(record_tokens.values())},
        "questions": len(rows),
        "accuracy": {m: round(mean([r[f"{m}_correct"] for r in rows]), 3) for m in methods},
        "accuracy_by_kind": {k: {m: round(mean([r[f"{m}_correct"] for r in rows if r["kind"] == k]), 3)
                                 for m in methods} for k in kinds},
        "accuracy_likeliest": {m: round(mean([r[f"{m}_likeliest"] for r in rows]), 3) for m in methods},
        "accuracy_likeliest_by_kind": {k: {m: round(mean([r[f"{m}_likeliest"] for r in rows if r["kind"] == k]), 3)
                                           for m in methods} for k in kinds},
        "closure": {m: round(sum(r["none_nll"] - r[f"{m}_nll"] for r in rows) / gap, 3) if gap else None
                    for m in ("cartridge", "rag")},
        "routed_right": round(mean([r["routed_right"] for r in rows]), 3),
        "kv_bytes_per_token": per_token,
        "kv_mib_per_request": {"cartridge": round(tokens * per_token / 2**20, 2),
                               "rag": round(tokens * per_token / 2**20, 2),
                               "record": round(mean(list(record_tokens.values())) * per_token / 2**20, 2)},
        "rows": rows,
    }


def likeliest(lm, q: dict, context: Context) -> str:
    """The option whose text, as the answer to the question asked without options, the model finds likeliest (mean
    log-probability per token): how a model too small to answer with a letter is scored on multiple choice."""
    options = [line[3:] for line in q["question"].splitlines()[1:]]
    scores = [-nll(answer_logprobs(lm, q["ask"], o, **context.kwargs()), lm, o) for o in options]
    return options[max(range(len(options)), key=scores.__getitem__)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patients", type=int, default=6)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a named model, or 'default' (the 135M)")
    parser.add_argument("--tokens", type=int, default=256, help="cartridge tokens per patient, and RAG's budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--questions", type=int, default=None, help="at most this many per patient (default all)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/medical-bench"), help="a scratch folder")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lm = load_model(None if args.model == "default" else args.model)
    start = time.perf_counter()
    result = run(lm, args.work / f"{args.model}-{args.seed}-{args.patients}", args.patients, args.seed, args.tokens,
                 args.questions)
    result.update({"model": lm.name, "seconds": round(time.perf_counter() - start, 1), "commit": provenance.commit(),
                   "dirty": provenance.dirty(), "machine": provenance.machine()})
    provenance.save(result, args.out or Path("benchmarks/results") / f"medical-{args.model}-{args.tokens}.json")
    print({k: v for k, v in result.items() if k != "rows"})


if __name__ == "__main__":
    main()
