"""The documents a store is synced from: one per file of a folder (or per top-level entry, or given by name), each
named as the store will call its cartridge and keyed by a hash of its content; and each file that is not one, with
why.

A folder is walked without trusting it: hidden entries (``.git``, ``.env``) are passed over silently; binary,
unreadable, oversized files, links that loop, and paths whose name the store cannot serve are skipped with one line
each. Nothing here writes.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

import attrs

from ..errors import ConfigError
from .subjects import check_subject

NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")  # what a store serves; also the API's model name
SUFFIX = ".safetensors"  # a cartridge's file is NAME + SUFFIX
CORPUS_SUFFIX = ".corpus.txt"  # the text routing reads for NAME
MAX_BYTES = 8 * 2**20  # a bigger file is most likely data, not a document
UNITS = ("file", "folder")


@attrs.frozen
class SourceDocument:
    """One document of the folder (or mapping) a store is synced from: the store's name for it, where it came from,
    its text and the hash of that text. (Not `cartridges_sdk.Document`, one text of a `Corpus`.)"""

    name: str
    origin: str  # the path relative to the folder, or the name the user gave
    text: str = attrs.field(repr=False)
    sha256: str
    subject: str | None = None  # who or what it is about, from its front matter (`front_subject`)


@attrs.frozen
class NotADocument:
    """A path that is not a document, and why (one line)."""

    path: str
    why: str


# a front-matter block at a document's top: "---" alone on the first line, fields, "---" alone again
_FRONT = re.compile(r"\A\ufeff?---[ \t]*\r?\n(?P<fields>.*?)^---[ \t]*$", re.DOTALL | re.MULTILINE)
_SUBJECT = re.compile(r"^subject[ \t]*:[ \t]*(?P<value>.*?)[ \t]*$", re.MULTILINE)


def front_subject(text: str) -> str | None:
    """The ``subject:`` field of the front matter at the top of `text` (who or what the document is about), or None.
    Raises ValueError for a subject that cannot be one (empty, too long, no word)::

        ---
        subject: Ada Quill
        ---
        Medical record of Ada Quill ...
    """
    front = _FRONT.match(text[:4096])
    found = _SUBJECT.search(front["fields"]) if front else None
    if found is None:
        return None
    value = found["value"].strip("\"'") if len(found["value"]) > 1 else found["value"]
    return check_subject(value)


def content_hash(text: str) -> str:
    """The full SHA-256 of a text (not `identity.text_fingerprint`'s 16 digits): an answer's version names its
    document exactly."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def store_name(origin: str) -> str:
    """The store's name for a document at relative path `origin`: its folders joined by '.' (``src/app.py`` is
    ``src.app.py``)."""
    return origin.replace(os.sep, "/").replace("/", ".")


def name_problem(name: str) -> str | None:
    """Why the store cannot serve a cartridge called `name`, or None."""
    if not NAME.match(name):
        return (f"the name {name!r} cannot be a cartridge's (1-128 letters, digits, '.', '_', '-', not starting with "
                "'.' or '-'); rename it")
    if name == "auto":
        return "the name 'auto' is taken by routing; rename it"
    return None


def read_documents(source: str | os.PathLike | Mapping[str, str], *, unit: str = "file",
                   max_bytes: int = MAX_BYTES,
                   include: tuple[str, ...] = ()) -> tuple[list[SourceDocument], list[NotADocument]]:
    """The documents of `source` (a folder, or a mapping of name to text) and the paths skipped, both sorted.
    `unit`, `max_bytes` and `include` are `SyncConfig`'s, checked there; a mapping's entries are its units already.
    With `include` patterns, a folder's files whose relative path matches none are passed over silently: left out
    by choice (a codebase's caches and binaries), not skipped for a fault."""
    if isinstance(source, Mapping):
        return _from_mapping(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"source must be a folder or a mapping of name to text, got {type(source).__name__}.")
    root = Path(source)
    if not root.is_dir():
        raise ConfigError(f"{str(root)!r} is not a folder; sync reads a folder of documents (one per file).")
    files, skipped = _walk(root)
    if include:
        files = [(origin, path) for origin, path in files if any(fnmatch.fnmatchcase(origin, p) for p in include)]
    documents: dict[str, SourceDocument] = {}
    if unit == "file":
        groups = [(origin, [(origin, path)]) for origin, path in files]
    else:
        tops: dict[str, list[tuple[str, Path]]] = {}
        for origin, path in files:
            tops.setdefault(origin.split("/", 1)[0], []).append((origin, path))
        groups = sorted(tops.items())
    for origin, members in groups:
        texts, fronts, failed = [], [], False
        for member, path in members:
            text, why = _read(path, max_bytes)
            if why is not None:
                skipped.append(NotADocument(member, why))
                failed = True
            else:
                fronts.append(text)
                texts.append(text if len(members) == 1 else f"### {member}\n\n{text}")
        if failed and len(members) > 1 and texts:  # built without one of its files, a unit would lose it
            skipped.append(NotADocument(origin, "one of its files was skipped (above); the unit keeps its cartridge "
                                                "until all of them read"))
            continue
        if not texts:
            continue
        name = store_name(origin)
        problem = name_problem(name)
        if problem is None and name in documents:
            problem = f"its name {name!r} is already that of {documents[name].origin!r}; rename one of them"
        if problem is not None:
            skipped.append(NotADocument(origin, problem))
            continue
        text = "\n\n".join(texts)
        try:  # in a folder unit, the first of its files with front matter says who the unit is about
            subject = next((s for s in map(front_subject, fronts) if s is not None), None)
        except ValueError as err:
            skipped.append(NotADocument(origin, f"its front matter's {err}"))
            continue
        documents[name] = SourceDocument(name, origin, text, content_hash(text), subject)
    return sorted(documents.values(), key=lambda d: d.name), sorted(skipped, key=lambda s: s.path)


def _from_mapping(source: Mapping[str, str]) -> tuple[list[SourceDocument], list[NotADocument]]:
    documents, skipped = [], []
    for name, text in source.items():
        problem = name_problem(name) if isinstance(name, str) else f"the name {name!r} is not a string"
        if problem is None and not isinstance(text, str):
            problem = f"its text is a {type(text).__name__}, not a str"
        elif problem is None and not text.strip():
            problem = "its text is empty"
        if problem is None:
            try:
                subject = front_subject(text)
            except ValueError as err:
                problem = f"its front matter's {err}"
        if problem is not None:
            skipped.append(NotADocument(str(name), problem))
        else:
            documents.append(SourceDocument(name, name, text, content_hash(text), subject))
    return sorted(documents, key=lambda d: d.name), sorted(skipped, key=lambda s: s.path)


def _walk(root: Path) -> tuple[list[tuple[str, Path]], list[NotADocument]]:
    """Every visible file under `root` (links followed, each folder once), by relative path; and what was not."""
    files: list[tuple[str, Path]] = []
    skipped: list[NotADocument] = []
    seen = {root.resolve()}
    stack = [(root, "")]
    while stack:
        folder, prefix = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as err:
            skipped.append(NotADocument(prefix.rstrip("/") or ".", f"the folder cannot be read ({err.strerror})"))
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            origin = prefix + entry.name
            try:
                is_dir = entry.is_dir()  # follows links; a loop of links raises ELOOP
                is_file = entry.is_file()
            except OSError as err:
                skipped.append(NotADocument(origin, f"it cannot be followed ({err.strerror})"))
                continue
            if is_dir:
                try:
                    real = Path(entry.path).resolve(strict=True)
                except (OSError, RuntimeError):
                    skipped.append(NotADocument(origin, "it is a link that loops"))
                    continue
                if real in seen:
                    skipped.append(NotADocument(origin, f"it links to a folder already read ({real}); a loop or a "
                                                   "duplicate"))
                    continue
                seen.add(real)
                stack.append((Path(entry.path), origin + "/"))
            elif is_file:
                files.append((origin, Path(entry.path)))
            elif entry.is_symlink():
                skipped.append(NotADocument(origin, "it is a link to nothing (or one that loops)"))
            else:
                skipped.append(NotADocument(origin, "it is not a regular file (a socket, a device or a pipe)"))
    return sorted(files), skipped


def snapshot(source: str | os.PathLike | Mapping[str, str]) -> object:
    """Something that changes when the documents may have: every visible file's size and modification time. Cheap
    (no file is read), so a watcher can look often."""
    if isinstance(source, Mapping):
        return tuple(sorted((k, content_hash(v) if isinstance(v, str) else None) for k, v in source.items()))
    files, skipped = _walk(Path(source))
    stamps = []
    for origin, path in files:
        try:
            st = path.stat()
            stamps.append((origin, st.st_size, st.st_mtime_ns))
        except OSError:
            stamps.append((origin, -1, -1))
    return tuple(stamps), tuple(skipped)


def _read(path: Path, max_bytes: int) -> tuple[str, str | None]:
    try:
        size = path.stat().st_size
        if size > max_bytes:
            return "", f"it is {size:,} bytes, over the limit of {max_bytes:,} (max_bytes / --max-bytes)"
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as err:
        return "", f"it cannot be read ({err.strerror or err})"
    if len(raw) > max_bytes:  # grew since it was measured
        return "", f"it is over the limit of {max_bytes:,} bytes (max_bytes / --max-bytes)"
    if b"\x00" in raw[:8192]:
        return "", "it is binary (it holds NUL bytes), not text"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return "", f"it is not UTF-8 text (byte {err.start} is not UTF-8)"
    if not text.strip():
        return "", "it is empty"
    return text, None
