"""Who may ask, and what the audit log holds: the Host, key and rate checks every request passes first (`admit`),
the check a running answer repeats (`withdrawn`), and the audit lines written before a response's first byte
(`opened`) and after its end (`ended`); docs/security.md."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse  # imported only to serve; the core never imports it
from starlette.datastructures import Headers

from .access import Grant, KeyFile, KeyFileError
from .guard import BadRequest, authorize, bearer, check_host
from .replies import error_response
from .state import AUDIT, GRANT, JOB, LOGGED, TOKEN, ServerState


def refusal(state: ServerState, scope: dict[str, Any]) -> JSONResponse | None:
    """The refusal `admit` gives a request, as a response; or None to let it through."""
    try:
        admit(state, scope)
    except BadRequest as refused:
        return error_response(refused, state.scrub)
    return None


def admit(state: ServerState, scope: dict[str, Any]) -> None:
    """Every path: the Host and Origin checks first (DNS rebinding, web pages), then the key and its rate limit
    (all but /health); raises BadRequest. The key's grant goes into the scope, for the endpoints."""
    headers = Headers(scope=scope)
    guarded = (state.keys is not None or state.config.api_key is not None) and scope["path"] != "/health"
    address = (scope.get("client") or ("unknown",))[0]
    if guarded:
        scope[AUDIT]["client"] = address
        wait = state.logins.wait(address)
        if wait is not None:  # too many failures from there: whatever it sends now is refused, and counted quietly
            scope[AUDIT]["quiet"] = True
            raise BadRequest(429, f"Too many failed authentications from this address ({state.config.auth_failures})"
                             f"; retry in {wait:.0f} s.", headers={"retry-after": str(max(1, round(wait)))})
    try:
        check_host(state.config.allowed_hosts, headers.get("host"), headers.get("origin"))
    except BadRequest:
        if guarded:  # a refused Host or Origin is a failed authentication too: it costs an audit line all the same
            state.logins.failed(address)
        raise
    if scope["path"] == "/health":
        return
    if state.audit is not None and state.audit.broken:
        raise audit_broken()
    if not guarded:
        return
    try:
        if state.keys is None:
            authorize(state.config.api_key, headers)
            return
        token = bearer(headers)
        grant = scope[GRANT] = key_grant(state.keys, token)
    except BadRequest as refused:
        if refused.status == 401:
            state.logins.failed(address)
        raise
    scope[TOKEN] = token
    scope[AUDIT]["key"] = grant.key_id
    wait = state.limits.wait(grant)
    if wait is not None:
        raise BadRequest(429, f"This key's rate limit ({grant.rate}) is used up; retry in {wait:.0f} s.",
                         headers={"retry-after": str(max(1, round(wait)))})


def key_grant(keys: KeyFile, token: str) -> Grant:
    """The grant of the bearer key `token`: 401 when the file does not hold it; 503 while the file is unreadable,
    for every request, one without a key too (none is let through on a file that may have revoked its key)."""
    try:
        grant = keys.authenticate(token)  # an empty token too: the file is read, and a broken one answers 503
    except KeyFileError as err:
        logging.getLogger("cartridges_sdk.serve").error("Refusing every request: %s", err)
        raise BadRequest(503, "The server's key file cannot be read; its operator must fix it (the server's log "
                         "says how).") from None
    if grant is None or not token:
        raise BadRequest(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.")
    return grant


def withdrawn(state: ServerState, scope: dict[str, Any], names: list[str]) -> tuple[str, BadRequest] | None:
    """Why a running answer's key may no longer read it (revoked, rotated, its grant narrowed, its file broken), as
    the audit log's word and the refusal to send; None while it may."""
    if state.keys is None:
        return None
    try:
        grant = state.keys.authenticate(scope.get(TOKEN, ""))
    except KeyFileError:
        return "key-file-broken", BadRequest(503, "The server's key file cannot be read; the answer was stopped.")
    if grant is None:
        return "key-revoked", BadRequest(401, "This key was revoked or rotated; the answer was stopped.")
    if not all(grant.allows(n) for n in names):
        return "grant-withdrawn", BadRequest(403, "This key no longer opens the cartridges answering; the answer "
                                             "was stopped.")
    return None


def grant_of(state: ServerState, scope: dict[str, Any]) -> Grant | None:
    """The request's grant; with a key file, a request the guard let through without one is refused rather than
    shown every cartridge (a route added later, a path the guard reads differently)."""
    grant = scope.get(GRANT)
    if state.keys is not None and grant is None:
        raise BadRequest(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.")
    return grant


def opened(state: ServerState, scope: dict[str, Any], status: int) -> bool:
    """Log the request before its response's first byte; False when the line could not be written (the response is
    then replaced by a 503: nothing is answered unlogged). A blocked address's refusals are counted, a line a minute."""
    if state.audit is None or scope["path"] == "/health":
        return True
    record = scope[AUDIT]
    if record.pop("quiet", False):
        counted = state.logins.quiet(record["client"])
        if counted is None:
            return True
        record["refusals_not_logged"] = counted
    record.setdefault("request", next(state.requests))
    state.audit.write({**record, "status": status})
    scope[LOGGED] = state.audit.broken is None
    return scope[LOGGED] or status == 503


def ended(state: ServerState, scope: dict[str, Any], status: int | None) -> None:
    """Once the response is over: its job stopped, and a second line for a stream that ended in an error (it began
    with 200) or a request that crashed before its response began."""
    job = scope.get(JOB)
    if job is not None:
        job.cancelled.set()
    if state.audit is None or scope["path"] == "/health":
        return
    record = scope[AUDIT]
    if status is None:
        record.setdefault("request", next(state.requests))
        state.audit.write({**record, "status": 500})
    elif scope.get(LOGGED) and status == 200 and "error" in record:
        state.audit.write({**record, "status": status, "ended": record["error"]})


def audit_broken() -> BadRequest:
    """The 503 of a request that cannot be logged (the audit log cannot be written: a full disk)."""
    return BadRequest(503, "The server cannot write its audit log; its operator must fix that (the server's log "
                      "says why).", headers={"retry-after": "10"})


def unlogged() -> Any:
    """`audit_broken` as the response that replaces one whose line could not be written."""
    return error_response(audit_broken(), str)
