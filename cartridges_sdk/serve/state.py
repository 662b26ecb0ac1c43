"""What one server's routes and checks share (`ServerState`), and the scope keys a request carries from the guard
to the endpoints and back to the audit log."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import attrs

from ..lm import LM
from .access import FailedLogins, Grant, KeyFile, RateLimits
from .audit import AuditLog
from .engine import Engine
from .replies import scrubber
from .settings import ServeConfig
from .store import CartridgeStore

GRANT = "cartridges.grant"  # the scope key of the request's grant (a key file's entry), set by the guard
TOKEN = "cartridges.token"  # the scope key of the request's bearer key: a running answer checks it is still good
JOB = "cartridges.job"  # the scope key of the request's engine job, stopped when the response ends however it ends
LOGGED = "cartridges.logged"  # the scope key saying the request's line is in the audit log
AUDIT = "cartridges.audit"  # the scope key of the request's audit record, filled in as the request is read


@attrs.define(eq=False)
class ServerState:
    """What one app's routes share: the store and the settings, the key file and its rate limits, the audit log, the
    message scrubber, and the engine (from the app's start to its end)."""

    store: CartridgeStore
    config: ServeConfig = attrs.field(factory=ServeConfig)
    keys: KeyFile | None = None
    limits: RateLimits | None = None
    audit: AuditLog | None = None
    scrub: Callable[[str], str] = str
    engine: Engine | None = None
    # failed authentications by client address (a key file or api_key)
    logins: FailedLogins = attrs.field(default=attrs.Factory(lambda self: FailedLogins(self.config.auth_failures),
                                                             takes_self=True))
    refreshed: float = 0.0  # when the store's folder was last re-read (time.monotonic)
    ids: Iterator[int] = attrs.field(factory=itertools.count)
    # each audit line's request id: this server's start (hex seconds) and a count, so two runs' lines never clash
    requests: Iterator[str] = attrs.field(factory=lambda: (f"{int(time.time()):x}-{n}" for n in itertools.count()))

    @classmethod
    def open(cls, store: CartridgeStore, config: ServeConfig) -> ServerState:
        """The state `config` asks for: its key file read (a bad file stops the start), its audit log opened."""
        keys = KeyFile(config.keys_file) if config.keys_file is not None else None
        audit = AuditLog(config.audit_log, questions=config.audit_questions) if config.audit_log is not None else None
        return cls(store, config, keys, RateLimits() if keys is not None else None, audit, scrubber(store.root))

    @property
    def lm(self) -> LM:
        return self.store.model

    def refresh(self, force: bool = False) -> None:
        if force or time.monotonic() - self.refreshed > 1.0:  # a folder re-read at most once a second
            self.store.refresh(quick=True)  # new and renamed-over files at once; rewritten in place within seconds
            self.refreshed = time.monotonic()

    def visible(self, grant: Grant | None) -> list[str]:
        """The cartridges a request may see: all of them, or those its key opens."""
        return self.store.names() if grant is None else grant.filter(self.store.names())
