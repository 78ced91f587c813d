"""Byte sizes as operators write them ("8GiB", "512MiB", 1073741824)."""

from __future__ import annotations

import re

from kvcr.domain.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_MAX_DIGITS = 30
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_byte_size(value: int | str, *, name: str = "size") -> int:
    """Return ``value`` in bytes; ``name`` is the setting named in the error message."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected bytes as an int or a string like '8GiB', got a bool")
    if isinstance(value, int):
        if value.bit_length() > 100:
            # Not its digits: str() refuses integers of over 4300 digits.
            raise ConfigError(f"{name}: an integer of {value.bit_length()} bits is far too large")
        if value < 0:
            raise ConfigError(f"{name}: must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected an int or a string like '8GiB', got {type(value).__name__}")
    match = _SIZE.match(value)
    if match is None:
        raise ConfigError(f"{name}: cannot read {value!r} as a byte size (try '8GiB' or '512MiB')")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(f"{name}: unknown unit {unit!r} in {value!r}")
    if len(number) > _MAX_DIGITS:
        raise ConfigError(f"{name}: {value[:24]!r}... is far too large")
    whole, _, fraction = number.partition(".")
    # Exact integer arithmetic: floats lose bytes, and overflow on absurd inputs.
    scaled = int(whole + fraction) * factor
    divisor = 10 ** len(fraction)
    if scaled % divisor:
        raise ConfigError(f"{name}: {value!r} is not a whole number of bytes")
    result: int = scaled // divisor
    return result


def format_byte_size(nbytes: int) -> str:
    """Render bytes with a binary unit, for logs and tables."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"
