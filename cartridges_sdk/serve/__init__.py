"""Serving cartridges: the store (files, routing) and the OpenAI-compatible server.

The names below are the public way in for code outside the package (the LangChain and LlamaIndex integrations):
`Answerer` picks the cartridges for a conversation and answers it, `Chosen` is a cartridge it picked, `Selection` all it picked (cartridges, then passages), `Usage` the
tokens an answer took. They resolve on first use (PEP 562), so importing one module of `serve` (the settings, say)
loads no other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .answering import Answerer, Chosen, Selection, Usage

__all__ = ["Answerer", "Chosen", "Selection", "Usage"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import answering

    value = getattr(answering, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
