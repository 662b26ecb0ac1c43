"""The synthesizer's options, validated when built, with errors that name the bad value."""

from __future__ import annotations

import os
import re
from typing import Any

import attrs

from cartridges_sdk import ConfigError
from cartridges_sdk.kit import at_least_one, boolean, count, positive


def _urls(value: Any) -> tuple[str, ...] | None:
    """One URL, a comma-separated string of them (handy on the command line), or a list."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.replace(",", " ").split()
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(u, str) for u in value):
        raise ConfigError(f"base_url={value!r} must be a server URL such as 'http://127.0.0.1:8000/v1', or a list of them.")
    urls = tuple(u.rstrip("/") for u in value)
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ConfigError(f"base_url entry {shown(u)!r} must start with http:// or https:// (e.g. 'http://127.0.0.1:8000/v1').")
    if len(set(urls)) != len(urls):
        raise ConfigError(f"base_url={[shown(u) for u in urls]} names a server twice; list each server once.")
    return urls


def shown(url: str) -> str:
    """`url` as messages and logs show it: a user:password part as ***."""
    return re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#@]*@", r"\1***@", url)


def _optional_text(_inst, attribute, value) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{attribute.name} must be a non-empty string, got {type(value).__name__}.")


@attrs.frozen
class OpenAIOptions:
    # the servers' OpenAI base URLs (…/v1), one or a list; default: the OPENAI_BASE_URL environment variable
    base_url: tuple[str, ...] | None = attrs.field(default=None, converter=_urls)
    # the served model's name; default: the one model the first server lists
    model: str | None = attrs.field(default=None, validator=_optional_text)
    # default: the OPENAI_API_KEY environment variable, else none (servers started without a key accept any)
    api_key: str | None = attrs.field(default=None, validator=_optional_text, repr=False)
    # requests in flight per server; a server batches what it receives, so more keeps it busier
    concurrency: int = attrs.field(default=32, validator=at_least_one)
    # retries of a request after its first attempt, on transient failures only (connection, timeout, 408/409/429/5xx)
    max_retries: int = attrs.field(default=8, validator=count)
    # first retry delay and its cap, in seconds (doubling, with jitter); the defaults wait about a minute in all,
    # long enough for a restarted vLLM server to come back
    backoff: float = attrs.field(default=0.5, validator=positive)
    max_backoff: float = attrs.field(default=20.0, validator=positive)
    # seconds a server that failed stays out of rotation before it is tried again
    cooldown: float = attrs.field(default=10.0, validator=positive)
    # seconds one request may take (a long prompt on a busy CPU server is slow)
    timeout: float = attrs.field(default=600.0, validator=positive)
    # seconds to wait for a connection: a host that does not answer at all is given up on quickly, and its requests
    # go to another server
    connect_timeout: float = attrs.field(default=10.0, validator=positive)
    # top-k log-probs the servers return per token (vLLM's --max-logprobs, 20 by default)
    max_logprobs: int = attrs.field(default=20, validator=at_least_one)
    # send each request's seed, so samples repeat on a server that honours seeds (vLLM on GPUs). Off by default:
    # vLLM 0.32 on CPUs dies ("CPU Generator does not use offset") when a seeded prompt is prefilled in chunks
    seeds: bool = attrs.field(default=False, validator=boolean)
    # ask for token ids ('token_id:N', vLLM's return_tokens_as_token_ids); off, or on a server that returns text,
    # each token's text is mapped back to an id of the student's tokenizer and refused when that is ambiguous
    token_ids: bool = attrs.field(default=True, validator=boolean)

    def urls(self) -> tuple[str, ...]:
        urls = self.base_url or _urls(os.environ.get("OPENAI_BASE_URL") or None)
        if not urls:
            raise ConfigError(
                "The openai synthesizer needs a server: pass base_url='http://HOST:PORT/v1' (or a list of them) in "
                "synthesizer_options / --backend-option, or set OPENAI_BASE_URL."
            )
        return urls

    def key(self) -> str:
        # openai's client insists on a key; a server started without --api-key ignores it
        return self.api_key or os.environ.get("OPENAI_API_KEY") or "none"
