"""attrs validators shared by the settings classes; each error names the field and the bad value.

Types are checked first, so ``"5"``, ``True`` or ``nan`` get the same one-line error as a value out of range,
never a `TypeError` from a comparison deep inside.
"""

from __future__ import annotations

import ipaddress
import math
import numbers
import os

from .errors import ConfigError


def _number(attribute, value, *, integer: bool) -> None:
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or (not integer and not math.isfinite(value)):
        raise ConfigError(f"{attribute.name}={value!r} must be {'an integer' if integer else 'a finite number'}.")


def at_least_one(_inst, attribute, value) -> None:
    """An integer >= 1 (a count of things that must happen at least once)."""
    _number(attribute, value, integer=True)
    if value < 1:
        raise ConfigError(f"{attribute.name}={value!r} must be >= 1.")


def count(_inst, attribute, value) -> None:
    """An integer >= 0."""
    _number(attribute, value, integer=True)
    if value < 0:
        raise ConfigError(f"{attribute.name}={value!r} must be >= 0.")


def optional_int(_inst, attribute, value) -> None:
    if value is not None:
        _number(attribute, value, integer=True)


def non_negative(_inst, attribute, value) -> None:
    if value is not None:
        _number(attribute, value, integer=False)
        if value < 0:
            raise ConfigError(f"{attribute.name}={value!r} must be >= 0.")


def positive(_inst, attribute, value) -> None:
    if value is not None:
        _number(attribute, value, integer=False)
        if value <= 0:
            raise ConfigError(f"{attribute.name}={value!r} must be > 0.")


def unit_interval(_inst, attribute, value) -> None:
    _number(attribute, value, integer=False)
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{attribute.name}={value!r} must be in (0, 1].")


def fraction(_inst, attribute, value) -> None:
    _number(attribute, value, integer=False)
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{attribute.name}={value!r} must be in [0, 1).")


def boolean(_inst, attribute, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name}={value!r} must be true or false.")


def one_of(*options):
    def check(_inst, attribute, value) -> None:
        if value not in options:
            raise ConfigError(f"{attribute.name}={value!r} must be one of {options}.")

    return check


def require(name: str, value, kind: type | tuple[type, ...], what: str) -> None:
    """Refuse an argument of the wrong type with an error that names it, before it fails deep inside."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):  # True is an int to Python
        raise ConfigError(f"{name}={value!r:.80} must be {what}.")


PATH = (str, os.PathLike)  # what `require` accepts as a file or folder path


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine only: what may go unauthenticated or unencrypted."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
