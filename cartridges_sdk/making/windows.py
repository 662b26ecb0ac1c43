"""Document windows: the corpus re-read by the teacher a chunk at a time, as training sequences of their own.

A small model's synthetic conversations carry little of the text's facts, and a teacher that has only the
preceding text cannot predict the facts a window introduces. A teacher that has just read the chunk predicts each
window token as the text in context would (near-copies, soft where the model is unsure), which is what the
cartridge should make the student do without the chunk. See docs/self-study.md for the measurements.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np

from ..lm import LM
from ..plugins import Synthesizer
from ..trainer_inputs import ROLE_DOCUMENT, SEED_KIND_DOCUMENT, Conversation
from .conversations import chunk_context
from .settings import SynthesisConfig


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


def document_windows(
    lm: LM, synthesizer: Synthesizer, config: SynthesisConfig, group: int, ids: Sequence[int], first_id: int, size: int
) -> list[Conversation]:
    """Windows of one chunk, each re-read by the teacher after the whole chunk and by the student after the cartridge."""
    width = min(config.window_tokens, len(ids))
    length = min(size * width, len(ids))
    start = window_chunk_start(len(ids), length, width, first_id // config.windows_per_chunk, config.seed)
    chunk = (start, start + length)
    context = lm.encode(chunk_context(lm.tokenizer.decode(ids[start : start + length]), config.description))
    spans = [(start + k * width, min(start + (k + 1) * width, start + length)) for k in range(size)]
    spans = [(a, b) for a, b in spans if b - a >= 2]  # synthesize() refuses corpora too short for any window
    scores = synthesizer.score(context, [list(ids[a:b]) for a, b in spans], config.top_k)
    first_conv_id = config.num_conversations + first_id  # after every conversation id
    return [_window(first_conv_id + k, group, chunk, ids[a:b], top_ids, top_lps)
            for k, ((a, b), (top_ids, top_lps)) in enumerate(zip(spans, scores))]


def _window(conv_id: int, group: int, chunk: tuple[int, int], window: Sequence[int], top_ids, top_lps) -> Conversation:
    """One window as a training sequence: every token after its first is a target, with the teacher's top-k."""
    n = len(window)
    return Conversation(conv_id, group, chunk, SEED_KIND_DOCUMENT, window, np.full(n, ROLE_DOCUMENT), np.arange(1, n),
                        top_ids, top_lps)
