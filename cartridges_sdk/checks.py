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


def _above(attribute, value, low: float, *, integer: bool, strict: bool = False) -> None:
    """A number of the right kind that is >= `low` (> `low` when `strict`)."""
    _number(attribute, value, integer=integer)
    if value < low or (strict and value == low):
        raise ConfigError(f"{attribute.name}={value!r} must be {'>' if strict else '>='} {low}.")


def at_least_one(_inst, attribute, value) -> None:
    """An integer >= 1 (a count of things that must happen at least once)."""
    _above(attribute, value, 1, integer=True)


def count(_inst, attribute, value) -> None:
    """An integer >= 0."""
    _above(attribute, value, 0, integer=True)


def optional_int(_inst, attribute, value) -> None:
    if value is not None:
        _number(attribute, value, integer=True)


def non_negative(_inst, attribute, value) -> None:
    """A finite number >= 0, or None."""
    if value is not None:
        _above(attribute, value, 0, integer=False)


def positive(_inst, attribute, value) -> None:
    """A finite number > 0, or None."""
    if value is not None:
        _above(attribute, value, 0, integer=False, strict=True)


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
