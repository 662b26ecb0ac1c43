"""A training run's checkpoint: what shapes the run (a checkpoint made otherwise is refused), saving it, and loading
it, older checkpoints' format brought up to date first."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from ..errors import ConfigError
from ..files import atomic_write
from ..identity import token_fingerprint
from ..trainer_inputs import Conversation, TrainConfig
from .dataset import describe_changes

if TYPE_CHECKING:
    from ..cartridge import Cartridge
    from .distractors import Distractors

CHECKPOINT = "checkpoint.pt"
RUN_LOG = "train_log.jsonl"
# how often to save or evaluate does not change what is trained, so a resume may change them
NOT_SHAPING = ("checkpoint_every", "checkpoint_seconds", "eval_every")


def run_settings(cfg: TrainConfig, init: Cartridge, conversations: Sequence[Conversation],
                 distractors: Distractors | None = None) -> dict[str, Any]:
    """Everything that shapes the result: a checkpoint made otherwise is refused, naming what differs. The ranks do
    not shape it, so a run resumes on any number of them. grad_accum keeps the name checkpoints gave the
    micro-batches per step when N ranks took N x grad_accum: those resume with grad_accum set to what they say.
    `max_distractors` and `alone_share` shape a run among distractors alone, and are recorded with them (so
    checkpoints made before distractors existed still resume)."""
    shaping = {k: v for k, v in attrs.asdict(cfg).items()
               if k not in NOT_SHAPING and k not in ("grad_accum", "max_distractors", "alone_share")}
    among = {"distractors": distractors.run_settings()} if distractors is not None else {}
    return {
        **among,
        "config": {**shaping, "micro_batches_per_step": cfg.grad_accum},
        "start": {"init": init.meta.init, "num_tokens": init.num_tokens, "num_frozen": init.num_frozen,
                  "content": init.fingerprint},
        "data": {"sequences": len(conversations),
                 "content": token_fingerprint([x for c in conversations for x in (c.conv_id, c.num_tokens)])},
    }


def migrate_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """`state` in today's format: checkpoints recorded by one process, before ranks, name the micro-batches per
    step ``grad_accum``; they become ``micro_batches_per_step``."""
    if "grad_accum" in state.get("run", {}).get("config", {}):
        config_then = dict(state["run"]["config"])
        config_then["micro_batches_per_step"] = config_then.pop("grad_accum")
        state["run"] = {**state["run"], "config": config_then}
    return state


def load_checkpoint(ckpt: Path, run: dict[str, Any], params: list[torch.nn.Parameter],
                    opt: torch.optim.Optimizer) -> tuple[int, list[dict[str, Any]]]:
    """Load the checkpoint into `params` and `opt` (refusing one of another run); the step it reached and the
    history so far."""
    state = migrate_checkpoint(torch.load(ckpt, map_location=params[0].device, weights_only=True))
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
    return state["step"], state.get("history", [])


def save_checkpoint(ckpt: Path, step: int, params: Sequence[torch.nn.Parameter], opt: torch.optim.Optimizer,
                    run: dict[str, Any], history: list[dict[str, Any]]) -> None:
    """Write the state after `step` atomically (a kill leaves the previous checkpoint whole)."""
    state = {
        "step": step,
        "params": [p.detach().cpu() for p in params],
        "optimizer": opt.state_dict(),
        "run": run,
        "history": history,
    }
    atomic_write(ckpt, lambda tmp: torch.save(state, tmp))
