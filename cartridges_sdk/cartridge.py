"""`Cartridge`: per-layer KV tensors plus `CartridgeMeta`; constructors, composition, binding to a model, answering.

A cartridge of ``p`` tokens holds, for every layer, ``keys`` and ``values`` of shape ``[kv_heads, p, head_dim]``.
Keys are stored after RoPE for positions ``0..p-1``; whatever follows the cartridge starts at position ``p``.

Longer than 400 lines because `Cartridge` is the SDK's one public object: its constructors, files, composition and
cutting, binding and answering are its own methods, each short, so that a user finds all of them on it.
"""

from __future__ import annotations

import functools
import numbers
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from .checks import PATH, require
from .errors import CartridgeFormatError, ConfigError, IncompatibleCartridgeError
from .fileformat import SHAPE_FIELDS, CartridgeMeta, read_file, write_file
from .generation import Message
from .identity import content_fingerprint, token_fingerprint
from .interop import load_authors_pt, load_peft, save_peft
from .lm import LM, rope_inv_freq
from .rope import ROTATE_HALF, convert_pairing, key_layout, one_after_another

if TYPE_CHECKING:
    from .plugins import Runtime
    from .protocols import ModelFacts

class Cartridge:
    """A trained (or initial) KV prefix for one model. Bound to an `LM` (``.lm``) it can answer questions."""

    def __init__(
        self,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        meta: CartridgeMeta,
        lm: LM | None = None,
    ):
        keys, values = list(keys), list(values)
        if not keys or len(keys) != len(values):
            raise ConfigError(f"A cartridge needs keys and values for every layer; got {len(keys)} and {len(values)} layers.")
        shape = tuple(keys[0].shape)
        if len(shape) != 3:
            raise ConfigError(f"Per-layer keys must be [kv_heads, tokens, head_dim]; got shape {shape}.")
        for i, (k, v) in enumerate(zip(keys, values)):
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise ConfigError(
                    f"Layer {i} has keys {tuple(k.shape)} and values {tuple(v.shape)}; every layer must be {shape}."
                )
        if shape[1] != meta.num_tokens:
            raise ConfigError(f"Tensors hold {shape[1]} tokens but meta.num_tokens={meta.num_tokens}.")
        arch = meta.model.architecture
        for key, got in (("num_layers", len(keys)), ("num_kv_heads", shape[0]), ("head_dim", shape[2])):
            if key in arch and arch[key] != got:
                raise ConfigError(f"Tensors have {key}={got} but the cartridge's model has {key}={arch[key]}.")
        self.keys = keys
        self.values = values
        self.meta = meta
        self.lm = None
        if lm is not None:
            self.check_model(lm)
            self.lm = lm

    # -- facts -----------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    @property
    def num_frozen(self) -> int:
        return self.meta.num_frozen

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def pairing(self) -> str:
        """Which key dimensions rotate together: ``"rotate_half"`` (Hugging Face) or ``"interleaved"``."""
        return self.meta.key_layout["pairing"]

    @property
    def quality(self) -> dict[str, Any] | None:
        """The quality report made when it was built or by `cartridges eval` (``recovered``, ``kl``, ``agreement``,
        ...; docs/quality-report.md), or None."""
        report = self.meta.extra.get("quality")
        return report if isinstance(report, dict) else None

    @functools.cached_property
    def fingerprint(self) -> str:
        """A stable hash of the tensors and of what decides how they are served (model, layout, dtype): equal
        content gives an equal fingerprint, so an engine installs a cartridge once and reuses it for every request."""
        facts = {"model": self.meta.model.fingerprint, "key_layout": self.meta.key_layout, "num_tokens": self.num_tokens}
        return content_fingerprint([t for pair in zip(self.keys, self.values) for t in pair], facts)

    def in_key_pairing(self, pairing: str) -> Cartridge:
        """This cartridge with its keys re-laid in `pairing` (itself when already so); exact, a permutation of each
        head's dimensions. Engines whose RoPE pairs dimensions otherwise convert explicitly with this."""
        if pairing == self.pairing:
            return self
        arch = self.meta.model.architecture
        head_dim = self.keys[0].shape[-1]
        rotary = int(round(head_dim * float(arch.get("partial_rotary_factor", 1.0))))
        keys = [convert_pairing(k, self.pairing, pairing, rotary) for k in self.keys]
        meta = attrs.evolve(self.meta, key_layout=key_layout(pairing))
        return Cartridge(keys, self.values, meta, lm=self.lm)

    @property
    def nbytes(self) -> int:
        """Memory of the KV tensors: what serving this cartridge costs per copy."""
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values])

    def truncated(self, num_tokens: int) -> Cartridge:
        """Its first `num_tokens` tokens (itself if it has no more), to fit a budget shared with passages
        (`CartridgeStore.plan(trim=True)`, docs/sync.md); a composed one keeps its first parts, the last clipped."""
        whole = isinstance(num_tokens, numbers.Integral) and not isinstance(num_tokens, bool)
        if whole and num_tokens >= self.num_tokens:
            return self
        if not whole or num_tokens <= self.num_frozen:
            raise ConfigError(f"truncated({num_tokens!r}): keep an int of tokens greater than the cartridge's "
                              f"{self.num_frozen} frozen attention-sink token(s).")
        parts = tuple({**p, "num_tokens": min(p["num_tokens"], num_tokens - p["offset"]),
                       "num_frozen": min(p.get("num_frozen", 0), num_tokens - p["offset"])}
                      for p in self.meta.parts if p["offset"] < num_tokens)
        extra = {k: v for k, v in self.meta.extra.items() if k != "quality"}  # measured on the whole cartridge
        meta = attrs.evolve(self.meta, num_tokens=int(num_tokens), parts=parts, extra=extra)
        return Cartridge([k[:, :num_tokens] for k in self.keys], [v[:, :num_tokens] for v in self.values], meta,
                         lm=self.lm)

    @property
    def sinks(self) -> list[int]:
        """The frozen attention-sink tokens: the first `num_frozen`, and in a composition each part's own."""
        if not self.meta.parts:
            return list(range(self.num_frozen))
        return sorted({p["offset"] + i for p in self.meta.parts for i in range(p.get("num_frozen", 0))})

    def selected(self, kept: Sequence[torch.Tensor]) -> Cartridge:
        """The tokens `kept` of each layer and kv head (one ``[kv_heads, n]`` tensor of token indices a layer), each
        head's in ascending order and holding every sink (`sinks`), so that a cut can keep what a question reads
        most (`serve/attended.py`) where `truncated` keeps the first n. Kept keys keep the rotation of their place in
        the whole cartridge while what follows starts at n: a trained cartridge's places are learned, and this kept
        more than re-placing them at 0..n-1 did (docs/vs-rag.md, "Cutting by the question's attention"). Heads keep
        different tokens, so the result has no part spans; ``meta.extra["selected_from"]`` says how many it had."""
        kept = list(kept)
        n = int(kept[0].shape[-1]) if kept and kept[0].ndim == 2 else -1
        want = (self.keys[0].shape[0], n)
        if len(kept) != self.num_layers or any(tuple(k.shape) != want for k in kept) or n < 1:
            raise ConfigError(f"selected() takes one [kv_heads={want[0]}, n] tensor of token indices for each of the "
                              f"{self.num_layers} layers, the same n for all; got shapes "
                              f"{[tuple(k.shape) for k in kept[:3]]}{'...' if len(kept) > 3 else ''}.")
        sinks = self.sinks
        if not len(sinks) < n < self.num_tokens:
            raise ConfigError(f"selected() keeps n={n} of {self.num_tokens} tokens; keep more than its {len(sinks)} "
                              "sink token(s) and fewer than all (or use the whole cartridge).")
        for k in kept:
            k = k.cpu()
            rising = bool((k[:, 1:] > k[:, :-1]).all()) and k.min() >= 0 and k.max() < self.num_tokens
            if not rising or not all(set(sinks) <= set(row) for row in k.tolist()):
                raise ConfigError(f"selected()'s indices must rise within 0..{self.num_tokens - 1} and keep the sink "
                                  f"token(s) {sinks} in every head.")
        keys, values = [], []
        for k, v, idx in zip(self.keys, self.values, kept):
            at = idx.to(k.device)[..., None].expand(-1, -1, k.shape[-1])
            keys.append(k.gather(1, at))
            values.append(v.gather(1, at))
        extra = {**{k: v for k, v in self.meta.extra.items() if k != "quality"}, "selected_from": self.num_tokens}
        meta = attrs.evolve(self.meta, num_tokens=n, parts=(), extra=extra)
        return Cartridge(keys, values, meta, lm=self.lm)

    def __repr__(self) -> str:
        return (
            f"Cartridge(model={self.meta.model.name!r}, num_tokens={self.num_tokens}, num_frozen={self.num_frozen}, "
            f"init={self.meta.init!r}, nbytes={self.nbytes}, bound={self.lm is not None})"
        )

    # -- binding ---------------------------------------------------------------------------------------
    def misfit(self, lm: ModelFacts) -> str | None:
        """Why this cartridge cannot run on `lm`, or None if it can: the model its metadata names must report the
        fields that shape a KV cache and agree with `lm` on every field both report, and the tensors themselves must
        have `lm`'s layers, kv heads and head dim (metadata alone is only the file's word)."""
        arch = self.meta.model.architecture
        unreported = [f for f in SHAPE_FIELDS if f not in arch]
        if unreported:
            return (f"its metadata does not say which model it was made for ({', '.join(unreported)} not reported), "
                    "so nothing shows it fits")
        problem = self.meta.model.mismatch(lm.identity)
        if problem:
            return problem
        kv_heads, _, head_dim = self.keys[0].shape
        have = {"num_layers": len(self.keys), "num_kv_heads": kv_heads, "head_dim": head_dim}
        want = {"num_layers": lm.num_layers, "num_kv_heads": lm.num_kv_heads, "head_dim": lm.head_dim}
        wrong = [f"{f}: tensors have {have[f]}, the model {want[f]}" for f in SHAPE_FIELDS if have[f] != want[f]]
        return "; ".join(wrong) or None

    def check_model(self, lm: ModelFacts, whose: str = "model", what: str = "The cartridge") -> None:
        """The wrong-model check, the one every loader, store, import and runtime makes: raise
        `IncompatibleCartridgeError` naming both models and why (`misfit`) when this cartridge cannot run on `lm`.
        `what` names the cartridge in the message (e.g. the file it was imported from), `whose` the model (e.g.
        "the store's")."""
        problem = self.misfit(lm)
        if problem:
            raise IncompatibleCartridgeError(
                f"{what} is for model {self.meta.model.name!r}, not {whose} {lm.name!r}, and does not fit it: "
                f"{problem}. Use it with the model it was made for, or make it again for this one."
            )

    def bind(self, lm: LM) -> Cartridge:
        """The same cartridge attached to `lm` (checked for compatibility), so `ask`/`chat` can run."""
        require("model", lm, LM, "a model from load_model()")
        return Cartridge(self.keys, self.values, self.meta, lm=lm)

    def _bound(self) -> LM:
        if self.lm is None:
            raise ConfigError(
                "This cartridge is not bound to a model. Use Cartridge.load(path, model=lm) or cartridge.bind(lm)."
            )
        return self.lm

    # -- constructors ----------------------------------------------------------------------------------
    @classmethod
    def _from_kv(cls, lm: LM, kv: list[tuple[torch.Tensor, torch.Tensor]], **meta: Any) -> Cartridge:
        keys = [k.detach().clone() for k, _ in kv]
        values = [v.detach().clone() for _, v in kv]
        info = CartridgeMeta(model=lm.identity, num_tokens=keys[0].shape[1], dtype=str(keys[0].dtype).removeprefix("torch."), **meta)
        return cls(keys, values, info, lm=lm)

    @staticmethod
    def check_size(num_tokens: int, num_frozen: int, available: int | None = None) -> None:
        """Refuse a size no cartridge can have: more frozen tokens than tokens, or more tokens than the text has."""
        if isinstance(num_frozen, bool) or not isinstance(num_frozen, numbers.Integral) or num_frozen < 0:
            raise ConfigError(f"num_frozen={num_frozen!r} must be an int >= 0 (the leading tokens that never train).")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral) or num_tokens <= num_frozen:
            raise ConfigError(
                f"num_tokens={num_tokens!r} must be an int greater than num_frozen={num_frozen} "
                "(the frozen attention-sink tokens alone cannot learn anything)."
            )
        if available is not None and num_tokens > available:
            raise ConfigError(
                f"num_tokens={num_tokens} is more than the {available} tokens the text has; "
                f"pass num_tokens <= {available} or a longer text."
            )

    @classmethod
    def from_prefix(
        cls, lm: LM, text_or_ids: str | Sequence[int] | torch.Tensor, num_tokens: int, *, num_frozen: int = 1
    ) -> Cartridge:
        """The KV of the first `num_tokens` tokens of a text (tokenized as the model expects) or of given token ids.

        Untrained, this is exactly the model with those tokens in context: the paper's default initialisation.
        """
        if not isinstance(text_or_ids, (str, list, tuple, torch.Tensor)):
            raise ConfigError(f"from_prefix takes a text or a list of token ids, got {type(text_or_ids).__name__}.")
        if isinstance(text_or_ids, str):
            if not text_or_ids.strip():
                raise ConfigError("The text is empty; from_prefix needs a text with at least num_tokens tokens.")
            ids = lm.encode(text_or_ids)
        else:
            ids = lm.check_ids(text_or_ids, "from_prefix")
        cls.check_size(num_tokens, num_frozen, len(ids))
        lm.check_context(num_tokens, f"A {num_tokens}-token prefix cartridge", "pass a smaller num_tokens")
        corpus = {"fingerprint": token_fingerprint(ids), "num_tokens": len(ids)}
        return cls._from_kv(lm, lm.kv(ids[:num_tokens]), num_frozen=num_frozen, init="prefix", corpus=corpus)

    @classmethod
    def compact(cls, lm: LM, corpus: Any, num_tokens: int, *, num_frozen: int = 1, config: Any = None,
                progress: bool = True, report: Any = True) -> Cartridge:
        """A `num_tokens` cartridge that stands in for the whole corpus, in seconds and with no training.

        Per layer and KV head it keeps the attention sink and the keys the corpus's own queries (and those of a few
        probe questions about it) attend to most, and refits their values so attention outputs match the whole
        corpus's (`cartridges_sdk.making.compaction`). At ``num_tokens`` = the corpus length it equals `from_prefix`.
        A corpus longer than the model's context is compacted per chunk and composed. `corpus` is a text, a path,
        a `Corpus` or token ids; `config` a `CompactionConfig`.
        Then the cartridge is checked against its corpus on questions the model asks itself (`quality`,
        docs/quality-report.md): `report` True, a `ReportConfig`, or False to skip it.
        """
        from .making.compaction import compact_corpus  # the facade: the making layer, imported here (docs/architecture.md)

        return compact_corpus(lm, corpus, num_tokens, num_frozen=num_frozen, config=config, progress=progress,
                              report=report)

    @classmethod
    def from_random_text(cls, lm: LM, num_tokens: int, seed: int = 0, *, num_frozen: int = 1) -> Cartridge:
        """The KV of text unrelated to any corpus (shipped with the package); `seed` picks where in it to start."""
        cls.check_size(num_tokens, num_frozen)
        require("seed", seed, int, "an integer")
        ids = lm.unrelated_ids(num_tokens, seed)
        return cls._from_kv(lm, lm.kv(ids), num_frozen=num_frozen, init="random_text", extra={"seed": seed})

    @classmethod
    def random(cls, lm: LM, num_tokens: int, seed: int = 0, *, num_frozen: int = 1) -> Cartridge:
        """Gaussian vectors with the per-layer, per-channel mean and spread of the model's real KV."""
        cls.check_size(num_tokens, num_frozen)
        require("seed", seed, int, "an integer")
        reference = lm.kv(lm.unrelated_ids(256, 0))
        gen = torch.Generator().manual_seed(seed)
        kv = []
        for k, v in reference:
            pair = []
            for t in (k[:, 1:].float().cpu(), v[:, 1:].float().cpu()):  # token 0 is an outlier sink
                mean, std = t.mean(dim=1, keepdim=True), t.std(dim=1, keepdim=True)
                noise = torch.randn(t.shape[0], num_tokens, t.shape[2], generator=gen)
                pair.append((mean + std * noise).to(lm.device, lm.dtype))
            kv.append((pair[0], pair[1]))
        return cls._from_kv(lm, kv, num_frozen=num_frozen, init="random", extra={"seed": seed})

    @classmethod
    def from_corpus(cls, corpus: Any, model: Any = None, **settings: Any) -> Cartridge:
        """Train a cartridge on `corpus` by self-study; `cartridges_sdk.making.selfstudy.build_cartridge` has the
        settings. ``recipe="reader"`` takes those measured best for a reader that asks useful questions (the 0.5B and
        up; `making.settings.RECIPES`); settings given beside it win over the recipe's."""
        from .making.selfstudy import build_with_recipe  # the facade: the making layer, imported here (docs/architecture.md)

        return build_with_recipe(corpus, model, **settings)

    # -- file format -----------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write one ``.safetensors`` file atomically (a crash leaves the old file or none, never half of one)."""
        return write_file(path, self.keys, self.values, self.meta)

    @classmethod
    def load(cls, path: str | os.PathLike, model: LM | None = None, *, data: bool = True) -> Cartridge:
        """Read a cartridge file (`cartridges_sdk.fileformat`); with `model`, check it fits and bind it. With
        ``data=False`` only its header is read and checked: the tensors are on the ``meta`` device (shapes and
        dtypes, no values), for a store that checks many files and answers from few."""
        require("path", path, PATH, "a file path")
        if model is not None:
            require("model", model, LM, "a model from load_model()")
        path = Path(path)
        if not path.is_file():
            raise CartridgeFormatError(f"No cartridge file at {str(path)!r}; check the path.")
        keys, values, meta = read_file(path, data=data)
        try:
            cartridge = cls(keys, values, meta)
        except ConfigError as err:
            raise CartridgeFormatError(f"{str(path)!r} is inconsistent: {err}") from err
        return cartridge.bind(model) if model is not None else cartridge

    # -- interop ---------------------------------------------------------------------------------------
    def to_peft(self, directory: str | os.PathLike) -> Path:
        """Export as a peft CARTRIDGE adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        return save_peft(self.keys, self.values, self.meta, Path(directory))

    @classmethod
    def from_peft(cls, directory: str | os.PathLike, model: LM | None = None) -> Cartridge:
        """Import a peft CARTRIDGE adapter directory; pass `model` to check it and bind it."""
        return cls._imported(load_peft(Path(directory)), model)

    @classmethod
    def from_authors_pt(cls, path: str | os.PathLike, model: LM | None = None, *, name: str | None = None) -> Cartridge:
        """Import a cache saved by the paper authors' code (``.pt`` with trainable and frozen/fixed keys and values)."""
        return cls._imported(load_authors_pt(Path(path), name=name), model)

    @classmethod
    def _imported(cls, parts: tuple[list[torch.Tensor], list[torch.Tensor], CartridgeMeta], model: LM | None) -> Cartridge:
        cartridge = cls(*parts)  # shapes checked against the file's own description first
        if model is None:
            return cartridge
        if cartridge.meta.init != "imported":  # written by this SDK: its metadata names its model
            return cartridge.bind(model)
        # the file knew only its shapes: checked against `model`'s, it is then known to be for `model`
        cartridge.check_model(model, what=cartridge.meta.extra["imported_from"])
        return cls(cartridge.keys, cartridge.values, attrs.evolve(cartridge.meta, model=model.identity), lm=model)

    # -- composition -----------------------------------------------------------------------------------
    @classmethod
    def compose(
        cls, cartridges: Sequence[Cartridge], reposition: bool = False, *, model: LM | None = None
    ) -> Cartridge:
        """One cartridge for several corpora: the parts' tokens one after another.

        Every token of every part is kept, the parts' own attention sinks included (each part was trained with its
        sink in front of it). The result's ``num_frozen`` is the first part's, so the leading sink stays frozen if the
        composition is trained further; ``meta.parts`` records each part's span, sink count and corpus.

        ``reposition=False`` (the paper's composition) keeps each part's keys at the positions it was made at.
        ``reposition=True`` rotates each later part's keys so it sits at the positions that follow the earlier parts,
        exactly as if it had been computed there; it needs the model (bound, or `model=`) for its RoPE frequencies.
        """
        cartridges = list(cartridges)
        if not cartridges:
            raise ConfigError("compose() needs at least one cartridge.")
        for i, c in enumerate(cartridges):
            require(f"cartridges[{i}]", c, Cartridge, "a Cartridge")
        first = cartridges[0]
        for other in cartridges[1:]:
            problem = first.meta.model.mismatch(other.meta.model)
            if problem:
                raise IncompatibleCartridgeError(
                    f"Cannot compose a cartridge for model {first.meta.model.name!r} with one for model "
                    f"{other.meta.model.name!r}: {problem}."
                )
        lm = model or next((c.lm for c in cartridges if c.lm is not None), None)
        # one key layout for all parts; shifting positions is done in the rotate-half layout
        pairing = ROTATE_HALF if reposition else first.pairing
        cartridges = [c.in_key_pairing(pairing) for c in cartridges]
        if reposition and lm is None:
            raise ConfigError("compose(reposition=True) needs the model: bind the cartridges or pass model=lm.")
        parts, offset = [], 0
        for c in cartridges:
            parts.append(
                {
                    "offset": offset,
                    "num_tokens": c.num_tokens,
                    "num_frozen": c.num_frozen,
                    "init": c.meta.init,
                    "corpus": c.meta.corpus,
                    "repositioned": bool(reposition and offset),
                }
            )
            offset += c.num_tokens
        layers = one_after_another([list(zip(c.keys, c.values)) for c in cartridges],
                                   rope_inv_freq(lm) if reposition else None, dtype=first.keys[0].dtype)
        cat_k, cat_v = [k for k, _ in layers], [v for _, v in layers]
        meta = CartridgeMeta(
            model=first.meta.model,
            num_tokens=offset,
            num_frozen=first.num_frozen,
            dtype=first.meta.dtype,
            init="composed",
            parts=tuple(parts),
            extra={"reposition": reposition},
            key_layout=key_layout(pairing),
        )
        return cls(cat_k, cat_v, meta, lm=lm)

    # -- answering -------------------------------------------------------------------------------------
    def ask(
        self, question: str | Sequence[str], *, runtime: str | Runtime = "auto",
        runtime_options: dict[str, Any] | None = None, **gen: Any,
    ) -> str | list[str]:
        """Answer a question (or a batch of them) with this cartridge as the model's context.

        `runtime` is a registered runtime name (``"hf"``, or an installed plugin's), ``"auto"`` (the fastest
        installed one for the model: `runtime_choice`) or a `Runtime` object.
        """
        return self._bound().ask(question, cartridges=[self], runtime=runtime, runtime_options=runtime_options, **gen)

    def chat(
        self, messages: Sequence[Message], stream: bool = False, *, runtime: str | Runtime = "auto",
        runtime_options: dict[str, Any] | None = None, **gen: Any,
    ) -> str | Iterator[str]:
        """Continue a conversation with this cartridge as context; `stream=True` yields text as it is generated."""
        return self._bound().chat(messages, cartridges=[self], stream=stream, runtime=runtime,
                                  runtime_options=runtime_options, **gen)

    def logits(self, input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Next-token logits of `input_ids` placed after this cartridge (see `LM.logits`)."""
        return self._bound().logits(input_ids, cartridges=[self])
