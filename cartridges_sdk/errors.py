"""One exception tree, so callers can catch everything the SDK raises with ``except CartridgeError``.

Every message names the bad value and says how to fix it. One class per kind of failure::

    CartridgeError                      everything the SDK raises on purpose
    ├── ConfigError (ValueError)        a setting, argument or request the SDK cannot use
    │   ├── StoreBusyError              another sync holds the store's lock (try again later)
    │   └── KeyFileError                a server's key file that cannot be read as one (serve/access.py)
    ├── ModelNotAvailableError          weights or tokenizer files not found offline
    ├── IncompatibleCartridgeError      a cartridge (or a teacher) for another model than the one it meets
    ├── CartridgeFormatError            a file that is corrupt, truncated, or not a cartridge
    ├── NotInStoreError (KeyError)      a name the store does not hold
    ├── UnsupportedModelError           the model lacks what an operation needs
    ├── BadRequest                      a request the server refuses, with its HTTP status (serve/guard.py)
    ├── BridgeError                     a question the MCP bridge could not get answered (serve/mcp_tool.py)
    ├── PluginError                     a backend unknown, broken, or not keeping its interface
    │   └── BackendUnavailableError     (also a BackendError) it cannot run here
    └── BackendError                    an engine failed; raised at the adapter boundary
        ├── BackendUnavailableError
        └── TransientBackendError       may pass if the call is made again (retry_after, when known)
            └── RateLimitedError        refused for now by load or quota (HTTP 429)

    ContractViolation (AssertionError)  a backend broke the contract `cartridges_sdk.testing` checks

Backends subclass these for their own cases (the llama.cpp state format, an OpenAI-compatible server that went
down), so the tree above is all a caller needs to catch.
"""

from __future__ import annotations


class CartridgeError(Exception):
    """Root of every error raised on purpose by cartridges-sdk."""


class ConfigError(CartridgeError, ValueError):
    """A setting or argument has a value the SDK cannot use."""


class StoreBusyError(ConfigError):
    """Another sync holds the store's lock: a watcher leaves the work to it, a caller may try again later."""


class ModelNotAvailableError(CartridgeError):
    """Model weights or tokenizer files cannot be found offline."""


class IncompatibleCartridgeError(CartridgeError):
    """A cartridge was made for a different model (architecture or tokenizer) than the one it meets."""


class CartridgeFormatError(CartridgeError):
    """A cartridge file is corrupt, truncated, or not a cartridge at all."""


class NotInStoreError(CartridgeError, KeyError):
    """A name the store does not hold (the message lists the ones it does)."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


class PluginError(CartridgeError):
    """A backend plugin is unknown, failed to import, or does not implement its interface."""


class UnsupportedModelError(CartridgeError):
    """The model lacks something an operation needs (for example a position-additive RoPE for repositioning)."""


class BackendError(CartridgeError):
    """An engine behind a backend failed; raised at the adapter boundary so callers never see engine internals."""


class BackendUnavailableError(BackendError, PluginError):
    """A backend cannot run here: its package fails to import, its engine cannot start, or its server is unreachable."""


class TransientBackendError(BackendError):
    """A failure that may pass if the same call is made again (a timeout, a dropped connection, a 5xx answer).

    `retry_after` is the delay the engine asked for, in seconds, when it said one.
    """

    def __init__(self, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class RateLimitedError(TransientBackendError):
    """The engine refused the call for now because of load or quota (HTTP 429); wait `retry_after` and retry."""


class ContractViolation(AssertionError):
    """A backend broke the contract; the message names the check and what differed (raised by `testing`'s checks,
    as an AssertionError so pytest reports it as a failed test)."""
