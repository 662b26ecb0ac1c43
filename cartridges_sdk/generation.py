"""What flows between the SDK and a backend: generation settings and requests, synthesis requests, completions.

These are plain frozen attrs values that validate on construction, so a backend receives only requests it can run
as given; `Completion.from_ids` is the one rule for turning generated ids into text in every engine.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from .checks import at_least_one, count, non_negative, optional_int, unit_interval
from .errors import ConfigError

if TYPE_CHECKING:
    from .protocols import KVPrefix, RunningModel

Message = dict[str, str]


def _token_ids(value: Any) -> tuple[int, ...]:
    return tuple(int(t) for t in value)


def _stops(value: Any) -> tuple[str, ...]:
    stops = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
    if stops is None or not all(isinstance(s, str) and s for s in stops):
        raise ConfigError(f"stop={value!r} must be a non-empty string or a list of them.")
    return stops


def _messages(value: Any) -> tuple[Message, ...]:
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ConfigError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {value!r:.80}.")
    messages = tuple(value)
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f"Message {i} is {m!r}; every message needs a string 'role' and a string 'content'.")
    return messages


# temperatures below this decode greedily, as vLLM does: dividing logits by a tinier one overflows to inf and NaN
GREEDY_BELOW = 1e-5
SEEDS = (-(2**63), 2**63 - 1)  # every engine seeds a signed 64-bit generator; a larger seed overflowed inside one


def _temperature(value: Any) -> Any:
    return 0.0 if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < GREEDY_BELOW \
        else value


def _seed(_inst, attribute, value) -> None:
    optional_int(_inst, attribute, value)
    if value is not None and not SEEDS[0] <= value <= SEEDS[1]:
        raise ConfigError(f"seed={value!r:.40} must be a 64-bit signed integer, from -2**63 to 2**63-1.")


@attrs.frozen
class GenerationParams:
    """How to sample an answer. ``temperature=0`` is greedy decoding, and so is any temperature below `GREEDY_BELOW`.

    With ``top_logprobs=k`` the completion also carries, per generated token, the model's top-k candidates and
    their log-probabilities before temperature (what the contract suite compares across engines).
    """

    max_new_tokens: int = attrs.field(default=256, validator=at_least_one)
    temperature: float = attrs.field(default=0.0, converter=_temperature, validator=non_negative)
    top_p: float = attrs.field(default=1.0, validator=unit_interval)
    top_k: int = attrs.field(default=0, validator=count)
    seed: int | None = attrs.field(default=None, validator=_seed)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stops)
    top_logprobs: int = attrs.field(default=0, validator=count)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> GenerationParams:
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"Unknown generation setting(s) {unknown}; valid ones are {sorted(known)}.")
        return cls(**kwargs)


@attrs.frozen
class Completion:
    """One generated answer: the text, its token ids, and why it ended (``"stop"`` or ``"length"``).

    `top_ids` / `top_logprobs`, when asked for: per generated token, the model's top-k candidates and their
    log-probabilities before temperature (arrays of shape ``[tokens, k]``).
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    top_ids: Any = None
    top_logprobs: Any = None

    @classmethod
    def from_ids(
        cls, lm: RunningModel, ids: Sequence[int], finish_reason: str | None, *, stop_ids: Iterable[int] = (),
        stop: Sequence[str] = (), top_ids: Any = None, top_logprobs: Any = None,
    ) -> Completion:
        """Generated ids as a `Completion`, the same in every engine: the text is the student's tokenizer's decoding
        without the ending stop token (or end-of-turn token), cut before the first stop string."""
        ids = tuple(int(i) for i in ids)
        body = ids[:-1] if ids and ids[-1] in set(stop_ids) | lm.eos_token_ids else ids
        text = lm.tokenizer.decode(list(body), skip_special_tokens=True)
        for s in stop:
            if s in text:
                text = text[: text.index(s)]
        return cls(text=text, token_ids=ids, finish_reason="stop" if finish_reason == "stop" else "length",
                   top_ids=top_ids, top_logprobs=top_logprobs)


@attrs.frozen
class GenerationRequest:
    """One conversation to answer with its own cartridges (zero, one, or several used one after another).

    `prefix_ids` are plain tokens placed after the cartridges and before the chat: a document in context, which is
    how a runtime shows that a cartridge made from those tokens answers the same.
    """

    messages: tuple[Message, ...] = attrs.field(converter=_messages)
    cartridges: tuple[KVPrefix, ...] = attrs.field(default=(), converter=tuple)
    params: GenerationParams = attrs.field(factory=GenerationParams)
    prefix_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)


@attrs.frozen
class SynthesisRequest:
    """One completion to sample for self-study, as token ids of the student's tokenizer.

    `prompt_ids` is the teacher's whole prompt, rendered once by the SDK (the chunk, then the chat turn ready for
    the answer) with the same rule the student's sequences follow, so an engine only continues it: it never applies
    a chat template and needs no Hugging Face weights. Generation ends at any of `stop_ids` (kept as the last token)
    or after `max_tokens`. Requests of one `group` share their chunk, so an engine can prefill it once.
    """

    prompt_ids: tuple[int, ...] = attrs.field(converter=_token_ids)
    stop_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    max_tokens: int = attrs.field(default=128, validator=at_least_one)
    temperature: float = attrs.field(default=1.0, validator=non_negative)
    top_logprobs: int = attrs.field(default=0, validator=count)
    group: int | None = None
    seed: int | None = attrs.field(default=None, validator=optional_int)

    @prompt_ids.validator
    def _check_prompt(self, _attribute, value):
        if not value:
            raise ConfigError("A synthesis request needs at least one prompt token.")


def settled_delta(shown: str, text: str, done: bool) -> str:
    """What `text` (a growing answer) adds to the `shown` part, once it has settled: text that may still change (an
    incomplete multi-byte character at its end) is held back until it does."""
    if (done or not text.endswith("\ufffd")) and len(text) > len(shown) and text.startswith(shown):
        return text[len(shown) :]
    return ""


def text_deltas(answers: Iterable[tuple[Completion, bool]]) -> Generator[str, None, Completion | None]:
    """The new part of a growing answer each time it settles, for `Runtime.stream`: `answers` gives the answer so far
    and whether it has ended; the last one is returned."""
    shown, last = "", None
    for last, done in answers:
        if delta := settled_delta(shown, last.text, done):
            yield delta
            shown = last.text
    return last


def check_fits(request: GenerationRequest, prompt_tokens: int, limit: int | None, limit_name: str, *,
               index: int | None = None, fix: str = "") -> None:
    """The context check every runtime makes for each request before any compute: its cartridges, its prompt and
    ``max_new_tokens`` must fit the engine's position limit (`limit`, described as `limit_name`; None: no limit
    known; `index`: its place in the batch, for the message). An engine would otherwise cut the answer short, or fail the whole batch, without saying why."""
    p = sum(c.num_tokens for c in request.cartridges)
    n = request.params.max_new_tokens
    need = p + prompt_tokens + n
    if limit is not None and need > limit:
        raise ConfigError(
            f"{'The request' if index is None else f'Request {index}'} ({p} cartridge tokens + {prompt_tokens} prompt tokens + max_new_tokens={n}) needs {need} "
            f"tokens, more than {limit_name}; shorten the conversation, lower max_new_tokens or use a smaller "
            f"cartridge{fix}."
        )
