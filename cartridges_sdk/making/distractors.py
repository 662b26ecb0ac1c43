"""Training a cartridge among others (composition-aware self-study, after Cartridges at Scale): at each step a few
frozen cartridges of other documents sit around the trainable one, composed as serving composes them, so that the
cartridge learns to answer with them in front rather than only alone.

A cartridge trained alone has never seen another cartridge's keys compete for its queries' attention; composed with
k - 1 others it loses most of what it gained over its compacted start (docs/sync.md measures this). The teacher
stays the document alone in context: the student learns to answer as if the others were not there.

The draw (how many others, which, and where the trainable one sits) depends on the run's seed and the step alone, so
every rank of a distributed run draws the same and a resumed run draws as the first did.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import attrs
import torch

from ..cartridge import Cartridge
from ..checks import require
from ..errors import ConfigError
from ..lm import LM, rope_inv_freq
from ..rope import ROTATE_HALF, one_after_another
from ..trainer_inputs import TrainConfig

KV = list[tuple[torch.Tensor, torch.Tensor]]


@attrs.frozen
class Placement:
    """The distractors in front of the trainable cartridge and after it, by index, in order."""

    before: tuple[int, ...]
    after: tuple[int, ...]


def draw(count: int, most: int, seed: int, step: int, alone: float = 0.5) -> Placement:
    """Step `step`'s others: none with probability `alone` (steps that keep what the cartridge is worth alone), else
    between 1 and `most` of the `count` distractors (each number as likely), at a uniform place among them."""
    rng = random.Random(f"distractors:{seed}:{step}")
    n = 0 if min(most, count) == 0 or rng.random() < alone else rng.randint(1, min(most, count))
    chosen = rng.sample(range(count), n)
    at = rng.randint(0, len(chosen))
    return Placement(tuple(chosen[:at]), tuple(chosen[at:]))


def check_distractors(distractors: Sequence[Cartridge], lm: LM) -> list[Cartridge]:
    """The distractors as a list, each checked to run on `lm` (before any synthesis or training)."""
    require("distractors", distractors, (list, tuple), "a list of Cartridge objects")
    for i, c in enumerate(distractors):
        require(f"distractors[{i}]", c, Cartridge, "a Cartridge")
        c.check_model(lm, what=f"distractors[{i}]")
    if distractors:
        rope_inv_freq(lm)  # placing the cartridge among others moves its keys: refuse a RoPE where that is inexact
    return list(distractors)


def among(init: Cartridge, distractors: Sequence[Cartridge], lm: LM, most: int, alone: float) -> Distractors | None:
    """What `init` trains among: the checked distractors on the device, or None without any."""
    distractors = check_distractors(distractors, lm)
    if not distractors:
        return None
    if init.pairing != ROTATE_HALF:
        raise ConfigError(f"Training among distractors places the cartridge's keys with the model's RoPE; the start "
                          f"cartridge's keys are paired {init.pairing!r}: convert it with in_key_pairing("
                          f"{ROTATE_HALF!r}) first.")
    return Distractors(distractors, lm, most, alone)


def check_among(lm: LM, distractors: Sequence[Cartridge], config: TrainConfig, tokens: int) -> None:
    """Refuse distractors whose longest draw would not fit the context beside `tokens` (the cartridge and the
    longest training sequence, when known)."""
    if not distractors:
        return
    most = min(config.max_distractors, len(distractors))
    longest = sum(sorted((c.num_tokens for c in distractors), reverse=True)[:most])
    lm.check_context(tokens + longest, f"Training among up to {most} distractors ({longest} tokens at most) with "
                     f"{tokens} tokens of cartridge and sequence", "set max_distractors lower, or give smaller "
                     "distractor cartridges")


class Distractors:
    """The frozen others' KV on the training device (float32, rotate-half pairing, the layout the model reads)."""

    def __init__(self, cartridges: Sequence[Cartridge], lm: LM, most: int, alone: float = 0.5):
        if not cartridges:
            raise ConfigError("Distractors() needs at least one cartridge.")
        self.most, self.alone = most, alone
        self.inv_freq = rope_inv_freq(lm)
        self.fingerprints = [c.fingerprint for c in cartridges]
        self.parts = []
        for c in cartridges:
            c = c.in_key_pairing(ROTATE_HALF)
            self.parts.append([(k.detach().float().to(lm.device), v.detach().float().to(lm.device))
                               for k, v in zip(c.keys, c.values)])

    def around(self, layers: KV, placement: Placement) -> KV:
        """The prefix of one step: the placement's others and the trainable `layers` one after another, each part's
        keys rotated to where it sits (as ``Cartridge.compose(reposition=True)``); gradients flow to `layers`."""
        parts = [self.parts[i] for i in placement.before] + [layers] + [self.parts[i] for i in placement.after]
        return one_after_another(parts, self.inv_freq)

    def run_settings(self) -> dict:
        """What the distractors add to a run's settings: a checkpoint made among other others is refused."""
        return {"most": self.most, "alone": self.alone, "content": self.fingerprints}

    def draw(self, seed: int, step: int) -> Placement:
        return draw(len(self.parts), self.most, seed, step, self.alone)
