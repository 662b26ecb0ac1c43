"""LangChain integration of cartridges-sdk: `ChatCartridges` (a chat model) and `CartridgeRetriever` (which
cartridges a question goes to). Errors are LangChain's `ModelError` classes and the SDK's at once (`errors.py`).
docs/vs-rag.md shows them in a chain."""

from .chat_model import ChatCartridges
from .errors import langchain_class
from .retriever import CartridgeRetriever

__all__ = ["CartridgeRetriever", "ChatCartridges", "langchain_class"]
