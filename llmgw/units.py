"""Durations and sizes as operators write them: ``500ms``, ``2m``, ``1h30m``; ``16MiB``, ``1GB``.

A duration is a number of seconds or a string of number+unit parts (units
``ms``, ``s``, ``m``, ``h``) and becomes float seconds. A size is an integer
number of bytes or a string with a unit: ``B``, decimal ``KB MB GB TB``
(powers of 1000), binary ``KiB MiB GiB TiB`` (powers of 1024, also written
``Ki Mi Gi Ti``); units are case-insensitive. Both reject negative values.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

_NUMBER = r"\d+(?:\.\d+)?"
_DURATION_PART = re.compile(rf"\s*({_NUMBER})\s*(ms|s|m|h)", re.IGNORECASE)
_DURATION_SECONDS = {"ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60), "h": Decimal(3600)}
_DURATION_HELP = "expected a duration: seconds as a number, or a string like '500ms', '5s', '2m', '1h30m'"

_SIZE = re.compile(rf"\s*({_NUMBER})\s*([a-z]*)\s*", re.IGNORECASE)
_SIZE_FACTORS = {"": 1, "b": 1}
for _power, _prefix in enumerate("kmgt", start=1):
    _SIZE_FACTORS[f"{_prefix}b"] = 1000**_power
    _SIZE_FACTORS[f"{_prefix}ib"] = _SIZE_FACTORS[f"{_prefix}i"] = 1024**_power
_SIZE_HELP = "expected a size: bytes as an integer, or a string like '64KiB', '16MiB', '1GB'"


def parse_duration(value: object) -> float:
    """Seconds from a number or a duration string; ``ValueError`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(_DURATION_HELP)
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError("a duration must be a finite number")
        if value < 0:
            raise ValueError("a duration must not be negative")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(_DURATION_HELP)
    text = value.strip()
    if re.fullmatch(_NUMBER, text):
        return float(text)
    total, position = Decimal(0), 0
    while position < len(text):
        part = _DURATION_PART.match(text, position)
        if not part:
            raise ValueError(_DURATION_HELP)
        total += Decimal(part.group(1)) * _DURATION_SECONDS[part.group(2).lower()]
        position = part.end()
    if position == 0:
        raise ValueError(_DURATION_HELP)
    return float(total)


def parse_size(value: object) -> int:
    """Bytes from an integer or a size string; ``ValueError`` otherwise."""
    if isinstance(value, bool) or isinstance(value, float):
        raise ValueError(_SIZE_HELP)
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size must not be negative")
        return value
    if not isinstance(value, str):
        raise ValueError(_SIZE_HELP)
    match = _SIZE.fullmatch(value)
    if not match or match.group(2).lower() not in _SIZE_FACTORS:
        raise ValueError(_SIZE_HELP)
    try:
        size = Decimal(match.group(1)) * _SIZE_FACTORS[match.group(2).lower()]
    except InvalidOperation as exc:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(_SIZE_HELP) from exc
    if size != size.to_integral_value():
        raise ValueError("a size must be a whole number of bytes")
    return int(size)

