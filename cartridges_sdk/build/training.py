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
import numpy as np
import torch

from ..cartridge import Cartridge, CartridgeMeta
from ..checks import at_least_one, boolean, count, fraction, non_negative, one_of, optional_int, positive
from .dataset import SEED_KIND_DOCUMENT, Conversation, SelfStudyDataset, describe_changes
from .distributed import (gather_from_ranks, lead_does, on_cpu, process_group, ranks_in_env, sum_across_ranks,
                          sum_numbers_across_ranks)
from ..errors import ConfigError
from ..files import atomic_write, folder_lock
from ..identity import token_fingerprint
from ..lm import LM, autocast
from ..plugins import Trainer, TrainerCapabilities

CHECKPOINT = "checkpoint.pt"
RUN_LOG = "train_log.jsonl"
# how often to save or evaluate does not change what is trained, so a resume may change them
NOT_SHAPING = ("checkpoint_every", "checkpoint_seconds", "eval_every")
# target positions whose logits are in memory at once (256 x a 50k vocabulary in float32 = 50 MB)
OUTPUT_CHUNK = 256


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


class TrainableCartridge(torch.nn.Module):
    """A cartridge's KV as parameters; the first `num_frozen` tokens are buffers and never change."""

    def __init__(self, init: Cartridge):
        super().__init__()
        nf = init.num_frozen
        self.num_frozen = nf
        self.frozen_keys = torch.nn.ParameterList(
            [torch.nn.Parameter(k[:, :nf].detach().float().clone(), requires_grad=False) for k in init.keys]
        )
        self.frozen_values = torch.nn.ParameterList(
            [torch.nn.Parameter(v[:, :nf].detach().float().clone(), requires_grad=False) for v in init.values]
        )
        self.keys = torch.nn.ParameterList([torch.nn.Parameter(k[:, nf:].detach().float().clone()) for k in init.keys])
        self.values = torch.nn.ParameterList([torch.nn.Parameter(v[:, nf:].detach().float().clone()) for v in init.values])

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (torch.cat([fk, k], dim=1), torch.cat([fv, v], dim=1))
            for fk, k, fv, v in zip(self.frozen_keys, self.keys, self.frozen_values, self.values)
        ]

    def to_cartridge(self, meta: CartridgeMeta, lm: LM | None, dtype: torch.dtype) -> Cartridge:
        kv = self.layers()
        return Cartridge([k.detach().to(dtype).clone() for k, _ in kv], [v.detach().to(dtype).clone() for _, v in kv], meta, lm=lm)


def target_weights(batch: Sequence[Conversation], conversation_weight: float = 1.0) -> np.ndarray:
    """Each target token's weight in the loss: 1 for document windows, `conversation_weight` for conversations."""
    return np.concatenate([
        np.full(len(c.target_positions), 1.0 if c.seed_kind == SEED_KIND_DOCUMENT else conversation_weight, np.float32)
        for c in batch
    ])


class Student(torch.nn.Module):
    """The frozen model's body and output layer as one module whose forward is the loss.

    One module, so FSDP2 can shard the whole model (`shard_model`): its root unit gathers the embeddings, final norm
    and output layer for the forward, while each decoder layer is a unit of its own."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, attention_mask, position_ids, cache, rows, positions, top_ids, top_p, weights):
        hidden = self.model.base_model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                                       past_key_values=cache, use_cache=True).last_hidden_state
        head = self.model.get_output_embeddings()
        return OutputLoss.apply(hidden[rows, positions], head.weight, head.bias, top_ids, top_p, weights)


def check_shardable(ranks: int) -> None:
    """Refuse `shard_model` where there is nothing to shard across, before any work."""
    if ranks < 2:
        raise ConfigError("shard_model=True splits the model across ranks; run under torchrun with 2 or more "
                          "(--nproc N), or train without it.")


def sharded_student(lm: LM) -> Student:
    """Shard `lm`'s frozen weights across the ranks with FSDP2 (each decoder layer a unit, the rest the root unit),
    in place: afterwards `lm` serves only this training. The cartridge is not part of it and stays whole on every
    rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = getattr(lm.model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"shard_model=True needs a model whose decoder layers are `model.layers` (Llama, Qwen2, "
                          f"Mistral, ...); {type(lm.model).__name__} has none. Train without shard_model.")
    mesh = init_device_mesh(lm.device.type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(Student(lm.model), mesh=mesh)


def student_loss(
    lm: LM, cartridge: TrainableCartridge, batch: Sequence[Conversation], objective: str = "distill",
    conversation_weight: float = 1.0, student: Student | None = None,
) -> tuple[torch.Tensor, float]:
    """Weighted sum of the loss over the batch's target tokens, and the sum of weights (divide for the mean).

    With the default weights each target token counts once, so the second value is the number of target tokens.
    `student` is the model as `sharded_student` made it, when it is sharded."""
    from transformers import DynamicCache

    device = lm.device
    rows = len(batch)
    width = max(c.num_tokens for c in batch)
    ids = torch.full((rows, width), lm.pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for r, c in enumerate(batch):
        ids[r, : c.num_tokens] = torch.from_numpy(c.input_ids.astype(np.int64))
        mask[r, : c.num_tokens] = 1
    ids, mask = ids.to(device), mask.to(device)
    layers = cartridge.layers()
    p = layers[0][0].shape[1]
    dtype = lm.dtype
    data = [(k.to(dtype)[None].expand(rows, -1, -1, -1), v.to(dtype)[None].expand(rows, -1, -1, -1)) for k, v in layers]
    cache = DynamicCache(ddp_cache_data=data, config=lm.model.config)
    # only the positions that predict a target token go through the (large) output layer
    row_idx = torch.cat([torch.full((len(c.target_positions),), r, dtype=torch.long) for r, c in enumerate(batch)])
    pos = torch.cat([torch.from_numpy(c.target_positions.astype(np.int64)) for c in batch])
    if objective == "ntp":
        top_ids = ids[row_idx.to(device), pos.to(device)][:, None]
        top_p = torch.ones(top_ids.shape, device=device)
    else:
        top_ids = torch.from_numpy(np.concatenate([c.topk_ids for c in batch]).astype(np.int64)).to(device)
        top_p = torch.from_numpy(np.concatenate([c.topk_logprobs for c in batch])).to(device).exp()
    weights = target_weights(batch, conversation_weight)
    loss = (student or Student(lm.model))(
        ids, torch.cat([torch.ones(rows, p, dtype=torch.long, device=device), mask], dim=1),
        (p + torch.arange(width, device=device))[None].expand(rows, -1), cache, row_idx.to(device),
        (pos - 1).to(device), top_ids, top_p, torch.from_numpy(weights).to(device),
    )
    return loss, float(weights.sum())


class OutputLoss(torch.autograd.Function):
    """The output layer and the loss at the target positions, ``OUTPUT_CHUNK`` positions at a time.

    Per target position: ``-sum_k p(k) log softmax(h W^T + b)_k`` over the target's ids `k` (the teacher's top-k, or
    the next token with ``p = 1``), times its weight; summed. The gradient with respect to the hidden states is
    worked out in the same pass, so the ``[targets, vocab]`` logits never exist whole (in float32 with their
    log-softmax and gradients they took about 1 GB more in a 2,048-token step). The layer is frozen: it gets no
    gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, top_ids, top_p, weights):
        need_grad = ctx.needs_input_grad[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if need_grad else None
        for start in range(0, hidden.shape[0], OUTPUT_CHUNK):
            rows = slice(start, start + OUTPUT_CHUNK)
            logits = torch.nn.functional.linear(hidden[rows], weight, bias).float()
            lse = logits.logsumexp(-1)
            p, w = top_p[rows].float(), weights[rows].float()
            mass = p.sum(-1)
            total += (w * (mass * lse - (p * logits.gather(-1, top_ids[rows])).sum(-1))).sum()
            if need_grad:  # d loss / d logits = w * (mass * softmax - p at the target ids)
                g = (logits - lse[:, None]).exp_().mul_((w * mass)[:, None])
                g.scatter_add_(-1, top_ids[rows], -(w[:, None] * p))
                grad[rows] = g.to(weight.dtype) @ weight
        if need_grad:
            ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None, None, None


def _peak_memory_mb(device: torch.device) -> float:
    """Peak memory since `_reset_peak_memory`: the accelerator's allocations, or on CPU the process's peak
    resident memory (model and data included)."""
    accelerator = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, ... expose the same counter
    if device.type != "cpu" and hasattr(accelerator, "max_memory_allocated"):
        return accelerator.max_memory_allocated(device) / 2**20
    peak = process_memory_mb("VmHWM")
    if peak is None:  # not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux; macOS reports bytes
    return peak


def process_memory_mb(field: str = "VmRSS") -> float | None:
    """A memory figure of this process from Linux's ``/proc/self/status`` (``VmRSS`` now, ``VmHWM`` the peak), or
    None where there is no such file."""
    try:
        return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0]) / 1024  # KiB
    except (OSError, IndexError, ValueError):
        return None


def _reset_peak_memory(device: torch.device) -> None:
    """Start the peak over, so training's figure is not synthesis's (on CPU, Linux only: elsewhere it stays the
    process's peak so far)."""
    accelerator = getattr(torch, device.type, None)
    if device.type != "cpu" and hasattr(accelerator, "reset_peak_memory_stats"):
        accelerator.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size


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
    capabilities = TrainerCapabilities(distributed=True)

    def __init__(self, model: LM | None = None, *, resume: bool = True, shard_model: bool = False):
        if shard_model:
            check_shardable(ranks_in_env())
        self.resume = resume
        self.shard_model = shard_model
        self.config = TrainConfig()
        self.history: list[dict[str, Any]] = []
        self.rank, self.world = 0, 1
        self.student: Student | None = None

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
        self, init: Cartridge, dataset: SelfStudyDataset | Sequence[Conversation], model: LM,
        config: TrainConfig | None = None, *, output_dir: str | os.PathLike | None = None, progress: bool = True,
    ) -> Cartridge:
        output_dir = Path(output_dir) if output_dir is not None else None
        try:
            with process_group(model.device) as (self.rank, self.world):  # under torchrun: this rank's share
                lead = self.rank == 0  # the one rank that writes checkpoints and logs
                with folder_lock(output_dir) if output_dir and lead else contextlib.nullcontext():
                    return self._fit(init, dataset, model, config or TrainConfig(), output_dir, progress and lead)
        finally:  # the group is gone: later calls (evaluate) run as one process again
            self.rank, self.world, self.student = 0, 1, None

    def _resume(self, ckpt: Path, run: dict[str, Any], params: list[torch.nn.Parameter],
                opt: torch.optim.Optimizer) -> int:
        """Load the checkpoint into `params` and `opt` (refusing one of another run); the step it reached."""
        state = torch.load(ckpt, map_location=params[0].device, weights_only=True)
        if "grad_accum" in state.get("run", {}).get("config", {}):  # recorded by one process, before ranks
            config_then = dict(state["run"]["config"])
            config_then["micro_batches_per_step"] = config_then.pop("grad_accum")
            state["run"] = {**state["run"], "config": config_then}
        if state.get("run") != run:
            changes = describe_changes(state["run"], run) if "run" in state else "made by an older version"
            raise ConfigError(
                f"The checkpoint in {str(ckpt.parent)!r} was made with other settings or data ({changes}); start "
                "over with restart=True (--restart), or use another folder."
            )
        with torch.no_grad():
            for mine, saved in zip(params, state["params"]):
                mine.copy_(saved)
        opt.load_state_dict(state["optimizer"])
        self.history = state.get("history", [])
        return state["step"]

    def _fit(self, init: Cartridge, dataset: SelfStudyDataset | Sequence[Conversation], model: LM, config: TrainConfig,
             output_dir: Path | None, progress: bool) -> Cartridge:
        from tqdm.auto import tqdm

        self.config = cfg = config
        lm = model
        if self.shard_model:
            check_shardable(self.world)
            self.student = sharded_student(lm)
        conversations = list(dataset)
        if not conversations:
            raise ConfigError("The self-study dataset has no conversations to train on.")
        if cfg.conversation_weight == 0:  # weightless conversations would only cost time (and empty batches)
            conversations = [c for c in conversations if c.seed_kind == SEED_KIND_DOCUMENT]
            if not conversations:
                raise ConfigError("conversation_weight=0 but the dataset has no document windows to train on; "
                                  "give conversations a weight > 0 or synthesize with document_windows > 0.")
        train, held_out = split_eval(conversations, cfg.eval_fraction, cfg.seed)
        steps = optimizer_steps(train, cfg)
        total_steps = len(steps)
        if self.rank == 0:
            warn_idle_ranks(cfg.grad_accum, self.world)

        cart = TrainableCartridge(init).to(lm.device)
        params = list(cart.keys) + list(cart.values)
        opt = torch.optim.Adam(params, lr=cfg.lr)
        ckpt = output_dir / CHECKPOINT if output_dir else None
        lead = self.rank == 0
        if output_dir and lead:
            output_dir.mkdir(parents=True, exist_ok=True)
        # everything that shapes the result: a checkpoint made otherwise is refused, naming what differs. The ranks do
        # not shape it, so a run resumes on any number of them. grad_accum keeps the name checkpoints gave the
        # micro-batches per step when N ranks took N x grad_accum: those resume with grad_accum set to what they say
        shaping = {k: v for k, v in attrs.asdict(cfg).items() if k not in NOT_SHAPING and k != "grad_accum"}
        run = {
            "config": {**shaping, "micro_batches_per_step": cfg.grad_accum},
            "start": {"init": init.meta.init, "num_tokens": init.num_tokens, "num_frozen": init.num_frozen,
                      "content": init.fingerprint},
            "data": {"sequences": len(conversations),
                     "content": token_fingerprint([x for c in conversations for x in (c.conv_id, c.num_tokens)])},
        }

        def resume() -> int:  # the step reached, or 0; rank 0 alone reads the folder, and its failure stops all
            return self._resume(ckpt, run, params, opt) if ckpt and ckpt.is_file() and self.resume else 0

        step = lead_does(resume) or 0
        if self.world > 1:  # every rank starts from rank 0's state, whatever files or start each one had
            told = gather_from_ranks((
                {k: run[k] for k in ("config", "data")},  # not the start: only rank 0's is real
                on_cpu({"params": list(params), "optimizer": opt.state_dict(), "step": step, "history": self.history,
                        "frozen": [*cart.frozen_keys, *cart.frozen_values]}) if lead else None,
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
            step = start_state["step"]

        log = (output_dir / RUN_LOG).open("a") if output_dir and lead else None
        bar = tqdm(total=total_steps, initial=step, desc="training cartridge", unit="step", disable=not progress)
        start, tokens_seen = time.perf_counter(), 0
        saved_at = start
        _reset_peak_memory(lm.device)
        try:
            while step < total_steps:
                lr = _lr_at(step, total_steps, cfg)
                for group in opt.param_groups:
                    group["lr"] = lr
                chunk = steps[step]
                n_targets = sum(float(target_weights(b, cfg.conversation_weight).sum()) for b in chunk)
                for p in params:  # zeros rather than None: a rank with no share still adds its (zero) gradient
                    p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
                loss_sum, step_tokens = 0.0, 0
                for batch, weight in self._share(chunk):  # this rank's share of the step
                    with self._autocast(lm):
                        loss, _ = student_loss(lm, cart, batch, cfg.objective, cfg.conversation_weight, self.student)
                    (loss * (weight / n_targets)).backward()
                    loss_sum += weight * float(loss.detach())
                    step_tokens += round(weight) * sum(c.num_tokens for c in batch)
                if self.world > 1:  # every rank now holds the gradient of the whole step, and takes the same step
                    sum_across_ranks([p.grad for p in params])
                    loss_sum, step_tokens = sum_numbers_across_ranks([loss_sum, step_tokens], params[0].device)
                    step_tokens = int(step_tokens)
                tokens_seen += step_tokens
                grad_norm = None
                if cfg.max_grad_norm:
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
                opt.step()
                step += 1
                elapsed = time.perf_counter() - start
                record = {
                    "step": step,
                    "loss": loss_sum / n_targets,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens_seen / elapsed,
                    "elapsed_s": elapsed,
                    "peak_memory_mb": _peak_memory_mb(lm.device),
                }
                if held_out and (step % cfg.eval_every == 0 or step == total_steps):
                    record["eval_loss"] = self.evaluate(lm, cart, held_out)
                self.history.append(record)
                if log:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}",
                    mem=f"{record['peak_memory_mb']:.0f}MB", **({"eval": f"{record['eval_loss']:.3f}"} if "eval_loss" in record else {}),
                )
                bar.update(1)
                due = time.perf_counter() - saved_at >= cfg.checkpoint_seconds
                if ckpt and lead and (step % cfg.checkpoint_every == 0 or step == total_steps or due):
                    saved_at = time.perf_counter()
                    atomic_write(ckpt, lambda tmp, state={
                        "step": step,
                        "params": [p.detach().cpu() for p in params],
                        "optimizer": opt.state_dict(),
                        "run": run,
                        "history": self.history,
                    }: torch.save(state, tmp))
        finally:
            bar.close()
            if log:
                log.close()
        final = self.history[-1] if self.history else {}
        training = {
            "trainer": "torch",
            "config": attrs.asdict(cfg),
            "steps": step,
            "conversations": len(train),
            "held_out_conversations": len(held_out),
            "final_loss": final.get("loss"),
            "final_eval_loss": next((h["eval_loss"] for h in reversed(self.history) if "eval_loss" in h), None),
        }
        meta = attrs.evolve(init.meta, init="trained", training={**(init.meta.training or {}), **training},
                            extra={**init.meta.extra, "init": init.meta.init})
        return cart.to_cartridge(meta, init.lm, init.keys[0].dtype)
