"""The serving stage's settings in one place: how a server answers (`ServeConfig`), how sync turns documents into
cartridges (`SyncConfig`), and where the MCP bridge sends questions (`BridgeConfig`).

They sit below every module that reads them (the request parser, the server, sync, the store, the bridge), so none
of those needs another to learn a limit; and this module imports no web framework, so the public `SyncConfig`
costs no FastAPI. Each validator's message names the bad value and the fix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs

from ..checks import at_least_one, one_of, positive
from ..errors import ConfigError
from ..making.settings import CompactionConfig, ReportConfig, is_reader
from .documents import MAX_BYTES, UNITS

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

BRIDGE_DESCRIPTION = ("Ask a question about the codebase. It is answered by a language model reading the cartridges "
                      "(one per source file) that the question is routed to; the answer names those files and their "
                      "versions. Ask about one thing at a time, naming the function, class or module when you know it.")


# ---- the server


def host_name(host: str) -> str:
    """The name in a Host header, without its port: ``[::1]:8000`` -> ``::1``, ``Example.com:80`` -> ``example.com``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


# a Host header as RFC 9110 allows it: a name or an IPv4 address, or an IPv6 address in brackets; then an optional
# port. Nothing else: no userinfo ("127.0.0.1:80@evil.example"), nothing after the brackets ("[::1]evil.example")
_HOST = re.compile(r"(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._-]+))(?::[0-9]{1,5})?")
# an Origin header: a scheme, "://", and a Host as above; no path, no userinfo
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(?P<host>[^/?#@\s]+)")


def strict_host(host: str) -> str | None:
    """The name in a Host header (lower case, no port or brackets), or None when the header is not exactly a host
    and an optional port."""
    found = _HOST.fullmatch(host.strip().lower())
    return None if found is None else found["v6"] or found["name"]


def origin_host(origin: str) -> str | None:
    """The host name of an Origin header (``http://[::1]:8000`` -> ``::1``), or None when it is not exactly
    ``scheme://host[:port]`` (``null``, a userinfo part, a path)."""
    found = _ORIGIN.fullmatch(origin.strip().lower())
    return None if found is None else strict_host(found["host"])


def host_names(value: Any) -> Any:
    """Host names as a Host header gives them (lower case, no port or brackets); anything else is left for the
    validator to refuse."""
    if value is None or isinstance(value, str) or not isinstance(value, (list, tuple, set)):
        return value
    return tuple(host_name(h) if isinstance(h, str) else h for h in value)


def check_host_names(_inst, _attr, value: Any) -> None:
    if value is not None and (not isinstance(value, tuple) or not all(isinstance(h, str) and h for h in value)):
        raise ConfigError(f"allowed_hosts={value!r:.80} must be a list of host names or addresses, or None for any.")


def _check_key(_inst, _attr, value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value or not value.isascii()
                              or not value.isprintable() or " " in value):
        raise ConfigError("The API key must be a non-empty string of printable ASCII characters with no spaces (HTTP "
                          "headers carry ASCII only, so another key could never be sent as typed).")


def check_rate(rate: str | None) -> str | None:
    """`rate` if `limits` reads it (``60/minute``, ``5/second``, ``1000/day``), or None for no limit."""
    if rate is None or (isinstance(rate, str) and rate.lower() == "none"):
        return None
    if not isinstance(rate, str):
        raise ConfigError(f"rate={rate!r} must be a string such as '60/minute', or 'none'.")
    from limits import parse

    try:
        if "," in rate or ";" in rate:  # `limits` would read one and drop the rest
            raise ValueError(rate)
        parse(rate)
    except ValueError:
        raise ConfigError(f"rate={rate!r} is not a rate; write it as COUNT/PERIOD, e.g. '60/minute', '5/second', "
                          "'1000/day', or 'none'.") from None
    return rate


def _check_rate(_inst, attribute, value: Any) -> None:
    if check_rate(value) is None:
        raise ConfigError(f"{attribute.name}={value!r} must be a rate such as '10/minute': failed authentications "
                          "are always limited.")


@attrs.frozen
class ServeConfig:
    """How `cartridges serve` answers: who may ask, how many requests wait and run together, how long answers run."""

    # a bearer token clients must send (compared in constant time); None: no authentication (bind to 127.0.0.1 then)
    api_key: str | None = attrs.field(default=None, repr=False, validator=_check_key)
    # the names a request's Host header may carry (any port): a loopback-only server answers only requests addressed
    # to it, so a web page that rebinds its own name to 127.0.0.1 (DNS rebinding) gets 403; None: any Host
    allowed_hosts: tuple[str, ...] | None = attrs.field(default=LOOPBACK_HOSTS, converter=host_names,
                                                        validator=check_host_names)
    # requests waiting for the engine; more are answered 429 with retry-after
    max_queue: int = attrs.field(default=256, validator=at_least_one)
    # requests answered together in one batch
    max_batch: int = attrs.field(default=16, validator=at_least_one)
    # largest request body, in bytes
    max_body_bytes: int = attrs.field(default=1_000_000, validator=at_least_one)
    # largest max_tokens a request may ask for
    max_new_tokens: int = attrs.field(default=2048, validator=at_least_one)
    # tokens an answer gets when a request does not say
    default_max_tokens: int = attrs.field(default=256, validator=at_least_one)
    # a key file (`cartridges keys`): per-key allow-lists and rate limits, re-read when it changes; not with api_key
    keys_file: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    # an append-only JSON-lines log of every request (who, which cartridges, status)
    audit_log: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    # write each request's last user turn into the audit log too (off: it may hold what the log must not)
    audit_questions: bool = False
    # failed authentications one client address may make (a `limits` rate): past it, the address is answered 429
    # whatever it sends, and its further refusals are counted in one audit line a minute instead of a line each
    auth_failures: str = attrs.field(default="10/minute", validator=_check_rate)

    def __attrs_post_init__(self) -> None:
        if self.api_key is not None and self.keys_file is not None:
            raise ConfigError("api_key (one key for everything) and keys_file (a key per user) exclude each other; "
                              "give one. Add the shared key to the file with `cartridges keys add ID --allow '*'`.")
        if self.audit_questions and self.audit_log is None:
            raise ConfigError("audit_questions writes questions into the audit log; give audit_log too.")


# ---- sync


def _patterns(_: object, __: object, patterns: tuple) -> None:
    for p in patterns:
        if not isinstance(p, str) or not p.strip():
            raise ConfigError(f"include holds {p!r}; each pattern is a non-empty glob such as '*.py' or 'src/*'.")


@attrs.frozen
class SyncConfig:
    """How each document becomes a cartridge. Changing `tokens` rebuilds every document at the next sync; changing
    `compaction` rebuilds the compacted ones (a self-studied cartridge keeps its training)."""

    # cartridge tokens per document; a document no longer than this is kept whole (its exact KV, no compaction);
    # None follows the model (`for_model`)
    tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(at_least_one))
    unit: str = attrs.field(default="file", validator=one_of(*UNITS))  # per file, or per entry at the folder's top
    max_bytes: int = attrs.field(default=MAX_BYTES, validator=at_least_one)  # larger files are skipped
    compaction: CompactionConfig = attrs.field(factory=CompactionConfig,
                                               validator=attrs.validators.instance_of(CompactionConfig))
    # glob patterns (fnmatch, '*' crosses folders) of the relative paths that are documents, e.g. ("*.py",);
    # empty: every file. A document that stops matching is deleted from the store like one removed.
    include: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_patterns)
    # each compacted or self-studied cartridge is checked against its document (docs/quality-report.md) and the
    # report kept in its record: True, a ReportConfig, or False to skip it (a document kept whole needs none)
    report: bool | ReportConfig = attrs.field(default=True, validator=attrs.validators.instance_of((bool, ReportConfig)))

    def for_model(self, lm: Any) -> SyncConfig:
        """These settings with `tokens` filled in when left at None: `READER_TOKENS` for a reader (`is_reader`), whose
        answers share a budget with passages (`passages.fills`), else `PLAIN_TOKENS`."""
        if self.tokens is not None:
            return self
        return attrs.evolve(self, tokens=READER_TOKENS if is_reader(lm) else PLAIN_TOKENS)


# cartridge tokens per document that sync makes by default. A reader's cartridge is small and its answers fill the
# rest of a budget with passages read apart: on the dev split (0.5B, 256-token budget, docs/vs-rag.md) a 64-token
# cartridge with 192 tokens of passages closed 1.025 of QuALITY's gap and 0.612 of QASPER's, where a 256-token
# cartridge alone closed 0.847 and 0.600 and the better RAG 0.951 and 0.482 (100-word passages; with the 50-word
# ones of today, 1.048 and 0.624 against RAG's 0.953 and 0.568). Other models keep a cartridge alone: the split was
# not measured on them.
READER_TOKENS = 64
PLAIN_TOKENS = 256


# ---- the MCP bridge


def _url(_: object, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise ConfigError(f"{attribute.name}={value!r} is not an http(s) URL; give the server's API base, e.g. "
                          "http://127.0.0.1:8000/v1 for `cartridges serve --port 8000`.")


def _tool_name(_: object, attribute: attrs.Attribute, value: str) -> None:
    if not (isinstance(value, str) and value.isidentifier()):
        raise ConfigError(f"{attribute.name}={value!r} is not a tool name; use letters, digits and '_', e.g. "
                          "ask_codebase.")


@attrs.frozen
class BridgeConfig:
    """Where the bridge sends questions and how its tool presents itself to the MCP client."""

    base_url: str = attrs.field(default="http://127.0.0.1:8000/v1", validator=_url)
    api_key: str | None = None  # the server's --api-key, sent as a bearer token
    tool: str = attrs.field(default="ask_codebase", validator=_tool_name)
    description: str = BRIDGE_DESCRIPTION  # what the client's model reads to decide when to call the tool
    k: int = attrs.field(default=1, validator=at_least_one)  # cartridges routed to per question
    max_tokens: int = attrs.field(default=384, validator=at_least_one)
    timeout: float = attrs.field(default=600.0, validator=positive)  # seconds: a CPU answer takes tens
