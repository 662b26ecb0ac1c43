"""`CartridgeRetriever`: where a RAG chain's retriever stood, it returns the cartridges a store routes the question
to (one document each: its name, score and document version in the metadata, the opening of its corpus as the
text), so a chain keeps its shape and its sources, and `ChatCartridges` answers with exactly those cartridges."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, PrivateAttr, model_validator

from cartridges_sdk.serve import Answerer

from .errors import langchain_errors


class CartridgeRetriever(BaseRetriever):
    """The best `k` cartridges of `store` for a question (or as many as fit `budget` tokens), best first."""

    store: Any
    k: int = 1
    budget: int | None = None

    model_config = ConfigDict(arbitrary_types_allowed=True)
    _answerer: Answerer = PrivateAttr()

    @model_validator(mode="after")
    def _build(self) -> CartridgeRetriever:
        with langchain_errors():
            self._answerer = Answerer(store=self.store, k=self.k, budget=self.budget)
        return self

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        with langchain_errors():
            return [Document(page_content=c.preview, metadata=c.metadata()) for c in self._answerer.choose(query)]
