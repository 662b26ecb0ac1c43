"""One group of self-study conversations on one chunk (the paper's Algorithm 1, for a chunk).

Participant A sees the chunk and a seed prompt and writes a message; participant B, the teacher, sees the chunk (or,
with ``b_context="document"``, the whole document) and answers. B's tokens, with the teacher's top-k
log-probabilities, become the distillation targets for a student that sees the cartridge instead of the chunk.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from ..lm import LM, Message
from ..plugins import Synthesizer
from ..generation import SynthesisRequest
from ..trainer_inputs import ROLE_ASSISTANT, ROLE_USER, Conversation
from .settings import SynthesisConfig

# one conversation's turns, ``(A's text, [])`` and ``(B's text, B's exact token ids)`` alternating, and B's top-k
Turns = list[tuple[str, list[int]]]
TopK = list[tuple[np.ndarray, np.ndarray]]


def teacher_prompt(lm: LM, context_ids: Sequence[int] | None, messages: Sequence[Message]) -> list[int]:
    """Token ids the teacher reads: the context as a document, then the chat turn by the prompt rule
    (`LM.prompt_ids`), so teacher and student differ only in chunk versus cartridge."""
    return lm.prompt_ids(messages, prefix_ids=context_ids or ())


def chunk_context(chunk_text: str, description: str | None) -> str:
    """What the teacher sees in place of the cartridge: the optional description, then the chunk."""
    return f"{description.strip()}\n\n{chunk_text}" if description else chunk_text


def student_sequence(lm: LM, turns: Turns) -> tuple[list[int], list[int], list[int]] | str:
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
        full = lm.prompt_ids(messages, after_cartridge=True)
        if full[: len(ids)] != ids:
            return "the chat template re-tokenizes earlier turns differently"
        roles += [ROLE_USER] * (len(full) - len(ids))
        ids = list(full)
        targets += list(range(len(ids), len(ids) + len(b_ids)))
        ids += b_ids
        roles += [ROLE_ASSISTANT] * len(b_ids)
        messages.append({"role": "assistant", "content": turns[i + 1][0]})
    return ids, roles, targets


def run_group(
    lm: LM,
    synthesizer: Synthesizer,
    config: SynthesisConfig,
    group: int,
    chunk: tuple[int, int],
    context: str,
    seeds: list[tuple[str, str]],
    rng: random.Random,
    teacher_context: str | None = None,
) -> list[Conversation | str]:
    """The group's conversations, one per seed ``(kind, prompt)``; a reason string in place of each that cannot
    be kept. B, the teacher, reads `teacher_context` where given (the whole document), else the chunk A reads."""
    context_ids = lm.encode(context)
    b_ids = lm.encode(teacher_context) if teacher_context is not None else context_ids
    turns, tops = _converse(lm, synthesizer, config, group, context, context_ids, b_ids, seeds, rng)
    return [_conversation(lm, synthesizer, config, group, chunk, b_ids, i, kind, turns[i], tops[i])
            for i, (kind, _) in enumerate(seeds)]


def _converse(
    lm: LM, synthesizer: Synthesizer, config: SynthesisConfig, group: int, context: str, context_ids: list[int],
    b_ids: list[int], seeds: list[tuple[str, str]], rng: random.Random,
) -> tuple[list[Turns], list[TopK]]:
    """Every conversation's `config.rounds` rounds, batched across the group: A's messages (A reads `context`),
    then B's answers with the teacher's top-k (B reads `b_ids`); each conversation's turns and B's top-k."""
    # A only writes questions, so it may read the chunk however it reads best; small models ignore a chunk placed
    # before the chat but use one inside the message. B is the teacher and reads its context where the cartridge sits.
    a_in_message = config.a_context == "message"
    a_first = (lambda seed: f"{context}\n\n{seed}") if a_in_message else (lambda seed: seed)
    a_ctx = None if a_in_message else context_ids
    stop_ids = tuple(sorted(lm.eos_token_ids))
    a_hist: list[list[Message]] = [[{"role": "user", "content": a_first(seed)}] for _, seed in seeds]
    b_hist: list[list[Message]] = [[] for _ in seeds]
    turns: list[Turns] = [[] for _ in seeds]
    tops: list[TopK] = [[] for _ in seeds]
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
                SynthesisRequest(teacher_prompt(lm, b_ids, h), stop_ids, config.max_tokens_b, config.temperature_b,
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
    return turns, tops


def _conversation(
    lm: LM, synthesizer: Synthesizer, config: SynthesisConfig, group: int, chunk: tuple[int, int],
    b_ids: list[int], index: int, kind: str, turns: Turns, tops: TopK,
) -> Conversation | str:
    """The group's `index`-th conversation as the student trains on it, or the reason it cannot be kept."""
    conv_id = group * config.conversations_per_chunk + index
    if any(not t[0] for t in turns[::2]):
        return f"conversation {conv_id}: participant A wrote an empty message"
    seq = student_sequence(lm, turns)
    if isinstance(seq, str):
        return f"conversation {conv_id}: {seq}"
    ids, roles, targets = seq
    messages = tuple({"role": "user" if j % 2 == 0 else "assistant", "content": t[0]} for j, t in enumerate(turns))
    if config.targets == "all":  # every token after the first, scored by the teacher with its context before them
        top_ids, top_lps = synthesizer.score(b_ids, [ids], config.top_k)[0]
        targets = list(range(1, len(ids)))
    else:
        top_ids = np.concatenate([t[0].reshape(-1, config.top_k) for t in tops])
        top_lps = np.concatenate([t[1].reshape(-1, config.top_k) for t in tops])
    return Conversation(conv_id, group, chunk, kind, ids, roles, targets, top_ids, top_lps, messages)
