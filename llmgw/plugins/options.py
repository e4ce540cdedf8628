"""Reading a routing tier's ``routing_options`` into its options dataclass (the built-in tiers share this)."""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping


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


def count(minimum: int) -> Callable[[Any], int]:
    """A converter accepting an integer (not a bool) of at least ``minimum``."""

    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {value!r}")
        return value

    return convert
