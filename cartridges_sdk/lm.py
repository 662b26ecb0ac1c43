"""`LM`: a frozen causal LM plus its tokenizer, the one model object the rest of the SDK talks to.

It knows the model's identity (so cartridges can refuse the wrong model), the prompt rule (how a chat turn follows
a cartridge or a document), its RoPE frequencies (`rope_inv_freq`), and how to score tokens placed after cartridges;
`ask`/`chat` hand requests to a runtime from the registry. `load_model` (in `models`) builds one. A `Cartridge` is
made from an `LM`, so cartridges are named here by what is read of them (`protocols.KVPrefix`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import numbers
import os
import weakref
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import ConfigError, UnsupportedModelError
from .generation import GenerationParams, GenerationRequest, Message
from .identity import ModelIdentity, architecture_of, tokenizer_fingerprint
from .kv import prefix_cache, use_grouped_sdpa
from .plugins import Runtime, runtimes
from .rope import POSITION_ADDITIVE_ROPE
from .runtime_choice import choose_runtime, runtime_name

if TYPE_CHECKING:
    from .protocols import KVPrefix


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {sorted(set(_DTYPES))}.") from None


def autocast(device: torch.device, dtype: str | torch.dtype | None):
    """A mixed-precision context for `device` in `dtype`, or a no-op context when `dtype` is None."""
    dtype = resolve_dtype(dtype)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


# model -> {dtype: its LM copy}, for `LM.in_dtype`; weak, so a copy goes with its model
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class LM:
    """A frozen causal LM plus its tokenizer, with the few primitives cartridges need.

    Build one with `load_model`; `.model` and `.tokenizer` are the plain transformers objects.
    """

    def __init__(self, model: Any, tokenizer: Any, *, name: str, source: str | None = None, revision: str | None = None,
                 files: str | os.PathLike | None = None, gguf: str | os.PathLike | None = None):
        if tokenizer is None:
            raise ConfigError("A tokenizer is required next to an already loaded model: load_model(model, tokenizer).")
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        use_grouped_sdpa(model)
        self.model = model
        self.tokenizer = tokenizer
        self.identity = ModelIdentity(
            name=name,
            source=source,
            revision=revision,
            architecture=architecture_of(model.config),
            tokenizer=tokenizer_fingerprint(tokenizer),
        )
        self._runtimes: dict[tuple[str, str], Runtime] = {}
        self._auto_runtime: str | None = None
        # a local folder with the model's config, weights and tokenizer in Hugging Face layout, when there is one:
        # engines that load weights themselves (vLLM) start from it
        self.files = Path(files) if files is not None else None
        # the GGUF file the weights were read from, when they were: engines that run GGUFs (llama.cpp) run this one
        self.gguf = Path(gguf) if gguf is not None else None

    def in_dtype(self, dtype: torch.dtype | None) -> LM:
        """This model, or its copy in `dtype` (made once per model and dtype, then shared: self-study's stage probe,
        its stages and a synthesizer's scorer use one bf16 copy, 0.5 GB for a 0.5B model)."""
        if dtype is None or dtype == self.dtype:
            return self
        held = _COPIES.setdefault(self.model, {})
        if dtype not in held:
            import copy

            held[dtype] = LM(copy.deepcopy(self.model).to(dtype), self.tokenizer, name=self.name,
                             source=self.identity.source, revision=self.identity.revision, files=self.files,
                             gguf=self.gguf)
        return held[dtype]

    # -- facts -----------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.identity.name

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @functools.cached_property
    def num_parameters(self) -> int:
        """Each shared tensor once (tied embeddings count once); counted once, as sync asks for every document."""
        return sum(p.numel() for p in self.model.parameters())

    @property
    def num_layers(self) -> int:
        return self.identity.architecture["num_layers"]

    @property
    def num_kv_heads(self) -> int:
        return self.identity.architecture["num_kv_heads"]

    @property
    def head_dim(self) -> int:
        return self.identity.architecture["head_dim"]

    @property
    def max_context(self) -> int | None:
        """How many positions the model attends over (its position limit), or None when its config does not say."""
        config = self.model.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        limit = getattr(text, "max_position_embeddings", None)
        return int(limit) if limit else None

    def check_context(self, tokens: int, what: str, fix: str) -> None:
        """Refuse work whose sequence of `tokens` would not fit the model's context, before any compute."""
        limit = self.max_context
        if limit is not None and tokens > limit:
            raise ConfigError(f"{what} needs {tokens} tokens, more than the {limit}-token context of {self.name!r}; {fix}.")

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if eos is None:
                continue
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        return ids

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = min(self.eos_token_ids) if self.eos_token_ids else 0
        return pad

    def __repr__(self) -> str:
        return f"LM({self.name!r}, device={self.device}, dtype={self.dtype})"

    # -- tokens ----------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of a document, with the sequence-start token where the tokenizer adds one."""
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def chat_ids(self, messages: Sequence[Message], *, after_cartridge: bool = True) -> list[int]:
        """Token ids of a chat turn ready for the assistant's answer, from the tokenizer's own chat template (the
        building block of `prompt_ids`, which is what engines and the SDK use).

        After a cartridge the sequence has already begun, so a leading sequence-start token that the tokenizer would
        add to any fresh sequence is left out (the cartridge's first token plays that role).
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                f"The tokenizer of {self.name!r} has no chat template; pass a tokenizer with one "
                "(load_model(model, tokenizer)) or set tokenizer.chat_template."
            )
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
        if after_cartridge and ids and ids[0] == self._auto_bos():
            ids = ids[1:]
        return ids

    def prompt_ids(self, messages: Sequence[Message], *, prefix_ids: Sequence[int] = (),
                   after_cartridge: bool = False) -> list[int]:
        """The prompt rule, the one every runtime and the synthesis teacher follow: plain `prefix_ids` (a document,
        or nothing), then the chat turn, rendered as a continuation when anything (a cartridge or `prefix_ids`) is
        in front of it and as the start of a sequence otherwise."""
        after = after_cartridge or bool(prefix_ids)
        return list(prefix_ids) + self.chat_ids(messages, after_cartridge=after)

    def check_ids(self, ids: Sequence[int] | torch.Tensor, what: str) -> list[int]:
        """Token ids as a list of ints, refusing non-integers and ids outside the model's vocabulary (`what` names
        the caller in the message)."""
        ids = ids.reshape(-1).tolist() if torch.is_tensor(ids) else list(ids)
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise ConfigError(f"{what}'s token ids must all be integers.")
        ids = [int(t) for t in ids]
        vocab = self.identity.architecture["vocab_size"]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"Token ids {bad[:5]} are outside the model's vocabulary [0, {vocab}).")
        return ids

    def unrelated_ids(self, num_tokens: int, seed: int) -> list[int]:
        """`num_tokens` ids of text unrelated to any corpus (shipped with the package), from a seed-chosen
        paragraph, wrapping around as needed: the paper's random-text initialisation reads it."""
        text = resources.files("cartridges_sdk").joinpath("data/unrelated.txt").read_text(encoding="utf-8")
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
        start = seed % len(paragraphs)
        ordered = paragraphs[start:] + paragraphs[:start]
        ids = self.encode("\n\n".join(ordered))
        body = self.tokenizer("\n\n" + "\n\n".join(ordered), add_special_tokens=False)["input_ids"]
        while len(ids) < num_tokens:
            ids = ids + body
        return ids[:num_tokens]

    def _auto_bos(self) -> int | None:
        """The token the tokenizer puts at the start of every sequence on its own, if any."""
        if not hasattr(self, "_auto_bos_id"):
            probe = self.tokenizer("a", add_special_tokens=True)["input_ids"]
            bare = self.tokenizer("a", add_special_tokens=False)["input_ids"]
            bos = self.tokenizer.bos_token_id
            self._auto_bos_id = bos if bos is not None and len(probe) > len(bare) and probe[0] == bos else None
        return self._auto_bos_id

    # -- scoring ---------------------------------------------------------------------------------------
    def _after(self, input_ids: Sequence[int] | torch.Tensor, cartridges: Sequence[KVPrefix] | None,
               what: str) -> dict[str, Any]:
        """A forward pass's inputs for `input_ids` placed after `cartridges`, checked first: a non-empty 1-D
        sequence that fits the context with the cartridges. `logits` and `hidden` share it, so a pass that needs
        only the model's body refuses what a scoring pass refuses, with the same message."""
        ids = torch.as_tensor(list(input_ids) if not torch.is_tensor(input_ids) else input_ids, dtype=torch.long)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ConfigError(f"input_ids must be a non-empty 1-D sequence of token ids, got shape {tuple(ids.shape)}.")
        p, n = sum(c.num_tokens for c in cartridges or []), ids.numel()
        self.check_context(p + n, f"{what} {n} tokens after {p} cartridge tokens",
                           "pass a shorter sequence or use a smaller cartridge")
        cache, p = prefix_cache(self, cartridges or [], batch_size=1)
        return dict(input_ids=ids.to(self.device)[None],
                    attention_mask=torch.ones(1, p + n, dtype=torch.long, device=self.device),
                    position_ids=torch.arange(p, p + n, device=self.device)[None],
                    past_key_values=cache, use_cache=cache is not None)

    @torch.inference_mode()
    def logits(self, input_ids: Sequence[int] | torch.Tensor, cartridges: Sequence[KVPrefix] | None = None) -> torch.Tensor:
        """Float32 next-token logits ``[n, vocab]`` for every position of `input_ids`, placed after `cartridges`."""
        return self.model(**self._after(input_ids, cartridges, "Scoring")).logits[0].float()

    @torch.inference_mode()
    def hidden(self, input_ids: Sequence[int] | torch.Tensor, cartridges: Sequence[KVPrefix] | None = None) -> torch.Tensor:
        """The last hidden states ``[n, hidden]`` of `input_ids` placed after `cartridges`: the model's body alone,
        for a pass whose use is what its attention reads (a `recording`), where the LM head's logits would cost a
        fifth of the pass for nothing."""
        return self.model.base_model(**self._after(input_ids, cartridges, "Reading")).last_hidden_state[0]

    @torch.inference_mode()
    def kv(self, input_ids: Sequence[int] | torch.Tensor, *, start_position: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer ``(keys, values)`` of shape ``[kv_heads, n, head_dim]`` for `input_ids` at positions from `start_position`."""
        ids = torch.as_tensor(list(input_ids) if not torch.is_tensor(input_ids) else input_ids, dtype=torch.long)
        ids = ids.to(self.device)[None]
        n = ids.shape[1]
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        self.model.base_model(
            input_ids=ids,
            attention_mask=torch.ones(1, n, dtype=torch.long, device=self.device),
            position_ids=torch.arange(start_position, start_position + n, device=self.device)[None],
            past_key_values=cache,
            use_cache=True,
        )
        return [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]

    # -- answering -------------------------------------------------------------------------------------
    @property
    def auto_runtime(self) -> str:
        """The runtime ``"auto"`` stands for with this model (`runtime_choice.choose_runtime`), chosen on first use and
        kept, so a call that leaves the runtime to its default does not look through the installed plugins again."""
        if self._auto_runtime is None:
            self._auto_runtime = choose_runtime(self)
        return self._auto_runtime

    def get_runtime(self, name: str = "auto", **options: Any) -> Runtime:
        """The runtime registered as `name`, serving this model; built once per name and options, then reused,
        since an engine can take seconds to start. `close()` releases every runtime made here. ``"auto"`` is the
        fastest installed one for this model here (`runtime_choice`), the same object as when it is named."""
        name = runtime_name(name, self, options)
        key = (name, json.dumps(options, sort_keys=True, default=repr))
        if key not in self._runtimes:
            self._runtimes[key] = runtimes.create(name, self, **options)
        return self._runtimes[key]

    def _runtime(self, runtime: str | Runtime, options: dict[str, Any] | None) -> Runtime:
        if options is not None and not isinstance(options, dict):
            raise ConfigError(f"runtime_options={options!r:.60} must be a dict of option names to values.")
        if isinstance(runtime, str):
            return self.get_runtime(runtime, **(options or {}))
        return runtimes.resolve(runtime, self, options)[0]  # an object: used as it is, options refused

    def close(self) -> None:
        """Close every runtime this model started (engines, servers); the model itself stays usable."""
        started, self._runtimes = list(self._runtimes.values()), {}
        for rt in started:
            rt.close()

    def chat(
        self,
        messages: Sequence[Message],
        cartridges: Sequence[KVPrefix] | None = None,
        *,
        stream: bool = False,
        runtime: str | Runtime = "auto",
        runtime_options: dict[str, Any] | None = None,
        **gen: Any,
    ) -> str | Iterator[str]:
        """Answer a conversation with zero, one or several cartridges as the prefix; `stream=True` yields text pieces.

        `runtime` is a registered runtime name (``cartridges backends`` lists them), ``"auto"`` (the fastest installed
        one for this model: `runtime_choice`) or a `Runtime` object.
        """
        request = GenerationRequest(messages, list(cartridges or []), GenerationParams.from_kwargs(gen))
        rt = self._runtime(runtime, runtime_options)
        if stream:
            return rt.stream(request)
        return rt.generate([request])[0].text

    def ask(
        self,
        question: str | Sequence[str],
        cartridges: Sequence[KVPrefix] | None = None,
        *,
        runtime: str | Runtime = "auto",
        runtime_options: dict[str, Any] | None = None,
        document: str | Sequence[int] | None = None,
        **gen: Any,
    ) -> str | list[str]:
        """Answer one question (returns a str) or several at once, batched (returns a list).

        `document` puts a text (or its token ids) in context, after any cartridges and before the question: the
        in-context answer a cartridge of that text stands in for, or a store's passages (`CartridgeStore.ask`)."""
        params = GenerationParams.from_kwargs(gen)
        questions = [question] if isinstance(question, str) else list(question) if isinstance(question, (list, tuple)) else []
        if not questions or not all(isinstance(q, str) and q.strip() for q in questions):
            raise ConfigError(f"ask() needs a non-empty question string or list of them, got {question!r}.")
        cartridges = list(cartridges or [])
        if isinstance(document, (list, tuple)) and document:
            prefix = self.check_ids(document, "document")
        elif document is None:
            prefix = ()
        elif isinstance(document, str) and document.strip():
            prefix = self.encode(document)
        else:
            raise ConfigError(f"document= must be a non-empty text or list of token ids, got {document!r:.60}.")
        requests = [GenerationRequest([{"role": "user", "content": q}], cartridges, params, prefix_ids=prefix)
                    for q in questions]
        texts = [c.text for c in self._runtime(runtime, runtime_options).generate(requests)]
        return texts[0] if isinstance(question, str) else texts


def rope_inv_freq(lm: LM) -> torch.Tensor:
    """The model's RoPE inverse frequencies, refusing RoPE variants where a position shift is not a rotation."""
    rope = lm.identity.architecture.get("rope") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in POSITION_ADDITIVE_ROPE:
        raise UnsupportedModelError(
            f"Model {lm.name!r} uses rope_type={rope_type!r}, whose angles are not position * frequency, so keys "
            f"cannot be moved exactly; compose with reposition=False (supported: {sorted(POSITION_ADDITIVE_ROPE)})."
        )
    for name, buf in lm.model.named_buffers():
        if name.endswith("inv_freq") and "original" not in name:
            return buf.detach().float()
    raise UnsupportedModelError(
        f"Model {lm.name!r} has no RoPE inv_freq buffer; repositioning needs rotary position embeddings."
    )
