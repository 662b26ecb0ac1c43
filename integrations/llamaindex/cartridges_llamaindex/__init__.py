"""LlamaIndex integration of cartridges-sdk: `CartridgeLLM` (an LLM) and `CartridgeQueryEngine` (a query engine over
a store). docs/vs-rag.md shows them in use."""

from .llm import CartridgeLLM
from .query_engine import CartridgeQueryEngine

__all__ = ["CartridgeLLM", "CartridgeQueryEngine"]
