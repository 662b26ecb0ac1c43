"""LangChain integration of cartridges-sdk: `ChatCartridges` (a chat model) and `CartridgeRetriever` (which
cartridges a question goes to). docs/vs-rag.md shows them in a chain."""

from .chat_model import ChatCartridges
from .errors import (CartridgesAPIError, CartridgesConnectionError, CartridgesInvalidRequestError,
                     CartridgesNotFoundError, CartridgesRateLimitError)
from .retriever import CartridgeRetriever

__all__ = ["CartridgeRetriever", "ChatCartridges", "CartridgesAPIError", "CartridgesConnectionError",
           "CartridgesInvalidRequestError", "CartridgesNotFoundError", "CartridgesRateLimitError"]
