"""Distillation training of a cartridge: the model is frozen, only the cartridge's KV tensors learn.

The student is the model with the trainable cartridge in front of each conversation (no chunk); its loss is the
cross-entropy against the teacher's stored top-k distribution, ``-sum_k p_teacher(k) log p_student(k)``, averaged
over target tokens (which is KL(teacher || student) up to the teacher's constant entropy). One process or many
under torchrun (`distributed.py`), CPU or GPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from ..cartridge import Cartridge
from ..checks import boolean
from ..errors import ConfigError
from ..files import folder_lock
from ..lm import LM, autocast
from ..plugins import Trainer, TrainerCapabilities
from ..trainer_inputs import SEED_KIND_DOCUMENT, Conversation, TrainConfig, TrainingData
from .checkpoint import CHECKPOINT, RUN_LOG, load_checkpoint, run_settings, save_checkpoint
from .dataset import describe_changes
from .distractors import Distractors, among
from .distributed import (gather_from_ranks, lead_does, on_cpu, process_group, ranks_in_env, sum_across_ranks,
                          sum_numbers_across_ranks)
from .loss import Student, check_shardable, sharded_student, student_loss, target_weights
from .memory import peak_memory_mb, reset_peak_memory
from .trainable import TrainableCartridge


def split_eval(conversations: Sequence[Conversation], share: float, seed: int) -> tuple[list, list]:
    """A fixed held-out slice of whole chunk groups (so eval chunks are unseen in training)."""
    groups = sorted({c.group for c in conversations})
    n_eval = 0 if share == 0 or len(groups) < 2 else max(1, round(share * len(groups)))
    held = set(random.Random(f"eval:{seed}").sample(groups, n_eval))
    return [c for c in conversations if c.group not in held], [c for c in conversations if c.group in held]


def pack(conversations: Sequence[Conversation], batch_tokens: int, rng: random.Random) -> list[list[Conversation]]:
    """Shuffle, then fill micro-batches while (rows x longest row) stays within `batch_tokens`."""
    order = list(conversations)
    rng.shuffle(order)
    batches: list[list[Conversation]] = []
    current: list[Conversation] = []
    longest = 0
    for c in order:
        longest_if = max(longest, c.num_tokens)
        if current and longest_if * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest_if = [], c.num_tokens
        current.append(c)
        longest = longest_if
    if current:
        batches.append(current)
    return batches


def optimizer_steps(train: Sequence[Conversation], cfg: TrainConfig) -> list[list[list[Conversation]]]:
    """Every optimizer step's micro-batches, in order: each epoch packed with a seed of its own, then `grad_accum`
    micro-batches a step (the last may have fewer). It depends on the data and settings alone, never on the number
    of ranks, which only share each step's micro-batches (`TorchTrainer._share`): any number trains the same."""
    micro = [b for e in range(cfg.epochs) for b in pack(train, cfg.batch_tokens, random.Random(f"{cfg.seed}:{e}"))]
    return [micro[i : i + cfg.grad_accum] for i in range(0, len(micro), cfg.grad_accum)]


def warn_idle_ranks(grad_accum: int, ranks: int) -> None:
    """Say when a step has fewer micro-batches than there are ranks: the ranks left without one wait every step,
    adding no speed (the cartridge is the same either way)."""
    if ranks > grad_accum:
        warnings.warn(f"grad_accum={grad_accum} (micro-batches per optimizer step, over all ranks) leaves "
                      f"{ranks - grad_accum} of the {ranks} ranks idle in every step; set it to a multiple of {ranks} "
                      "to use them all.", stacklevel=4)


def _lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or total <= cfg.warmup_steps:
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@attrs.frozen
class TorchTrainerOptions:
    # continue from the checkpoint in the output folder when there is one (its settings must match)
    resume: bool = attrs.field(default=True, validator=boolean)
    # under torchrun: shard the frozen model's weights across the ranks with FSDP2 (for models too large for one
    # device); the cartridge stays whole on every rank. The model object is sharded for good (docs/distributed.md)
    shard_model: bool = attrs.field(default=False, validator=boolean)


class TorchTrainer(Trainer):
    """The built-in trainer (registered as ``torch``): Adam on the cartridge's KV, the model frozen; data-parallel
    under torchrun, the model replicated or (``shard_model=True``) sharded with FSDP2."""

    Options = TorchTrainerOptions
    capabilities = TrainerCapabilities(distributed=True, distractors=True)

    def __init__(self, model: LM | None = None, *, resume: bool = True, shard_model: bool = False):
        super().__init__(model, resume=resume, shard_model=shard_model)
        if self.options.shard_model:
            check_shardable(ranks_in_env())
        self.resume = self.options.resume
        self.shard_model = self.options.shard_model
        self.config = TrainConfig()
        self.history: list[dict[str, Any]] = []
        self.rank, self.world = 0, 1
        self.student: Student | None = None
        self.distractors: Distractors | None = None

    def _share(self, batches: Sequence[list[Conversation]]) -> list[tuple[list[Conversation], float]]:
        """This rank's batches of `batches` (every world-th), each with the weight its loss counts with. A sharded
        model needs every rank to run as many forward and backward passes as the others (each one gathers weights
        from all ranks), so a rank short of batches repeats the first with weight 0."""
        mine = [(b, 1.0) for b in batches[self.rank :: self.world]]
        if self.student is not None:
            mine += [(batches[0], 0.0)] * (math.ceil(len(batches) / self.world) - len(mine))
        return mine

    @torch.no_grad()
    def evaluate(self, lm: LM, cartridge: TrainableCartridge, conversations: Sequence[Conversation]) -> float | None:
        """The mean held-out loss; under torchrun every rank evaluates its share of the batches (call it on all)."""
        if not conversations:
            return None
        total, count = 0.0, 0.0
        for batch, weight in self._share(pack(conversations, self.config.batch_tokens, random.Random(0))):
            with self._autocast(lm):
                loss, n = student_loss(lm, cartridge, batch, self.config.objective, self.config.conversation_weight,
                                       self.student)
            total, count = total + weight * float(loss), count + weight * n
        if self.student is not None:  # a forward without backward leaves the root unit's weights gathered
            self.student.reshard()
        if self.world > 1:
            total, count = sum_numbers_across_ranks([total, count], lm.device)
        return total / max(count, 1)

    def _autocast(self, lm: LM):
        return autocast(lm.device, self.config.autocast_dtype)

    def fit(
        self, init: Cartridge, dataset: TrainingData, model: LM, config: TrainConfig | None = None, *,
        output_dir: str | os.PathLike | None = None, progress: bool = True, distractors: Sequence[Cartridge] = (),
    ) -> Cartridge:
        """Train `init`, among `distractors` when given (making/distractors.py; the held-out loss is its alone)."""
        output_dir = Path(output_dir) if output_dir is not None else None
        cfg = config or TrainConfig()
        self.distractors = among(init, distractors, model, cfg.max_distractors, cfg.alone_share)
        try:
            with process_group(model.device) as (self.rank, self.world):  # under torchrun: this rank's share
                lead = self.rank == 0  # the one rank that writes checkpoints and logs
                with folder_lock(output_dir) if output_dir and lead else contextlib.nullcontext():
                    return self._fit(init, dataset, model, cfg, output_dir, progress and lead)
        finally:  # the group is gone: later calls (evaluate) run as one process again
            self.rank, self.world, self.student, self.distractors = 0, 1, None, None

    def _fit(self, init: Cartridge, dataset: TrainingData, model: LM, config: TrainConfig,
             output_dir: Path | None, progress: bool) -> Cartridge:
        self.config = cfg = config
        lm = model
        if self.shard_model:
            check_shardable(self.world)
            self.student = sharded_student(lm)
        conversations = self._conversations(dataset)
        train, held_out = split_eval(conversations, cfg.eval_fraction, cfg.seed)
        steps = optimizer_steps(train, cfg)
        if self.rank == 0:
            warn_idle_ranks(cfg.grad_accum, self.world)
        cart = TrainableCartridge(init).to(lm.device)
        opt = torch.optim.Adam(list(cart.keys) + list(cart.values), lr=cfg.lr)
        if output_dir and self.rank == 0:
            output_dir.mkdir(parents=True, exist_ok=True)
        run = run_settings(cfg, init, conversations, self.distractors)
        step = self._start(cart, opt, run, output_dir / CHECKPOINT if output_dir else None)
        step = self._train(lm, cart, opt, steps, step, held_out, run, output_dir, progress)
        return self._finish(init, cart, step, train, held_out)

    def _conversations(self, dataset: TrainingData) -> list[Conversation]:
        """The conversations to train on: all of them, or the document windows alone when conversations weigh 0."""
        conversations = list(dataset)
        if not conversations:
            raise ConfigError("The self-study dataset has no conversations to train on.")
        if self.config.conversation_weight == 0:  # weightless conversations would only cost time (and empty batches)
            conversations = [c for c in conversations if c.seed_kind == SEED_KIND_DOCUMENT]
            if not conversations:
                raise ConfigError("conversation_weight=0 but the dataset has no document windows to train on; "
                                  "give conversations a weight > 0 or synthesize with document_windows > 0.")
        return conversations

    def _start(self, cart: TrainableCartridge, opt: torch.optim.Optimizer, run: dict[str, Any],
               ckpt: Path | None) -> int:
        """The step to start from: the checkpoint's when resuming, else 0; under torchrun every rank starts from
        rank 0's state."""
        params = list(cart.keys) + list(cart.values)

        def resume() -> int:  # the step reached, or 0; rank 0 alone reads the folder, and its failure stops all
            if not (ckpt and ckpt.is_file() and self.resume):
                return 0
            step, self.history = load_checkpoint(ckpt, run, params, opt)
            return step

        step = lead_does(resume) or 0
        if self.world > 1:
            step = self._adopt_lead_state(cart, opt, run, step)
        return step

    def _adopt_lead_state(self, cart: TrainableCartridge, opt: torch.optim.Optimizer, run: dict[str, Any],
                          step: int) -> int:
        """Every rank takes rank 0's cartridge, optimizer, step and history, whatever files or start each one had
        (refusing ranks given other data or settings); the step."""
        params = list(cart.keys) + list(cart.values)
        told = gather_from_ranks((
            {k: run[k] for k in ("config", "data")},  # not the start: only rank 0's is real
            on_cpu({"params": list(params), "optimizer": opt.state_dict(), "step": step, "history": self.history,
                    "frozen": [*cart.frozen_keys, *cart.frozen_values]}) if self.rank == 0 else None,
        ))
        differ = [f"rank {r}: {describe_changes(told[0][0], theirs)}" for r, (theirs, _) in enumerate(told)
                  if theirs != told[0][0]]
        if differ:
            raise ConfigError(f"The ranks were given other training data or settings than rank 0 "
                              f"({'; '.join(differ)}); give every rank the same dataset and settings.")
        start_state = told[0][1]
        self.history = start_state["history"]
        with torch.no_grad():
            for mine, given in zip([*params, *cart.frozen_keys, *cart.frozen_values],
                                   [*start_state["params"], *start_state["frozen"]], strict=True):
                mine.copy_(given)
        opt.load_state_dict(start_state["optimizer"])
        return start_state["step"]

    def _train(self, lm: LM, cart: TrainableCartridge, opt: torch.optim.Optimizer,
               steps: list[list[list[Conversation]]], step: int, held_out: list[Conversation], run: dict[str, Any],
               output_dir: Path | None, progress: bool) -> int:
        """Take the optimizer steps from `step` on, logging each and checkpointing when due; the step reached."""
        from tqdm.auto import tqdm

        cfg = self.config
        params = list(cart.keys) + list(cart.values)
        total_steps = len(steps)
        lead = self.rank == 0
        ckpt = output_dir / CHECKPOINT if output_dir else None
        log = (output_dir / RUN_LOG).open("a") if output_dir and lead else None
        bar = tqdm(total=total_steps, initial=step, desc="training cartridge", unit="step", disable=not progress)
        start, tokens_seen = time.perf_counter(), 0
        saved_at = start
        reset_peak_memory(lm.device)
        try:
            while step < total_steps:
                lr = _lr_at(step, total_steps, cfg)
                loss, step_tokens, grad_norm = self._step(lm, cart, opt, steps[step], lr, step)
                tokens_seen += step_tokens
                step += 1
                elapsed = time.perf_counter() - start
                record = {
                    "step": step,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens_seen / elapsed,
                    "elapsed_s": elapsed,
                    "peak_memory_mb": peak_memory_mb(lm.device),
                }
                if held_out and (step % cfg.eval_every == 0 or step == total_steps):
                    record["eval_loss"] = self.evaluate(lm, cart, held_out)
                self._record(record, log, bar)
                due = time.perf_counter() - saved_at >= cfg.checkpoint_seconds
                if ckpt and lead and (step % cfg.checkpoint_every == 0 or step == total_steps or due):
                    saved_at = time.perf_counter()
                    save_checkpoint(ckpt, step, params, opt, run, self.history)
        finally:
            bar.close()
            if log:
                log.close()
        return step

    def _step(self, lm: LM, cart: TrainableCartridge, opt: torch.optim.Optimizer, chunk: list[list[Conversation]],
              lr: float, step: int) -> tuple[float, int, float | None]:
        """One optimizer step on `chunk`'s micro-batches (this rank's share of them, among the step's distractors);
        the step's mean loss, the tokens it went through (all ranks) and the gradient norm before clipping (or None)."""
        cfg = self.config
        params = list(cart.keys) + list(cart.values)
        for group in opt.param_groups:
            group["lr"] = lr
        n_targets = sum(float(target_weights(b, cfg.conversation_weight).sum()) for b in chunk)
        for p in params:  # zeros rather than None: a rank with no share still adds its (zero) gradient
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
        loss_sum, step_tokens = 0.0, 0
        placement = self.distractors.draw(cfg.seed, step) if self.distractors else None
        for batch, weight in self._share(chunk):  # this rank's share of the step
            with self._autocast(lm):
                kv = self.distractors.around(cart.layers(), placement) if placement is not None else None
                loss, _ = student_loss(lm, cart, batch, cfg.objective, cfg.conversation_weight, self.student, kv)
            (loss * (weight / n_targets)).backward()
            loss_sum += weight * float(loss.detach())
            step_tokens += round(weight) * sum(c.num_tokens for c in batch)
        if self.world > 1:  # every rank now holds the gradient of the whole step, and takes the same step
            sum_across_ranks([p.grad for p in params])
            loss_sum, step_tokens = sum_numbers_across_ranks([loss_sum, step_tokens], params[0].device)
            step_tokens = int(step_tokens)
        grad_norm = None
        if cfg.max_grad_norm:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        opt.step()
        return loss_sum / n_targets, step_tokens, grad_norm

    def _record(self, record: dict[str, Any], log, bar) -> None:
        """Keep a step's record in the history and the run log, and show it on the progress bar."""
        self.history.append(record)
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()
        bar.set_postfix(
            loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
            mem=f"{record['peak_memory_mb']:.0f}MB", **({"eval": f"{record['eval_loss']:.3f}"} if "eval_loss" in record else {}),
        )
        bar.update(1)

    def _finish(self, init: Cartridge, cart: TrainableCartridge, step: int, train: list[Conversation],
                held_out: list[Conversation]) -> Cartridge:
        """The trained cartridge, its metadata recording how it was trained."""
        final = self.history[-1] if self.history else {}
        training = {
            "trainer": "torch",
            **({"distractors": self.distractors.run_settings()} if self.distractors else {}),
            "config": attrs.asdict(self.config),
            "steps": step,
            "conversations": len(train),
            "held_out_conversations": len(held_out),
            "final_loss": final.get("loss"),
            "final_eval_loss": next((h["eval_loss"] for h in reversed(self.history) if "eval_loss" in h), None),
        }
        meta = attrs.evolve(init.meta, init="trained", training={**(init.meta.training or {}), **training},
                            extra={**init.meta.extra, "init": init.meta.init})
        return cart.to_cartridge(meta, init.lm, init.keys[0].dtype)
