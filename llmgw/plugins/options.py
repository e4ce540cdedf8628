"""Reading a routing tier's ``routing_options`` into its options dataclass (the built-in tiers share this)."""

from __future__ import annotations

import math
from typing import Any, Callable, Collection, Mapping

from ..units import parse_duration

MAX_COUNT = 1_000_000_000  # the upper bound of an integer option with no tighter one
MAX_DURATION = 24 * 3600.0  # of a duration option: a day
MAX_NUMBER = 1e6  # of a positive number option (weights, factors)


def option_reader(options: Any, raw: Mapping[str, Any], problems: list[str],
                  nullable: Collection[str] = ()) -> Callable[[str, Callable[[Any], Any]], None]:
    """``take(key, convert)``: set ``options.<key>`` to ``convert(raw[key])``.

    A missing key keeps its default, and so does a null one unless it is in
    ``nullable`` (then it becomes None); a value ``convert`` rejects
    (TypeError, ValueError) keeps the default and is added to ``problems`` as
    ``"key: why"``.
    """

    def take(key: str, convert: Callable[[Any], Any]) -> None:
        if key not in raw or raw[key] is None and key not in nullable:
            return
        try:
            setattr(options, key, None if raw[key] is None else convert(raw[key]))
        except (TypeError, ValueError) as exc:
            problems.append(f"{key}: {exc}")

    return take


def flag(value: Any) -> bool:
    """A converter accepting ``true`` or ``false`` (not 0, 1 or a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def count(minimum: int, maximum: int = MAX_COUNT) -> Callable[[Any], int]:
    """A converter accepting an integer (not a bool) from ``minimum`` to ``maximum``."""

    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {value!r}")
        if value > maximum:
            raise ValueError(f"must be at most {maximum}, got {value!r}")
        return value

    return convert


def duration(*, allow_zero: bool = False) -> Callable[[Any], float]:
    """A converter accepting a duration (``500ms``, ``2m``, seconds) above 0 (or from 0), at most a day."""

    def convert(value: Any) -> float:
        seconds = parse_duration(value)
        if not (seconds >= 0 if allow_zero else seconds > 0) or not math.isfinite(seconds):
            raise ValueError("must be 0 or more" if allow_zero else "must be greater than 0")
        if seconds > MAX_DURATION:
            raise ValueError("must be at most 1 day")
        return seconds

    return convert
