"""Corpus and Document: the text a cartridge learns, tokenized once, and the random chunks self-study reads."""

from __future__ import annotations

import fnmatch
import glob
import os
import random
import re
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from ..errors import ConfigError
from ..identity import text_fingerprint

if TYPE_CHECKING:
    from ..lm import LM


@attrs.frozen
class Document:
    """One text of a corpus; `name` (e.g. a relative path) introduces it so the corpus's structure stays visible."""

    name: str | None
    text: str


def read_text(path: Path) -> str | None:
    """The file's text, or None if it is binary or not UTF-8."""
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _existing_path(text: str) -> bool:
    """Whether `text` names an existing file or folder (a long line of text is not a path: the OS says so)."""
    if "\n" in text or len(text) > 4096:
        return False
    try:
        return Path(text).exists()
    except OSError:
        return False


def _looks_like_path(text: str) -> bool:
    """One line that has a path separator and no sentence, or one word ending in a file extension."""
    text = text.strip()
    if "\n" in text or len(text) > 1024:
        return False
    has_separator = ("/" in text or "\\" in text) and ". " not in text and len(text.split()) <= 3
    return has_separator or re.fullmatch(r"[^\s/\\]+\.[A-Za-z0-9]{1,8}", text) is not None


def _warn_skipped(skipped: list[str]) -> None:
    if skipped:
        shown = ", ".join(skipped[:10]) + (f" and {len(skipped) - 10} more" if len(skipped) > 10 else "")
        warnings.warn(f"Skipped {len(skipped)} binary or non-UTF-8 file(s): {shown}", stacklevel=3)


class Corpus:
    """The documents a cartridge should know, optionally with a description placed before every chunk."""

    def __init__(self, documents: Sequence[Document], description: str | None = None):
        documents = [d for d in documents if d.text.strip()]
        if not documents:
            raise ConfigError("The corpus is empty: give at least one document with some text.")
        self.documents = list(documents)
        self.description = description
        self._ids: dict[str, list[int]] = {}

    def __repr__(self) -> str:
        return f"Corpus({len(self.documents)} documents, {len(self.text)} characters)"

    # -- constructors ----------------------------------------------------------------------------------
    @classmethod
    def from_texts(cls, texts: str | Sequence[str], names: Sequence[str] | None = None, *, description: str | None = None) -> Corpus:
        texts = [texts] if isinstance(texts, str) else list(texts)
        if names is not None and len(names) != len(texts):
            raise ConfigError(f"Got {len(names)} names for {len(texts)} texts; give one name per text or none.")
        return cls([Document(n, t) for n, t in zip(names or [None] * len(texts), texts)], description)

    @classmethod
    def from_files(cls, paths: str | os.PathLike | Iterable[str | os.PathLike], *, description: str | None = None) -> Corpus:
        """Files by path or glob pattern (``**`` recurses); each is introduced by its path as given."""
        specs = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        found: list[Path] = []
        for spec in specs:
            spec = str(spec)
            matches = sorted(glob.glob(spec, recursive=True)) if glob.has_magic(spec) else [spec]
            if not matches:
                raise ConfigError(f"No file matches {spec!r}.")
            for m in matches:
                p = Path(m)
                if not p.exists():
                    raise ConfigError(f"File {m!r} does not exist.")
                if p.is_file():
                    found.append(p)
        docs, skipped = [], []
        for p in found:
            text = read_text(p)
            if text is None:
                skipped.append(str(p))
            else:
                docs.append(Document(str(p), text))
        _warn_skipped(skipped)
        return cls(docs, description)

    @classmethod
    def from_directory(
        cls,
        directory: str | os.PathLike,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        *,
        description: str | None = None,
    ) -> Corpus:
        """Every file under `directory` matching an `include` glob (default all) and no `exclude` glob.

        Patterns match the path relative to `directory` (``**/*.py``); hidden folders such as ``.git`` are skipped.
        """
        root = Path(directory)
        if not root.is_dir():
            raise ConfigError(f"{str(directory)!r} is not a directory.")
        include = list(include or ["**/*"])
        exclude = list(exclude or [])

        def matches(rel: str, patterns: list[str]) -> bool:
            # "**/x" should also match "x" at the top level
            return any(fnmatch.fnmatch(rel, p) or (p.startswith("**/") and fnmatch.fnmatch(rel, p[3:])) for p in patterns)

        docs, skipped = [], []
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root).as_posix()
            if not path.is_file() or any(part.startswith(".") for part in Path(rel).parts):
                continue
            if not matches(rel, include) or matches(rel, exclude):
                continue
            text = read_text(path)
            if text is None:
                skipped.append(rel)
            else:
                docs.append(Document(rel, text))
        _warn_skipped(skipped)
        if not docs:
            raise ConfigError(f"No text files in {str(directory)!r} match include={include} exclude={exclude}.")
        return cls(docs, description)

    @classmethod
    def coerce(cls, corpus: Any) -> Corpus:
        """A Corpus, a path (file or folder), a text, or a list of texts; a string is never guessed at.

        A string naming an existing file or folder is read from there. A one-line string that looks like a path
        (it has a slash, or is one word ending in an extension) but names nothing is refused, since it is far more
        likely a typo than the text to learn; other strings are the text itself. `Corpus.from_texts`,
        `from_files` and `from_directory` say which is meant outright.
        """
        if isinstance(corpus, Corpus):
            return corpus
        if isinstance(corpus, os.PathLike):
            p = Path(corpus)
            if not p.exists():
                raise ConfigError(f"No file or folder at {str(p)!r}; check the path.")
            return cls.from_directory(p) if p.is_dir() else cls.from_files([p])
        if isinstance(corpus, str):
            if not corpus.strip():
                raise ConfigError("The corpus is empty: pass a text, a path to a file or folder, or a Corpus.")
            if _existing_path(corpus):
                return cls.coerce(Path(corpus))
            if _looks_like_path(corpus):
                raise ConfigError(
                    f"{corpus!r} looks like a path, but no file or folder is there (a typo?). To learn this string "
                    f"itself, pass Corpus.from_texts({corpus!r})."
                )
            return cls.from_texts(corpus)
        if isinstance(corpus, (list, tuple)) and corpus and all(isinstance(t, str) for t in corpus):
            return cls.from_texts(list(corpus))
        raise ConfigError(
            f"Cannot make a corpus from {type(corpus).__name__} {corpus!r:.60}; pass a text, a list of texts, a path, "
            "or a Corpus."
        )

    # -- text and tokens -------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The documents one after another, each named document under a header line with its name."""
        parts = []
        for d in self.documents:
            parts.append(f"### {d.name}\n\n{d.text.strip()}" if d.name else d.text.strip())
        return "\n\n".join(parts)

    def token_ids(self, lm: LM) -> list[int]:
        """Token ids of `text` (computed once per tokenizer)."""
        key = lm.identity.tokenizer or lm.name
        if key not in self._ids:
            self._ids[key] = lm.tokenizer(self.text, add_special_tokens=False)["input_ids"]
        return self._ids[key]

    def fingerprint(self) -> str:
        return text_fingerprint(self.text)


def _check_chunk(inst: ChunkSampler, attribute, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{attribute.name}={value} must be >= 1.")
    if attribute.name == "max_chunk" and value < inst.min_chunk:
        raise ConfigError(f"max_chunk={value} must be >= min_chunk={inst.min_chunk}.")


@attrs.frozen
class ChunkSampler:
    """Uniformly random token windows of `min_chunk`..`max_chunk` tokens (clamped to the corpus length)."""

    min_chunk: int = attrs.field(default=512, validator=_check_chunk)
    max_chunk: int = attrs.field(default=4096, validator=_check_chunk)

    def sample(self, num_tokens: int, rng: random.Random) -> tuple[int, int]:
        """A ``(start, end)`` window into a corpus of `num_tokens` tokens."""
        if num_tokens < 1:
            raise ConfigError("Cannot sample a chunk from an empty corpus.")
        hi = min(self.max_chunk, num_tokens)
        lo = min(self.min_chunk, hi)
        length = rng.randint(lo, hi)
        start = rng.randint(0, num_tokens - length)
        return start, start + length
