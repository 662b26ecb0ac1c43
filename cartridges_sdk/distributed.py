"""Data-parallel training across processes with PyTorch's own `torch.distributed` (gloo on CPU, nccl on GPU).

`torchrun` starts one process per rank and sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``; the trainer joins that group
when it starts (nothing happens at import). Each rank takes its share of every optimizer step's micro-batches and the
cartridge's gradients are summed across ranks, so every rank takes the same step and holds the same cartridge.

Why one all-reduce of the flattened gradients rather than `DistributedDataParallel`: the trained parameters are a
few tensors (the cartridge), and DDP's reducer needs every rank to run the same number of forwards per step, which
the last, shorter step of an epoch breaks; summing once per step is what DDP would do, without that constraint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch


def join(device: torch.device) -> tuple[int, int]:
    """(rank, world size): of the process group already set up, of the one `torchrun` describes in the environment
    (joined now, gloo on CPU and nccl on CUDA), or (0, 1) for a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def launch(module_args: Sequence[str], nproc: int) -> int:
    """Run ``python -m MODULE_ARGS`` as `nproc` ranks on this machine under torchrun; its exit code. For more
    machines, run torchrun on each yourself (docs/distributed.md)."""
    import subprocess
    import sys

    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                            str(nproc), "-m", *module_args])


def is_lead() -> bool:
    """Whether this process writes what is written once: rank 0, or the only process."""
    return int(os.environ.get("RANK", "0")) == 0


def barrier() -> None:
    """Wait for every rank (nothing to wait for in a single process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def sum_across_ranks(tensors: Sequence[torch.Tensor]) -> None:
    """Replace each tensor by its sum over all ranks, in one collective call."""
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
