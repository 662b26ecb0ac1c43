"""Shared fixtures: tiny random Llama/Qwen2 models with GQA built in memory, and the embedded default model."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import torch

from cartridges_sdk import load_model

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
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

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
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=2048,
    )
    if kind == "llama":
        config = LlamaConfig(**common, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=5)
        model = LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = Qwen2Config(**common, rope_theta=1000000.0, eos_token_id=4, pad_token_id=5)
        model = Qwen2ForCausalLM(config)
    else:
        raise ValueError(kind)
    return model.float().eval()


def make_tiny_lm(kind: str, seed: int = 0):
    tok = char_tokenizer(bos=kind == "llama", chat_template=LLAMA_CHAT if kind == "llama" else CHATML)
    model = tiny_model(kind, len(tok), seed)
    model.config._name_or_path = f"tiny-{kind}-seed{seed}"
    return load_model(model, tok)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_lm(request):
    return make_tiny_lm(request.param)


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_lm("llama")


@pytest.fixture(scope="session")
def tiny_qwen():
    return make_tiny_lm("qwen2")


@pytest.fixture(scope="session")
def default_lm():
    return load_model()


DATA = Path(__file__).parent.parent / "examples" / "data"
TEXT = (DATA / "harrow_point.txt").read_text(encoding="utf-8")
