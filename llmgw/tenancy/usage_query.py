"""A usage query (filters, a time range, a grouping) parsed from ``/admin/usage``'s parameters, and its answer.

Both stores hand :func:`summarize` the hourly rows in the query's range; it filters and groups them, so SQLite and
Redis answer alike. Times are UTC hours: ``since`` is rounded down to its hour, ``until`` (exclusive) up, and a
range holds at most :data:`MAX_HOURS`.
"""

from __future__ import annotations

import csv
import io
import math
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping

from ..units import parse_duration
from .model import nano_to_usd
from .usage import FIELDS, HOUR, NANO_USD, Counts, UsageRow, add_into, add_to, hour_of, zero

GROUPS = ("key", "team", "model", "class", "hour")
MAX_HOURS = 24 * 400  # the longest range one query reads: 400 days of hours
DEFAULT_HOURS = 24  # without ``since``: the last day
MAX_FILTER = 256  # characters of a key, team, model or class filter
MAX_PARAMETER = 1024  # characters of any parameter
PARAMETERS = ("key", "team", "model", "class", "since", "until", "group_by", "format")
_FILTERS = {"key": "key", "team": "team", "model": "model", "class": "priority"}  # parameter -> UsageQuery field
FORMATS = ("json", "csv")
_EPOCH = re.compile(r"\d{1,12}")


class QueryError(ValueError):
    """A parameter that cannot be read; ``param`` names it (the 400's ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class UsageQuery:
    since: int  # the first hour (epoch seconds, a multiple of 3600)
    until: int  # the hour after the last one
    key: str | None = None  # a key id, or a key name
    team: str | None = None  # "" matches keys of no team
    model: str | None = None
    priority: str | None = None  # a priority class (the ``class`` parameter); "" matches rows of no class
    group_by: tuple[str, ...] = ("key", "model")
    format: str = "json"

    def hours(self) -> range:
        return range(self.since, self.until, HOUR)

    def matches(self, row: UsageRow) -> bool:
        return (self.since <= row.hour < self.until
                and (self.key is None or self.key in (row.key_id, row.key_name))
                and (self.team is None or self.team == row.team)
                and (self.model is None or self.model == row.model)
                and (self.priority is None or self.priority == row.priority))


def parse_moment(text: str, now: float, param: str) -> float:
    """Seconds since the epoch from epoch seconds (``1796000400``), an ISO 8601 date or time (UTC unless it
    gives an offset: ``2026-12-07``, ``2026-12-07T10:00``, ``2026-12-07T10:00+01:00``), or a duration ago
    (``90m``, ``24h``)."""
    text = text.strip()
    if _EPOCH.fullmatch(text):
        return float(text)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        pass
    else:
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        return moment.timestamp()
    try:
        ago = parse_duration(text)
    except ValueError:
        raise QueryError(param, f"{param}={text!r}: expected epoch seconds, an ISO 8601 date or time "
                                "(UTC unless an offset is given), or a duration ago such as '24h'") from None
    return now - ago


def parse_query(params: Mapping[str, str], now: float | None = None) -> UsageQuery:
    """A :class:`UsageQuery` from query-string parameters; :class:`QueryError` naming the first wrong one."""
    now = time.time() if now is None else now
    for name, value in params.items():
        if name not in PARAMETERS:
            raise QueryError(name, f"unknown parameter {name!r}: the parameters are {', '.join(PARAMETERS)}")
        if len(value) > MAX_PARAMETER:
            raise QueryError(name, f"{name} is longer than {MAX_PARAMETER} characters")
    filters: dict[str, str | None] = {}
    for name, field in _FILTERS.items():
        wanted = params.get(name)
        if wanted is not None and len(wanted) > MAX_FILTER:
            raise QueryError(name, f"{name} is longer than {MAX_FILTER} characters")
        filters[field] = wanted
    until = hour_of(now) + HOUR
    if params.get("until"):
        until = _hour_after(parse_moment(params["until"], now, "until"))
    since = until - DEFAULT_HOURS * HOUR
    if params.get("since"):
        since = hour_of(_finite(parse_moment(params["since"], now, "since"), "since"))
    if since >= until:
        raise QueryError("since", "since must be before until")
    if (until - since) // HOUR > MAX_HOURS:
        raise QueryError("since", f"a query reads at most {MAX_HOURS} hours ({MAX_HOURS // 24} days)")
    group_by: tuple[str, ...] = ("key", "model")
    if params.get("group_by") is not None:
        group_by = tuple(part.strip() for part in params["group_by"].split(",") if part.strip())
        wrong = [part for part in group_by if part not in GROUPS]
        if wrong or len(set(group_by)) != len(group_by):
            raise QueryError("group_by", f"group_by is a comma-separated list of distinct {', '.join(GROUPS)}")
    fmt = params.get("format", "json")
    if fmt not in FORMATS:
        raise QueryError("format", f"format is one of {', '.join(FORMATS)}")
    return UsageQuery(since=since, until=until, group_by=group_by, format=fmt, **filters)


def _finite(moment: float, param: str) -> float:
    if not math.isfinite(moment) or not 0 <= moment < 2**40:
        raise QueryError(param, f"{param} is out of range")
    return moment


def _hour_after(moment: float) -> int:
    """The first hour not before ``moment`` ends: ``until`` rounded up to an hour."""
    start = hour_of(_finite(moment, "until"))
    return start if start == moment else start + HOUR


def _group_of(row: UsageRow, group_by: tuple[str, ...]) -> tuple[Any, ...]:
    parts: list[Any] = []
    for name in group_by:
        if name == "key":
            parts += [row.key_id, row.key_name]
        elif name == "team":
            parts.append(row.team)
        elif name == "model":
            parts.append(row.model)
        elif name == "class":
            parts.append(row.priority)
        else:
            parts.append(row.hour)
    return tuple(parts)


def _columns(group_by: tuple[str, ...]) -> list[str]:
    columns: list[str] = []
    for name in group_by:
        columns += ["key_id", "key_name"] if name == "key" else [name]
    return columns


def summarize(rows: Iterable[tuple[UsageRow, Counts]], query: UsageQuery) -> list[dict[str, Any]]:
    """The rows ``query`` matches, summed per group: one dict per group with its columns, every counter of
    :data:`FIELDS` and ``usd``; the largest spenders first (then the most tokens, then the group)."""
    groups: dict[tuple[Any, ...], Counts] = {}
    for row, counts in rows:
        if query.matches(row):
            add_to(groups, _group_of(row, query.group_by), counts)
    columns = _columns(query.group_by)
    answer = []
    for group, counts in groups.items():
        item: dict[str, Any] = dict(zip(columns, group))
        if "hour" in item:
            item["hour"] = _iso(item["hour"])
        item.update(zip(FIELDS, counts))
        item["usd"] = nano_to_usd(counts[NANO_USD])
        answer.append(item)
    tokens: Callable[[dict[str, Any]], int] = lambda item: item["input_tokens"] + item["output_tokens"]  # noqa: E731
    answer.sort(key=lambda item: (-item["nano_usd"], -tokens(item), [str(item[c]) for c in columns]))
    return answer


def _iso(hour: int) -> str:
    return datetime.fromtimestamp(hour, timezone.utc).strftime("%Y-%m-%dT%H:00:00Z")


def to_csv(items: list[dict[str, Any]], group_by: tuple[str, ...]) -> str:
    """The answer as CSV: a header line, then one line per group (money in USD with nine decimals)."""
    columns = [*_columns(group_by), *FIELDS, "usd"]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for item in items:
        writer.writerow([f"{item[c]:.9f}" if c == "usd" else _cell(item.get(c)) for c in columns])
    return out.getvalue()


def _cell(value: Any) -> Any:
    """A text cell a spreadsheet would take for a formula starts with a quote (names come from API callers)."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def query_json(items: list[dict[str, Any]], query: UsageQuery) -> dict[str, Any]:
    """The JSON answer: the range, the grouping, the groups and their total."""
    total = zero()
    for item in items:
        add_into(total, [item[field] for field in FIELDS])
    return {"since": _iso(query.since), "until": _iso(query.until), "group_by": list(query.group_by),
            "data": items, "total": {**dict(zip(FIELDS, total)), "usd": nano_to_usd(total[NANO_USD])}}
