"""Tiny models built in memory (seconds, no files) and fake backends, for tests of the SDK and of plugins."""

from __future__ import annotations

import itertools
import string
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from ..errors import ConfigError
from ..generation import Completion, GenerationRequest, SynthesisRequest
from ..models import load_model
from ..plugins import Runtime, Synthesizer, SynthesizerCapabilities

if TYPE_CHECKING:
    from ..lm import LM


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}{{ '[' + m['role'] + '] ' + m['content'] + '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}"
)


def char_tokenizer(*, bos: bool, chat_template: str):
    """A character-level fast tokenizer built in memory (no files), with or without an automatic BOS."""
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]
    chars = sorted(set(string.printable))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>" if bos else "<|im_end|>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = chat_template
    return fast


def tiny_model(kind: str, vocab_size: int, seed: int = 0):
    """A random 3-layer Llama or Qwen2 with grouped-query attention (4 query heads, 2 KV heads), float32."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=5))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1000000.0, eos_token_id=4, pad_token_id=5))
    else:
        raise ConfigError(f"kind={kind!r} must be 'llama' or 'qwen2'.")
    return model.float().eval()


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
