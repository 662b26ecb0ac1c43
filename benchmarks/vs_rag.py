"""Cartridges against RAG on the same questions: real long-document QA sets, the same reader, the same prompt budget.

    python -m benchmarks.vs_rag --model qwen2.5-coder-0.5b --docs 3 --questions 4 --tokens 256

Per data set (QASPER, QuALITY, TPO from ../shared/evaldata), `--docs` documents make one corpus: one store of
cartridges (one per document, compacted by the store's sync; `--selfstudy N` also trains each by self-study on N
conversations, `--recipe reader` by a named recipe) and one RAG index (passages of every document:
`benchmarks/rag.py`). Each question is answered with:

- ``none``: the question alone;            ``icl``: its own document in context (the ceiling);
- ``bm25`` / ``dense`` / ``fused``: RAG's best passages, up to `--tokens` prompt tokens (``fused``: both rankings
  added up, `serve/passages.py`);
- ``cartridge`` / ``selfstudy``: the cartridge the store routes the question to (`store.route`, top 1), `--tokens`
  tokens of KV each: the same budget as RAG's prompt, held as KV instead of prompt text;
- ``hybrid:N``: an N-token cartridge, then passages filling the budget; ``hybrid-selfstudy:N/M``: M-token
  cartridges cut to their first N (`store.ask(..., trim=True)`); ``default``: `store.ask(q, budget=TOKENS)`;
  ``opening:N`` (with `--scope document`): the document's first N tokens (default: a quarter of the budget) as
  exact KV, then its passages;
- ``+draft`` after a method with passages (``hybrid+draft:64``, ``default+draft``): its passages ranked against the
  question and a first answer (`store.ask(..., draft=48)`), written by its own plan or, with `--draft-from METHOD`,
  by that stored method's cartridges alone (``--draft-from selfstudy:192``); ``+dense`` or ``+fused`` after one:
  its passages ranked by that retrieval (`store.ask(..., retrieval=...)`), not BM25 (``default+fused``);
  ``+attention`` after a cut hybrid one (``hybrid-selfstudy+draft+attention:160/192``): the cut keeps the tokens the
  question (and its first answer) reads most, not the first (`store.ask(..., trim="attention")`);

Quality: gold-answer closure (how much of the none-to-ICL drop in the gold answer's NLL a method recovers, with a
95% interval from resampling the questions: `closure_interval`) and, on
multiple-choice sets, two accuracies: ``letter``, the share where the letter the reader ranks first (options listed,
"answer with the letter") is the right one, which needs a reader that can pick (the 1.5B); and ``likeliest``, the
share where the right option's text is the likeliest answer to the question asked without options, for a reader that
picks letters at chance (the 0.5B; `--mc letter` skips it, four passes a context per question). Cost: prompt
tokens, KV bytes per user, time to first token and decode tokens/s at 1 and 32 concurrent users (one document, the
first of the first set), and seconds to build (an edited document re-makes its own cartridge only: its share of
the build). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cartridges_sdk import Cartridge, CartridgeStore, SyncConfig, load_model
from cartridges_sdk.cli.common import compaction_config, parse_settings
from cartridges_sdk.making.settings import DEFAULT_CONVERSATIONS, RECIPES, CompactionConfig
from cartridges_sdk.making.evaluation import answer_logprobs, nll
from cartridges_sdk.errors import ConfigError
from cartridges_sdk.kv import prefix_cache
from cartridges_sdk.serve.passages import RETRIEVALS, PassageIndex, candidates, passage_ids, read_apart, sought

from . import provenance
from .data import EVALDATA, Corpus, load_corpora
from .measure import Context, decode_throughput, kv_bytes_per_token, mean, score_questions, synchronize
from .naming import recipe_flags, settings_tag
from .rag import Retriever, passages

DATASETS = {"qasper": "scientific_qa_dev.jsonl", "quality": "quality_dev.jsonl", "tpo": "tpo_dev.jsonl"}
RAGS = RETRIEVALS  # RAG alone, passages ranked as `serve/passages.py`'s retrieval of that name
METHODS = ("none", "icl", *RAGS, "cartridge", "selfstudy", "hybrid", "hybrid-selfstudy", "multi", "default", "opening")
LABELS = {"none": "no context", "icl": "whole document in context", "bm25": "RAG, BM25", "dense": "RAG, dense (MiniLM)",
          "fused": "RAG, BM25 and dense fused",
          "cartridge": "routed cartridge (compacted)", "selfstudy": "routed cartridge (self-studied)",
          "hybrid": "cartridge (compacted) + passages", "hybrid-selfstudy": "cartridge (self-studied) + passages",
          "multi": "routed cartridges (compacted), as many as fit",
          "default": "SDK default: store.ask(q, budget=TOKENS)",
          "opening": "its opening (exact KV) + passages"}
SCOPES = ("store", "document")  # what a question is asked of: the whole corpus, or its own document
# how a multiple-choice answer is read (see the module's docstring): the name, the result's key, the plot's title
MC_FIELDS = (("letter", "mc_letter", "the letter picked"), ("likeliest", "mc_accuracy", "the likeliest option text"))
MC_SCORES = tuple(name for name, _, _ in MC_FIELDS)
STORED = ("cartridge", "selfstudy", "hybrid", "hybrid-selfstudy", "multi")
# the document's first tokens as a cartridge (exact KV, no compaction) and passages of it filling the budget
SIZED = STORED + ("opening",)
RERANK = 8  # BM25's candidates a '+rerank' method ranks again with the question's likelihood (serve/rerank.py)
DRAFTED = ("hybrid", "hybrid-selfstudy", "default")  # the methods with passages a first answer can pick ('+draft')
RANKINGS = tuple(r for r in RETRIEVALS if r != "bm25")  # '+dense' or '+fused' after one of DRAFTED: its passages
# ranked so (else by BM25, the SDK's default)
DRAFT = 48  # the first answer's tokens, for a '+draft' method (`store.ask(..., draft=DRAFT)`)
_OPTION = re.compile(r"^\s*\(?([A-Z])[).]\s+(.*\S)\s*$", re.MULTILINE)


def base_of(method: str) -> tuple[str, set[str]]:
    """A method's kind without its size and what follows it after ``+`` (``rerank``, ``draft``, ``fused``...), and
    those."""
    base, *extras = method.partition(":")[0].split("+")
    return base, set(extras)


def plans_each_answer(method: str) -> bool:
    """Whether each answer of `method` plans its KV (`method_plan`): the default's variants and the hybrid ones."""
    kind = base_of(method)[0]
    return kind == "default" or kind.startswith("hybrid")


def method_spec(method: str, tokens: int) -> tuple[str, int]:
    """A method's kind and its cartridges' size: ``hybrid:128`` is 128-token cartridges with passages filling the
    rest of the budget; a stored method without a size uses the whole budget (a hybrid one, half of it; ``opening``,
    a quarter). A stored method's kind may end in ``+rerank``: routing's candidates ranked again
    (`store.plan(..., rerank=RERANK)`); one with passages (`DRAFTED`) in ``+draft``: its passages ranked against the
    question and a first answer (`store.ask(..., draft=DRAFT)`), and in ``+dense`` or ``+fused``: its passages ranked
    by that retrieval instead of BM25 (`store.ask(..., retrieval=...)`); a cut hybrid one (``:N/M``) in
    ``+attention``: the cut keeps what the question reads most (`store.ask(..., trim="attention")`)."""
    kind, _, size = method.partition(":")
    size, _, whole = size.partition("/")
    base, added = base_of(method)
    ranking = added & set(RANKINGS)
    if (base not in METHODS or not added <= {"rerank", "draft", "attention", *RANKINGS}
            or ("rerank" in added and base not in STORED) or ("attention" in added and not whole)
            or ((ranking or "draft" in added) and base not in DRAFTED) or len(ranking) > 1
            or (size and (base not in SIZED or not size.isdigit()))
            or (whole and (not base.startswith("hybrid") or not size or not whole.isdigit()
                           or int(whole) <= int(size)))):
        raise ConfigError(f"method {method!r}: use one of {list(METHODS)}, with '+rerank' after one of "
                          f"{list(STORED)}, '+draft' and one of {[f'+{r}' for r in RANKINGS]} after one of "
                          f"{list(DRAFTED)}, ':TOKENS' after one of {list(SIZED)}, or ':TOKENS/MADE' after a hybrid "
                          "one (MADE-token cartridges cut to TOKENS, MADE > TOKENS), with '+attention' only there.")
    shared = base.startswith("hybrid") or base == "opening"  # passages fill what the cartridge leaves
    default = tokens // 4 if base == "opening" else tokens // 2 if shared else tokens
    size_ = int(size) if size else default
    if size_ > tokens or (shared and size_ >= tokens):
        raise ConfigError(f"method {method!r}: its cartridges must be smaller than the budget of {tokens} tokens.")
    return kind, size_


def made_size(method: str, tokens: int) -> int:
    """The size a stored method's cartridges are made at: ``hybrid-selfstudy:160/192`` answers with 192-token
    cartridges cut to 160 (`store.plan(..., trim=True)`); without ``/``, the size they answer at."""
    whole = method.partition(":")[2].partition("/")[2]
    return int(whole) if whole else method_spec(method, tokens)[1]


def label(method: str, scope: str = "store") -> str:
    size = method.partition(":")[2]
    base, added = base_of(method)
    text = (LABELS[base] + (", reranked" if "rerank" in added else "")
            + (", passages picked with a first answer" if "draft" in added else "")
            + "".join(f", passages ranked {r}" for r in RANKINGS if r in added)
            + (", cut by the question's attention" if "attention" in added else "")
            + (f", {size.replace('/', '-token cut of a ')}-token cartridge" if size else ""))
    if scope == "document":  # nothing is routed: the question's own document answers, and RAG reads only it
        text = text.replace("routed cartridges", "its cartridge").replace("routed cartridge", "its own cartridge")
        text = text.replace("budget=TOKENS", "cartridges=[its own], budget=TOKENS")
        text += ", in the document" if base in RAGS else ""
    return text


def options(question: str) -> tuple[str, list[str]]:
    """The question's stem and its options' texts, in letter order."""
    found = _OPTION.findall(question)
    first = _OPTION.search(question)
    return question[: first.start()].strip() if first else question, [text for _, text in found]


def likeliest(lm, question: str, context: Context) -> int:
    """The option whose text the model finds likeliest (mean log-probability per token) as the answer to the stem
    asked without options: how a small reader is scored on multiple choice (it picks letters at chance)."""
    stem, texts = options(question)
    scores = [-nll(answer_logprobs(lm, stem, t, **context.kwargs()), lm, t) for t in texts]
    return max(range(len(texts)), key=scores.__getitem__)


def build_store(lm, texts: dict[str, str], folder: Path, tokens: int, selfstudy: dict | None,
                compaction: dict | None = None, train: Sequence[str] | None = None) -> tuple:
    """A store of one cartridge per text: compacted by sync to `tokens` (with `compaction`'s `CompactionConfig`
    settings when given), then trained by self-study with `selfstudy`'s settings (`Cartridge.from_corpus` keyword
    arguments) when given, from that compacted start: every text's cartridge, or those named in `train`. Made once,
    resumed when a run is interrupted; returns it and its build seconds (None when an earlier run made it)."""
    # no quality report: these questions score every cartridge here, and a report costs as much as a compaction
    config = SyncConfig(tokens=tokens, compaction=CompactionConfig(**(compaction or {})), report=False)
    store = CartridgeStore(folder, lm)
    start = time.perf_counter()
    report = store.sync(texts, config)
    built = bool(report.added or report.updated)
    if selfstudy is not None:
        chosen = texts if train is None else {n: texts[n] for n in train}
        built = store.self_study(chosen, config, selfstudy) or built
        untrained = [n for n, r in store.records().items() if n in chosen and r.get("method") != "self-study"]
        if untrained:  # sync keeps a compacted cartridge when training fails: it must not be scored as trained
            raise ConfigError(f"self-study did not finish for {untrained} (see the log above); run again to resume.")
    return store, (time.perf_counter() - start if built else None)


def store_of(lm, method: str, tokens: int, work: Path, selfstudy: dict,
             compaction: dict | None = None) -> tuple[tuple[str, int], Path] | None:
    """A stored method's kind of cartridge and size, and the folder of its store under `work` (other settings,
    other folders); None for a method that answers from no store."""
    kind = base_of(method)[0]
    if kind not in STORED and kind != "default":
        return None
    compacted = f"-{settings_tag(compaction)}" if compaction else ""
    if kind == "default":  # sync's default size: the same store as a compacted method of that size
        size = SyncConfig().for_model(lm).tokens
        return ("compact", size), work / f"compact-{size}{compacted}"
    trained = kind.endswith("selfstudy")
    size = made_size(method, tokens)
    folder = f"selfstudy-{size}-{settings_tag(selfstudy)}" if trained else f"compact-{size}"
    return ("selfstudy" if trained else "compact", size), work / f"{folder}{compacted}"


def build_stores(lm, corpora: Sequence[Corpus], tokens: int, work: Path, methods: Sequence[str],
                 selfstudy: dict, compaction: dict | None = None,
                 train: Sequence[str] | None = None) -> tuple[dict, dict]:
    """The store each stored method answers from (one per kind of cartridge and size, shared by the methods that
    use it), and each method's build seconds. Self-study trains the cartridges of `train` (None: all)."""
    texts = {c.name: c.text for c in corpora}
    stores, seconds, made = {}, {}, {}
    for method in methods:
        found = store_of(lm, method, tokens, work, selfstudy, compaction)
        if found is None:
            continue
        key, folder = found
        if key not in made:
            made[key] = build_store(lm, texts, folder, key[1], selfstudy if key[0] == "selfstudy" else None,
                                    compaction, train)
        stores[method], seconds[method] = made[key]
    return stores, seconds


def method_plan(store: CartridgeStore, method: str, question: str, tokens: int, document: str | None = None,
                draft_from: CartridgeStore | None = None) -> Any:
    """The plan a stored method answers `question` with (`stored_context`); a ConfigError where nothing is
    routed."""
    base, added = base_of(method)
    rerank = RERANK if "rerank" in added and document is None else 0
    draft = DRAFT if "draft" in added else 0
    named = {} if document is None else {"cartridges": [document]}
    own = {} if document is None else {"passages_from": "routed"}  # where passages are sought: refused elsewhere
    own.update({"retrieval": r for r in RANKINGS if r in added})
    if base == "default":
        return store.drafted_plan(question, draft, draft_from=draft_from if draft else None, budget=tokens,
                                  **named, **(own if sought(store.model, None, tokens) else {}))[0]
    if base.startswith("hybrid"):
        size = method_spec(method, tokens)[1]
        cut = made_size(method, tokens) > size and ("attention" if "attention" in added else True)
        return store.drafted_plan(question, draft, draft_from=draft_from if draft else None, budget=tokens,
                                  passages=tokens - size, rerank=rerank, trim=cut,
                                  **named, **own)[0]
    if base == "multi":
        return store.plan(question, budget=tokens, passages=0, rerank=rerank, **named)  # cartridges alone
    return store.plan(question, k=1, rerank=rerank, **named)


def stored_context(store: CartridgeStore, method: str, question: str, tokens: int,
                   document: str | None = None, draft_from: CartridgeStore | None = None) -> tuple[Context, str | None]:
    """What a stored method answers `question` with, and the cartridge it was routed to (None when the question
    shares no word with any document: answered with nothing, as a router would). Given the question's `document`
    (`--scope document`), its cartridge answers, as ``store.ask(question, cartridges=[document])`` would, and a
    hybrid's passages come from that document alone (``passages_from="routed"``). A ``+draft`` method's first
    answer is its own plan's, or that of `draft_from`'s cartridges (`store.drafted_plan`)."""
    try:
        plan = method_plan(store, method, question, tokens, document, draft_from)
    except ConfigError:
        if document is not None:  # nothing is routed, so a refusal is a bad setting, never "answered with nothing"
            raise
        return Context(), None
    parts = plan.parts(store)  # the cartridges, then the passages' KV read apart (when there are both)
    cartridge = parts[0] if len(parts) == 1 else Cartridge.compose(parts) if parts else None
    return Context(document=plan.prefix_ids or None, cartridge=cartridge), plan.cartridges[0] if parts else None


def check_only(only: Sequence[int] | None, docs: int) -> None:
    if only is not None and (not only or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < docs
                                             for d in only)):
        raise ConfigError(f"only={list(only)}: give document numbers from 0 to {docs - 1} (the first docs={docs}).")


def check_mc(mc: Sequence[str]) -> None:
    if not mc or set(mc) - set(MC_SCORES):
        raise ConfigError(f"mc={list(mc)}: use one or more of {list(MC_SCORES)}.")


def run_dataset(lm, path: Path, docs: int, questions: int, tokens: int, work: Path, methods: Sequence[str],
                selfstudy: dict | None = None, scope: str = "store", compaction: dict | None = None,
                mc: Sequence[str] = MC_SCORES, only: Sequence[int] | None = None,
                draft_from: str | None = None) -> dict:
    """Every method on the set's first `docs` documents. `scope` "store": each question is asked of the whole
    corpus (cartridges routed, RAG over every document's passages); "document": of its own document, as the data
    set poses it and as ICL answers it (its document's cartridge, RAG over its passages only). `compaction`:
    `CompactionConfig` settings for every stored method's compacted cartridges (and self-study's start). `mc`: the
    multiple-choice accuracies scored (`MC_SCORES`; ``letter`` costs nothing beyond the closure's passes). `only`:
    the documents (numbers below `docs`) whose questions are scored and whose cartridges are self-studied; the stores
    and RAG's index still hold all `docs`, so each row is the one a run over all of them gives. `draft_from`: a
    stored method (``selfstudy:192``) whose cartridges write the ``+draft`` methods' first answers, scored too."""
    if scope not in SCOPES:
        raise ConfigError(f"scope={scope!r}: use one of {list(SCOPES)}.")
    check_mc(mc)
    check_only(only, docs)
    openings = {m: method_spec(m, tokens)[1] for m in methods if m.partition(":")[0] == "opening"}
    if openings and scope != "document":
        raise ConfigError(f"{list(openings)} read the opening of the question's own document; use scope='document' "
                          "(--scope document).")
    if draft_from is not None:
        method_spec(draft_from, tokens)
        drafter, extras = base_of(draft_from)
        if extras or drafter not in STORED:
            raise ConfigError(f"draft_from={draft_from!r}: use a stored method, one of {list(STORED)} (':TOKENS').")
        if not any("draft" in base_of(m)[1] for m in methods):
            raise ConfigError(f"draft_from={draft_from!r} writes the first answers of '+draft' methods, and none is "
                              "asked for; add one (hybrid+draft:64), or drop it.")
        methods = list(methods) + ([draft_from] if draft_from not in methods else [])
    drafted = [m for m in methods if base_of(m) == ("default", {"draft"})]
    if drafted and not sought(lm, None, tokens):
        raise ConfigError(f"{drafted[0]}: {lm.name}'s default budget is all cartridges, so there are no passages for a "
                          "first answer to pick; use hybrid+draft:N.")
    corpora = load_corpora(path, list(range(docs)))
    scored = {d: c for d, c in enumerate(corpora) if only is None or d in only}
    stores, build = build_stores(lm, corpora, tokens, work, methods, selfstudy or {}, compaction,
                                 None if only is None else [c.name for c in scored.values()])
    chunks = passages([c.text for c in corpora])
    retrievers: dict[str, Retriever] = {}
    for kind in [k for k in RAGS if k in methods]:  # fused after BM25 and dense (RETRIEVALS' order), reusing them
        retrievers[kind] = Retriever(kind, [p for _, p in chunks], work, built=retrievers)
    build.update({kind: r.seconds for kind, r in retrievers.items()})
    rows, lengths = [], []
    for d, c in scored.items():
        ids = lm.encode(c.text)
        lengths.append(len(ids))
        own = [i for i, (doc, _) in enumerate(chunks) if doc == d] if scope == "document" else None
        document = c.name if scope == "document" else None
        if lm.max_context and len(ids) + 512 > lm.max_context:
            raise ConfigError(f"{c.name} has {len(ids)} tokens; with a question it does not fit {lm.name}'s "
                              f"{lm.max_context}-token context, so ICL cannot be the reference. Pick a longer-context "
                              "model (--model qwen2.5-coder-0.5b) or another set.")
        # the document in context as the KV of all its tokens: the same scores (the exactness property), one prefill
        whole = Context(cartridge=Cartridge.from_prefix(lm, ids, len(ids)))
        index = PassageIndex.of({c.name: c.text}, "bm25") if openings else None  # its passages, as the store's
        opened = {m: Cartridge.from_prefix(lm, ids, min(p, len(ids))) for m, p in openings.items()}
        for q in c.questions[:questions]:
            contexts = {"none": Context(), "icl": whole}
            for kind, r in retrievers.items():
                contexts[kind] = Context(document=tuple(r.context(lm, q.question, tokens, among=own)))
            for method, cartridge in opened.items():  # as `store.plan` fills a budget after a cartridge
                room = tokens - cartridge.num_tokens
                found = index.ranked(q.question, candidates(room))
                apart = read_apart(lm, passage_ids(lm, found, room, after_cartridge=False)[0], cartridge.num_tokens)
                contexts[method] = Context(cartridge=Cartridge.compose([cartridge, apart]))
            routed = {}
            for method, store in stores.items():
                contexts[method], routed[method] = stored_context(store, method, q.question, tokens, document,
                                                                  stores.get(draft_from))
            scores = score_questions(lm, [q], contexts, icl="icl", desc=c.name)
            row = {"doc": c.name, "question": q.question[:120], "routed": routed,
                   "routed_right": {k: v == c.name for k, v in routed.items()},
                   "nll": {m: round(s["nll"][0], 4) for m, s in scores.items()},
                   "kl": {m: round(s["kl"][0], 4) for m, s in scores.items()},
                   "context_tokens": {m: len(ctx.document or ()) + (ctx.cartridge.num_tokens if ctx.cartridge else 0)
                                      for m, ctx in contexts.items() if m != "icl"}}
            if q.multiple_choice:
                row["letter_right"] = {m: bool(s["correct"][0]) for m, s in scores.items()}
                if "likeliest" in mc:
                    gold = q.options.index(q.gold)
                    row["likeliest_right"] = {m: likeliest(lm, q.question, ctx) == gold for m, ctx in contexts.items()}
            rows.append(row)
            print(row, flush=True)
    used = list(contexts)
    cloze = [r for r in rows if "likeliest_right" in r]
    letter = [r for r in rows if "letter_right" in r]
    return {
        "data": path.name, "scope": scope, "docs": docs, "only": None if only is None else sorted(only),
        "questions": len(rows), "methods": used,
        "doc_tokens": round(mean(lengths)),
        "nll": {m: round(mean([r["nll"][m] for r in rows]), 4) for m in used},
        "closure": {m: closure(rows, m) for m in used},
        "closure_interval": {m: closure_interval(rows, m) for m in used},
        "kl": {m: round(mean([r["kl"][m] for r in rows]), 4) for m in used},
        "mc_accuracy": {m: round(mean([r["likeliest_right"][m] for r in cloze]), 3) for m in used} if cloze else None,
        "mc_letter": {m: round(mean([r["letter_right"][m] for r in letter]), 3) for m in used} if letter else None,
        "mc_questions": len(letter),
        "routed_right": {k: round(mean([r["routed_right"][k] for r in rows]), 3) for k in stores},
        "build_seconds": {k: round(v, 3) if v is not None else None for k, v in build.items()},
        "rows": rows,
    }


def closure(rows: Sequence[dict], method: str) -> float | None:
    """How much of the drop in the gold answer's NLL from no context (``none``) to the document in context
    (``icl``) `method` recovers, over `rows` (each with its ``nll`` per method); None where there is no drop."""
    gap = mean([r["nll"]["none"] - r["nll"]["icl"] for r in rows])
    return round(mean([r["nll"]["none"] - r["nll"][method] for r in rows]) / gap, 3) if gap > 0 else None


INTERVAL_RESAMPLES = 2000  # resamples of the questions behind each closure's interval


def closure_interval(rows: Sequence[dict], method: str, resamples: int = INTERVAL_RESAMPLES,
                     seed: int = 0) -> list[float] | None:
    """A 95% interval for `method`'s `closure` over `rows`: the 2.5th and 97.5th percentiles of the closures of
    `resamples` draws of as many questions, with replacement (bootstrap percentile; None where the closure is).
    Twelve questions give a wide one, and a check on few documents reads its closure against it. A draw whose
    questions have no drop in all has no closure and is set aside, which scipy's `bootstrap` cannot do."""
    if closure(rows, method) is None:
        return None
    gain = np.array([r["nll"]["none"] - r["nll"][method] for r in rows])
    gap = np.array([r["nll"]["none"] - r["nll"]["icl"] for r in rows])
    drawn = np.random.default_rng(seed).integers(0, len(rows), (resamples, len(rows)))
    gaps = gap[drawn].sum(1)
    if not (gaps > 0).any():  # a drop carried by few questions that no draw picked enough of
        return None
    low, high = np.percentile(gain[drawn].sum(1)[gaps > 0] / gaps[gaps > 0], [2.5, 97.5])
    return [round(float(low), 3), round(float(high), 3)]


@torch.inference_mode()
def first_token_seconds(lm, prompts: Sequence[Sequence[int]], cartridges: Sequence[Cartridge],
                        plan: Callable[[], Sequence[Cartridge]] | None = None) -> float:
    """Seconds until every one of `prompts` (one per user, arriving together) has its first token: prefills of up
    to 4,096 tokens at a time (a long document's attention would not fit 32 rows at once), after `cartridges`' KV.
    With `plan`, each user's request first plans its own KV (routing, ranking, passages read apart: timed too, one
    request after another, as the server resolves them) and the prefills read what it gave."""
    n = len(prompts[0])
    rows = max(1, min(len(prompts), 4096 // n))
    dev = lm.device
    synchronize(dev)
    start = time.perf_counter()
    if plan is not None:
        for _ in prompts:
            cartridges = plan()
    for i in range(0, len(prompts), rows):
        batch = torch.tensor([list(p) for p in prompts[i: i + rows]], device=dev)
        cache, p = prefix_cache(lm, list(cartridges), len(batch),
                                capacity=sum(c.num_tokens for c in cartridges) + n + 1)
        out = lm.model(input_ids=batch, position_ids=torch.arange(p, p + n, device=dev)[None].expand(len(batch), -1),
                       past_key_values=cache, use_cache=True)
        out.logits[:, -1].argmax(-1).tolist()
    synchronize(dev)
    return time.perf_counter() - start


def speed(lm, corpus: Corpus, tokens: int, retriever: Retriever | None, stores: Mapping[str, CartridgeStore],
          users: Sequence[int], decode: int, icl_users: Sequence[int] = (1,),
          draft_from: CartridgeStore | None = None) -> list[dict]:
    """Per method and number of concurrent users: prompt tokens, KV bytes per user, time to first token, decode rate.
    ICL is timed at `icl_users` only: on a CPU its prefill is compute-bound, so 32 users take 32 times one.
    `stores` holds the stored methods' stores, of ``cartridge`` (the routed cartridge's `tokens` of KV), and of
    ``default`` (``+draft``, ``+fused``...) and any ``hybrid`` method, planned as the run answers them (`method_plan`,
    routed; the default's as `store.plan(question, budget=tokens)`: for a reader its cartridge, then passages each
    request reads apart, which count among its prompt tokens and its first-token time). A ``+draft`` method writes
    a first answer of `DRAFT` tokens before the plan it gives (by `draft_from`'s cartridges when given, as the
    quality rows do), whose decode counts in the first-token time; it is timed for one user only, as each request
    drafts on its own."""
    q = corpus.questions[0].question
    turn = [{"role": "user", "content": q}]
    doc = lm.encode(corpus.text)
    rag = retriever.context(lm, q, tokens) if retriever else doc[:tokens]
    after = lm.prompt_ids(turn, after_cartridge=True)
    # per method: its prompt, the KV before it, how each request plans that KV (None: fixed), and the passage
    # tokens it reads apart (prompt tokens too)
    setups = {"none": (lm.prompt_ids(turn), [], None, 0), "icl": (lm.prompt_ids(turn, prefix_ids=doc), [], None, 0),
              "rag": (lm.prompt_ids(turn, prefix_ids=rag), [], None, 0)}
    if "cartridge" in stores:
        routed = stores["cartridge"]
        setups["cartridge"] = (after, [routed.get(routed.route(q)[0].name)], None, 0)

    def planned(store: CartridgeStore, planning: Callable[[], Any]) -> tuple:
        """A method whose every request plans its KV (`planning`): planned once here for its prompt and sizes."""
        plan = planning()
        parts = plan.parts(store)
        return (lm.prompt_ids(turn, prefix_ids=plan.prefix_ids, after_cartridge=bool(parts)), parts,
                lambda: planning().parts(store), plan.passages_kv.num_tokens if plan.passages_kv is not None else 0)

    for method, store in stores.items():
        if plans_each_answer(method):
            setups[method] = planned(store, lambda s=store, m=method: method_plan(s, m, q, tokens,
                                                                               draft_from=draft_from))
    per_token = kv_bytes_per_token(lm)
    out = []
    for method, (prompt, parts, plan, apart) in setups.items():
        held = len(prompt) + sum(c.num_tokens for c in parts)  # KV a user holds once its prompt is read
        # decoding reads the same KV whatever it holds: the context as a prefix, the chat turn after it
        ahead = prompt[: len(prompt) - len(after)] if method != "none" else prompt[:2]  # "none": 2 tokens, ~nothing
        context = (parts[0] if len(parts) == 1 else Cartridge.compose(parts)) if parts \
            else Cartridge.from_prefix(lm, ahead, len(ahead))
        alone = method == "icl" or "draft" in base_of(method)[1]  # timed at icl_users, or one user
        for n in users if not alone else [u for u in users if u in (icl_users if method == "icl" else (1,))]:
            out.append({"method": method, "users": n, "prompt_tokens": len(prompt) + apart,
                        "kv_mib_per_user": round((held + decode) * per_token / 2**20, 2),
                        "first_token_s": round(first_token_seconds(lm, [prompt] * n, parts, plan), 3),
                        "decode_tokens_per_s": round(decode_throughput(lm, context, n, after, decode), 1)})
            print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a named model, or 'default' (the 135M)")
    parser.add_argument("--sets", default="qasper,quality,tpo", help=f"comma-separated, of {sorted(DATASETS)}")
    parser.add_argument("--data-dir", type=Path, default=EVALDATA)
    parser.add_argument("--docs", type=int, default=3, help="documents per set: one corpus, one store, one RAG index")
    parser.add_argument("--only", default=None, help="comma-separated document numbers (0-based) of the first --docs "
                        "whose questions are scored and cartridges self-studied; the stores and RAG index still hold "
                        "all --docs, so each row is a full run's (e.g. --docs 10 --only 5,6,7,8,9)")
    parser.add_argument("--questions", type=int, default=4, help="at most this many per document")
    parser.add_argument("--tokens", type=int, default=256, help="cartridge tokens, and RAG's prompt budget")
    parser.add_argument("--methods", default="none,icl,bm25,dense,fused,default",
                        help=f"of {','.join(METHODS)} (by default the SDK's default path against each RAG); stored "
                        "ones and opening (--scope document only) take a cartridge size, as hybrid:128")
    parser.add_argument("--draft-from", default=None, metavar="METHOD",
                        help="a stored method (selfstudy:192) whose cartridges write the '+draft' methods' first "
                        "answers (default: each method's own plan); it is scored too")
    parser.add_argument("--selfstudy", type=int, default=None,
                        help=f"self-study conversations, for the self-studied methods (default: the recipe's, else "
                        f"{DEFAULT_CONVERSATIONS})")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                        help="a named recipe's settings for the self-studied methods and its start for every stored "
                        "one (docs/self-study.md, \"Recipes\"), --selfstudy, --set and --compaction over them")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="any other from_corpus setting for the self-studied methods (repeatable)")
    parser.add_argument("--compaction", action="append", metavar="KEY=VALUE",
                        help="a CompactionConfig setting for the stores' compacted cartridges and self-study's start "
                        "(repeatable), e.g. chunk_questions=8")
    parser.add_argument("--scope", default="store", choices=SCOPES,
                        help="ask each question of the whole corpus (routed) or of its own document, as ICL does")
    parser.add_argument("--mc", default=",".join(MC_SCORES),
                        help=f"multiple-choice accuracies to score, of {','.join(MC_SCORES)} (letter: the reader picks "
                             "a letter, for one that can; likeliest: the likeliest option text, for one that cannot)")
    parser.add_argument("--users", default="1,32", help="concurrent users for the speed figures ('' skips them)")
    parser.add_argument("--icl-users", default="1", help="the --users ICL is timed at (its prefill is the slow part)")
    parser.add_argument("--decode", type=int, default=16, help="new tokens per user in the decode-rate figure")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vs-rag"), help="a scratch folder (stores, resumable)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plots", type=Path, default=Path("docs/img"), help="where the two figures are written")
    parser.add_argument("--from", dest="saved", type=Path, default=None,
                        help="re-make the table and figures from a saved result, running nothing")
    args = parser.parse_args()
    if args.saved:
        result = json.loads(args.saved.read_text())
        print(table(result), *plots(result, args.plots), sep="\n")
        return
    methods = [m for m in args.methods.split(",") if m]
    mc = [m for m in args.mc.split(",") if m]
    try:
        for m in methods:
            method_spec(m, args.tokens)
        check_mc(mc)
    except ConfigError as err:
        parser.error(str(err))
    bad = [s for s in args.sets.split(",") if s not in DATASETS]
    if bad or not {"none", "icl"} <= set(methods):
        parser.error(f"unknown sets {bad}; --methods must include none and icl (the reference); sets: "
                     f"{sorted(DATASETS)}")
    recipe, start = recipe_flags(args.recipe)  # spelled out, so its stores are the ones the flags would name
    if args.selfstudy is not None:
        recipe["num_conversations"] = args.selfstudy
    elif not args.recipe:
        recipe["num_conversations"] = DEFAULT_CONVERSATIONS
    selfstudy = {**recipe, **parse_settings(args.set)}
    try:
        only = None if args.only is None else [int(d) for d in args.only.split(",")]
    except ValueError:
        parser.error(f"--only {args.only!r}: give comma-separated document numbers, e.g. 5,6,7,8,9")
    try:
        check_only(only, args.docs)
    except ConfigError as err:
        parser.error(str(err))
    compaction_config(args.compaction)  # a name CompactionConfig lacks is refused before the model loads
    compaction = start | parse_settings(args.compaction)
    lm = load_model(None if args.model == "default" else args.model)
    start = time.perf_counter()
    result = {"model": lm.name, "tokens": args.tokens, "scope": args.scope, "kv_bytes_per_token": kv_bytes_per_token(lm),
              "selfstudy": selfstudy, "compaction": compaction, "sets": {}}
    for name in args.sets.split(","):
        work = args.work / f"{args.model}-{name}-{args.docs}"
        result["sets"][name] = run_dataset(lm, args.data_dir / DATASETS[name], args.docs, args.questions,
                                           args.tokens, work, methods, selfstudy, args.scope, compaction, mc, only,
                                           args.draft_from)
    if args.users:
        first = args.sets.split(",")[0]
        corpus = load_corpora(args.data_dir / DATASETS[first], [0])[0]
        work = args.work / f"{args.model}-{first}-{args.docs}"
        retriever = Retriever("bm25", [p for _, p in passages([c.text for c in load_corpora(
            args.data_dir / DATASETS[first], list(range(args.docs)))])], work)
        timed = [m for m in methods if m == "cartridge" or plans_each_answer(m)]  # of those the run built
        stores = {m: CartridgeStore(store_of(lm, m, args.tokens, work, selfstudy, compaction)[1], lm) for m in timed}
        drafter = CartridgeStore(store_of(lm, args.draft_from, args.tokens, work, selfstudy, compaction)[1], lm) \
            if args.draft_from else None
        result["speed"] = speed(lm, corpus, args.tokens, retriever, stores,
                                [int(u) for u in args.users.split(",")], args.decode,
                                [int(u) for u in args.icl_users.split(",") if u], drafter)
    result.update({"seconds": round(time.perf_counter() - start, 1), "commit": provenance.commit(),
                   "dirty": provenance.dirty(), "machine": provenance.machine()})
    out = args.out or Path("benchmarks/results") / f"vs_rag-{args.model}-{args.tokens}.json"
    provenance.save(result, out)
    print(table(result), *plots(result, args.plots), sep="\n")


def plots(result: dict, folder: Path) -> list[Path]:
    """Quality per set and method (closure; MC accuracy), and first-token time and decode rate per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    sets, scope = result["sets"], result.get("scope", "store")
    methods = [m for m in dict.fromkeys(m for s in sets.values() for m in s["methods"]) if m != "icl"]
    panels = [("closure", "gold-answer closure (ICL = 1)")] + [
        (key, f"multiple choice: {title}") for _, key, title in MC_FIELDS if any(s.get(key) for s in sets.values())]
    rows = -(-len(methods) // 2)  # of the legend, two methods a row under the panels
    fig, axes = plt.subplots(1, len(panels), figsize=(max(5.5 * len(panels), 9), 3.6 + 0.2 * rows), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        names = [n for n in sets if sets[n].get(key)]
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            ax.bar([j + i * width for j in range(len(names))], [_bar(sets[n][key].get(m)) for n in names], width,
                   label=label(m, scope) if key == "closure" else None, color=f"C{i}")
        if key != "closure":
            ax.axhline(0.25, color="gray", lw=0.8, ls="--")
            ax.axhline(mean([sets[n][key]["icl"] for n in names]), color="black", lw=0.8, label="ICL (mean)")
            ax.legend(fontsize=7)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
        ax.set_title(title, fontsize=10)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7, frameon=False)
    asked = "each question asked of its own document" if scope == "document" else "each question routed in the store"
    fig.suptitle(f"{result['model']}, {result['tokens']} tokens of cartridge or RAG context;\n{asked}", fontsize=10)
    fig.tight_layout(rect=(0, 0.05 * rows + 0.02, 1, 1))
    paths = [folder / ("vs-rag-quality.png" if scope == "store" else f"vs-rag-quality-{scope}.png")]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    if result.get("speed"):
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
        rows = result["speed"]
        labels = [f"{r['method']}\n{r['users']} user{'s' * (r['users'] > 1)}" for r in rows]
        axes[0].bar(labels, [r["first_token_s"] for r in rows])
        axes[0].set_yscale("log")
        axes[0].set_title("seconds until every user has a first token (log)", fontsize=10)
        axes[1].bar(labels, [r["decode_tokens_per_s"] for r in rows])
        axes[1].set_title("decode tokens/s, all users together", fontsize=10)
        for ax in axes:
            ax.tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        paths.append(folder / "vs-rag-speed.png")
        fig.savefig(paths[1], dpi=120)
        plt.close(fig)
    return paths


def table(result: dict) -> str:
    """The head-to-head as markdown: quality per set, then cost per method."""
    sets = result["sets"]
    methods = list(dict.fromkeys(m for s in sets.values() for m in s["methods"]))
    columns = {n: [("closure", "closure")] + [(key, f"MC {name} (of {s['mc_questions']})")
                                              for name, key, _ in MC_FIELDS if s.get(key)] for n, s in sets.items()}
    lines = ["| method | " + " | ".join(f"{n} {head}" for n, cols in columns.items() for _, head in cols) + " |"]
    lines.append("|---" * (1 + sum(len(cols) for cols in columns.values())) + "|")
    for m in methods:
        cells = [_f(sets[n][key].get(m)) + (_within(sets[n].get("closure_interval", {}).get(m)) if key == "closure"
                                            else "") for n, cols in columns.items() for key, _ in cols]
        lines.append(f"| {label(m, result.get('scope', 'store'))} | " + " | ".join(cells) + " |")
    if result.get("speed"):
        lines += ["", "| method | users | prompt tokens | KV MiB/user | first token s | decode tokens/s |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['users']} | {r['prompt_tokens']:,} | {r['kv_mib_per_user']} | "
                  f"{r['first_token_s']} | {r['decode_tokens_per_s']} |" for r in result["speed"]]
    return "\n".join(lines)


def _bar(x: float | None) -> float:
    """A bar's height: a method not run on a set draws no bar (not a zero)."""
    return float("nan") if x is None else x


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _within(interval: Sequence[float] | None) -> str:
    """A closure's 95% interval after it, where it has one (not ICL's and no context's, which are 1 and 0 by
    definition)."""
    return "" if interval is None or interval[0] == interval[1] else f" ({interval[0]:.2f} to {interval[1]:.2f})"


if __name__ == "__main__":
    main()
