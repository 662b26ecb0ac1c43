"""pytest fixtures for backends' own tests: import the ones a test module uses (``from cartridges_sdk.testing.fixtures
import lm``), so every backend's tests start the same model the same way."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..lm import LM
from ..models import load_model


@pytest.fixture(scope="module")
def lm() -> Iterator[LM]:
    """The embedded default model, one per test module; closing it stops the engines its runtimes started there."""
    model = load_model()
    yield model
    model.close()
