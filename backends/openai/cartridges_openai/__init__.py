"""cartridges-openai: self-study synthesis against OpenAI-compatible inference servers (vLLM, llama.cpp's server).

Nothing heavy is imported here; the SDK finds the synthesizer through the entry point ``openai``.
"""

from .options import OpenAIOptions

__all__ = ["OpenAIOptions"]
