"""`Cartridge.from_corpus`: self-study synthesis, then distillation training, wired from flat settings."""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path
from typing import Any

import attrs
import torch

from .cartridge import Cartridge
from .corpus import Corpus
from .errors import ConfigError
from .models import LM, load_model
from .plugins import Synthesizer, Trainer
from .synthesis import HFSynthesizer, SynthesisConfig, synthesize
from .training import TorchTrainer, TrainConfig

INITS = ("prefix", "random_text", "random")
_SYNTH_FIELDS = {f.name for f in attrs.fields(SynthesisConfig)} - {"num_conversations", "seed"}
_TRAIN_FIELDS = {f.name for f in attrs.fields(TrainConfig)} - {"epochs", "seed"}


def _work_copy(lm: LM, dtype: torch.dtype | None) -> LM:
    """The model to synthesize and train with: `lm` itself, or a copy in a faster dtype (the result stays with `lm`)."""
    if dtype is None or dtype == lm.dtype:
        return lm
    clone = LM(copy.deepcopy(lm.model).to(dtype), lm.tokenizer, name=lm.name, source=lm.identity.source,
               revision=lm.identity.revision)
    return clone


def initial_cartridge(lm: LM, corpus: Corpus, num_tokens: int, init: str, seed: int, num_frozen: int = 1) -> Cartridge:
    if init == "prefix":
        ids = lm.encode(corpus.text)
        if len(ids) < num_tokens:
            raise ConfigError(
                f"init='prefix' needs num_tokens <= the corpus's {len(ids)} tokens (got {num_tokens}); "
                "use a smaller num_tokens or init='random_text'."
            )
        return Cartridge.from_prefix(lm, ids, num_tokens, num_frozen=num_frozen)
    if init == "random_text":
        return Cartridge.from_random_text(lm, num_tokens, seed=seed, num_frozen=num_frozen)
    if init == "random":
        return Cartridge.random(lm, num_tokens, seed=seed, num_frozen=num_frozen)
    raise ConfigError(f"init={init!r} must be one of {INITS}.")


def build_cartridge(
    corpus: Any,
    model: Any = None,
    *,
    num_tokens: int,
    num_conversations: int = 256,
    epochs: int = 1,
    init: str = "prefix",
    seed: int = 0,
    synthesizer: Synthesizer | None = None,
    trainer: Trainer | None = None,
    output_dir: str | os.PathLike | None = None,
    num_frozen: int = 1,
    work_dtype: str | torch.dtype | None = None,
    progress: bool = True,
    **settings: Any,
) -> Cartridge:
    """Synthesize `num_conversations` self-study conversations about `corpus`, then train a `num_tokens` cartridge.

    `settings` are fields of `SynthesisConfig` and `TrainConfig` (e.g. ``lr=``, ``max_tokens_b=``, ``min_chunk=``).
    With `output_dir`, the dataset (``data/``) and training checkpoints (``train/``) are kept there and a re-run
    resumes both stages; without it they live in a temporary folder. `work_dtype` is the dtype synthesis and
    training compute in (default: the model's); the returned cartridge is bound to the original model.
    """
    unknown = sorted(set(settings) - _SYNTH_FIELDS - _TRAIN_FIELDS)
    if unknown:
        raise ConfigError(
            f"Unknown setting(s) {unknown}. Synthesis settings: {sorted(_SYNTH_FIELDS)}; "
            f"training settings: {sorted(_TRAIN_FIELDS)}."
        )
    if init not in INITS:
        raise ConfigError(f"init={init!r} must be one of {INITS}.")
    lm = model if isinstance(model, LM) else load_model(model)
    corpus = Corpus.coerce(corpus)
    from .models import resolve_dtype

    work = _work_copy(lm, resolve_dtype(work_dtype))
    synth_cfg = SynthesisConfig(
        num_conversations=num_conversations, seed=seed, **{k: v for k, v in settings.items() if k in _SYNTH_FIELDS}
    )
    train_cfg = TrainConfig(epochs=epochs, seed=seed, **{k: v for k, v in settings.items() if k in _TRAIN_FIELDS})
    init_cartridge = initial_cartridge(lm, corpus, num_tokens, init, seed, num_frozen)

    with tempfile.TemporaryDirectory(prefix="cartridges-") as tmp:
        root = Path(output_dir) if output_dir is not None else Path(tmp)
        dataset = synthesize(
            corpus, work, root / "data", synth_cfg, synthesizer=synthesizer or HFSynthesizer(work), progress=progress
        )
        trainer = trainer or TorchTrainer(train_cfg, output_dir=root / "train", progress=progress)
        trained = trainer.fit(init_cartridge.bind(work), dataset, work)
    meta = attrs.evolve(
        trained.meta,
        model=lm.identity,
        corpus={"fingerprint": corpus.fingerprint(), "num_tokens": len(corpus.token_ids(lm)), "documents": len(corpus.documents)},
        training={
            **(trained.meta.training or {}),
            "init": init,
            "synthesis": attrs.asdict(synth_cfg),
            "num_conversations": num_conversations,
            "work_dtype": str(work.dtype).removeprefix("torch."),
        },
    )
    return Cartridge([k.to(lm.dtype) for k in trained.keys], [v.to(lm.dtype) for v in trained.values], meta, lm=lm)
