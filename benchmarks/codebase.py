"""The codebase assistant, measured: questions whose answers a package's authors wrote, routed across one cartridge
per module, against the best context that fits and BM25 RAG over the code at the same prompt budget.

    python -m benchmarks.codebase --package httpx --model qwen2.5-coder-0.5b --questions 24

Questions come from the package's own docstrings: "What does the Client.send method in httpx do?" has the first
paragraph of `Client.send`'s docstring as its gold answer. The source keeps its docstrings (the assistant reads the
code as it is), so each method is scored on recalling, from its context, what the authors wrote. Per question, the
gold answer's NLL (teacher-forced) is measured with:

- ``none``: the question alone;
- ``best``: the question's own module in context, whole if it fits, else the window of it that fits around the
  asked definition (an oracle no user could pick: the ceiling, closure 1 by definition);
- ``routed``: the cartridge BM25 routing picks among every module's (k = 1), as the app answers;
- ``own``: the question's own module's cartridge (what perfect routing gives);
- ``rag``: BM25 over 30-line chunks of every module, best first, up to the same number of tokens as a cartridge.

Closure is pooled: (NLL none - NLL method) / (NLL none - NLL best), over the questions. Then, for a few questions,
the time to answer (greedy, `--answer-tokens`) and to the first token, per method, and the KV memory each request
holds. The store is synced once per package, model and size, and reused (a re-run only syncs what changed).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import random
import re
import time
from pathlib import Path

import attrs

from cartridges_sdk import CartridgeStore, SyncConfig, load_model
from cartridges_sdk.making.evaluation import answer_logprobs, nll

from . import provenance
from .measure import kv_bytes_per_token

ROOM = 512  # positions kept beside a context for the question and its answer
CHUNK_LINES = 30  # lines of code per RAG chunk


@attrs.frozen
class CodeQuestion:
    """A question about one definition, and its authors' answer."""

    question: str
    answer: str
    module: str  # the store's name for the module's file (``_transports.default.py``)
    line: int  # where the definition starts (1-based)
    qualname: str


def docstring_questions(source: Path, package: str, count: int, seed: int, per_module: int = 2,
                        words: tuple[int, int] = (8, 80)) -> list[CodeQuestion]:
    """Up to `count` questions about public functions, classes and methods whose docstring opens with a paragraph of
    `words` words; at most `per_module` from each module, drawn with `seed`."""
    by_module: dict[str, list[CodeQuestion]] = {}
    for path in sorted(source.rglob("*.py")):
        module = path.relative_to(source).as_posix().replace("/", ".")
        try:
            tree = ast.parse(path.read_text("utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node, owner in _definitions(tree):
            doc = ast.get_docstring(node)
            if not doc:
                continue
            first = re.sub(r"\s+", " ", doc.strip().split("\n\n")[0]).strip()
            if not words[0] <= len(first.split()) <= words[1]:
                continue
            name = f"{owner}.{node.name}" if owner else node.name
            if isinstance(node, ast.ClassDef):
                question = f"What is the {name} class in {package} for?"
            elif owner:
                question = f"What does the {name} method in {package} do?"
            else:
                question = f"What does the {package} function {name} do?"
            by_module.setdefault(module, []).append(CodeQuestion(question, first, module, node.lineno, name))
    rng = random.Random(seed)
    picked = [q for qs in by_module.values() for q in rng.sample(qs, min(per_module, len(qs)))]
    rng.shuffle(picked)
    return sorted(picked[:count], key=lambda q: (q.module, q.line))


def _definitions(tree: ast.Module):
    """Public top-level functions and classes, and the public methods of top-level classes, with their class."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            yield node, None
            if isinstance(node, ast.ClassDef):
                for inner in node.body:
                    if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) and not inner.name.startswith("_"):
                        yield inner, node.name


def best_window(lm, text: str, line: int, limit: int) -> list[int]:
    """The module's tokens if they fit in `limit`, else the `limit` tokens around the definition at `line`."""
    ids = lm.encode(text)
    if len(ids) <= limit:
        return ids
    at = len(lm.encode("".join(text.splitlines(keepends=True)[: line - 1])))
    start = min(max(0, at - limit // 4), len(ids) - limit)  # the definition a quarter in: its body follows
    return ids[start: start + limit]


def rag_context(lm, retriever, chunks: list[str], question: str, budget: int) -> list[int]:
    """BM25's best chunks for `question`, best first, until `budget` tokens (the last one cut to fit)."""
    import bm25s

    found, _ = retriever.retrieve(bm25s.tokenize([question], stopwords="en", show_progress=False),
                                  k=min(len(chunks), 32), show_progress=False)
    ids: list[int] = []
    for i in found[0].tolist():
        ids += lm.encode(chunks[i] + "\n\n")[: budget - len(ids)]
        if len(ids) >= budget:
            break
    return ids


def run(lm, source: Path, package: str, store_dir: Path, tokens: int, count: int, seed: int, timed: int,
        answer_tokens: int, earlier: dict | None = None) -> dict:
    """With `earlier` (a result of the same model, package, size and questions), its scores that do not depend on
    routing are reused and only routing is run again: how a change to the router is measured in minutes."""
    import bm25s

    store = CartridgeStore(store_dir, lm)
    start = time.perf_counter()
    report = store.sync(source, SyncConfig(tokens=tokens, include=("*.py",)))
    sync_seconds = round(time.perf_counter() - start, 1)
    modules = {n: store.corpus_path(n).read_text("utf-8") for n in store.names()}
    module_tokens = {n: len(lm.encode(t)) for n, t in modules.items()}
    chunks = [f"# {n}\n" + "".join(lines[i: i + CHUNK_LINES]) for n, t in modules.items()
              for lines in [t.splitlines(keepends=True)] for i in range(0, len(lines), CHUNK_LINES)]
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(chunks, stopwords="en", show_progress=False), show_progress=False)
    limit = (lm.max_context or 10**9) - ROOM
    questions = docstring_questions(source, package, count, seed)
    reused = {(r["module"], r["qualname"]): r for r in (earlier or {}).get("rows", [])}
    if earlier and (earlier["model"] != lm.name or earlier["tokens"] != tokens or
                    set(reused) != {(q.module, q.qualname) for q in questions}):
        raise SystemExit("the earlier result is of another model, size or question set; run without --reuse-scores")
    rows = []
    for q in questions:
        def at(**context) -> float:
            return nll(answer_logprobs(lm, q.question, q.answer, **context), lm, q.answer)

        routed = store.route(q.question, k=1)[0].name
        if earlier:
            row = {k: v for k, v in reused[(q.module, q.qualname)].items() if k not in ("routed", "routed_to")}
        else:
            best = best_window(lm, modules[q.module], q.line, limit)
            row = {"module": q.module, "qualname": q.qualname, "none": at(), "best": at(document=best),
                   "best_tokens": len(best), "best_whole": len(best) == module_tokens[q.module],
                   "own": at(cartridges=[store.get(q.module)]),
                   "rag": at(document=rag_context(lm, retriever, chunks, q.question, tokens))}
        row.update(routed_to=routed, routed_right=routed == q.module)
        row["routed"] = row["own"] if routed == q.module else at(cartridges=[store.get(routed)])
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        rows.append(row)
    kinds = ("routed", "own", "rag")
    closure = {k: _closure(rows, k) for k in kinds}
    wins = {k: sum(r[k] < r["rag"] for r in rows) for k in ("routed", "own")}
    per_token = kv_bytes_per_token(lm)
    return {"package": package, "modules": len(modules), "source_tokens": sum(module_tokens.values()),
            "largest_module_tokens": max(module_tokens.values()), "tokens": tokens, "sync": str(report),
            "sync_seconds": sync_seconds, "questions": len(rows), "closure": closure,
            "closure_whole_module_fits": {k: _closure([r for r in rows if r["best_whole"]], k) for k in kinds},
            "routed_right": round(sum(r["routed_right"] for r in rows) / len(rows), 3),
            "beats_rag": wins, "kv_bytes_per_token": per_token,
            "timing": earlier["timing"] if earlier else timing(lm, store, retriever, chunks, modules,
                                                              questions[:timed], tokens, limit, answer_tokens),
            "rows": rows}


def timing(lm, store: CartridgeStore, retriever, chunks, modules, questions, tokens: int, limit: int,
           answer_tokens: int) -> dict:
    """Seconds to the first token and to a whole greedy answer, and KV tokens a request holds, per method (mean)."""
    out: dict[str, dict[str, list[float]]] = {m: {"first": [], "answer": [], "kv_tokens": []}
                                              for m in ("routed", "rag", "best")}
    for q in questions:
        for method in out:
            for key, n in (("first", 1), ("answer", answer_tokens)):
                start = time.perf_counter()
                if method == "routed":  # routing is part of the cost
                    cart = store.get(store.route(q.question, k=1)[0].name)
                    lm.ask(q.question, cartridges=[cart], max_new_tokens=n)
                    context = cart.num_tokens
                else:
                    ids = (rag_context(lm, retriever, chunks, q.question, tokens) if method == "rag"
                           else best_window(lm, modules[q.module], q.line, limit))
                    lm.ask(q.question, document=lm.tokenizer.decode(ids), max_new_tokens=n)
                    context = len(ids)
                out[method][key].append(time.perf_counter() - start)
            out[method]["kv_tokens"].append(context + len(lm.encode(q.question)) + answer_tokens)
    return {m: {k: round(sum(v) / len(v), 2) for k, v in d.items()} for m, d in out.items() if questions}


def _closure(rows: list[dict], key: str) -> float | None:
    gap = sum(r["none"] - r["best"] for r in rows)
    return round(sum(r["none"] - r[key] for r in rows) / gap, 3) if rows and gap else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="httpx", help="an installed package whose source is the corpus")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a named model, or 'default' (the 135M)")
    parser.add_argument("--tokens", type=int, default=512, help="cartridge tokens per module, and RAG's budget")
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--timed", type=int, default=4, help="questions whose answers are timed")
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store", type=Path, default=Path("/tmp/codebase-bench"), help="a scratch folder")
    parser.add_argument("--reuse-scores", type=Path, help="an earlier result file: reuse its scores and timings, "
                        "and run routing (and the routed scores) again")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    spec = importlib.util.find_spec(args.package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{args.package!r} is not an installed package")
    source = Path(next(iter(spec.submodule_search_locations)))
    lm = load_model(None if args.model == "default" else args.model)
    start = time.perf_counter()
    earlier = json.loads(args.reuse_scores.read_text()) if args.reuse_scores else None
    result = run(lm, source, args.package, args.store / f"{args.package}-{args.model}-{args.tokens}", args.tokens,
                 args.questions, args.seed, args.timed, args.answer_tokens, earlier)
    if earlier:
        result["scores_from"] = {"file": str(args.reuse_scores), "commit": earlier.get("commit")}
    result.update({"model": lm.name, "seconds": round(time.perf_counter() - start, 1), "commit": provenance.commit(),
                   "dirty": provenance.dirty(), "machine": provenance.machine()})
    provenance.save(result, args.out or Path("benchmarks/results") / f"codebase-{args.package}-{args.model}.json")


if __name__ == "__main__":
    main()
