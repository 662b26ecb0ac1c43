"""What a synced cartridge says of the document it stands for, written by sync and read by the store, the server
and the integrations.

The record travels inside the cartridge file (``meta.extra["document"]``): ``name``, ``origin``, ``sha256`` (of the
document's text), ``tokens`` (its length), ``method`` (``whole``, ``compact`` or ``self-study``) and ``size`` (the
cartridge's tokens), and for a compacted one ``compaction`` (its `CompactionConfig`'s settings, so a sync asked for
other settings rebuilds it without reading the file). Stores written by earlier versions hold the same keys but the
last, so they load as they are. Read back, a
record also holds the cartridge's quality report when it has one (``quality``, read from ``meta.extra["quality"]``,
docs/quality-report.md), so a later `cartridges eval` of the file shows there too. Beside it,
``meta.extra["subject"]`` says who or what the cartridge is about (`subjects`), for any cartridge, synced or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ..cartridge import Cartridge
from ..making.settings import CompactionConfig

if TYPE_CHECKING:
    from .documents import SourceDocument


def document_record(cartridge: Cartridge) -> dict[str, Any] | None:
    """The document a synced cartridge stands for (name, origin, sha256, how it was built), or None."""
    record = cartridge.meta.extra.get("document")
    if not (isinstance(record, dict) and isinstance(record.get("sha256"), str)):
        return None
    quality = cartridge.meta.extra.get("quality")  # how good it is for its document, as last checked (report.py)
    return {**record, "quality": quality} if isinstance(quality, dict) else record


def subject_of(cartridge: Cartridge) -> str | None:
    """Who or what the cartridge is about (``meta.extra["subject"]``: a patient's name, a module), or None."""
    subject = cartridge.meta.extra.get("subject")
    return subject if isinstance(subject, str) and subject.strip() else None


def with_subject(cartridge: Cartridge, subject: str | None) -> Cartridge:
    """`cartridge` saying it is about `subject` (None: about no one in particular)."""
    extra = {k: v for k, v in cartridge.meta.extra.items() if k != "subject"}
    if subject is not None:
        extra["subject"] = subject
    return Cartridge(cartridge.keys, cartridge.values, attrs.evolve(cartridge.meta, extra=extra), lm=cartridge.lm)


def versions(cartridges: Sequence[Cartridge]) -> tuple[str | None, ...]:
    """The document version (SHA-256) each cartridge stands for, read from the cartridge itself so that it names
    exactly what answered, even when the file was replaced since."""
    return tuple((document_record(c) or {}).get("sha256") for c in cartridges)


def with_record(lm: Any, cartridge: Cartridge, doc: SourceDocument, method: str, tokens: int, size: int) -> Cartridge:
    """`cartridge` carrying the record of the document version it stands for, built by `method` at `size` tokens
    from a document of `tokens` tokens."""
    record = {"name": doc.name, "origin": doc.origin, "sha256": doc.sha256, "tokens": tokens, "method": method,
              "size": size}
    if method == "compact":  # its settings, not where its chunks fell: a store's catalog holds every record
        made = cartridge.meta.extra.get("compaction", {})
        record["compaction"] = {k: v for k, v in made.items() if k in attrs.fields_dict(CompactionConfig)}
    meta = attrs.evolve(cartridge.meta, extra={**cartridge.meta.extra, "document": record})
    # the subject from the document's front matter: the document says who it is about (None: no one)
    return with_subject(Cartridge(cartridge.keys, cartridge.values, meta, lm=lm), doc.subject)
