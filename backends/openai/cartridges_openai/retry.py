"""Which failures are worth another attempt, and how long to wait: openai-python's policy, kept in one place.

Transient: connection errors and timeouts, and HTTP 408, 409, 429 and 5xx; a server's ``x-should-retry`` header
overrides that either way. A server's ``retry-after`` (or ``retry-after-ms``) is obeyed up to two minutes; a longer
one means the server will not serve us soon (e.g. a spent quota), so the request fails at once. Otherwise the delay
doubles from `backoff` up to `max_backoff`, less up to a quarter at random, so many clients do not retry in step
(openai-python's backoff, with longer defaults here, to ride out a server's restart). Anything else (400, 401, 403,
404, 422, ...) is permanent: the request fails at once with the server's own message. The openai client's own
retries are set to zero, so the two never stack.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Mapping
from typing import Any

import openai

from cartridges_sdk import BackendError
from cartridges_sdk.kit import RateLimitedError, TransientBackendError

TRANSIENT_STATUS = frozenset({408, 409, 429})
LONGEST_RETRY_AFTER = 120.0


def retry_after(headers: Mapping[str, str] | None) -> float | None:
    """The delay a server asked for, in seconds (None when it asked for none, or for none that can be read)."""
    if not headers:
        return None
    delay: float | None = None
    try:
        if headers.get("retry-after-ms") is not None:
            delay = float(headers["retry-after-ms"]) / 1000
        elif headers.get("retry-after") is not None:
            value = headers["retry-after"]
            try:
                delay = float(value)
            except ValueError:  # an HTTP date
                when = email.utils.parsedate_to_datetime(value)
                delay = when.timestamp() - time.time()
    except (TypeError, ValueError):
        return None
    return delay if delay is not None and math.isfinite(delay) and delay > 0 else None


class ServerDownError(TransientBackendError):
    """The server is unreachable, timed out or failed (5xx): take it out of rotation for a while."""


def is_transient_status(status: int) -> bool:
    return status in TRANSIENT_STATUS or status >= 500


def to_backend_error(err: Exception, url: str) -> BackendError:
    """An openai exception as the SDK's: transient ones carry the server's retry-after; the server's message is kept."""
    if isinstance(err, BackendError):
        return err
    if isinstance(err, openai.APIStatusError):
        message = f"{url} answered HTTP {err.status_code}: {_server_message(err).rstrip('.')}."
        headers = err.response.headers
        asked = retry_after(headers)
        should = (headers.get("x-should-retry") or "").lower()
        transient = should == "true" or (should != "false" and is_transient_status(err.status_code))
        if transient and asked is not None and asked > LONGEST_RETRY_AFTER:
            return BackendError(f"{message} It asks to be retried in {asked:.0f} s, longer than this backend waits "
                                f"({LONGEST_RETRY_AFTER:.0f} s); run again later (synthesis resumes where it stopped).")
        if not transient:
            hint = {401: " Check api_key (or OPENAI_API_KEY).", 403: " Check api_key (or OPENAI_API_KEY).",
                    404: " Check base_url (it ends in /v1) and model."}.get(err.status_code, "")
            return BackendError(message + hint)
        if err.status_code == 429:
            return RateLimitedError(message, retry_after=asked)
        if err.status_code >= 500:
            return ServerDownError(message, retry_after=asked)
        return TransientBackendError(message, retry_after=asked)
    if isinstance(err, openai.APITimeoutError):
        return ServerDownError(f"{url} did not answer in time ({err}); raise the option timeout for slow servers.")
    if isinstance(err, openai.APIConnectionError):
        cause = err.__cause__ or err
        return ServerDownError(f"{url} is unreachable: {type(cause).__name__}: {cause}")
    return BackendError(f"{url}: {type(err).__name__}: {err}")


def _server_message(err: Any) -> str:
    body = getattr(err, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if body.get("message"):
            return str(body["message"])
    return str(getattr(err, "message", err))


class Backoff:
    """tenacity's `wait`: the server's retry-after when it gave a usable one, else jittered exponential backoff."""

    def __init__(self, first: float, cap: float, rng: random.Random | None = None):
        self.first = first
        self.cap = cap
        self.rng = rng or random.Random()

    def __call__(self, retry_state: Any) -> float:
        err = retry_state.outcome.exception() if retry_state.outcome else None
        asked = getattr(err, "retry_after", None)
        if asked is not None:
            return float(asked)
        delay = min(self.first * 2 ** (retry_state.attempt_number - 1), self.cap)
        return delay * (1 - 0.25 * self.rng.random())
