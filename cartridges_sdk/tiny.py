"""Tiny random models built in memory (seconds, no files): what tests run on, and ``load_model("tiny-random")``,
which lets anyone repeat a benchmark of the SDK's own machinery (a store of 100,000 documents) with no download."""

from __future__ import annotations

import string

from .errors import ConfigError

TINY_RANDOM = "tiny-random"  # the model name every command takes (`--model tiny-random`)

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
    """A random 3-layer Llama or Qwen2 with grouped-query attention (4 query heads, 2 KV heads), float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

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


def tiny_random():
    """`TINY_RANDOM`'s transformers model and tokenizer: the seed-0 Llama with a character tokenizer, the same
    weights in every process (the caller's random state is left as it was)."""
    import torch

    tok = char_tokenizer(bos=True, chat_template=LLAMA_CHAT)
    with torch.random.fork_rng(devices=[]):
        model = tiny_model("llama", len(tok))
    model.config._name_or_path = TINY_RANDOM
    return model, tok
