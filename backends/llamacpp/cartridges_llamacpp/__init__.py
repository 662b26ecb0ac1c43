"""cartridges-llamacpp: cartridges served by llama.cpp (llama-cpp-python), written into a sequence's KV cells."""

from .runtime import LlamaCppRuntime
from .state import Layout, StateFormatError

__all__ = ["Layout", "LlamaCppRuntime", "StateFormatError"]
