"""`Cartridge.from_corpus`: self-study synthesis, then distillation training, wired from flat settings.

Each setting is validated once, before any model work (`settings.check_settings`); the corpus is read once; each check
of the settings against the backends and the model runs once, before the minutes of synthesis; then the stages run on
what was checked (`synthesis.synthesize_checked`, `train_checked`).
"""

from __future__ import annotations

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
from ..trainer_inputs import TrainConfig
from .checkpoint import CHECKPOINT, RUN_LOG
from .compaction import compact_corpus
from .corpus import Corpus
from .dataset import CORPUS_TEXT, SelfStudyDataset
from .distractors import check_among, check_distractors
from .distributed import is_lead, lead_does, process_group, ranks_in_env, under_torchrun
from .loss import check_shardable
from .precision import FASTEST, resolve_work_dtype, WorkDtypes
from .report import check_report, reported
from .settings import (DEFAULT_CONVERSATIONS, DEFAULT_START, STARTS, CompactionConfig, ReportConfig, StartConfig,
                       check_settings, check_training_settings, made_with, with_recipe)
from .synthesis import check_built_synthesizer, check_context, check_synthesizer, synthesize_checked

COMPACT_START = "start-compact.safetensors"  # kept in the training folder, so a resumed run starts from it


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
                      num_frozen: int = 1, *, saved: Path | None = None, progress: bool = True,
                      compaction: CompactionConfig | None = None) -> Cartridge:
    """The cartridge training starts from: the corpus compacted (`compact`, `prefix_ids` then holds the whole
    corpus), its first tokens (`prefix`), unrelated text, or random vectors.

    A compacted start is kept at `saved` when given and read back from there, so a resumed run starts from the
    very tensors the interrupted one did."""
    if init == "compact":
        if saved is not None and saved.is_file():
            kept = Cartridge.load(saved, lm)
            same = (kept.num_tokens, kept.num_frozen) == (num_tokens, num_frozen) and (
                prefix_ids is None or (kept.meta.corpus or {}).get("fingerprint") == token_fingerprint(prefix_ids)) \
                and made_with(kept.meta.extra.get("compaction", {}), compaction or CompactionConfig(), lm)
            if same:
                return kept
        check_compact(prefix_ids, num_tokens)
        start = compact_corpus(lm, list(prefix_ids), num_tokens, num_frozen=num_frozen, config=compaction,
                               progress=progress)
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
    raise ConfigError(f"init={init!r} must be one of {STARTS}.")


def check_trainer(trainer: str | Trainer, options: dict[str, Any] | None, distractors: Sequence[Cartridge]) -> None:
    """Refuse, before any work, a trainer (a registered name with `options`, or an object) that cannot take its
    options, or cannot train among `distractors` when they are given."""
    if options is not None:
        require("trainer_options", options, dict, "a dict of option names to values")
    if isinstance(trainer, str):
        cls = trainers.get(trainer)
        trainer_opts = cls.parse_options(options or {}, f"trainer {trainer!r}")
        if getattr(trainer_opts, "shard_model", False):  # before synthesis, not after it
            check_shardable(ranks_in_env())
        can, name = cls.capabilities_with(trainer_opts).distractors, cls.__name__
    elif isinstance(trainer, Trainer):
        can, name = trainer.capabilities.distractors, type(trainer).__name__
    else:
        return  # `trainers.resolve` refuses it, naming the registered trainers
    if distractors and not can:
        raise ConfigError(f"Trainer {name} cannot train among distractors; use trainer='torch' or train without "
                          "distractors.")


def check_training_data(dataset: SelfStudyDataset, lm: LM, num_tokens: int, config: TrainConfig,
                        distractors: Sequence[Cartridge], prefix_ids: Sequence[int] | None) -> None:
    """Refuse a dataset this training cannot use: sequences too long for the model's context after the cartridge
    (and the distractors), another model's data, one shard of a synthesis, or another corpus than `prefix_ids`'s;
    warn of a dataset that lacks groups."""
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
                      "merge. Training on what is there; run the same synthesis on it to complete it.", stacklevel=4)
    if prefix_ids is not None:
        check_dataset_corpus(dataset, prefix_ids=prefix_ids)


def train_cartridge(
    dataset: SelfStudyDataset,
    lm: LM,
    *,
    num_tokens: int,
    epochs: int = 1,
    init: str = DEFAULT_START,
    seed: int = 0,
    prefix_ids: Sequence[int] | None = None,
    trainer: str | Trainer = "torch",
    trainer_options: dict[str, Any] | None = None,
    output_dir: str | os.PathLike | None = None,
    num_frozen: int = 1,
    work_dtype: str | torch.dtype | None = FASTEST,
    restart: bool = False,
    progress: bool = True,
    distractors: Sequence[Cartridge] = (),
    compaction: CompactionConfig | None = None,
    **settings: Any,
) -> Cartridge:
    """Train a `num_tokens` cartridge on a self-study dataset; the result is bound to `lm`.

    `trainer` is a registered trainer name (``"torch"``, built with `trainer_options`) or a `Trainer` object;
    `settings` are `TrainConfig` fields. A checkpoint in `output_dir` made with other settings is refused, naming
    them, unless ``restart=True``, which deletes it first. `distractors` (cartridges of other documents) are
    composed around the trainable one during training, up to ``max_distractors`` a step (making/distractors.py).
    `compaction` says how the compacted start (``init="compact"``) is made.
    """
    start, config = check_training_settings(settings, num_tokens=num_tokens, epochs=epochs, init=init, seed=seed,
                                            num_frozen=num_frozen, compaction=compaction)
    distractors = check_distractors(distractors, lm)
    check_trainer(trainer, trainer_options, distractors)
    return train_checked(dataset, lm, start, config, prefix_ids=prefix_ids, trainer=trainer,
                         trainer_options=trainer_options, output_dir=output_dir, work_dtype=work_dtype, restart=restart,
                         progress=progress, distractors=distractors)


def train_checked(
    dataset: SelfStudyDataset, lm: LM, start: StartConfig, config: TrainConfig, *,
    prefix_ids: Sequence[int] | None = None, trainer: str | Trainer = "torch", trainer_options: dict[str, Any] | None = None,
    output_dir: str | os.PathLike | None = None, work_dtype: str | torch.dtype | WorkDtypes | None = None,
    restart: bool = False, progress: bool = True, distractors: Sequence[Cartridge] = (),
) -> Cartridge:
    """`train_cartridge` once its settings, trainer and distractors are checked (`build_cartridge` checks them before
    synthesis): the dataset's checks, the trainer's fit, and the result bound to `lm` in its dtype."""
    check_training_data(dataset, lm, start.num_tokens, config, distractors, prefix_ids)
    work = lm.in_dtype(resolve_work_dtype(lm, work_dtype, stages=("training",))["training"])
    fitter, owned = trainers.resolve(trainer, work, trainer_options)
    try:
        if restart and output_dir is not None and is_lead():  # under torchrun, rank 0 alone touches the folder
            clear_training(Path(output_dir))
        trained = _fit(fitter, dataset, lm, work, start, config, prefix_ids=prefix_ids, output_dir=output_dir,
                       progress=progress, distractors=distractors)
    finally:
        if owned:
            fitter.close()
    return _bound_to(lm, trained, work, dataset, start.init)


def _fit(fitter: Trainer, dataset: SelfStudyDataset, lm: LM, work: LM, start: StartConfig, config: TrainConfig, *,
         prefix_ids: Sequence[int] | None, output_dir: str | os.PathLike | None, progress: bool,
         distractors: Sequence[Cartridge]) -> Cartridge:
    """`fitter` trains on `work` from the start cartridge: under torchrun, a distributed trainer's ranks all start
    from rank 0's."""
    saved = Path(output_dir) / COMPACT_START if output_dir is not None and is_lead() else None  # rank 0 keeps it

    def make_start() -> Cartridge:
        ids = prefix_ids if prefix_ids is not None else dataset_corpus_ids(dataset, lm, start.init)
        return initial_cartridge(lm, ids, start.num_tokens, start.init, start.seed, start.num_frozen, saved=saved,
                                 progress=progress, compaction=start.compaction)

    among = {"distractors": distractors} if distractors else {}
    with process_group(work.device):  # under torchrun: one group for the start and the training
        if fitter.capabilities.distributed:
            # it starts every rank from rank 0's cartridge: rank 0 alone makes the start (minutes of compaction
            # on a large corpus), the others take one of the right shape
            begin = lead_does(make_start)
            if begin is None:
                begin = Cartridge.random(lm, start.num_tokens, seed=start.seed, num_frozen=start.num_frozen)
        else:
            begin = make_start()
        return fitter.fit(begin.bind(work), dataset, work, config, output_dir=output_dir, progress=progress, **among)


def _bound_to(lm: LM, trained: Cartridge, work: LM, dataset: SelfStudyDataset, init: str) -> Cartridge:
    """The trained cartridge bound to `lm` in its dtype, its metadata naming the model, the corpus, the start and
    the synthesis it was trained from."""
    corpus_info = dataset.header.get("corpus", {})
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


def check_work_dir(output_dir: str | os.PathLike | None) -> None:
    """Refuse a work folder that is not a path, or none under torchrun (the ranks need one they all reach)."""
    if output_dir is not None:
        require("output_dir", output_dir, PATH, "a folder path")
    elif under_torchrun():
        raise ConfigError("Under torchrun, give output_dir (--work-dir): a folder every rank reaches, where the ranks "
                          "write their shares of the dataset and rank 0 the checkpoints.")


def corpus_start_ids(lm: LM, corpus: Corpus, start: StartConfig) -> list[int] | None:
    """The corpus token ids the start is made from (all of them to compact, the first `num_tokens` for a prefix),
    refused when there are too few; None for a start that needs no corpus."""
    if start.init not in ("prefix", "compact"):
        return None
    ids = lm.encode(corpus.text)
    if start.init == "prefix":
        ids = ids[: start.num_tokens]
        check_prefix(ids, start.num_tokens)
    else:
        check_compact(ids, start.num_tokens)
    return ids


def build_with_recipe(corpus: Any, model: Any = None, **settings: Any) -> Cartridge:
    """`build_cartridge` with a ``recipe`` among `settings` spelled out (`with_recipe`): `Cartridge.from_corpus`."""
    return build_cartridge(corpus, model, **with_recipe(settings))


def build_cartridge(
    corpus: Any, model: Any = None, *, num_tokens: int, num_conversations: int = DEFAULT_CONVERSATIONS,
    epochs: int = 1, init: str = DEFAULT_START, seed: int = 0, synthesizer: str | Synthesizer = "hf",
    synthesizer_options: dict[str, Any] | None = None, trainer: str | Trainer = "torch",
    trainer_options: dict[str, Any] | None = None, allow_unverified_model: bool = False,
    output_dir: str | os.PathLike | None = None, restart: bool = False, num_frozen: int = 1,
    work_dtype: str | torch.dtype | None = FASTEST, progress: bool = True, distractors: Sequence[Cartridge] = (),
    report: bool | ReportConfig = True, compaction: CompactionConfig | None = None, **settings: Any,
) -> Cartridge:
    """Synthesize `num_conversations` self-study conversations about `corpus`, then train a `num_tokens` cartridge.

    `settings` are fields of `SynthesisConfig` and `TrainConfig` (e.g. ``lr=``, ``max_tokens_b=``, ``min_chunk=``).
    `synthesizer` and `trainer` are registered backend names (``cartridges backends`` lists them), built with
    their `*_options`, or backend objects. Every setting, option and capability is checked before synthesis starts;
    a synthesizer that cannot show it serves the student's model is refused unless `allow_unverified_model`.
    With `output_dir`, the dataset (``data/``) and training checkpoints (``train/``) are kept there and a re-run
    resumes both stages; without it they live in a temporary folder. A re-run with other settings is refused,
    naming them, unless ``restart=True``, which starts both stages over. `work_dtype` is the dtype synthesis and
    training compute in (``"fastest"``, the default: per stage, bfloat16 where this machine runs a miniature of
    that stage clearly faster in it, measured at the start; None: the model's own); the returned cartridge is bound to the
    original model, and its ``meta.training`` names both stages' dtypes.
    `distractors` (other documents' cartridges) are composed around it in training, so it holds up when composed
    with others (making/distractors.py). Then the cartridge is checked against its corpus on questions the model
    asks itself (`Cartridge.quality`, docs/quality-report.md): `report` True, a `ReportConfig`, or False to skip it.
    `compaction` (a `CompactionConfig`) says how the compacted start (``init="compact"``) is made.

    Under torchrun, the ranks share both stages (docs/distributed.md): each makes its share of the conversations
    into `output_dir` (required: a folder every rank reaches), then they train data-parallel.
    """
    check_report(report)
    start, synth_cfg, train_cfg = check_settings(settings, num_tokens=num_tokens, num_conversations=num_conversations,
                                                 epochs=epochs, init=init, seed=seed, num_frozen=num_frozen,
                                                 compaction=compaction)
    check_work_dir(output_dir)
    declared = check_synthesizer(synthesizer, synthesizer_options, synth_cfg)
    check_trainer(trainer, trainer_options, distractors)
    lm = model if isinstance(model, LM) else load_model(model)
    distractors = check_distractors(distractors, lm)
    corpus = Corpus.coerce(corpus)
    prefix_ids = corpus_start_ids(lm, corpus, start)
    check_context(lm, synth_cfg, len(corpus.token_ids(lm)), num_tokens, synthesizer=declared)
    check_among(lm, distractors, train_cfg, num_tokens)
    work_dtype = resolve_work_dtype(lm, work_dtype)  # measured once, for both stages
    work = lm.in_dtype(work_dtype["synthesis"])
    if synthesizer == "hf" and work_dtype["training"] not in (None, work.dtype):
        # its document windows are scored by forward passes over whole sequences, as training runs them
        synthesizer_options = {"score_dtype": work_dtype["training"], **(synthesizer_options or {})}
    sampler, owned = synthesizers.resolve(synthesizer, work, synthesizer_options)
    check_built_synthesizer(sampler, owned, synthesizer, synth_cfg, work, len(corpus.token_ids(lm)), num_tokens)
    # one process group for both stages (under torchrun)
    with process_group(work.device), tempfile.TemporaryDirectory(prefix="cartridges-") as tmp:
        root = Path(output_dir) if output_dir is not None else Path(tmp)
        try:
            dataset = synthesize_checked(corpus, work, root / "data", synth_cfg, sampler,
                                         allow_unverified_model=allow_unverified_model, restart=restart,
                                         progress=progress)
        finally:
            if owned:
                sampler.close()
        trained = train_checked(dataset, lm, start, train_cfg, prefix_ids=prefix_ids, trainer=trainer,
                                trainer_options=trainer_options, output_dir=root / "train", work_dtype=work_dtype,
                                restart=restart, progress=progress, distractors=distractors)
    trained.meta = attrs.evolve(trained.meta, training={**trained.meta.training,
                                                        "synthesis_dtype": str(work.dtype).removeprefix("torch.")})
    # every rank holds the same cartridge and one writes it: one checks it
    return reported(lm, corpus, trained, report, progress=progress) if is_lead() else trained
