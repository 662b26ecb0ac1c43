"""The self-study commands: ``build`` (both stages), ``synthesize`` and ``merge`` (the data), and ``train``; with
``--nproc N`` each runs again as N ranks under torchrun."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..making.dataset import SelfStudyDataset, Shard, merge
from ..making.distributed import is_lead, rank_device, under_torchrun
from ..making.loss import check_shardable
from ..making.selfstudy import COMPACT_START, check_compact, check_dataset_corpus, check_whole, train_cartridge
from ..making.settings import (DEFAULT_CONVERSATIONS, SynthesisConfig, check_settings, check_training_settings,
                               split_settings)
from ..making.corpus import Corpus
from ..making.synthesis import check_context, check_synthesizer, synthesize
from ..cartridge import Cartridge
from ..errors import CartridgeError, ConfigError
from ..plugins import synthesizers, trainers
from ..trainer_inputs import SEED_KIND_DOCUMENT
from . import common  # common.model_for is looked up at each call, so tests can replace it
from .common import (as_ranks, backend_options, bind_all, compaction_config, human_bytes, output_file, parse_settings,
                     read_corpus, study_keywords)


def _start_ranks(args: argparse.Namespace, trainer_options: dict[str, Any] | None = None) -> int | None:
    """With ``--nproc N`` (N > 1) outside torchrun: run this command as N ranks on this machine and return their exit
    code. Otherwise (one process, or a rank) None: go on here, on this rank's own device."""
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc} must be at least 1.")
    if (trainer_options or {}).get("shard_model") and not under_torchrun():  # before the model loads
        check_shardable(args.nproc)
    trainer = getattr(args, "trainer", None)
    if args.nproc > 1 and trainer and not trainers.get(trainer).capabilities_for(trainer_options or {}).distributed:
        raise ConfigError(f"--nproc runs training data-parallel under torchrun; trainer {trainer!r} does not join a "
                          "process group (its capabilities.distributed is False). Drop --nproc, or use a trainer "
                          "that does, e.g. --trainer torch.")
    ranks_exit = as_ranks(args, "--nproc", args.nproc)
    if ranks_exit is not None:
        return ranks_exit
    args.device = rank_device(args.device)
    return None


def cmd_build(args: argparse.Namespace) -> int:
    settings = study_keywords(args)
    conversations = settings.pop("num_conversations", DEFAULT_CONVERSATIONS)
    epochs, compaction = settings.pop("epochs", 1), settings.pop("compaction")
    check_settings(settings, num_tokens=args.tokens, num_conversations=conversations, epochs=epochs,
                   init=args.init, seed=args.seed, compaction=compaction)
    options = backend_options(args, {"synthesizer": args.synthesizer, "trainer": args.trainer})
    output_file(args.output)
    distractors = _distractor_files(args.distractors)
    ranks_exit = _start_ranks(args, options["trainer"])  # after the checks: a mistake is said once, not by every rank
    if ranks_exit is not None:
        return ranks_exit
    lm = common.model_for(args.model, device=args.device)
    work = Path(args.work_dir) if args.work_dir else Path(str(args.output) + ".work")
    c = Cartridge.from_corpus(
        read_corpus(args), lm, num_tokens=args.tokens, num_conversations=conversations, epochs=epochs,
        init=args.init, seed=args.seed, output_dir=work, synthesizer=args.synthesizer,
        synthesizer_options=options["synthesizer"], trainer=args.trainer, trainer_options=options["trainer"],
        allow_unverified_model=args.allow_unverified_model, restart=args.restart,
        distractors=bind_all(distractors, lm), report=not args.no_report, compaction=compaction, **settings,
    )
    if is_lead():  # every rank holds the same cartridge; one writes it
        c.save(args.output)
        print(f"wrote {args.output}: {c.num_tokens} tokens, {human_bytes(c.nbytes)} (work files in {work})")
    return 0


def _stage_settings(args: argparse.Namespace, stage: str) -> dict[str, Any]:
    """The `--set` settings of one stage (`synthesize` or `train`); the other stage's are refused by name."""
    synth, train = split_settings(parse_settings(args.set))
    mine, other, other_stage = (synth, train, "train") if stage == "synthesize" else (train, synth, "synthesize")
    if other:
        raise CartridgeError(f"{sorted(other)} are settings of `cartridges {other_stage}`; pass them there.")
    return mine


def cmd_synthesize(args: argparse.Namespace) -> int:
    shard = Shard.parse(args.shard) if args.shard else None
    if shard is not None and (args.nproc > 1 or under_torchrun()):
        raise ConfigError("--shard makes one shard in one process; with --nproc (or torchrun) the ranks already share "
                          "the work. Use one or the other.")
    synth = _stage_settings(args, "synthesize")
    config = SynthesisConfig(num_conversations=args.conversations, seed=args.seed, **synth)
    options = backend_options(args, {"synthesizer": args.synthesizer})["synthesizer"]
    declared = check_synthesizer(args.synthesizer, options, config)
    ranks_exit = _start_ranks(args)
    if ranks_exit is not None:
        return ranks_exit
    lm = common.model_for(args.model, device=args.device)
    corpus = Corpus.coerce(read_corpus(args))
    check_context(lm, config, len(corpus.token_ids(lm)), synthesizer=declared)  # before the engine starts
    with synthesizers.create(args.synthesizer, lm, **options) as sampler:
        ds = synthesize(corpus, lm, args.output, config, synthesizer=sampler,
                        allow_unverified_model=args.allow_unverified_model, restart=args.restart, shard=shard)
    if is_lead():
        what = (f" (shard {shard.index} of {shard.count}; gather the shards with `cartridges merge`)"
                if shard and shard.count > 1 else "")
        print(f"wrote {args.output}: {_dataset_summary(ds)}{what}")
    return 0


def _dataset_summary(ds: Any) -> str:
    windows = sum(c.seed_kind == SEED_KIND_DOCUMENT for c in ds)
    missing = ds.missing_groups()
    return f"{len(ds) - windows} conversations, {windows} document windows" + (
        f"; {len(missing)} group(s) missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}" if missing else "")


def cmd_merge(args: argparse.Namespace) -> int:
    ds = merge(args.sources, args.output)
    missing = ds.missing_groups()
    print(f"wrote {args.output}: {_dataset_summary(ds)}")
    if missing:
        print("the shards that hold the missing groups are not among the sources, or are unfinished; run the same "
              f"`cartridges synthesize` with -o {args.output} to make what is missing", file=sys.stderr)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    train = _stage_settings(args, "train")
    compaction = compaction_config(args.compaction)
    check_training_settings(train, num_tokens=args.tokens, epochs=args.epochs, init=args.init, seed=args.seed,
                            compaction=compaction)
    options = backend_options(args, {"trainer": args.trainer})["trainer"]
    output_file(args.output)
    distractors = _distractor_files(args.distractors)
    dataset = SelfStudyDataset(args.data)
    work = Path(args.work_dir) if args.work_dir else Path(str(args.output) + ".work")
    check_whole(dataset)
    # the start is rank 0's to make (a distributed trainer sends it to the others): they need not read the corpus
    needs_corpus = args.corpus and (is_lead() or not trainers.get(args.trainer).capabilities_for(options).distributed)
    corpus = read_corpus(args) if needs_corpus else None
    # before the model loads: a corpus given must be the dataset's; without one, the start comes from the corpus the
    # dataset keeps (checked here), and a dataset made before datasets kept it cannot be compacted
    if corpus is not None:
        check_dataset_corpus(dataset, corpus)
    elif not args.corpus and args.init in ("compact", "prefix") and is_lead():
        if (dataset.corpus_text() is None and args.init == "compact"
                and (args.restart or not (work / COMPACT_START).is_file())):
            check_compact(None, args.tokens)
    ranks_exit = _start_ranks(args, options)
    if ranks_exit is not None:
        return ranks_exit
    lm = common.model_for(args.model, device=args.device)  # the dataset's recorded model is compared, never loaded
    prefix_ids = lm.encode(corpus.text) if corpus is not None else None
    c = train_cartridge(
        dataset, lm, num_tokens=args.tokens, epochs=args.epochs, init=args.init, seed=args.seed,
        prefix_ids=prefix_ids, output_dir=work, trainer=args.trainer, trainer_options=options, restart=args.restart,
        distractors=bind_all(distractors, lm), compaction=compaction, **train,
    )
    if is_lead():  # every rank holds the same cartridge; one writes it
        c.save(args.output)
        print(f"wrote {args.output}: {c.num_tokens} tokens, {human_bytes(c.nbytes)}")
    return 0


def _distractor_files(paths: list[str]) -> list[Cartridge]:
    """The --distractors files read before the model loads (a missing or damaged one is refused first); bind them to
    the model with `bind_all` once it is loaded."""
    loaded = []
    for path in paths:
        try:
            loaded.append(Cartridge.load(path))
        except CartridgeError as err:
            err.add_note(f"It was given with --distractors {path}: give cartridge files of other documents.")
            raise
    return loaded
