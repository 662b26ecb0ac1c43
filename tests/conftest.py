"""Shared fixtures: tiny random Llama/Qwen2 models with GQA built in memory (`cartridges_sdk.testing`), and the
embedded default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from cartridges_sdk import load_model
from cartridges_sdk.testing import tiny_lm as make_tiny_lm


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_lm(request):
    return make_tiny_lm(request.param)


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_lm("llama")


@pytest.fixture(scope="session")
def tiny_qwen():
    return make_tiny_lm("qwen2")


@pytest.fixture
def kill_at_step(monkeypatch):
    """`kill_at_step(n)` makes the n-th optimizer step raise KeyboardInterrupt, as a kill would; the function it
    returns puts the real step back."""
    import torch

    real = torch.optim.Adam.step

    def arm(n: int):
        calls = {"n": 0}

        def dying(self, *a, **kw):
            calls["n"] += 1
            if calls["n"] == n:
                raise KeyboardInterrupt("killed")
            return real(self, *a, **kw)

        monkeypatch.setattr(torch.optim.Adam, "step", dying)
        return lambda: monkeypatch.setattr(torch.optim.Adam, "step", real)

    return arm


@pytest.fixture(scope="session")
def default_lm():
    return load_model()


DATA = Path(__file__).parent.parent / "examples" / "data"
TEXT = (DATA / "harrow_point.txt").read_text(encoding="utf-8")
