"""The built-in Hugging Face backend, a plugin like any other: a runtime and a synthesizer on a transformers model.

Registered in the core's ``pyproject.toml`` as ``hf`` in the runtimes and synthesizers groups.
"""

from .runtime import HFRuntime
from .synthesizer import HFSynthesizer

__all__ = ["HFRuntime", "HFSynthesizer"]
