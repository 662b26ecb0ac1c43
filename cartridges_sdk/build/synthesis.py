"""Self-study data generation (the paper's Algorithm 1) over any `Synthesizer`, engine-neutral.

For each group of conversations: sample a chunk of the corpus; participant A sees the chunk and a seed prompt and
writes a message; participant B sees the chunk and answers. B's tokens, with the teacher's top-k log-probabilities,
become the distillation targets for a student that sees the cartridge instead of the chunk.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import os
import random
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ..checks import at_least_one, count, non_negative, optional_int
from .corpus import ChunkSampler, Corpus
from .dataset import (HEADER, ROLE_ASSISTANT, ROLE_DOCUMENT, ROLE_USER, SEED_KIND_DOCUMENT, Conversation,
                      SelfStudyDataset, Shard, dataset_settings, describe_changes, group_counts)
from .distributed import barrier, gather_from_ranks, lead_does, patient_group, process_group, under_torchrun
from ..errors import BackendError, ConfigError, IncompatibleCartridgeError
from ..files import folder_lock
from ..lm import LM, Message
from ..plugins import Synthesizer, SynthesizerCapabilities
from ..requests import Completion, SynthesisRequest
from ..probe import check_same_model
from .seeds import DEFAULT_WEIGHTS, check_weights, sample_seed

PREFIX_IDS_KEPT = 4096


def _text(_inst, attribute, value):
    if not isinstance(value, str):
        raise ConfigError(f"{attribute.name}={value!r:.60} must be a string.")


def _weights(_inst, _attribute, value):
    check_weights(value)


# the default data budget: from a compacted start, half the data of the first recipe reached the same quality
# in half the time (docs/self-study.md)
DEFAULT_CONVERSATIONS = 128
DEFAULT_DOCUMENT_WINDOWS = 96


@attrs.frozen
class SynthesisConfig:
    """How self-study conversations are sampled. Defaults suit a small model on a CPU."""

    num_conversations: int = attrs.field(default=DEFAULT_CONVERSATIONS, validator=at_least_one)
    rounds: int = attrs.field(default=1, validator=at_least_one)
    min_chunk: int = attrs.field(default=512, validator=at_least_one)
    max_chunk: int = attrs.field(default=1024, validator=at_least_one)  # CPU-sized; the sampler allows 4096
    description: str | None = attrs.field(default=None, validator=attrs.validators.optional(_text))
    conversations_per_chunk: int = attrs.field(default=16, validator=at_least_one)
    seed_weights: Mapping[str, float] = attrs.field(factory=lambda: dict(DEFAULT_WEIGHTS), converter=dict, validator=_weights)
    temperature_a: float = attrs.field(default=0.7, validator=non_negative)
    temperature_b: float = attrs.field(default=0.5, validator=non_negative)
    max_tokens_a: int = attrs.field(default=48, validator=at_least_one)
    max_tokens_b: int = attrs.field(default=64, validator=at_least_one)
    top_k: int = attrs.field(default=20, validator=at_least_one)
    targets: str = attrs.field(default="assistant")
    a_context: str = attrs.field(default="message")
    document_windows: int = attrs.field(default=DEFAULT_DOCUMENT_WINDOWS, validator=count)
    window_tokens: int = attrs.field(default=256)
    windows_per_chunk: int = attrs.field(default=4, validator=at_least_one)
    seed: int = attrs.field(default=0, validator=optional_int)

    @a_context.validator
    def _check_a_context(self, _attribute, value):
        if value not in ("message", "prefix"):
            raise ConfigError(f"a_context={value!r} must be 'message' (chunk inside A's prompt) or 'prefix' (before the chat).")

    @window_tokens.validator
    def _check_window_tokens(self, _attribute, value):
        if not isinstance(value, int) or value < 2:
            raise ConfigError(f"window_tokens={value!r} must be an integer >= 2: a window needs a token to predict after its first.")

    @targets.validator
    def _check_targets(self, _attribute, value):
        if value not in ("assistant", "all"):
            raise ConfigError(f"targets={value!r} must be 'assistant' (B's answers) or 'all' (every token after the first).")

    def __attrs_post_init__(self):
        ChunkSampler(self.min_chunk, self.max_chunk)  # validates the pair


def teacher_prompt(lm: LM, context_ids: Sequence[int] | None, messages: Sequence[Message]) -> list[int]:
    """Token ids the teacher reads: the context as a document, then the chat turn by the prompt rule
    (`LM.prompt_ids`), so teacher and student differ only in chunk versus cartridge."""
    return lm.prompt_ids(messages, prefix_ids=context_ids or ())


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


# room for a seed prompt and the chat markup around a chunk and the turns (the longest built-in seed prompt is ~90
# tokens in the default model's tokenizer)
PROMPT_MARKUP = 256


def check_context(lm: LM, config: SynthesisConfig, corpus_tokens: int, num_tokens: int | None = None) -> None:
    """Refuse settings whose prompts (or, with `num_tokens`, whose training sequences after the cartridge) could
    outgrow the model's context, with the numbers, before any work."""
    chunk = min(config.max_chunk, corpus_tokens) + (len(lm.encode(config.description)) if config.description else 0)
    turns = config.rounds * (config.max_tokens_a + config.max_tokens_b)
    lm.check_context(
        chunk + PROMPT_MARKUP + turns,
        f"A self-study prompt (a chunk of up to {chunk} tokens, {PROMPT_MARKUP} for the seed prompt and chat markup, "
        f"{turns} for {config.rounds} round(s) of max_tokens_a + max_tokens_b)",
        "lower max_chunk, max_tokens_a or max_tokens_b",
    )
    window_chunk = min(config.windows_per_chunk * config.window_tokens, corpus_tokens)
    if config.document_windows:
        lm.check_context(
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


def chunk_context(chunk_text: str, description: str | None) -> str:
    """What the teacher sees in place of the cartridge: the optional description, then the chunk."""
    return f"{description.strip()}\n\n{chunk_text}" if description else chunk_text


def _student_sequence(lm: LM, turns: list[tuple[str, list[int]]]) -> tuple[list[int], list[int], list[int]] | str:
    """Token ids, roles and target positions of a conversation as the student sees it (after a cartridge).

    `turns` alternates ``(A's text, [])`` and ``(B's text, B's exact token ids)``. B's ids are used as sampled,
    so the targets are exactly the tokens the teacher scored. Returns a reason string when the chat template
    re-tokenizes earlier turns differently (then the conversation is skipped).
    """
    ids: list[int] = []
    roles: list[int] = []
    targets: list[int] = []
    messages: list[Message] = []
    for i in range(0, len(turns), 2):
        user_text, _ = turns[i]
        _, b_ids = turns[i + 1]
        messages.append({"role": "user", "content": user_text})
        full = lm.chat_ids(messages, after_cartridge=True)
        if full[: len(ids)] != ids:
            return "the chat template re-tokenizes earlier turns differently"
        roles += [ROLE_USER] * (len(full) - len(ids))
        ids = list(full)
        targets += list(range(len(ids), len(ids) + len(b_ids)))
        ids += b_ids
        roles += [ROLE_ASSISTANT] * len(b_ids)
        messages.append({"role": "assistant", "content": turns[i + 1][0]})
    return ids, roles, targets


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
        from ..hf import HFSynthesizer

        synthesizer = HFSynthesizer(lm)
    check_capabilities(config, synthesizer.capabilities, type(synthesizer).__name__)
    ids = corpus.token_ids(lm)
    if config.document_windows and len(ids) < 2:
        raise ConfigError(
            f"The corpus has {len(ids)} token(s), too few for document windows; give a longer corpus or document_windows=0."
        )
    check_context(lm, config, len(ids))
    model_check = check_same_model(lm, synthesizer, allow_unverified_model=allow_unverified_model)
    header = {
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
    if shard is not None and shard.count > 1:
        header["shard"] = attrs.asdict(shard)
    elif under_torchrun():
        return _synthesize_across_ranks(lm, synthesizer, config, ids, output, header, restart, progress, corpus.text)
    with folder_lock(output):  # the dataset keeps the corpus's text: training starts from it with nothing else
        dataset = SelfStudyDataset.create(output, header, restart=restart, corpus_text=corpus.text)
        _drop_damaged(dataset)
        return _synthesize(lm, synthesizer, config, ids, dataset, shard or Shard(0, 1), progress)


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
            lead_settings = told[0][0]
            problems = [f"rank {r} was given other settings than rank 0 ({describe_changes(lead_settings, theirs)})"
                        for r, (theirs, _) in enumerate(told) if theirs != lead_settings]
            problems += [f"rank {r} does not see the dataset folder rank 0 prepared"
                         for r, (_, sees) in enumerate(told) if not sees]
            if problems:
                raise ConfigError(f"The ranks cannot share this synthesis: {'; '.join(problems)} in {str(output)!r}. "
                                  f"{SHARED_FOLDER}")
            _synthesize(lm, synthesizer, config, ids, SelfStudyDataset(output), Shard(rank, ranks),
                        progress and rank == 0)
            barrier(waits)  # every rank's share is written
            missing = gather_from_ranks(SelfStudyDataset(output).missing_groups(), waits)
        unseen = [f"rank {r} does not see group(s) {m[:8]}" for r, m in enumerate(missing) if m]
        if unseen:
            raise ConfigError(f"{'; '.join(unseen)} in {str(output)!r}. {SHARED_FOLDER}")
    return SelfStudyDataset(output)


def _drop_damaged(dataset: SelfStudyDataset) -> None:
    damaged = dataset.drop_damaged()
    if damaged:
        warnings.warn(f"Making {len(damaged)} damaged part(s) of {str(dataset.path)!r} again: {', '.join(damaged)}",
                      stacklevel=4)


def _synthesize(lm: LM, synthesizer: Synthesizer, config: SynthesisConfig, ids: list[int],
                dataset: SelfStudyDataset, shard: Shard, progress: bool) -> SelfStudyDataset:
    from tqdm.auto import tqdm

    sampler = ChunkSampler(config.min_chunk, config.max_chunk)
    group_size = config.conversations_per_chunk
    num_groups, window_groups = group_counts(attrs.asdict(config))
    mine = [g for g in range(num_groups + window_groups) if shard.owns(g)]
    todo = set(dataset.missing_groups(shard))
    total = sum(_group_size(config, g, num_groups) for g in mine)
    already = sum(_group_size(config, g, num_groups) for g in mine if g not in todo)
    desc = "self-study synthesis" + (f" (shard {shard.index} of {shard.count})" if shard.count > 1 else "")
    bar = tqdm(total=total, initial=already, desc=desc, unit="seq", disable=not progress)
    skipped: list[str] = []
    vocab = lm.identity.architecture["vocab_size"]
    try:
        for g in range(num_groups):
            if g not in todo:
                continue
            size = min(group_size, config.num_conversations - g * group_size)
            rng = random.Random(f"{config.seed}:{g}")
            start, end = sampler.sample(len(ids), rng)
            context = chunk_context(lm.tokenizer.decode(ids[start:end]), config.description)
            seeds = [sample_seed(rng, config.seed_weights) for _ in range(size)]
            conversations = _run_group(lm, synthesizer, config, g, (start, end), context, seeds, rng)
            kept = []
            for conv in conversations:
                if isinstance(conv, str):
                    skipped.append(conv)
                    continue
                problems = conv.problems(vocab)
                if problems:
                    skipped.append(f"conversation {conv.conv_id}: {'; '.join(problems)}")
                else:
                    kept.append(conv)
            dataset.write_group(g, kept)
            bar.update(size)
        for w in range(window_groups):
            g = num_groups + w
            if g not in todo:
                continue
            size = _group_size(config, g, num_groups)
            dataset.write_group(g, _document_windows(lm, synthesizer, config, g, ids, w * config.windows_per_chunk, size))
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


def _group_size(config: SynthesisConfig, group: int, num_groups: int) -> int:
    """How many sequences group `group` holds: conversations first, then document windows."""
    if group < num_groups:
        return min(config.conversations_per_chunk, config.num_conversations - group * config.conversations_per_chunk)
    first = (group - num_groups) * config.windows_per_chunk
    return min(config.windows_per_chunk, config.document_windows - first)


def window_chunk_start(n_tokens: int, length: int, width: int, index: int, seed: int) -> int:
    """Start of the `index`-th document-window chunk (`length` tokens, read as windows of `width`).

    Uniformly random starts would train the corpus's first and last windows several times less often than its
    middle, and a document's opening (title, abstract, summary) is often what questions are about. Instead, starts
    sweep the corpus evenly (each sweep in a random order, with jitter) over a range that reaches a chunk's length
    beyond both ends, then are clamped into the corpus, so every window position is trained about equally often.
    """
    if n_tokens <= length:
        return 0
    lo, hi = -(length - width), n_tokens - width
    tiles = math.ceil((hi - lo) / width) + 1
    sweep, slot = divmod(index, tiles)
    order = list(range(tiles))
    random.Random(f"{seed}:windows:sweep:{sweep}").shuffle(order)
    spacing = (hi - lo) / (tiles - 1)
    jitter = random.Random(f"{seed}:windows:{index}").uniform(-spacing / 2, spacing / 2)
    return min(max(round(lo + order[slot] * spacing + jitter), 0), n_tokens - length)


def _document_windows(
    lm: LM, synthesizer: Synthesizer, config: SynthesisConfig, group: int, ids: Sequence[int], first_id: int, size: int
) -> list[Conversation]:
    """Windows of one chunk, each re-read by the teacher after the whole chunk and by the student after the cartridge.

    A small model's synthetic conversations carry little of the text's facts, and a teacher that has only the
    preceding text cannot predict the facts a window introduces. A teacher that has just read the chunk predicts
    each window token as the text in context would (near-copies, soft where the model is unsure), which is what
    the cartridge should make the student do without the chunk. See docs/self-study.md for the measurements.
    """
    width = min(config.window_tokens, len(ids))
    length = min(size * width, len(ids))
    start = window_chunk_start(len(ids), length, width, first_id // config.windows_per_chunk, config.seed)
    context = lm.encode(chunk_context(lm.tokenizer.decode(ids[start : start + length]), config.description))
    spans = [(start + k * width, min(start + (k + 1) * width, start + length)) for k in range(size)]
    spans = [(a, b) for a, b in spans if b - a >= 2]  # synthesize() refuses corpora too short for any window
    scores = synthesizer.score(context, [list(ids[a:b]) for a, b in spans], config.top_k)
    out = []
    for k, ((a, b), (top_ids, top_lps)) in enumerate(zip(spans, scores)):
        n = b - a
        out.append(
            Conversation(
                conv_id=config.num_conversations + first_id + k,  # after every conversation id
                group=group,
                chunk=(start, start + length),
                seed_kind=SEED_KIND_DOCUMENT,
                input_ids=np.asarray(ids[a:b], dtype=np.int32),
                role_mask=np.full(n, ROLE_DOCUMENT, dtype=np.int8),
                target_positions=np.arange(1, n, dtype=np.int32),
                topk_ids=np.asarray(top_ids, dtype=np.int32),
                topk_logprobs=np.asarray(top_lps, dtype=np.float32),
            )
        )
    return out


def _run_group(
    lm: LM,
    synthesizer: Synthesizer,
    config: SynthesisConfig,
    group: int,
    chunk: tuple[int, int],
    context: str,
    seeds: list[tuple[str, str]],
    rng: random.Random,
) -> list[Conversation | str]:
    # A only writes questions, so it may read the chunk however it reads best; small models ignore a chunk placed
    # before the chat but use one inside the message. B is the teacher and reads the chunk where the cartridge sits.
    a_in_message = config.a_context == "message"
    a_first = (lambda seed: f"{context}\n\n{seed}") if a_in_message else (lambda seed: seed)
    context_ids = lm.encode(context)
    a_ctx = None if a_in_message else context_ids
    stop_ids = tuple(sorted(lm.eos_token_ids))
    a_hist: list[list[Message]] = [[{"role": "user", "content": a_first(seed)}] for _, seed in seeds]
    b_hist: list[list[Message]] = [[] for _ in seeds]
    turns: list[list[tuple[str, list[int]]]] = [[] for _ in seeds]
    tops: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in seeds]
    for _ in range(config.rounds):
        a_out = synthesizer.complete(
            [
                SynthesisRequest(teacher_prompt(lm, a_ctx, h), stop_ids, config.max_tokens_a, config.temperature_a, 0,
                                 group, rng.randrange(2**31))
                for h in a_hist
            ]
        )
        for i, a in enumerate(a_out):
            text = a.text.strip()
            a_hist[i].append({"role": "assistant", "content": text})
            b_hist[i].append({"role": "user", "content": text})
        b_out = synthesizer.complete(
            [
                SynthesisRequest(teacher_prompt(lm, context_ids, h), stop_ids, config.max_tokens_b, config.temperature_b,
                                 config.top_k, group, rng.randrange(2**31))
                for h in b_hist
            ]
        )
        for i, b in enumerate(b_out):
            text = b.text.strip()
            turns[i] += [(a_hist[i][-1]["content"], []), (text, list(b.token_ids))]
            tops[i].append((np.asarray(b.top_ids), np.asarray(b.top_logprobs)))
            a_hist[i].append({"role": "user", "content": text})
            b_hist[i].append({"role": "assistant", "content": text})

    out: list[Conversation | str] = []
    for i, (kind, _) in enumerate(seeds):
        conv_id = group * config.conversations_per_chunk + i
        if any(not t[0] for t in turns[i][::2]):
            out.append(f"conversation {conv_id}: participant A wrote an empty message")
            continue
        seq = _student_sequence(lm, turns[i])
        if isinstance(seq, str):
            out.append(f"conversation {conv_id}: {seq}")
            continue
        ids, roles, targets = seq
        messages = tuple({"role": "user" if j % 2 == 0 else "assistant", "content": t[0]} for j, t in enumerate(turns[i]))
        if config.targets == "all":  # every token after the first, scored by the teacher with the chunk in context
            top_ids, top_lps = synthesizer.score(context_ids, [ids], config.top_k)[0]
            targets = list(range(1, len(ids)))
        else:
            top_ids = np.concatenate([t[0].reshape(-1, config.top_k) for t in tops[i]])
            top_lps = np.concatenate([t[1].reshape(-1, config.top_k) for t in tops[i]])
        out.append(
            Conversation(
                conv_id=conv_id,
                group=group,
                chunk=chunk,
                seed_kind=kind,
                input_ids=np.asarray(ids, dtype=np.int32),
                role_mask=np.asarray(roles, dtype=np.int8),
                target_positions=np.asarray(targets, dtype=np.int32),
                topk_ids=top_ids.astype(np.int32),
                topk_logprobs=top_lps.astype(np.float32),
                messages=messages,
            )
        )
    return out
