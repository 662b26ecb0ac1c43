"""The built-in Hugging Face runtime: cartridges become a transformers KV cache in front of the chat turn.

Our own decode loop (rather than ``model.generate``) keeps the cartridge prefix, the attention mask over
cartridge + padding + new tokens, and the position ids explicit, which is where prefix caches go wrong silently.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from .errors import ConfigError
from .kv import prefix_cache
from .plugins import Completion, GenerationParams, Message, Runtime

if TYPE_CHECKING:
    from .cartridge import Cartridge
    from .models import LM


def _sample(logits: torch.Tensor, params: GenerationParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from ``[batch, vocab]`` logits."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class HFRuntime(Runtime):
    """Runs cartridges on the transformers model inside an `LM`; batches questions with left padding."""

    def __init__(self, lm: LM):
        self.lm = lm

    def generate(
        self, cartridges: Sequence[Cartridge], messages: Sequence[Message], params: GenerationParams
    ) -> Completion:
        return self.generate_batch(cartridges, [messages], params)[0]

    def generate_batch(
        self, cartridges: Sequence[Cartridge], conversations: Sequence[Sequence[Message]], params: GenerationParams
    ) -> list[Completion]:
        prompts = [self.lm.chat_ids(m, after_cartridge=bool(cartridges)) for m in conversations]
        for outs in self._decode(cartridges, prompts, params):
            pass
        return [self._finish(ids, reason, params) for ids, reason in outs]

    def stream(
        self, cartridges: Sequence[Cartridge], messages: Sequence[Message], params: GenerationParams
    ) -> Iterator[str]:
        prompt = self.lm.chat_ids(messages, after_cartridge=bool(cartridges))
        shown = ""
        for (ids, reason), in self._decode(cartridges, [prompt], params):
            text = self._finish(ids, reason, params).text
            # hold back text that may still change (an incomplete multi-byte character) until it settles
            if text.endswith("\ufffd") and reason is None:
                continue
            if len(text) > len(shown) and text.startswith(shown):
                yield text[len(shown) :]
                shown = text

    def _finish(self, ids: list[int], reason: str | None, params: GenerationParams) -> Completion:
        return finish(self.lm, ids, reason, stop=params.stop)

    def _decode(self, cartridges: Sequence[Cartridge], prompts: list[list[int]], params: GenerationParams):
        for state in decode(self.lm, cartridges, prompts, params):
            yield [(list(o), r) for o, r in zip(state.tokens, state.reasons)]


def finish(lm: LM, ids: Sequence[int], reason: str | None, *, stop: Sequence[str] = (), **extra) -> Completion:
    """A `Completion` from generated ids: text without the end-of-turn token, cut before the first stop string."""
    body = ids[:-1] if ids and ids[-1] in lm.eos_token_ids else ids
    text = lm.tokenizer.decode(list(body), skip_special_tokens=True)
    for s in stop:
        if s in text:
            text = text[: text.index(s)]
    return Completion(text=text, token_ids=tuple(ids), finish_reason=reason or "length", **extra)


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
    cartridges: Sequence[Cartridge],
    prompts: list[list[int]],
    params: GenerationParams,
    *,
    top_logprobs: int = 0,
) -> Iterator[DecodeState]:
    """Batch-decode `prompts` after `cartridges`, yielding the state after every step (the last has all reasons set).

    With `top_logprobs=k`, every generated token also gets the model's top-k log-probabilities (before
    temperature), which is what self-study keeps as the teacher's distribution.
    """
    if not prompts or any(not p for p in prompts):
        raise ConfigError("Every conversation must format to at least one token.")
    device = lm.device
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    room = sum(c.num_tokens for c in cartridges) + width + params.max_new_tokens
    cache, p = prefix_cache(lm, cartridges, batch_size=batch, capacity=room)
    pad = lm.pad_token_id
    ids = torch.full((batch, width), pad, dtype=torch.long, device=device)
    prompt_mask = torch.zeros((batch, width), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, device=device)
        prompt_mask[row, width - len(prompt) :] = 1
    mask = torch.cat([torch.ones(batch, p, dtype=torch.long, device=device), prompt_mask], dim=1)
    # positions continue after the cartridge; padding gets a harmless position and is masked out
    positions = (p + prompt_mask.cumsum(-1) - 1).clamp(min=p)
    generator = None
    if params.temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    eos = lm.eos_token_ids
    state = DecodeState(batch)
    next_pos = positions[:, -1:] + 1
    step_ids, step_pos = ids, positions
    for _ in range(params.max_new_tokens):
        result = lm.model(
            input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache, use_cache=True
        )
        cache = result.past_key_values
        logits = result.logits[:, -1, :]
        token = _sample(logits, params, generator)
        if top_logprobs:
            top = torch.topk(logits.float().log_softmax(-1), top_logprobs, dim=-1)
        for row in range(batch):
            if state.reasons[row] is not None:
                continue
            t = int(token[row])
            state.tokens[row].append(t)
            if top_logprobs:
                state.top_ids[row].append(top.indices[row].cpu())
                state.top_logprobs[row].append(top.values[row].cpu())
            if t in eos:
                state.reasons[row] = "stop"
            elif params.stop:
                text = lm.tokenizer.decode(state.tokens[row], skip_special_tokens=True)
                if any(s in text for s in params.stop):
                    state.reasons[row] = "stop"
        yield state
        if all(r is not None for r in state.reasons):
            return
        step_ids = token[:, None].masked_fill(torch.tensor([[r is not None] for r in state.reasons], device=device), pad)
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long, device=device)], dim=1)
        step_pos = next_pos
        next_pos = next_pos + 1
    state.reasons = [r or "length" for r in state.reasons]
    yield state
