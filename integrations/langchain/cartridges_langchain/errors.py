"""The SDK's errors as LangChain's own: each raised class is both a `langchain_core.exceptions.ModelError` (what
LangChain code and its retry helpers catch, `is_retryable` included) and the SDK's class, so code catching either
keeps working."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from langchain_core import exceptions as lc

from cartridges_sdk import errors as sdk


class CartridgesInvalidRequestError(lc.ModelInvalidRequestError, sdk.ConfigError):
    """A setting, message or question the SDK cannot use (a question sharing no word with any corpus, say)."""


class CartridgesNotFoundError(lc.ModelNotFoundError, sdk.NotInStoreError):
    """A cartridge name the store does not hold."""


class CartridgesRateLimitError(lc.ModelRateLimitError, sdk.RateLimitedError):
    """The engine refused for now (load or quota)."""


class CartridgesConnectionError(lc.ModelConnectionError, sdk.BackendUnavailableError):
    """The runtime cannot run here, or its server cannot be reached."""


class CartridgesAPIError(lc.ModelAPIError, sdk.BackendError):
    """The engine failed while answering."""


# most specific first: the first class the error is an instance of decides
_MAP: tuple[tuple[type[Exception], type[Exception]], ...] = (
    (sdk.NotInStoreError, CartridgesNotFoundError),
    (sdk.RateLimitedError, CartridgesRateLimitError),
    (sdk.BackendUnavailableError, CartridgesConnectionError),
    (sdk.BackendError, CartridgesAPIError),
    (sdk.CartridgeError, CartridgesInvalidRequestError),  # config, incompatible cartridge, unsupported model ...
)


@contextlib.contextmanager
def langchain_errors() -> Iterator[None]:
    """Raise what the SDK raises inside as the matching LangChain error, chained to the original."""
    try:
        yield
    except sdk.CartridgeError as e:
        if isinstance(e, lc.ModelError):
            raise
        mapped = next(new for old, new in _MAP if isinstance(e, old))
        error = mapped(str(e))
        if isinstance(e, sdk.TransientBackendError):
            error.retry_after = e.retry_after
        raise error from e
