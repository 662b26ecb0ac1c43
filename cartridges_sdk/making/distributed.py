"""Self-study across processes with PyTorch's own `torch.distributed` (gloo on CPU, nccl on GPU).

`torchrun` starts one process per rank and sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``; synthesis and
the trainer join that group when they start (nothing happens at import). In synthesis each rank makes its share of
the groups. In training each rank takes its share of every optimizer step's micro-batches and the cartridge's
gradients are summed across ranks, so every rank takes the same step and holds the same cartridge; rank 0's starting
state (cartridge, optimizer, step) is sent to the others first. What rank 0 does alone (`lead_does`), the others
wait for, and its failure stops them all with its reason.

Why one all-reduce of the flattened gradients rather than `DistributedDataParallel`: the trained parameters are a
few tensors (the cartridge), and DDP's reducer needs every rank to run the same number of forwards per step, which
a step with fewer micro-batches than ranks breaks; summing once per step is what DDP would do, without that
constraint.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from ..errors import ConfigError

T = TypeVar("T")


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[tuple[int, int]]:
    """(rank, world size) while inside: of the process group already set up, of the one `torchrun` describes in the
    environment (joined here with torch's default backend for each device type, gloo on CPU and nccl on CUDA, and
    left on exit), or (0, 1) for a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        yield dist.get_rank(), dist.get_world_size()
        return
    if not under_torchrun():
        yield 0, 1
        return
    if _is_accelerator(device) and device.index is not None:
        torch.accelerator.set_device_index(device.index)  # collectives and broadcast objects go to this rank's own
    dist.init_process_group()
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()


def _is_accelerator(device: torch.device) -> bool:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator is not None and device.type == accelerator.type


def rank_device(device: str) -> str:
    """An accelerator named without an index (e.g. ``cuda``) means this rank's own one under torchrun
    (``cuda:LOCAL_RANK``); any other device is kept."""
    given = torch.device(device)
    if _is_accelerator(given) and given.index is None and "LOCAL_RANK" in os.environ:
        return f"{given.type}:{int(os.environ['LOCAL_RANK'])}"
    return device


def launch(module_args: Sequence[str], nproc: int) -> int:
    """Run ``python -m MODULE_ARGS`` as `nproc` ranks on this machine under torchrun; its exit code. For more
    machines, run torchrun on each yourself (docs/distributed.md)."""
    import subprocess
    import sys

    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                            str(nproc), "-m", *module_args])


def ranks_in_env() -> int:
    """How many ranks torchrun says the job has (1 outside torchrun), before any process group is joined."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def under_torchrun() -> bool:
    return ranks_in_env() > 1


def is_lead() -> bool:
    """Whether this process writes what is written once: rank 0, or the only process."""
    return int(os.environ.get("RANK", "0")) == 0


def on_cpu(value: Any) -> Any:
    """`value` with every tensor inside (in dicts, lists and tuples) moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(v) for v in value)
    return value


# how long ranks wait for rank 0's lone work (compacting a corpus) or for the slowest rank's share of a synthesis:
# torch's default group timeout (minutes) is shorter than either may take
RANKS_WAIT = datetime.timedelta(hours=24)


def lead_does(work: Callable[[], T]) -> T | None:
    """Run `work` on rank 0 alone while the other ranks wait for it (up to `RANKS_WAIT`, on a gloo group of their
    own). If it raises, every rank raises: rank 0 its own error, the others a `ConfigError` quoting it. Rank 0 gets
    the result and the others None; without a process group of several ranks, just ``work()``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return work()
    result, problem = None, None
    with patient_group() as waits:
        if dist.get_rank() == 0:
            try:
                result = work()
            except Exception as err:  # noqa: BLE001 - told to the other ranks, then raised here as it is
                problem = err
        told = gather_from_ranks(None if problem is None else f"{type(problem).__name__}: {problem}", waits)[0]
    if problem is not None:
        raise problem
    if told is not None:
        raise ConfigError(f"Rank 0 failed, so this rank stops too: {told}")
    return result


@contextlib.contextmanager
def patient_group(timeout: datetime.timedelta = RANKS_WAIT) -> Iterator[Any]:
    """A gloo group of all ranks whose collectives wait up to `timeout` (enter it on every rank), for waits known to
    be long, while the main group keeps torch's default timeout for training; left on exit."""
    import torch.distributed as dist

    waits = dist.new_group(backend="gloo", timeout=timeout)
    try:
        yield waits
    finally:
        dist.destroy_process_group(waits)


def barrier(group: Any = None) -> None:
    """Wait until every rank of `group` (default: all) gets here."""
    import torch.distributed as dist

    dist.barrier(group=group)


def gather_from_ranks(value: Any, group: Any = None) -> list[Any]:
    """Every rank's `value` (picklable), in rank order, on every rank."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def scatter_from_lead(values: Sequence[Any] | None, group: Any = None) -> Any:
    """Rank r's item of `values` (one per rank, picklable, given on rank 0; None elsewhere): each rank is sent only
    its own."""
    import torch.distributed as dist

    out = [None]
    dist.scatter_object_list(out, list(values) if dist.get_rank(group) == 0 else None, src=0, group=group)
    return out[0]


def sum_numbers_across_ranks(numbers: Sequence[float], device: torch.device) -> list[float]:
    """Each of `numbers` summed over all ranks (in float64, on `device`, where the group's backend can send it)."""
    totals = torch.tensor(list(numbers), dtype=torch.float64, device=device)
    sum_across_ranks([totals])
    return totals.tolist()


def sum_across_ranks(tensors: Sequence[torch.Tensor]) -> None:
    """Replace each tensor by its sum over all ranks, in one collective call (the tensors share a dtype and device)."""
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
