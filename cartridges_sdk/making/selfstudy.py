"""`Cartridge.from_corpus`: self-study synthesis, then distillation training, wired from flat settings."""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from ..cartridge import Cartridge
from ..checks import PATH, require
from ..errors import ConfigError
from ..identity import token_fingerprint
from ..lm import LM, resolve_dtype
from ..models import load_model
from ..plugins import Synthesizer, Trainer, synthesizers, trainers
from .checkpoint import CHECKPOINT, RUN_LOG
from .corpus import Corpus
from .dataset import CORPUS_TEXT, SelfStudyDataset
from .distractors import check_among, check_distractors
from .distributed import is_lead, lead_does, process_group, ranks_in_env, under_torchrun
from .loss import check_shardable
from .synthesis import DEFAULT_CONVERSATIONS, SynthesisConfig, check_capabilities, check_context, synthesize
from .training import TrainConfig

INITS = ("compact", "prefix", "random_text", "random")
# where training starts: the corpus compacted (measured best, docs/self-study.md)
DEFAULT_INIT = "compact"
COMPACT_START = "start-compact.safetensors"  # kept in the training folder, so a resumed run starts from it
SYNTHESIS_SETTINGS = {f.name for f in attrs.fields(SynthesisConfig)} - {"num_conversations", "seed"}
TRAINING_SETTINGS = {f.name for f in attrs.fields(TrainConfig)} - {"epochs", "seed"}


# arguments of their own (keywords of from_corpus, flags of the CLI), never given as flat settings
OWN_ARGUMENTS = ("num_tokens", "num_conversations", "epochs", "seed", "init", "num_frozen")


def split_settings(settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Flat keyword settings -> (synthesis, training) settings, refusing unknown names."""
    own = sorted(set(settings) & set(OWN_ARGUMENTS))
    if own:
        flags = ", ".join(f"--{k.removeprefix('num_').replace('_', '-')}" for k in own)
        raise ConfigError(f"{own} are arguments of their own ({flags} on the command line), not --set settings.")
    unknown = sorted(set(settings) - SYNTHESIS_SETTINGS - TRAINING_SETTINGS)
    if unknown:
        raise ConfigError(
            f"Unknown setting(s) {unknown}. Synthesis settings: {sorted(SYNTHESIS_SETTINGS)}; "
            f"training settings: {sorted(TRAINING_SETTINGS)}."
        )
    return (
        {k: v for k, v in settings.items() if k in SYNTHESIS_SETTINGS},
        {k: v for k, v in settings.items() if k in TRAINING_SETTINGS},
    )


def check_settings(
    settings: dict[str, Any], *, num_tokens: int, num_conversations: int = DEFAULT_CONVERSATIONS, epochs: int = 1, init: str = DEFAULT_INIT,
    seed: int = 0, num_frozen: int = 1,
) -> tuple[SynthesisConfig, TrainConfig]:
    """Every self-study setting of both stages, validated in one place before any model work; returns the configs.

    Each error names the setting, the bad value and the fix (`--set lr=abc` -> ``lr='abc' must be a finite number``).
    """
    synth_settings, train_settings = split_settings(settings)
    if init not in INITS:
        raise ConfigError(f"init={init!r} must be one of {INITS}.")
    Cartridge.check_size(num_tokens, num_frozen)
    if init == "compact" and num_frozen > 1:
        raise ConfigError(f"num_frozen={num_frozen}: init='compact' keeps one attention sink; use num_frozen=1 or 0, "
                          "or init='prefix'.")
    return (SynthesisConfig(num_conversations=num_conversations, seed=seed, **synth_settings),
            TrainConfig(epochs=epochs, seed=seed, **train_settings))


def work_model(lm: LM, dtype: str | torch.dtype | None) -> LM:
    """The model to synthesize and train with: `lm` itself, or a copy in another dtype."""
    dtype = resolve_dtype(dtype)
    if dtype is None or dtype == lm.dtype:
        return lm
    return LM(copy.deepcopy(lm.model).to(dtype), lm.tokenizer, name=lm.name, source=lm.identity.source,
              revision=lm.identity.revision, files=lm.files)


def check_prefix(prefix_ids: Sequence[int] | None, num_tokens: int) -> None:
    """Refuse a prefix initialisation the corpus cannot supply (before any minutes are spent on synthesis)."""
    if prefix_ids is None:
        raise ConfigError("init='prefix' needs the corpus (pass --corpus), or use init='random_text'.")
    if len(prefix_ids) < num_tokens:
        raise ConfigError(
            f"init='prefix' needs num_tokens <= the corpus's {len(prefix_ids)} tokens (got {num_tokens}); "
            "use a smaller num_tokens or init='random_text'."
        )


def check_whole(dataset: SelfStudyDataset) -> None:
    """Refuse to train on one shard of a synthesis (it holds 1/N of the data)."""
    if dataset.header.get("shard"):
        raise ConfigError(f"{str(dataset.path)!r} holds {dataset.holds()} of a synthesis, not the whole "
                          "dataset; gather the shards with `cartridges merge` (dataset.merge) and train on that.")


def dataset_corpus_ids(dataset: SelfStudyDataset, lm: LM, init: str) -> list[int] | None:
    """The corpus token ids a start of kind `init` needs, from the dataset alone: the whole corpus it keeps, or (a
    dataset made before datasets kept their corpus) the opening tokens its header keeps, enough for a prefix start
    only; None when the dataset cannot supply them (`initial_cartridge` then asks for the corpus)."""
    if init not in ("compact", "prefix"):
        return None
    text = dataset.corpus_text()
    if text is not None:
        return lm.encode(text)
    return dataset.header.get("corpus", {}).get("prefix_ids") if init == "prefix" else None


def check_dataset_corpus(dataset: SelfStudyDataset, corpus: Corpus | None = None,
                         prefix_ids: Sequence[int] | None = None) -> None:
    """Refuse a corpus (or its token ids, all or the first ones) that is not the one `dataset` was synthesized from."""
    recorded = dataset.header.get("corpus", {})
    kept = (dataset.path / CORPUS_TEXT).is_file()
    if corpus is not None and recorded.get("fingerprint") and corpus.fingerprint() != recorded["fingerprint"]:
        raise ConfigError(
            f"The corpus given ({len(corpus.documents)} document(s), fingerprint {corpus.fingerprint()}) is not the "
            f"one {str(dataset.path)!r} was synthesized from ({recorded.get('documents')} document(s), fingerprint "
            f"{recorded['fingerprint']}); " + ("leave --corpus out: the dataset keeps its corpus." if kept else
                                              "give the files it was made from, with the same --include/--exclude.")
        )
    opening = recorded.get("prefix_ids")
    if prefix_ids is not None and opening:
        n = min(len(prefix_ids), len(opening))
        if list(prefix_ids[:n]) != list(opening[:n]):
            first = next(i for i in range(n) if prefix_ids[i] != opening[i])
            raise ConfigError(
                f"The corpus token ids given differ from those of the corpus {str(dataset.path)!r} was synthesized "
                f"from at token {first}; " + ("leave prefix_ids out: the dataset keeps its corpus." if kept else
                                             "pass lm.encode(corpus.text) of the corpus it was made from.")
            )


def clear_training(folder: Path) -> None:
    """Delete a training folder's checkpoint, log and compacted start (nothing else), to start over."""
    for name in (CHECKPOINT, RUN_LOG, COMPACT_START):
        (folder / name).unlink(missing_ok=True)


def check_compact(corpus_ids: Sequence[int] | None, num_tokens: int) -> None:
    """Refuse a compacted start without the whole corpus (a dataset keeps only its first tokens)."""
    if corpus_ids is None:
        raise ConfigError("init='compact' (the default) needs the whole corpus: pass --corpus (the dataset keeps only "
                          "its opening tokens), or --init prefix.")
    if len(corpus_ids) < num_tokens:
        raise ConfigError(
            f"init='compact' needs num_tokens <= the corpus's {len(corpus_ids)} tokens (got {num_tokens}); "
            "use a smaller num_tokens or init='random_text'."
        )


def initial_cartridge(lm: LM, prefix_ids: Sequence[int] | None, num_tokens: int, init: str, seed: int,
                      num_frozen: int = 1, *, saved: Path | None = None, progress: bool = True) -> Cartridge:
    """The cartridge training starts from: the corpus compacted (`compact`, `prefix_ids` then holds the whole
    corpus), its first tokens (`prefix`), unrelated text, or random vectors.

    A compacted start is kept at `saved` when given and read back from there, so a resumed run starts from the
    very tensors the interrupted one did."""
    if init == "compact":
        if saved is not None and saved.is_file():
            kept = Cartridge.load(saved, lm)
            same = (kept.num_tokens, kept.num_frozen) == (num_tokens, num_frozen) and (
                prefix_ids is None or (kept.meta.corpus or {}).get("fingerprint") == token_fingerprint(prefix_ids))
            if same:
                return kept
        check_compact(prefix_ids, num_tokens)
        start = Cartridge.compact(lm, list(prefix_ids), num_tokens, num_frozen=num_frozen, progress=progress)
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            start.save(saved)
        return start
    if init == "prefix":
        check_prefix(prefix_ids, num_tokens)
        return Cartridge.from_prefix(lm, list(prefix_ids), num_tokens, num_frozen=num_frozen)
    if init == "random_text":
        return Cartridge.from_random_text(lm, num_tokens, seed=seed, num_frozen=num_frozen)
    if init == "random":
        return Cartridge.random(lm, num_tokens, seed=seed, num_frozen=num_frozen)
    raise ConfigError(f"init={init!r} must be one of {INITS}.")


def train_cartridge(
    dataset: SelfStudyDataset,
    lm: LM,
    *,
    num_tokens: int,
    epochs: int = 1,
    init: str = DEFAULT_INIT,
    seed: int = 0,
    prefix_ids: Sequence[int] | None = None,
    trainer: str | Trainer = "torch",
    trainer_options: dict[str, Any] | None = None,
    output_dir: str | os.PathLike | None = None,
    num_frozen: int = 1,
    work_dtype: str | torch.dtype | None = None,
    restart: bool = False,
    progress: bool = True,
    distractors: Sequence[Cartridge] = (),
    **settings: Any,
) -> Cartridge:
    """Train a `num_tokens` cartridge on a self-study dataset; the result is bound to `lm`.

    `trainer` is a registered trainer name (``"torch"``, built with `trainer_options`) or a `Trainer` object;
    `settings` are `TrainConfig` fields. A checkpoint in `output_dir` made with other settings is refused, naming
    them, unless ``restart=True``, which deletes it first. `distractors` (cartridges of other documents) are
    composed around the trainable one during training, up to ``max_distractors`` a step (making/distractors.py).
    """
    _, train_settings = split_settings(settings)
    if any(k not in TRAINING_SETTINGS for k in settings):
        raise ConfigError(f"{sorted(set(settings) - TRAINING_SETTINGS)} are synthesis settings; training takes "
                          f"{sorted(TRAINING_SETTINGS)}.")
    _, config = check_settings(train_settings, num_tokens=num_tokens, epochs=epochs, init=init, seed=seed,
                               num_frozen=num_frozen)
    distractors = check_distractors(distractors, lm)
    longest = max((c.num_tokens for c in dataset), default=0)
    lm.check_context(num_tokens + longest, f"Training a {num_tokens}-token cartridge on sequences of up to {longest} "
                     "tokens", "use a smaller num_tokens")
    check_among(lm, distractors, config, num_tokens + longest)
    header_model = dataset.header.get("model", {})
    if header_model.get("fingerprint") and header_model["fingerprint"] != lm.identity.fingerprint:
        raise ConfigError(
            f"The dataset was synthesized with model {header_model.get('name')!r}, not {lm.name!r}; "
            "train with the model that made it (the CLI loads the one --model names, never the one a file records)."
        )
    check_whole(dataset)
    missing = dataset.missing_groups()
    if missing:
        warnings.warn(f"{str(dataset.path)!r} lacks {len(missing)} of its settings' groups ({missing[:8]}"
                      f"{' ...' if len(missing) > 8 else ''}): its synthesis stopped early, or a shard was left out of a "
                      "merge. Training on what is there; run the same synthesis on it to complete it.", stacklevel=2)
    corpus_info = dataset.header.get("corpus", {})
    if prefix_ids is not None:
        check_dataset_corpus(dataset, prefix_ids=prefix_ids)
    work = work_model(lm, work_dtype)
    fitter, owned = trainers.resolve(trainer, work, trainer_options)
    if distractors and not fitter.capabilities.distractors:
        if owned:
            fitter.close()
        raise ConfigError(f"Trainer {type(fitter).__name__} cannot train among distractors; use trainer='torch' or "
                          "train without distractors.")
    among = {"distractors": distractors} if distractors else {}
    if restart and output_dir is not None and is_lead():  # under torchrun, rank 0 alone touches the folder
        clear_training(Path(output_dir))
    try:
        saved = Path(output_dir) / COMPACT_START if output_dir is not None and is_lead() else None  # rank 0 keeps it

        def make_start() -> Cartridge:
            ids = prefix_ids if prefix_ids is not None else dataset_corpus_ids(dataset, lm, init)
            return initial_cartridge(lm, ids, num_tokens, init, seed, num_frozen, saved=saved, progress=progress)

        with process_group(work.device):  # under torchrun: one group for the start and the training
            if fitter.capabilities.distributed:
                # it starts every rank from rank 0's cartridge: rank 0 alone makes the start (minutes of compaction
                # on a large corpus), the others take one of the right shape
                start = lead_does(make_start)
                if start is None:
                    start = Cartridge.random(lm, num_tokens, seed=seed, num_frozen=num_frozen)
            else:
                start = make_start()
            trained = fitter.fit(start.bind(work), dataset, work, config, output_dir=output_dir, progress=progress,
                                 **among)
    finally:
        if owned:
            fitter.close()
    meta = attrs.evolve(
        trained.meta,
        model=lm.identity,
        corpus={k: v for k, v in corpus_info.items() if k != "prefix_ids"} or None,
        training={
            **(trained.meta.training or {}),
            "init": init,
            "synthesis": dataset.header.get("config"),
            "synthesizer": dataset.header.get("synthesizer"),
            "work_dtype": str(work.dtype).removeprefix("torch."),
        },
    )
    return Cartridge([k.to(lm.dtype) for k in trained.keys], [v.to(lm.dtype) for v in trained.values], meta, lm=lm)


def build_cartridge(
    corpus: Any,
    model: Any = None,
    *,
    num_tokens: int,
    num_conversations: int = DEFAULT_CONVERSATIONS,
    epochs: int = 1,
    init: str = DEFAULT_INIT,
    seed: int = 0,
    synthesizer: str | Synthesizer = "hf",
    synthesizer_options: dict[str, Any] | None = None,
    trainer: str | Trainer = "torch",
    trainer_options: dict[str, Any] | None = None,
    allow_unverified_model: bool = False,
    output_dir: str | os.PathLike | None = None,
    restart: bool = False,
    num_frozen: int = 1,
    work_dtype: str | torch.dtype | None = None,
    progress: bool = True,
    distractors: Sequence[Cartridge] = (),
    **settings: Any,
) -> Cartridge:
    """Synthesize `num_conversations` self-study conversations about `corpus`, then train a `num_tokens` cartridge.

    `settings` are fields of `SynthesisConfig` and `TrainConfig` (e.g. ``lr=``, ``max_tokens_b=``, ``min_chunk=``).
    `synthesizer` and `trainer` are registered backend names (``cartridges backends`` lists them), built with
    their `*_options`, or backend objects. Every setting, option and capability is checked before synthesis starts;
    a synthesizer that cannot show it serves the student's model is refused unless `allow_unverified_model`.
    With `output_dir`, the dataset (``data/``) and training checkpoints (``train/``) are kept there and a re-run
    resumes both stages; without it they live in a temporary folder. A re-run with other settings is refused,
    naming them, unless ``restart=True``, which starts both stages over. `work_dtype` is the dtype synthesis and
    training compute in (default: the model's); the returned cartridge is bound to the original model.
    `distractors` (other documents' cartridges) are composed around it in training, so it holds up when composed
    with others (making/distractors.py).

    Under torchrun, the ranks share both stages (docs/distributed.md): each makes its share of the conversations
    into `output_dir` (required: a folder every rank reaches), then they train data-parallel.
    """
    synth_cfg, train_cfg = check_settings(settings, num_tokens=num_tokens, num_conversations=num_conversations,
                                          epochs=epochs, init=init, seed=seed, num_frozen=num_frozen)
    if output_dir is not None:
        require("output_dir", output_dir, PATH, "a folder path")
    elif under_torchrun():
        raise ConfigError("Under torchrun, give output_dir (--work-dir): a folder every rank reaches, where the ranks "
                          "write their shares of the dataset and rank 0 the checkpoints.")
    for role, options in (("synthesizer", synthesizer_options), ("trainer", trainer_options)):
        if options is not None:
            require(f"{role}_options", options, dict, "a dict of option names to values")
    _, train_settings = split_settings(settings)
    if isinstance(synthesizer, str):  # what the class can do is known before its engine starts
        cls = synthesizers.get(synthesizer)
        cls.parse_options(synthesizer_options or {}, f"synthesizer {synthesizer!r}")
        check_capabilities(synth_cfg, cls.capabilities_for(synthesizer_options or {}), f"synthesizer {synthesizer!r}")
    if isinstance(trainer, str):
        trainer_opts = trainers.get(trainer).parse_options(trainer_options or {}, f"trainer {trainer!r}")
        if getattr(trainer_opts, "shard_model", False):  # before synthesis, not after it
            check_shardable(ranks_in_env())
        if distractors and not trainers.get(trainer).capabilities.distractors:
            raise ConfigError(f"Trainer {trainer!r} cannot train among distractors; use trainer='torch' or train "
                              "without distractors.")
    lm = model if isinstance(model, LM) else load_model(model)
    distractors = check_distractors(distractors, lm)
    corpus = Corpus.coerce(corpus)
    work = work_model(lm, work_dtype)
    prefix_ids = lm.encode(corpus.text) if init in ("prefix", "compact") else None
    if init == "prefix":
        prefix_ids = prefix_ids[:num_tokens]
        check_prefix(prefix_ids, num_tokens)
    if init == "compact":
        check_compact(prefix_ids, num_tokens)
    check_context(lm, synth_cfg, len(corpus.token_ids(lm)), num_tokens)
    check_among(lm, distractors, train_cfg, num_tokens)
    sampler, owned = synthesizers.resolve(synthesizer, work, synthesizer_options)
    # one process group for both stages (under torchrun)
    with process_group(work.device), tempfile.TemporaryDirectory(prefix="cartridges-") as tmp:
        root = Path(output_dir) if output_dir is not None else Path(tmp)
        try:
            dataset = synthesize(corpus, work, root / "data", synth_cfg, synthesizer=sampler,
                                 allow_unverified_model=allow_unverified_model, restart=restart, progress=progress)
        finally:
            if owned:
                sampler.close()
        return train_cartridge(
            dataset, lm, num_tokens=num_tokens, epochs=epochs, init=init, seed=seed, prefix_ids=prefix_ids,
            trainer=trainer, trainer_options=trainer_options, output_dir=root / "train", num_frozen=num_frozen,
            work_dtype=work_dtype, restart=restart, progress=progress, distractors=distractors, **train_settings,
        )
