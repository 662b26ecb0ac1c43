"""Who may read which cartridge: API keys kept hashed in a JSON file, each with the cartridges it opens and its own
rate limit (docs/security.md).

The file is re-read whenever it changes, so keys are added, revoked and rotated without restarting the server
(`cartridges keys ...` writes it atomically, under a lock). The server keeps only SHA-256 hashes: a key is a random
256-bit token, so a plain hash cannot be reversed, and a stolen file opens nothing. A file that turns unreadable
while serving is not worked around: every request is refused (503) until it is fixed, so a bad edit can never leave
a revoked key working.

File layout::

    {"format": "cartridges-keys/1",
     "keys": {"dr-ada": {"sha256": "<hex>", "allow": ["patient-0001", "ward3-*"], "rate": "60/minute",
                         "created": "2026-11-26T08:00:00Z"}}}

``allow`` holds cartridge names or shell patterns (``*`` for every cartridge); ``rate`` is a `limits` string such
as ``60/minute`` or ``1000/day``, or null for none.
"""

from __future__ import annotations

import datetime
import fnmatch
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from ..errors import ConfigError
from ..files import atomic_write, folder_lock
from .settings import check_rate

FORMAT = "cartridges-keys/1"
KEY_PREFIX = "ck-"
KEY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
DEFAULT_RATE = "60/minute"


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _check_names(names: Iterable[str]) -> tuple[str, ...]:
    names = tuple(names)
    for name in names:
        if not isinstance(name, str) or not name or any(c.isspace() for c in name) or "/" in name:
            raise ConfigError(f"allow={name!r} must be a cartridge name or a pattern such as 'patient-*' ('*' for "
                              "every cartridge), with no spaces or '/'.")
    return names


@attrs.frozen
class Grant:
    """What one key may do: the cartridges it opens (names or patterns), and its rate limit."""

    key_id: str
    allow: tuple[str, ...] = ()
    rate: str | None = DEFAULT_RATE

    def allows(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.allow)

    def filter(self, names: Iterable[str]) -> list[str]:
        """The `names` this key opens, in their order."""
        return [n for n in names if self.allows(n)]


class KeyFileError(ConfigError):
    """The key file cannot be read as one; the message says where it goes wrong."""


class KeyFile:
    """The keys in `path`, re-read when the file changes (checked at each request: a stat costs microseconds)."""

    def __init__(self, path: str | os.PathLike, *, create: bool = False):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._keys: dict[str, dict[str, Any]] = {}
        self._broken: str | None = None
        if create and not self.path.exists():
            self._edit(lambda keys: None)  # under the lock: two `keys add` on a new file must not lose a key
        if not self.path.is_file():
            raise KeyFileError(f"No key file at {self.path}; make one with `cartridges keys add ID --keys "
                               f"{self.path} --allow NAME`.")
        self._reload()
        if self._broken:
            raise KeyFileError(self._broken)

    # ---- reading

    def _reload(self) -> None:
        """Read the file again if it changed since it was last read; a file that no longer reads breaks every key."""
        try:
            st = self.path.stat()
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError as err:
            self._stamp, self._broken = None, f"The key file {self.path} cannot be read: {err.strerror}."
            return
        if stamp == self._stamp:
            return
        try:
            self._keys, self._broken = _parse(self.path.read_text("utf-8"), self.path), None
        except OSError as err:  # passing (too many open files...): read again at the next request
            self._keys, self._broken, self._stamp = {}, f"The key file {self.path} cannot be read: {err}.", None
            return
        except (UnicodeDecodeError, KeyFileError) as err:
            self._keys, self._broken = {}, str(err)
        self._stamp = stamp

    def keys(self) -> dict[str, Grant]:
        """Every key's grant, by key id."""
        with self._lock:
            self._reload()
            if self._broken:
                raise KeyFileError(self._broken)
            return {key_id: _grant(key_id, entry) for key_id, entry in sorted(self._keys.items())}

    def authenticate(self, token: str) -> Grant | None:
        """The grant of the key `token`, or None. Every stored hash is compared, in constant time, so how long it
        takes says nothing of which key came close. Raises `KeyFileError` while the file does not read."""
        given = _hash(token).encode()
        with self._lock:
            self._reload()
            if self._broken:
                raise KeyFileError(self._broken)
            found = None
            for key_id, entry in self._keys.items():
                if hmac.compare_digest(given, entry["sha256"].encode()):
                    found = _grant(key_id, entry)
            return found

    # ---- writing (the `cartridges keys` commands)

    def _edit(self, change) -> Any:
        """Apply `change` to the current keys under the file's lock, and write them back atomically."""
        with folder_lock(self.path.parent, name=f".{self.path.name}.lock", timeout=10,
                         busy=f"Another process is writing {self.path}; try again."):
            keys = _parse(self.path.read_text("utf-8"), self.path) if self.path.exists() else {}
            out = change(keys)
            self._write(keys)
        with self._lock:
            self._reload()
        return out

    def _write(self, keys: dict[str, dict[str, Any]]) -> None:
        text = json.dumps({"format": FORMAT, "keys": dict(sorted(keys.items()))}, indent=2)
        # hashes only, but nobody else's business: the temporary file is private from its first byte
        atomic_write(self.path, lambda tmp: Path(tmp).write_text(text), mode=0o600)

    def add(self, key_id: str, allow: Iterable[str] = (), rate: str | None = DEFAULT_RATE) -> str:
        """A new key for `key_id`, opening `allow`; returns the key, the one time it is ever shown."""
        if not isinstance(key_id, str) or not KEY_ID.match(key_id):
            raise ConfigError(f"key id {key_id!r} must be 1-64 letters, digits, '.', '_', '@' or '-' (it names the "
                              "key in the audit log; never put the key itself there).")
        allow, rate = _check_names(allow), check_rate(rate)
        key = KEY_PREFIX + secrets.token_urlsafe(32)

        def change(keys):
            if key_id in keys:
                raise ConfigError(f"The key file already has a key {key_id!r}; rotate it (`cartridges keys rotate "
                                  f"{key_id}`) or revoke it first.")
            keys[key_id] = {"sha256": _hash(key), "allow": list(dict.fromkeys(allow)), "rate": rate,
                            "created": _now()}
        self._edit(change)
        return key

    def rotate(self, key_id: str) -> str:
        """A new key for `key_id`, with the same grant; the old key stops working at once."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)

        def change(keys):
            _entry(keys, key_id, self.path).update(sha256=_hash(key), created=_now())
        self._edit(change)
        return key

    def revoke(self, key_id: str) -> None:
        self._edit(lambda keys: (_entry(keys, key_id, self.path), keys.pop(key_id)))

    def allow(self, key_id: str, names: Iterable[str]) -> None:
        """Let `key_id` open `names` (names or patterns) too."""
        names = _check_names(names)

        def change(keys):
            entry = _entry(keys, key_id, self.path)
            entry["allow"] = list(dict.fromkeys([*entry["allow"], *names]))
        self._edit(change)

    def deny(self, key_id: str, names: Iterable[str]) -> None:
        """Take `names` (as written in the allow-list) from `key_id`."""
        names = set(_check_names(names))

        def change(keys):
            entry = _entry(keys, key_id, self.path)
            missing = sorted(names - set(entry["allow"]))
            if missing:
                raise ConfigError(f"Key {key_id!r} does not list {missing}; it lists {entry['allow']}.")
            entry["allow"] = [n for n in entry["allow"] if n not in names]
        self._edit(change)

    def forget(self, name: str) -> list[str]:
        """Take the cartridge `name` out of every allow-list that names it exactly (a deleted patient); returns the
        key ids changed. Patterns are left alone: they name no one."""
        def change(keys):
            changed = [key_id for key_id, entry in sorted(keys.items()) if name in entry["allow"]]
            for key_id in changed:
                keys[key_id]["allow"] = [n for n in keys[key_id]["allow"] if n != name]
            return changed
        return self._edit(change)


class RateLimits:
    """Each key's rate limit, counted in a moving window in this process's memory (the `limits` library)."""

    def __init__(self) -> None:
        self._limiter = _moving_window()

    def wait(self, grant: Grant) -> float | None:
        """None if `grant`'s key may make one more request now (counted), else the seconds until it may."""
        if grant.rate is None:
            return None
        from limits import parse

        item = parse(grant.rate)
        if self._limiter.hit(item, grant.key_id):
            return None
        return max(_window_left(self._limiter, item, grant.key_id), 0.0)


class FailedLogins:
    """Failed authentications by client address, counted in a moving window (the `limits` library): an address past
    `rate` is refused whatever it sends until the window moves on, and its refusals are logged one line a minute
    (`quiet`) instead of a line each, so a flood of wrong keys can neither guess on nor fill the disk."""

    QUIET_SECONDS = 60.0

    def __init__(self, rate: str) -> None:
        from limits import parse

        self._item = parse(rate)
        self._limiter = _moving_window()
        self._quiet: dict[str, tuple[float, int]] = {}  # address -> (when its last line was logged, refusals since)
        self._lock = threading.Lock()

    def wait(self, address: str) -> float | None:
        """None if `address` may try a key now, else the seconds until it may."""
        if self._limiter.test(self._item, address):
            return None
        return max(_window_left(self._limiter, self._item, address), 1.0)

    def failed(self, address: str) -> None:
        self._limiter.hit(self._item, address)

    def quiet(self, address: str) -> int | None:
        """For a refusal of a blocked `address`: None when it is only counted, else the number of its refusals
        counted since its last logged one (this one is to be logged, with that number)."""
        import time

        now = time.monotonic()
        with self._lock:
            since, count = self._quiet.get(address, (-self.QUIET_SECONDS, 0))
            if now - since < self.QUIET_SECONDS:
                self._quiet[address] = (since, count + 1)
                return None
            if len(self._quiet) > 10_000:  # many addresses: forget those whose minute is over (their count was 0
                self._quiet = {a: v for a, v in self._quiet.items() if now - v[0] < self.QUIET_SECONDS or v[1]}
            self._quiet[address] = (now, 0)
            return count

    def counted(self) -> dict[str, int]:
        """The refusals counted and not yet logged, by address (logged when the server stops)."""
        with self._lock:
            return {address: count for address, (_, count) in self._quiet.items() if count}


def _moving_window() -> Any:
    """A moving-window limiter counting in this process's memory (the `limits` library)."""
    from limits.storage import MemoryStorage
    from limits.strategies import MovingWindowRateLimiter

    return MovingWindowRateLimiter(MemoryStorage())


def _window_left(limiter: Any, item: Any, key: str) -> float:
    """Seconds until `key`'s window for `item` lets one more through."""
    import time

    return limiter.get_window_stats(item, key).reset_time - time.time()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _grant(key_id: str, entry: dict[str, Any]) -> Grant:
    return Grant(key_id, tuple(entry["allow"]), check_rate(entry.get("rate")))  # "none" (hand-written) is None


def _entry(keys: dict[str, dict[str, Any]], key_id: str, path: Path) -> dict[str, Any]:
    if key_id not in keys:
        raise ConfigError(f"The key file {path} has no key {key_id!r}; it has: {', '.join(sorted(keys)) or 'none'}.")
    return keys[key_id]


def _parse(text: str, path: Path) -> dict[str, dict[str, Any]]:
    """The keys in a key file's text, every field checked (a hand edit gone wrong is named, not half read)."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise KeyFileError(f"The key file {path} is nested too deeply to be a key file; restore it.") from None
    except ValueError as err:
        raise KeyFileError(f"The key file {path} is not valid JSON ({err}); fix it, or restore it.") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("keys"), dict):
        raise KeyFileError(f"The key file {path} is not a {FORMAT} file ({{\"format\": \"{FORMAT}\", \"keys\": "
                           "{...}}); make it with `cartridges keys add`.")
    for key_id, entry in data["keys"].items():
        where = f"The key file {path}, key {key_id!r}:"
        if not KEY_ID.match(key_id) or not isinstance(entry, dict):
            raise KeyFileError(f"{where} a key is an id (letters, digits, '.', '_', '@', '-') and an object.")
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise KeyFileError(f"{where} 'sha256' must be the 64-hex-digit SHA-256 of the key.")
        allow = entry.get("allow")
        if not isinstance(allow, list):
            raise KeyFileError(f"{where} 'allow' must be a list of cartridge names or patterns.")
        try:
            _check_names(allow)
            check_rate(entry.get("rate"))
        except ConfigError as err:
            raise KeyFileError(f"{where} {err}") from None
    return data["keys"]
