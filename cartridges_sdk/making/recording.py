"""Reading a model's post-RoPE queries from inside its attention, for compaction's reference queries.

The model's attention is switched, for the duration, to a function registered with transformers' attention interface
that hands each call to the active recorder; a thread with no recorder gets the model's own attention.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ..errors import UnsupportedModelError
from ..kv import sdpa_gqa_attention

if TYPE_CHECKING:
    from ..lm import LM


class Recorder:
    """Collects post-RoPE queries per layer from inside the attention function, for the positions asked for."""

    def __init__(self) -> None:
        self.select: torch.Tensor | None = None  # positions of the current forward to keep (None: all)
        self.paused = False  # forwards that are not references (the model asking its own questions)
        self.queries: dict[int, list[torch.Tensor]] = {}
        self.scaling: dict[int, float] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        if not self.paused:
            q = query[0] if self.select is None else query[0].index_select(1, self.select.to(query.device))
            self.queries.setdefault(module.layer_idx, []).append(q.detach().float().cpu())
        self.scaling[module.layer_idx] = float(scaling if scaling is not None else module.scaling)
        return sdpa_gqa_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("cartridges_recorder", default=None)
RECORDING = "cartridges_record"
_BEFORE: dict[int, str] = {}  # id(model config) -> the attention the model used before recording switched it
# id(model config) -> recordings open on it: threads overlap (a server cutting cartridges by attention for two
# requests, a watcher compacting), each with its own recorder, and only the last to close may switch the model back
_OPEN: dict[int, int] = {}
_SWITCHING = threading.Lock()


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention function a model uses while a recorder is active (registered once, under `RECORDING`). Another
    thread using the same model meanwhile (a server answering while a watcher compacts) has no recorder in its
    context and gets the model's own attention, so it answers as if nothing were recorded."""
    recorder = _RECORDER.get()
    if recorder is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        before = _BEFORE.get(id(module.config), "sdpa")
        if before == RECORDING or before not in ALL_ATTENTION_FUNCTIONS:
            raise RuntimeError(f"cartridges_record attention ran outside compaction and the model's own ({before!r}) "
                               "cannot stand in; call model.set_attn_implementation('sdpa').")
        return ALL_ATTENTION_FUNCTIONS[before](module, query, key, value, attention_mask, **kwargs)
    return recorder(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def recording(lm: LM) -> Iterator[Recorder]:
    """Route the model's attention through a recorder for the duration (restored afterwards, even on error).
    The model is switched as a whole; other threads answering with it meanwhile get its own attention through
    `_recording_attention`."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    model = lm.model
    AttentionInterface.register(RECORDING, _recording_attention)
    AttentionMaskInterface.register(RECORDING, sdpa_mask)
    recorder = Recorder()
    token = _RECORDER.set(recorder)
    key = id(model.config)
    with _SWITCHING:  # the first recording open on the model switches it, the last one to close switches it back
        if not _OPEN.get(key):
            _BEFORE[key] = model.config._attn_implementation
            model.set_attn_implementation(RECORDING)
        _OPEN[key] = _OPEN.get(key, 0) + 1
    try:
        if model.config._attn_implementation != RECORDING:
            raise UnsupportedModelError(
                f"Model {lm.name!r} would not switch its attention function, so its queries cannot be read; "
                "compaction needs a transformers model that takes `set_attn_implementation`."
            )
        yield recorder
    finally:
        with _SWITCHING:
            _OPEN[key] -= 1
            if not _OPEN[key]:
                del _OPEN[key]
                model.set_attn_implementation(_BEFORE[key])
        _RECORDER.reset(token)
