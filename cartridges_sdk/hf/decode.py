"""The decode loop the HF runtime and synthesizer share: a batch of prompts, each after its own prefix KV.

Our own loop (rather than ``model.generate``) keeps every row's prefix, the attention mask over prefix + padding +
new tokens, and the position ids explicit, which is where prefix caches go wrong silently. Rows are padded on the
left (prompts) and their prefixes right-aligned (see `kv.rows_prefix_cache`), so each row's tokens sit at the
positions they would have alone and padding is masked out.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from ..kit import (Completion, ConfigError, decoding_kernels, ends_answer, GenerationParams, Layers, PackedRows,
    rows_prefix_cache, sample_next)

if TYPE_CHECKING:
    from ..kit import LM


class DecodeState:
    """What a batch decode has produced so far; `top_ids`/`top_logprobs` hold per-token top-k when asked for."""

    def __init__(self, batch: int):
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.reasons: list[str | None] = [None] * batch
        self.top_ids: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.top_logprobs: list[list[torch.Tensor]] = [[] for _ in range(batch)]


@torch.inference_mode()
def decode(
    lm: LM,
    prefixes: Sequence[Layers | None] | PackedRows,
    prompts: Sequence[Sequence[int]],
    params: GenerationParams,
    *,
    top_logprobs: int = 0,
    stop_ids: Sequence[int] | None = None,
) -> Iterator[DecodeState]:
    """Batch-decode `prompts`, row i after the per-layer KV `prefixes[i]` (or none), yielding the state after every
    step (the last has all reasons set).

    With `top_logprobs=k`, every generated token also gets the model's top-k log-probabilities (before
    temperature), which is what self-study keeps as the teacher's distribution. A row ends at any of `stop_ids`
    (default: the model's end-of-turn tokens) or at one of ``params.stop``'s strings.
    """
    if not prompts or any(not p for p in prompts) or len(prefixes) != len(prompts):
        raise ConfigError("Every conversation must format to at least one token, with one prefix entry per prompt.")
    device = lm.device
    cache, step_ids, mask, step_pos = _first_inputs(lm, prefixes, prompts, params.max_new_tokens)
    generator = _generator(params, device)
    eos = set(stop_ids) if stop_ids is not None else lm.eos_token_ids
    state = DecodeState(len(prompts))
    next_pos = step_pos[:, -1:] + 1
    live = list(range(len(prompts)))  # the state row of each batch row still being decoded
    for _ in range(params.max_new_tokens):
        with decoding_kernels(device):
            result = lm.model(
                input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache, use_cache=True,
                logits_to_keep=1,  # the prompt's own logits are never used
            )
        cache = result.past_key_values
        logits = result.logits[:, -1, :]
        token = sample_next(logits, params, generator)
        _record_step(lm, state, live, token, logits, top_logprobs, params.stop, eos)
        yield state
        finished = [b for b, row in enumerate(live) if state.reasons[row] is not None]
        if len(finished) == len(live):
            return
        if 4 * len(finished) >= len(live):
            # finished rows would cost a full row of work every step; dropping them copies the cache once, so it
            # waits until a quarter of the batch is done
            keep = torch.tensor([b for b in range(len(live)) if state.reasons[live[b]] is None], device=device)
            cache.reorder_cache(keep)
            token, mask, next_pos = token[keep], mask[keep], next_pos[keep]
            live = [live[b] for b in keep.tolist()]
            finished = []
        step_ids = token[:, None]
        if finished:
            step_ids = step_ids.masked_fill(torch.tensor([[b in finished] for b in range(len(live))], device=device),
                                            lm.pad_token_id)
        mask = torch.cat([mask, torch.ones(len(live), 1, dtype=torch.long, device=device)], dim=1)
        step_pos = next_pos
        next_pos = next_pos + 1
    state.reasons = [r or "length" for r in state.reasons]
    yield state


def _first_inputs(lm: LM, prefixes: Sequence[Layers | None] | PackedRows, prompts: Sequence[Sequence[int]], max_new_tokens: int):
    """The first forward's cache, input ids, attention mask and position ids: prompts padded on the left, after
    their right-aligned prefixes, each token at the position it would have alone (padding is masked out)."""
    device = lm.device
    batch, width = len(prompts), max(len(p) for p in prompts)
    longest_prefix = prefixes.width if isinstance(prefixes, PackedRows) else max(
        (layers[0][0].shape[1] for layers in prefixes if layers), default=0)
    cache, _, prefix_mask = rows_prefix_cache(lm, prefixes, capacity=longest_prefix + width + max_new_tokens)
    ids = torch.full((batch, width), lm.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((batch, width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # built on the host, then moved in one copy each
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt))
        prompt_mask[row, width - len(prompt) :] = 1
    ids, prompt_mask = ids.to(device), prompt_mask.to(device)
    mask = torch.cat([prefix_mask, prompt_mask], dim=1)
    # each row's positions continue after its own prefix; padding gets a harmless position and is masked out
    start = prefix_mask.sum(-1, keepdim=True)
    positions = torch.maximum(start + prompt_mask.cumsum(-1) - 1, start)
    return cache, ids, mask, positions


def _generator(params: GenerationParams, device: torch.device) -> torch.Generator | None:
    """The random generator sampling draws from (seeded by `params.seed`, else at random); None when greedy."""
    if params.temperature == 0:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else torch.seed())
    return generator


def _record_step(lm: LM, state: DecodeState, live: list[int], token: torch.Tensor, logits: torch.Tensor,
                 top_logprobs: int, stop: Sequence[str], eos: set[int]) -> None:
    """Append each live row's new token (and its top-k, when asked for) to `state`, ending rows by the stop rule."""
    if top_logprobs:
        top = torch.topk(logits.float().log_softmax(-1), top_logprobs, dim=-1)
        top_ids, top_lps = top.indices.cpu(), top.values.cpu()  # one copy per step, not one per row
    chosen = token.tolist()  # on a GPU every per-row read would wait for the device
    for b, row in enumerate(live):
        if state.reasons[row] is not None:
            continue
        state.tokens[row].append(chosen[b])
        if top_logprobs:
            state.top_ids[row].append(top_ids[b])
            state.top_logprobs[row].append(top_lps[b])
        if ends_answer(lm, state.tokens[row], stop, eos):
            state.reasons[row] = "stop"


@torch.inference_mode()
def prefill_rows(lm: LM, prefix: Layers | None, prompts: Sequence[Sequence[int]]) -> PackedRows | list[Layers | None]:
    """Each row's KV: `prefix`, then its prompt but the last token (which `decode` feeds to get the first logits),
    as `PackedRows` (or the prefix for every row, when no prompt has more than one token).

    The distinct prompts are packed end to end into one sequence, each seeing the prefix and its own earlier tokens
    only, at the positions it would have alone. A padded batch would compute every row to the longest prompt and
    repeat identical prompts; in self-study that was a third of the prompts' work.
    """
    from transformers import DynamicCache

    bodies = [tuple(int(t) for t in p[:-1]) for p in prompts]
    spans: dict[tuple[int, ...], tuple[int, int]] = {}  # each distinct body's place in the packed sequence
    total = 0
    for body in bodies:
        if body and body not in spans:
            spans[body] = (total, total + len(body))
            total += len(body)
    if not spans:
        return [prefix] * len(prompts)
    past = prefix[0][0].shape[1] if prefix else 0
    device = lm.device
    ids = torch.tensor([t for body in spans for t in body], device=device)[None]
    positions = torch.cat([torch.arange(past, past + b - a, device=device) for a, b in spans.values()])[None]
    segment = torch.cat([torch.full((b - a,), i, device=device) for i, (a, b) in enumerate(spans.values())])
    own = (segment[:, None] == segment[None, :]) & torch.ones(total, total, dtype=torch.bool, device=device).tril()
    mask = torch.cat([torch.ones(total, past, dtype=torch.bool, device=device), own], dim=1)[None, None]
    data = [(k[None], v[None]) for k, v in prefix] if prefix else None
    cache = DynamicCache(ddp_cache_data=data, config=lm.model.config) if data else DynamicCache(config=lm.model.config)
    lm.model.base_model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True)
    layers = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
    return PackedRows(layers, past, [spans[body] if body else (0, 0) for body in bodies])


def row_completion(
    lm: LM, state: DecodeState, row: int, *, stop: Sequence[str] = (), stop_ids: Sequence[int] | None = None,
) -> Completion:
    """Row `row` of a decode as a `Completion`, with its top-k arrays ``[tokens, k]`` when they were kept."""
    extra = {}
    if state.top_ids[row]:
        extra = {"top_ids": torch.stack(state.top_ids[row]).numpy(),
                 "top_logprobs": torch.stack(state.top_logprobs[row]).float().numpy()}
    return Completion.from_ids(lm, state.tokens[row], state.reasons[row], stop=stop, stop_ids=stop_ids or (), **extra)
