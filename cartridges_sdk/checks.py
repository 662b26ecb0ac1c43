"""attrs validators shared by the settings classes; each error names the field and the bad value."""

from __future__ import annotations

from .errors import ConfigError


def at_least_one(_inst, attribute, value) -> None:
    if value < 1:
        raise ConfigError(f"{attribute.name}={value!r} must be >= 1.")


def non_negative(_inst, attribute, value) -> None:
    if value is not None and value < 0:
        raise ConfigError(f"{attribute.name}={value!r} must be >= 0.")


def positive(_inst, attribute, value) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{attribute.name}={value!r} must be > 0.")


def unit_interval(_inst, attribute, value) -> None:
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{attribute.name}={value!r} must be in (0, 1].")


def fraction(_inst, attribute, value) -> None:
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{attribute.name}={value!r} must be in [0, 1).")


def one_of(*options):
    def check(_inst, attribute, value) -> None:
        if value not in options:
            raise ConfigError(f"{attribute.name}={value!r} must be one of {options}.")

    return check
