"""The methods a benchmark compares, and how the trained ones are built, resumably, with their cost on record.

Each trained cartridge is saved in the run's work folder when done; synthesis datasets and training checkpoints
live there too, so an interrupted run picks up where it stopped. Wall clock is added up across runs in
``cost.json`` (work lost to a kill between two checkpoints is not counted).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cartridges_sdk import Cartridge
from cartridges_sdk.making.corpus import Corpus as SDKCorpus
from cartridges_sdk.making.dataset import SelfStudyDataset
from cartridges_sdk.files import atomic_write_json
from cartridges_sdk.lm import LM
from cartridges_sdk.plugins import synthesizers, trainers
from cartridges_sdk.making.settings import SynthesisConfig
from cartridges_sdk.making.synthesis import synthesize
from cartridges_sdk.making.windows import window_chunk_start
from cartridges_sdk.making.training import split_eval
from cartridges_sdk.trainer_inputs import ROLE_ASSISTANT, ROLE_DOCUMENT, SEED_KIND_DOCUMENT, Conversation, TrainConfig

from .profiles import Profile

# name -> what the table calls it; the order is the table's
METHODS = {
    "icl": "ICL (whole document)",
    "none": "no context",
    "truncated": "truncated ICL",
    "untrained": "untrained cartridge",
    "compact": "compaction (no training)",
    "ntp": "NTP on raw document",
    "generic": "self-study, generic seed",
    "selfstudy": "self-study (full)",
}
SIZED = ("truncated", "untrained", "compact", "ntp", "generic", "selfstudy")
TRAINED = ("ntp", "generic", "selfstudy")
NTP_WINDOW = 256


def synthesis_config(kind: str, profile: Profile, seed: int) -> SynthesisConfig:
    """Full self-study is the SDK's default recipe (five seed kinds plus document windows); the paper's generic
    ablation has only conversations, all from the one generic seed prompt."""
    if kind == "selfstudy":
        return SynthesisConfig(num_conversations=profile.conversations, document_windows=profile.document_windows,
                               seed=seed)
    if kind == "generic":
        return SynthesisConfig(num_conversations=profile.generic_conversations, document_windows=0,
                               seed_weights={"generic": 1.0}, seed=seed)
    raise ValueError(kind)


class CostBook:
    """Seconds and counts per stage, summed over runs, kept in one JSON file written atomically."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.is_file() else {}

    def add_seconds(self, key: str, seconds: float) -> None:
        entry = self.data.setdefault(key, {"seconds": 0.0, "runs": 0})
        entry["seconds"] += seconds
        entry["runs"] += 1
        self._save()

    def set(self, key: str, **values: Any) -> None:
        self.data.setdefault(key, {"seconds": 0.0, "runs": 0}).update(values)
        self._save()

    def get(self, key: str) -> dict[str, Any]:
        return self.data.get(key, {"seconds": 0.0, "runs": 0})

    def _save(self) -> None:
        atomic_write_json(self.path, self.data)


def generated_tokens(lm: LM, conversations: Sequence[Conversation]) -> int:
    """Tokens the two participants wrote: A's messages (re-tokenized) and B's sampled answers. Chat-template tokens
    and document windows (which are read, not generated) do not count."""
    total = 0
    for c in conversations:
        total += int((c.role_mask == ROLE_ASSISTANT).sum())
        total += sum(len(lm.tokenizer(m["content"], add_special_tokens=False)["input_ids"])
                     for m in c.messages if m["role"] == "user")
    return total


def synthesize_data(lm: LM, text: str, work: Path, kind: str, profile: Profile, seed: int,
                    costs: CostBook) -> list[Conversation]:
    key, folder = f"synthesis:{kind}", work / f"data-{kind}"
    if "sequences" in costs.get(key) and folder.is_dir():  # finished by an earlier run (same settings: run.check_work)
        return list(SelfStudyDataset(folder))
    config = synthesis_config(kind, profile, seed)
    start = time.perf_counter()
    dataset = synthesize(text, lm, folder, config, synthesizer=synthesizers.create("hf", lm))
    conversations = list(dataset)
    costs.add_seconds(key, time.perf_counter() - start)
    costs.set(key, sequences=len(conversations), generated_tokens=generated_tokens(lm, conversations),
              teacher_scored_tokens=int(sum(len(c.target_positions) for c in conversations)))
    return conversations


def raw_windows(ids: Sequence[int], count: int, seed: int, width: int = NTP_WINDOW) -> list[Conversation]:
    """`count` windows of the raw document for next-token prediction, spread evenly over it (the same sweep as
    self-study's document windows), each its own group so the held-out slice is whole windows."""
    out = []
    for k in range(count):
        a = window_chunk_start(len(ids), min(width, len(ids)), min(width, len(ids)), k, seed)
        seq = np.asarray(ids[a : a + width], dtype=np.int32)
        n = len(seq)
        out.append(Conversation(
            conv_id=k, group=k, chunk=(a, a + n), seed_kind=SEED_KIND_DOCUMENT, input_ids=seq,
            role_mask=np.full(n, ROLE_DOCUMENT, dtype=np.int8), target_positions=np.arange(1, n, dtype=np.int32),
            topk_ids=seq[1:, None].copy(), topk_logprobs=np.zeros((n - 1, 1), dtype=np.float32),
        ))
    return out


def train_config(kind: str, seed: int, epochs: int) -> TrainConfig:
    """The SDK's default training settings for every trained method; only the objective differs for NTP."""
    return TrainConfig(epochs=epochs, seed=seed, objective="ntp" if kind == "ntp" else "distill")


def attention_flops(n: int, past: int, lm: LM) -> float:
    """Forward FLOPs of the score and value products for `n` new tokens after `past` cached ones, all layers."""
    cfg = lm.model.config
    heads = cfg.num_attention_heads
    return 4.0 * lm.num_layers * heads * lm.head_dim * (n * past + n * (n + 1) / 2)


def linear_params(lm: LM) -> int:
    """Weights of the decoder layers' matrix products (embeddings and the output layer excluded)."""
    import torch

    layers = lm.model.base_model.layers
    return sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))


def training_flops(lm: LM, conversations: Sequence[Conversation], p: int, epochs: int) -> float:
    """Useful FLOPs of training (no padding): forward plus a backward that computes input gradients only.

    The model is frozen, so each layer's backward is one product per forward product (no weight gradients), and
    attention's is two per forward product (scores and values both need gradients to reach the cartridge). The
    output layer runs only at target positions.
    """
    n_lin = linear_params(lm)
    d, vocab = lm.model.config.hidden_size, lm.identity.architecture["vocab_size"]
    total = 0.0
    for c in conversations:
        n, t = c.num_tokens, len(c.target_positions)
        total += 2 * (2 * n_lin * n) + 3 * attention_flops(n, p, lm) + 2 * (2 * d * vocab * t)
    return total * epochs


def compact_method(lm: LM, p: int, ids: Sequence[int], work: Path, costs: CostBook) -> Cartridge:
    """The document compacted to `p` tokens (the SDK's self-study start): loaded if an earlier run made it."""
    path = work / f"compact-p{p}.safetensors"
    if path.is_file():
        return Cartridge.load(path, lm)
    start = time.perf_counter()
    cartridge = Cartridge.compact(lm, list(ids), p, report=False)
    costs.add_seconds(f"compaction:p{p}", time.perf_counter() - start)
    cartridge.save(path)
    return cartridge


def train_method(lm: LM, kind: str, p: int, conversations: list[Conversation], start_cartridge: Cartridge,
                 work: Path, profile: Profile, seed: int, costs: CostBook) -> Cartridge:
    """The trained cartridge of `kind` at size `p`: loaded if an earlier run finished it, else trained (resuming).

    Every trained method starts from `start_cartridge` (the compacted document, as `from_corpus` does by default),
    so the methods differ only in their data."""
    path = work / f"{kind}-p{p}.safetensors"
    key = f"training:{kind}:p{p}"
    if path.is_file():
        return Cartridge.load(path, lm)
    config = train_config(kind, seed, profile.epochs)
    start = time.perf_counter()
    cartridge = trainers.create("torch", lm).fit(start_cartridge.bind(lm), conversations, lm, config,
                                                 output_dir=work / f"train-{kind}-p{p}")
    costs.add_seconds(key, time.perf_counter() - start)
    train, _ = split_eval(conversations, config.eval_fraction, config.seed)
    costs.set(key, tokens=int(sum(c.num_tokens for c in train)) * config.epochs, steps=cartridge.meta.training["steps"],
              flops=training_flops(lm, train, p, config.epochs), final_loss=cartridge.meta.training["final_loss"])
    cartridge.save(path)
    return cartridge


def document_ids(lm: LM, text: str) -> list[int]:
    """The corpus tokens self-study reads (no sequence-start token), as synthesis tokenizes them."""
    return SDKCorpus.coerce(text).token_ids(lm)
