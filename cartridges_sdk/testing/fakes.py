"""Tiny models built in memory (seconds, no files) and fake backends, for tests of the SDK and of plugins."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..generation import Completion, GenerationRequest, SynthesisRequest
from ..models import load_model
from ..plugins import Runtime, Synthesizer, SynthesizerCapabilities
# the tiny models live in the core (`load_model("tiny-random")` builds one); tests and plugins import them from here
from ..tiny import CHATML, LLAMA_CHAT, char_tokenizer, tiny_model  # noqa: F401

if TYPE_CHECKING:
    from ..lm import LM


def tiny_lm(kind: str = "llama", seed: int = 0) -> LM:
    """A tiny random model with a character tokenizer as an `LM`: a Llama (with BOS) or a Qwen2 (ChatML, no BOS)."""
    tok = char_tokenizer(bos=kind == "llama", chat_template=LLAMA_CHAT if kind == "llama" else CHATML)
    model = tiny_model(kind, len(tok), seed)
    model.config._name_or_path = f"tiny-{kind}-seed{seed}"
    return load_model(model, tok)


# ------------------------------------------------------------------------------------------------------------
# fakes, for unit tests of code that calls a backend


class FakeRuntime(Runtime):
    """Answers with queued texts in order (cycling), and records every request it was given."""

    def __init__(self, model: LM | None = None, *, answers: Iterable[str] = ("fake answer",)):
        self.lm = model
        self._answers = itertools.cycle(list(answers))
        self.requests: list[GenerationRequest] = []
        self.closed = False

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Completion]:
        out = []
        for r in requests:
            self.requests.append(r)
            text = next(self._answers)
            ids = tuple(self.lm.tokenizer(text, add_special_tokens=False)["input_ids"]) if self.lm else ()
            out.append(Completion(text=text, token_ids=ids, finish_reason="stop"))
        return out

    def close(self) -> None:
        self.closed = True


class FakeSynthesizer(Synthesizer):
    """Answers with queued texts in order (cycling), tokenized by the student's tokenizer, with made-up top-k
    (the sampled token first, uniform log-probs). Reports the student's identity; cannot score."""

    capabilities = SynthesizerCapabilities(max_top_logprobs=20)

    def __init__(self, model: LM, *, answers: Iterable[str] = ("A question about the text?", "An answer from it.")):
        self.lm = model
        self._answers = itertools.cycle(list(answers))
        self.requests: list[SynthesisRequest] = []

    def identity(self):
        return self.lm.identity

    def complete(self, requests: Sequence[SynthesisRequest]) -> list[Completion]:
        vocab = self.lm.identity.architecture["vocab_size"]
        out = []
        for r in requests:
            self.requests.append(r)
            text = next(self._answers)
            ids = self.lm.tokenizer(text, add_special_tokens=False)["input_ids"][: r.max_tokens]
            k = r.top_logprobs
            top_ids = np.array([[(t + j) % vocab for j in range(k)] for t in ids]).reshape(len(ids), k) if k else None
            top_lps = np.full((len(ids), k), -np.log(k + 1)) if k else None
            out.append(Completion(text=text, token_ids=tuple(ids), finish_reason="length", top_ids=top_ids,
                                  top_logprobs=top_lps))
        return out


# ------------------------------------------------------------------------------------------------------------
# comparisons
