"""Memory figures for training's log and the benchmarks: the accelerator's peak allocations, or on CPU the process's
own figures from Linux's ``/proc``."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory since `reset_peak_memory`: the accelerator's allocations, or on CPU the process's peak
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


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak over, so training's figure is not synthesis's (on CPU, Linux only: elsewhere it stays the
    process's peak so far)."""
    accelerator = getattr(torch, device.type, None)
    if device.type != "cpu" and hasattr(accelerator, "reset_peak_memory_stats"):
        accelerator.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
