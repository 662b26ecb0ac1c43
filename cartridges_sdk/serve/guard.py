"""Who may ask the server anything: the Host and Origin checks (DNS rebinding, other sites' web pages) and the API
key, in one plain ASGI middleware (`Guard`) in front of every path but ``/health`` (docs/security.md)."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from typing import Any

from starlette.datastructures import Headers

from ..checks import is_loopback
from ..errors import CartridgeError
from .settings import LOOPBACK_HOSTS, host_name, origin_host, strict_host


class BadRequest(CartridgeError):
    """A request the server refuses: its HTTP status, and a message naming the field and the fix. Not a
    `ConfigError`: the server's handlers turn those (the runtime's refusals) into a 400 of their own."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


class Unlogged(Exception):
    """Raised into the app when its response cannot be logged: the response is dropped before its first byte."""


class Guard:
    """A plain ASGI middleware that answers a request `check` refuses, and passes the rest through untouched
    (Starlette's BaseHTTPMiddleware would hide a client's disconnect from the endpoint, so a dropped request
    would decode on). Each request carries a record (``scope["cartridges.audit"]``) that the endpoints fill in.

    `opened` gets the record with the response's status before the response's first byte is sent, and says whether
    it was logged: a response that was not is replaced by a 503 (`unlogged`), so nothing is answered unlogged.
    `done` gets it once the response (a whole stream too) is over, to log how a stream ended or a crash."""

    def __init__(self, app: Any, check, opened=None, done=None, unlogged=None) -> None:
        self.app, self.check, self.opened, self.done, self.unlogged = app, check, opened, done, unlogged

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # the path as sent, cut short: a refused request must not write kilobytes into the log
        scope["cartridges.audit"] = {"key": None, "method": scope["method"][:16], "path": scope["path"][:200]}
        status: int | None = None

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                if self.opened is not None and not self.opened(scope, message["status"]):
                    raise Unlogged
                status = message["status"]
            await send(message)

        try:
            refused = self.check(scope)
            await (refused or self.app)(scope, receive, sending)
        except Unlogged:
            if status is None and self.unlogged is not None:
                status = 503
                await self.unlogged()(scope, receive, send)
        finally:
            if self.done is not None:
                self.done(scope, status)


def allowed_hosts(bind: str, named: Sequence[str] | None) -> tuple[str, ...] | None:
    """The Host names a server bound to `bind` answers: the `named` ones ('*' for any) and, on a loopback address,
    the loopback names. A server bound elsewhere is reachable by whatever names the network gives it, so it checks
    only when names are given (as Jupyter does)."""
    named = [host_name(n) for n in named or ()]
    if "*" in named:
        return None
    if is_loopback(bind):
        return tuple(dict.fromkeys([*LOOPBACK_HOSTS, host_name(bind), *named]))
    return tuple(dict.fromkeys(named)) or None


def check_host(allowed: tuple[str, ...] | None, host: str | None, origin: str | None) -> None:
    """Refuse (403) a request addressed to a name the server does not answer (DNS rebinding) or sent by a web page
    from another site; `allowed` None: any."""
    if allowed is None:
        return
    if host is not None:  # no Host header: not a browser, not a rebinding
        name = strict_host(host)
        if name is None:  # a userinfo part, something after a bracketed address: read by some as another name
            raise BadRequest(400, f"The Host header {host[:100]!r} is not a host name or address with an optional "
                             "port.", "host")
        if name not in allowed:
            raise BadRequest(403, f"This server does not answer requests addressed to {name[:100]!r} (Host "
                             f"header); it answers {', '.join(allowed)}. If clients reach it by that name, start "
                             "it with --allowed-host NAME.", "host")
    # a web page's request carries its Origin: one from a page not served under an allowed name is another
    # site's, which may not make this server work (it could not read the answer, but it would spend the engine)
    if origin is not None and origin_host(origin) not in allowed:
        raise BadRequest(403, f"Requests from web pages at {origin[:100]!r} (Origin header) are refused; start the "
                         "server with --allowed-host NAME for pages served under NAME.", "origin")


def authorize(api_key: str | None, headers: Headers) -> None:
    """Refuse (401) a request without the bearer `api_key` (compared in constant time); None: no key needed."""
    if api_key is None:
        return
    if not hmac.compare_digest(bearer(headers).encode(), api_key.encode()):
        raise BadRequest(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.")


def bearer(headers: Headers) -> str:
    """The token of an ``Authorization: Bearer <token>`` header, or "" without one."""
    given = headers.get("authorization", "")
    return given[7:] if given.lower().startswith("bearer ") else ""
