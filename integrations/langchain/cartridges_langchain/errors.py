"""The SDK's errors as LangChain's own: each raised error is an instance of both the matching
`langchain_core.exceptions.ModelError` class (what LangChain code and its retry helpers catch, `is_retryable`
included) and the SDK's exact class it came from, so code catching either keeps working."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from langchain_core import exceptions as lc

from cartridges_sdk import errors as sdk

# most specific first: the first SDK class the error is an instance of picks LangChain's class
_MAP: tuple[tuple[type[Exception], type[lc.ModelError]], ...] = (
    (sdk.NotInStoreError, lc.ModelNotFoundError),
    (sdk.RateLimitedError, lc.ModelRateLimitError),
    (sdk.BackendUnavailableError, lc.ModelConnectionError),
    (sdk.BackendError, lc.ModelAPIError),
    (sdk.CartridgeError, lc.ModelInvalidRequestError),  # config, incompatible cartridge, unsupported model ...
)


@functools.cache
def langchain_class(cls: type[sdk.CartridgeError]) -> type[Exception]:
    """The class raised for SDK errors of class `cls`: LangChain's matching class first, then `cls` itself."""
    base = next(new for old, new in _MAP if issubclass(cls, old))
    return type(f"LangChain{cls.__name__}", (base, cls), {"__module__": __name__})


def as_langchain(error: sdk.CartridgeError) -> Exception:
    """`error` as an instance of `langchain_class(type(error))`, with the same message and attributes."""
    mapped = langchain_class(type(error))
    out = mapped.__new__(mapped, *error.args)  # not __init__: SDK classes may take other arguments
    out.args = error.args
    out.__dict__.update(error.__dict__)
    return out


@contextlib.contextmanager
def langchain_errors() -> Iterator[None]:
    """Raise what the SDK raises inside as the matching LangChain error, chained to the original."""
    try:
        yield
    except sdk.CartridgeError as e:
        if isinstance(e, lc.ModelError):
            raise
        raise as_langchain(e) from e


def invalid_request(message: str) -> Exception:
    """A request the integration itself refuses: LangChain's ModelInvalidRequestError and the SDK's ConfigError."""
    return as_langchain(sdk.ConfigError(message))
