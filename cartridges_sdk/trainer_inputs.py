"""What a trainer is given: its settings (`TrainConfig`) and the conversations it distills (`Conversation`, read
through `TrainingData`).

They sit in the core, beside the `Trainer` contract, so a trainer backend types its `fit` from the kit alone; the
making layer writes conversations to Parquet (`making/dataset.py`) and reads them back as these.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import attrs
import numpy as np

from .checks import at_least_one, count, fraction, non_negative, one_of, optional_int, positive

# role of every token of a student sequence
ROLE_TEMPLATE, ROLE_USER, ROLE_ASSISTANT, ROLE_DOCUMENT = 0, 1, 2, 3
SEED_KIND_DOCUMENT = "document"  # the seed kind of document windows (not a seed prompt; reserved)


@attrs.frozen
class Conversation:
    """One self-study conversation as the student sees it, with the teacher's sparse top-k at the target tokens.

    ``topk_ids[i]`` / ``topk_logprobs[i]`` are the teacher's top-k next-token candidates for the token at
    ``input_ids[target_positions[i]]``.
    """

    conv_id: int
    group: int
    chunk: tuple[int, int]
    seed_kind: str
    # arrays in the dtypes the Parquet file stores (given as lists or arrays of any dtype, converted here)
    input_ids: np.ndarray = attrs.field(converter=lambda a: np.asarray(a, dtype=np.int32))  # [n]
    role_mask: np.ndarray = attrs.field(converter=lambda a: np.asarray(a, dtype=np.int8))  # [n]
    target_positions: np.ndarray = attrs.field(converter=lambda a: np.asarray(a, dtype=np.int32))  # [t]
    topk_ids: np.ndarray = attrs.field(converter=lambda a: np.asarray(a, dtype=np.int32))  # [t, k]
    topk_logprobs: np.ndarray = attrs.field(converter=lambda a: np.asarray(a, dtype=np.float32))  # [t, k]
    messages: tuple[dict[str, str], ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def problems(self, vocab_size: int) -> list[str]:
        """Why this conversation cannot be trained on (empty if it can)."""
        out = []
        n, t = self.num_tokens, self.target_positions.shape[0]
        if n == 0 or t == 0:
            out.append("no tokens or no target tokens")
        if self.role_mask.shape != (n,):
            out.append(f"role mask has shape {self.role_mask.shape}, expected ({n},)")
        if n and (self.input_ids.min() < 0 or self.input_ids.max() >= vocab_size):
            out.append(f"token ids outside [0, {vocab_size})")
        if self.topk_ids.shape != self.topk_logprobs.shape or self.topk_ids.ndim != 2 or self.topk_ids.shape[0] != t:
            out.append(f"top-k arrays {self.topk_ids.shape}/{self.topk_logprobs.shape} do not align with {t} targets")
        elif t:
            if self.topk_ids.min() < 0 or self.topk_ids.max() >= vocab_size:
                out.append(f"top-k ids outside [0, {vocab_size})")
            if not np.isfinite(self.topk_logprobs).all() or self.topk_logprobs.max() > 1e-3:
                out.append("top-k log-probabilities are not finite and <= 0")
        if t and (self.target_positions.min() < 1 or self.target_positions.max() >= n):
            out.append("target positions outside the sequence (the first token cannot be a target)")
        return out


class TrainingData(Protocol):
    """The conversations a trainer reads: a self-study dataset folder (`SelfStudyDataset`) or a list of
    `Conversation`s; a trainer iterates it (as often as it needs) and may ask its size."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Conversation]: ...


@attrs.frozen
class TrainConfig:
    """How a cartridge is trained: Adam as in the paper, with the learning rate and batch measured best for small
    models on a CPU (the paper's lr 2e-2 at its scale; see docs/self-study.md)."""

    lr: float = attrs.field(default=3e-3, validator=positive)
    epochs: int = attrs.field(default=1, validator=at_least_one)
    batch_tokens: int = attrs.field(default=2048, validator=at_least_one)
    grad_accum: int = attrs.field(default=1, validator=at_least_one)
    warmup_steps: int = attrs.field(default=0, validator=count)
    schedule: str = attrs.field(default="cosine", validator=one_of("cosine", "constant"))
    min_lr_ratio: float = attrs.field(default=0.1, validator=fraction)
    max_grad_norm: float | None = attrs.field(default=1.0, validator=positive)
    objective: str = attrs.field(default="distill", validator=one_of("distill", "ntp"))
    # weight of conversation target tokens against document-window tokens (seed kind "document") in the mean loss
    conversation_weight: float = attrs.field(default=0.25, validator=non_negative)
    eval_fraction: float = attrs.field(default=0.05, validator=fraction)
    eval_every: int = attrs.field(default=25, validator=at_least_one)
    checkpoint_every: int = attrs.field(default=25, validator=at_least_one)
    # also checkpoint when this long has passed since the last one, so a kill loses at most about this much work
    checkpoint_seconds: float = attrs.field(default=60.0, validator=positive)
    autocast_dtype: str | None = attrs.field(default=None, validator=one_of(None, "bfloat16", "float16"))
    seed: int = attrs.field(default=0, validator=optional_int)
    # with distractor cartridges (`fit(distractors=...)`, making/distractors.py): at most this many around the
    # trainable one at a step (7: compositions of up to 8), and the share of steps alone (half: docs/sync.md)
    max_distractors: int = attrs.field(default=7, validator=count)
    alone_share: float = attrs.field(default=0.5, validator=fraction)
