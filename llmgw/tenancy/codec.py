"""Keys and teams as the stores keep them: a JSON object each, checked field by field when read back.

The same bytes go into SQLite (``state.backend: local``) and, signed, into Redis. :func:`decode_key` and
:func:`decode_team` trust nothing: a record of the wrong shape, of a size or count beyond what the admin API
writes, or with a value out of range raises :class:`RecordError` (a store counts and skips it).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..config.schema import IDENTIFIER_PATTERN, KEY_NAME_PATTERN, MAX_LIMIT
from .directory import API, KeyEntry, TeamEntry
from .model import PERIODS, Budget, Limits

MAX_RECORD_BYTES = 256 * 1024  # a key with 10,000 model names of 24 characters; the admin API writes no more
MAX_MODELS = 10_000
MAX_MODEL_NAME = 1024
MAX_NANO_USD = 10**18  # 1e9 USD, the config's largest budget
NAME = re.compile(KEY_NAME_PATTERN)
PRIORITY = re.compile(IDENTIFIER_PATTERN)
KEY_ID = re.compile(r"k-[0-9a-f]{16}")


class RecordError(ValueError):
    """A stored record this version cannot trust or read."""


def _limits_json(limits: Limits) -> dict[str, Any]:
    return {"rpm": limits.rpm, "tpm": limits.tpm, "concurrency": limits.concurrency,
            "budgets": [{"period": b.period, "tokens": b.tokens, "nano_usd": b.nano_usd} for b in limits.budgets]}


def _common_json(entry: KeyEntry | TeamEntry) -> dict[str, Any]:
    return {"name": entry.name, "models": None if entry.models is None else sorted(entry.models),
            "priority": entry.priority, "limits": _limits_json(entry.limits), "created": entry.created,
            **({"priority_header": True} if entry.priority_header else {})}


def encode_key(entry: KeyEntry) -> bytes:
    return json.dumps({"id": entry.key_id, "sha256": entry.digest.hex(), "team": entry.team, **_common_json(entry)},
                      separators=(",", ":")).encode()


def encode_team(entry: TeamEntry) -> bytes:
    return json.dumps(_common_json(entry), separators=(",", ":")).encode()


def decode_key(raw: bytes) -> KeyEntry:
    fields = _object(raw)
    key_id = _text(fields, "id", KEY_ID)
    digest = _text(fields, "sha256", re.compile(r"[0-9a-f]{64}"))
    team = fields.get("team")
    if team is not None:
        team = _text(fields, "team", NAME)
    name, models, priority, limits, created = _common(fields)
    return KeyEntry(key_id, name, bytes.fromhex(digest), team, models, priority, limits, API, created,
                    _flag(fields, "priority_header"))


def decode_team(raw: bytes) -> TeamEntry:
    fields = _object(raw)
    name, models, priority, limits, created = _common(fields)
    return TeamEntry(name, limits, models, priority, API, created, _flag(fields, "priority_header"))


def _object(raw: object) -> dict[str, Any]:
    if not isinstance(raw, bytes) or len(raw) > MAX_RECORD_BYTES:
        raise RecordError("not a record, or larger than any the admin API writes")
    try:
        fields = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RecordError(f"not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise RecordError("not a JSON object")
    return fields


def _text(fields: dict[str, Any], name: str, pattern: re.Pattern[str]) -> str:
    value = fields.get(name)
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise RecordError(f"{name} is not valid")
    return value


def _flag(fields: dict[str, Any], name: str) -> bool:
    """A boolean field; absent (a record of an earlier version, or one that leaves it false) is false."""
    value = fields.get(name, False)
    if type(value) is not bool:
        raise RecordError(f"{name} is not true or false")
    return value


def _count(value: object, name: str, highest: int) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not 1 <= value <= highest:
        raise RecordError(f"{name} is not a count from 1 to {highest}")
    return value


def _common(fields: dict[str, Any]) -> tuple[str, frozenset[str] | None, str | None, Limits, float]:
    name = _text(fields, "name", NAME)
    models = fields.get("models")
    if models is not None:
        if not isinstance(models, list) or len(models) > MAX_MODELS or not all(
                isinstance(m, str) and 0 < len(m) <= MAX_MODEL_NAME for m in models):
            raise RecordError("models is not a list of model names")
        models = frozenset(models)
    priority = fields.get("priority")
    if priority is not None and (not isinstance(priority, str) or len(priority) > MAX_MODEL_NAME):
        raise RecordError("priority is not valid")
    if priority is not None:
        priority = _text(fields, "priority", PRIORITY)
    created = fields.get("created", 0)
    if type(created) not in (int, float) or not 0 <= created < 1e11:
        raise RecordError("created is not a time")
    return name, models, priority, _limits(fields.get("limits")), float(created)


def _limits(value: object) -> Limits:
    if not isinstance(value, dict):
        raise RecordError("limits is not an object")
    budgets = value.get("budgets") or []
    if not isinstance(budgets, list) or len(budgets) > len(PERIODS):
        raise RecordError("budgets is not a list of at most one budget per period")
    parsed = []
    for budget in budgets:
        if not isinstance(budget, dict) or budget.get("period") not in PERIODS:
            raise RecordError("a budget's period is not valid")
        tokens = _count(budget.get("tokens"), "a budget's tokens", MAX_LIMIT)
        nano_usd = budget.get("nano_usd")
        if nano_usd is not None and (type(nano_usd) is not int or not 0 <= nano_usd <= MAX_NANO_USD):
            raise RecordError("a budget's nano_usd is not valid")
        parsed.append(Budget(budget["period"], tokens, nano_usd))
    if len({b.period for b in parsed}) != len(parsed):
        raise RecordError("two budgets of one period")
    return Limits(rpm=_count(value.get("rpm"), "rpm", MAX_LIMIT), tpm=_count(value.get("tpm"), "tpm", MAX_LIMIT),
                  concurrency=_count(value.get("concurrency"), "concurrency", MAX_LIMIT), budgets=tuple(parsed))
