"""Self-study data generation (the paper's Algorithm 1) over any `Synthesizer`, engine-neutral.

For each group of conversations: sample a chunk of the corpus; participant A sees the chunk and a seed prompt and
writes a message; participant B sees the chunk (or the whole corpus, ``b_context="document"``) and answers. B's
tokens, with the teacher's top-k log-probabilities, become the distillation targets for a student that sees the
cartridge instead of the chunk. Here: the checks of the settings (`SynthesisConfig`, in `settings.py`) against a
synthesizer and a model, and the loop over groups (one process, a shard, or the ranks under torchrun); one group's
conversations are made in `conversations.py`, the document windows in `windows.py`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import random
import warnings
from pathlib import Path
from typing import Any

import attrs

from ..checks import require
from ..errors import BackendError, ConfigError
from ..files import folder_lock
from ..lm import LM
from ..plugins import Synthesizer, SynthesizerCapabilities, synthesizers
from ..probe import check_same_model
from ..trainer_inputs import Conversation
from .conversations import chunk_context, run_group
from .corpus import ChunkSampler, Corpus
from .dataset import HEADER, SelfStudyDataset, Shard, dataset_settings, describe_changes, group_counts
from .distributed import barrier, gather_from_ranks, lead_does, patient_group, process_group, under_torchrun
from .seeds import sample_seed
from .settings import SynthesisConfig
from .windows import document_windows

PREFIX_IDS_KEPT = 4096


def check_capabilities(config: SynthesisConfig, capabilities: SynthesizerCapabilities, name: str) -> None:
    """Refuse settings the synthesizer cannot serve, naming each setting and its fix, before any work."""
    problems = []
    if config.top_k > capabilities.max_top_logprobs:
        problems.append(
            f"top_k={config.top_k} but {name} returns at most {capabilities.max_top_logprobs} log-probabilities per "
            f"token; set top_k <= {capabilities.max_top_logprobs}"
        )
    if not capabilities.score:
        if config.document_windows:
            problems.append(
                f"document_windows={config.document_windows} needs a synthesizer that scores given sequences and "
                f"{name} cannot; set document_windows=0 or use one that can (e.g. 'hf')"
            )
        if config.targets == "all":
            problems.append(f"targets='all' needs a synthesizer that scores given sequences and {name} cannot; "
                            "set targets='assistant'")
    if problems:
        raise ConfigError("; ".join(problems) + ".")
    if config.b_context == "document" and not capabilities.prefix_reuse:
        warnings.warn(f"b_context='document' with {name}, which does not keep a shared prompt's KV: each of B's "
                      "requests reads the whole corpus again; use a synthesizer that does (e.g. 'hf' or 'vllm') or "
                      "b_context='chunk'.", stacklevel=3)


def check_synthesizer(synthesizer: str | Synthesizer, options: dict[str, Any] | None,
                      config: SynthesisConfig) -> tuple[SynthesizerCapabilities | None, str]:
    """Refuse, before its engine starts, a synthesizer (a registered name with `options`, or an object) that cannot
    take its options or serve `config`; what it can do, and its name, for `check_context`."""
    if options is not None:
        require("synthesizer_options", options, dict, "a dict of option names to values")
    if isinstance(synthesizer, str):  # what the class can do is known before its engine starts
        cls = synthesizers.get(synthesizer)
        parsed = cls.parse_options(options or {}, f"synthesizer {synthesizer!r}")
        found, name = cls.capabilities_with(parsed), f"synthesizer {synthesizer!r}"
    elif isinstance(synthesizer, Synthesizer):
        found, name = synthesizer.capabilities, type(synthesizer).__name__
    else:
        return None, ""
    check_capabilities(config, found, name)
    return found, name


def check_built_synthesizer(built: Synthesizer, owned: bool, asked: str | Synthesizer, config: SynthesisConfig,
                            lm: LM, corpus_tokens: int, num_tokens: int | None = None) -> None:
    """Check `config` again against a synthesizer built by name when the instance narrowed what its class declared
    (the HF one caps top-k at its model's vocabulary; the OpenAI one learns its servers' context when it opens),
    closing it if it refuses: `check_synthesizer` saw the class. The rest as for `check_context`."""
    declared = type(built).capabilities_with(getattr(built, "options", None))
    if not isinstance(asked, str) or built.capabilities == declared:
        return
    try:
        check_capabilities(config, built.capabilities, f"synthesizer {asked!r}")
        check_context(lm, config, corpus_tokens, num_tokens, synthesizer=(built.capabilities, f"synthesizer {asked!r}"))
    except ConfigError:
        if owned:
            built.close()
        raise


# room for a seed prompt and the chat markup around a chunk and the turns (the longest built-in seed prompt is ~90
# tokens in the default model's tokenizer)
PROMPT_MARKUP = 256


def check_context(lm: LM, config: SynthesisConfig, corpus_tokens: int, num_tokens: int | None = None,
                  synthesizer: tuple[SynthesizerCapabilities | None, str] = (None, "")) -> None:
    """Refuse settings whose prompts could outgrow the model's context, or the `synthesizer`'s engine's where it
    takes less (its capabilities and name), or, with `num_tokens`, whose training sequences after the cartridge
    could outgrow the model's, with the numbers, before any work; a corpus too short for document windows too."""
    if config.document_windows and corpus_tokens < 2:
        raise ConfigError(f"The corpus has {corpus_tokens} token(s), too few for document windows; give a longer "
                          "corpus or document_windows=0.")
    capabilities, name = synthesizer
    engine = capabilities.max_context if capabilities is not None else None

    def fits(tokens: int, what: str, fix: str) -> None:
        lm.check_context(tokens, what, fix)
        if engine is not None and tokens > engine:
            raise ConfigError(f"{what} needs {tokens} tokens, more than the {engine} that {name} was started with; "
                              f"{fix}, or start it with a longer context.")

    whole = config.b_context == "document"  # then B reads the whole corpus, and max_chunk does not bound it
    read = corpus_tokens if whole else min(config.max_chunk, corpus_tokens)
    chunk = read + (len(lm.encode(config.description)) if config.description else 0)
    turns = config.rounds * (config.max_tokens_a + config.max_tokens_b)
    fits(
        chunk + PROMPT_MARKUP + turns,
        f"A self-study prompt (a {'document' if whole else 'chunk'} of up to {chunk} tokens, {PROMPT_MARKUP} for the "
        f"seed prompt and chat markup, {turns} for {config.rounds} round(s) of max_tokens_a + max_tokens_b)",
        "lower max_tokens_a or max_tokens_b, or " + ("b_context='chunk'" if whole else "max_chunk"),
    )
    window_chunk = min(config.windows_per_chunk * config.window_tokens, corpus_tokens)
    if config.document_windows:
        fits(
            window_chunk + config.window_tokens,
            f"A document window ({window_chunk} chunk tokens re-read as {config.window_tokens}-token windows)",
            "lower windows_per_chunk or window_tokens",
        )
    if num_tokens is not None:
        longest = max(PROMPT_MARKUP + turns, config.window_tokens if config.document_windows else 0)
        lm.check_context(
            num_tokens + longest, f"Training a {num_tokens}-token cartridge on sequences of up to {longest} tokens",
            "use a smaller num_tokens, or shorter turns and windows",
        )


def synthesize(
    corpus: Corpus | Any,
    lm: LM,
    output: str | os.PathLike,
    config: SynthesisConfig | None = None,
    *,
    synthesizer: Synthesizer | None = None,
    allow_unverified_model: bool = False,
    restart: bool = False,
    progress: bool = True,
    shard: Shard | None = None,
) -> SelfStudyDataset:
    """Sample `config.num_conversations` self-study conversations into the dataset folder `output`.

    `synthesizer` defaults to the built-in HF one on `lm`. Before any conversation, the settings are checked against
    its capabilities and it must be shown to serve `lm`'s model (see `check_same_model`; the dataset header records
    how). Re-running with the same `output` and settings continues after the last complete group (damaged parts are
    made again); other settings are refused, naming them, unless ``restart=True``. One process at a time per folder.

    Under torchrun, the ranks share the work: rank r makes the groups ``g % ranks == r`` into `output` (a folder
    every rank reaches) and every rank returns the whole dataset. `shard` instead makes one shard into a folder of its
    own, for machines that share no folder or no process group; `dataset.merge` gathers the shards.
    """
    corpus = Corpus.coerce(corpus)
    config = config or SynthesisConfig()
    if synthesizer is None:
        synthesizer = synthesizers.create("hf", lm)  # the built-in one, by name like any other
    name = type(synthesizer).__name__
    check_capabilities(config, synthesizer.capabilities, name)
    check_context(lm, config, len(corpus.token_ids(lm)), synthesizer=(synthesizer.capabilities, name))
    return synthesize_checked(corpus, lm, output, config, synthesizer, allow_unverified_model=allow_unverified_model,
                              restart=restart, progress=progress, shard=shard)


def synthesize_checked(
    corpus: Corpus, lm: LM, output: str | os.PathLike, config: SynthesisConfig, synthesizer: Synthesizer, *,
    allow_unverified_model: bool = False, restart: bool = False, progress: bool = True, shard: Shard | None = None,
) -> SelfStudyDataset:
    """`synthesize` once its caller has checked `config` against the synthesizer (`check_capabilities`) and the
    model's context (`check_context`): `build_cartridge` checks them before the model loads, and runs each once."""
    ids = corpus.token_ids(lm)
    model_check = check_same_model(lm, synthesizer, allow_unverified_model=allow_unverified_model)
    header = _header(lm, corpus, ids, config, synthesizer, model_check)
    if shard is not None and shard.count > 1:
        header["shard"] = attrs.asdict(shard)
    elif under_torchrun():
        return _synthesize_across_ranks(lm, synthesizer, config, ids, output, header, restart, progress, corpus.text)
    with folder_lock(output):  # the dataset keeps the corpus's text: training starts from it with nothing else
        dataset = SelfStudyDataset.create(output, header, restart=restart, corpus_text=corpus.text)
        _drop_damaged(dataset)
        return _synthesize(lm, synthesizer, config, ids, dataset, shard or Shard(0, 1), progress)


def _header(lm: LM, corpus: Corpus, ids: list[int], config: SynthesisConfig, synthesizer: Synthesizer,
            model_check: dict[str, Any]) -> dict[str, Any]:
    """The dataset's header: what it was made from and with, so a re-run with other settings is refused."""
    return {
        "model": lm.identity.to_dict(),
        "corpus": {
            "fingerprint": corpus.fingerprint(),
            "num_tokens": len(ids),
            "documents": len(corpus.documents),
            # the corpus's opening tokens, so `cartridges train` can start a prefix cartridge without the corpus
            "prefix_ids": lm.encode(corpus.text)[:PREFIX_IDS_KEPT],
        },
        "config": attrs.asdict(config),
        "synthesizer": type(synthesizer).__name__,
        "model_check": model_check,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


SHARED_FOLDER = ("Under torchrun the dataset folder must be one every rank reaches (on several machines, a shared "
                 "filesystem); otherwise make shards (--shard I/N) and `cartridges merge` them.")


def _synthesize_across_ranks(lm: LM, synthesizer: Synthesizer, config: SynthesisConfig, ids: list[int],
                             output: str | os.PathLike, header: dict[str, Any], restart: bool,
                             progress: bool, corpus_text: str) -> SelfStudyDataset:
    """Every rank makes its share of the groups into one folder; rank 0 alone prepares it (and holds its lock).

    Whatever stops one rank before or after its share stops them all, with the reason, rather than leaving the
    others waiting: a problem preparing the folder, a rank given other settings (another corpus, model or
    config), or a rank that cannot see the folder or the others' groups (a folder not shared between machines)."""
    with process_group(lm.device) as (rank, ranks), contextlib.ExitStack() as held:

        def prepare() -> None:
            held.enter_context(folder_lock(output))
            _drop_damaged(SelfStudyDataset.create(output, header, restart=restart, corpus_text=corpus_text))

        lead_does(prepare)
        with patient_group() as waits:  # the slowest rank's share may end hours after the fastest's
            told = gather_from_ranks((dataset_settings(header), (Path(output) / HEADER).is_file()), waits)
            _check_ranks_share(told, output)
            _synthesize(lm, synthesizer, config, ids, SelfStudyDataset(output), Shard(rank, ranks),
                        progress and rank == 0)
            barrier(waits)  # every rank's share is written
            missing = gather_from_ranks(SelfStudyDataset(output).missing_groups(), waits)
        _check_ranks_see_all(missing, output)
    return SelfStudyDataset(output)


def _check_ranks_share(told: list[tuple[dict[str, Any], bool]], output: str | os.PathLike) -> None:
    """Refuse ranks given other settings than rank 0 or not seeing the folder it prepared; `told` is each rank's
    ``(dataset settings, sees the folder)``."""
    lead_settings = told[0][0]
    problems = [f"rank {r} was given other settings than rank 0 ({describe_changes(lead_settings, theirs)})"
                for r, (theirs, _) in enumerate(told) if theirs != lead_settings]
    problems += [f"rank {r} does not see the dataset folder rank 0 prepared"
                 for r, (_, sees) in enumerate(told) if not sees]
    if problems:
        raise ConfigError(f"The ranks cannot share this synthesis: {'; '.join(problems)} in {str(output)!r}. "
                          f"{SHARED_FOLDER}")


def _check_ranks_see_all(missing: list[list[int]], output: str | os.PathLike) -> None:
    """Refuse a dataset some rank does not see whole once all are written; `missing` is each rank's missing groups."""
    unseen = [f"rank {r} does not see group(s) {m[:8]}" for r, m in enumerate(missing) if m]
    if unseen:
        raise ConfigError(f"{'; '.join(unseen)} in {str(output)!r}. {SHARED_FOLDER}")


def _drop_damaged(dataset: SelfStudyDataset) -> None:
    damaged = dataset.drop_damaged()
    if damaged:
        warnings.warn(f"Making {len(damaged)} damaged part(s) of {str(dataset.path)!r} again: {', '.join(damaged)}",
                      stacklevel=5)


def _synthesize(lm: LM, synthesizer: Synthesizer, config: SynthesisConfig, ids: list[int],
                dataset: SelfStudyDataset, shard: Shard, progress: bool) -> SelfStudyDataset:
    """Make `shard`'s groups that `dataset` is missing: conversation groups first, then document-window groups."""
    sampler = ChunkSampler(config.min_chunk, config.max_chunk)
    num_groups, window_groups = group_counts(attrs.asdict(config))
    mine = [g for g in range(num_groups + window_groups) if shard.owns(g)]
    todo = set(dataset.missing_groups(shard))
    bar = _progress_bar(config, shard, mine, todo, num_groups, progress)
    skipped: list[str] = []
    vocab = lm.identity.architecture["vocab_size"]
    # with b_context="document" every group's teacher reads the same text: decode it once
    teacher = chunk_context(lm.tokenizer.decode(ids), config.description) if config.b_context == "document" else None
    try:
        for g in range(num_groups + window_groups):
            if g not in todo:
                continue
            size = _group_size(config, g, num_groups)
            if g < num_groups:
                sequences = _conversation_group(lm, synthesizer, config, sampler, ids, teacher, g, size, vocab,
                                                skipped)
            else:
                first_id = (g - num_groups) * config.windows_per_chunk
                sequences = document_windows(lm, synthesizer, config, g, ids, first_id, size)
            dataset.write_group(g, sequences)
            bar.update(size)
    except BackendError as err:  # the engine failed; say what is kept and how to go on
        saved = len(dataset.done_groups() & set(mine))
        err.add_note(f"{saved} of {len(mine)} groups are saved in {str(dataset.path)!r}; run the same synthesis "
                     "again to continue from there.")
        raise
    finally:
        bar.close()
        if skipped:  # said even when the run stops early: those conversations are not in the saved groups
            warnings.warn(f"Skipped {len(skipped)} bad conversation(s): " + " | ".join(skipped[:5]), stacklevel=2)
    return dataset


def _progress_bar(config: SynthesisConfig, shard: Shard, mine: list[int], todo: set[int], num_groups: int,
                  progress: bool):
    """A bar over this shard's sequences, starting at those already made."""
    from tqdm.auto import tqdm

    total = sum(_group_size(config, g, num_groups) for g in mine)
    already = sum(_group_size(config, g, num_groups) for g in mine if g not in todo)
    desc = "self-study synthesis" + (f" (shard {shard.index} of {shard.count})" if shard.count > 1 else "")
    return tqdm(total=total, initial=already, desc=desc, unit="seq", disable=not progress)


def _conversation_group(lm: LM, synthesizer: Synthesizer, config: SynthesisConfig, sampler: ChunkSampler,
                        ids: list[int], teacher: str | None, group: int, size: int, vocab: int,
                        skipped: list[str]) -> list[Conversation]:
    """The conversations of `group` on a chunk drawn for it; those that cannot be kept are left out, their reasons
    added to `skipped`. `teacher` is B's context where it is not the chunk (the whole corpus)."""
    rng = random.Random(f"{config.seed}:{group}")
    start, end = sampler.sample(len(ids), rng)
    context = chunk_context(lm.tokenizer.decode(ids[start:end]), config.description)
    seeds = [sample_seed(rng, config.seed_weights) for _ in range(size)]
    kept = []
    for conv in run_group(lm, synthesizer, config, group, (start, end), context, seeds, rng, teacher):
        if isinstance(conv, str):
            skipped.append(conv)
            continue
        problems = conv.problems(vocab)
        if problems:
            skipped.append(f"conversation {conv.conv_id}: {'; '.join(problems)}")
        else:
            kept.append(conv)
    return kept


def _group_size(config: SynthesisConfig, group: int, num_groups: int) -> int:
    """How many sequences group `group` holds: conversations first, then document windows."""
    if group < num_groups:
        return min(config.conversations_per_chunk, config.num_conversations - group * config.conversations_per_chunk)
    first = (group - num_groups) * config.windows_per_chunk
    return min(config.windows_per_chunk, config.document_windows - first)
