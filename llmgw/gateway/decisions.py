"""The last routing decisions this process's data plane finished, with their explanation (``GET /admin/decisions``).

A ring of the last :data:`RECENT_DECISIONS` answered attempts, newest first
when read. Recording costs O(1) on the data plane's finish path (about 1 µs):
a tuple appended to a bounded deque, with a shallow copy of the tier's
``detail`` limited to :data:`DETAIL_KEYS` plain entries, so that the ring never
holds a request's block keys (a list the size of its prompt) or other large values. Rendering (for the status page,
``/ui``) does the rest: wall-clock times, milliseconds, strings cut to
:data:`MAX_TEXT` characters.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from typing import Any

from ..router.tier import Decision, RouteRequest

RECENT_DECISIONS = 100
DETAIL_KEYS = 32  # the most entries of a tier's detail kept per decision
MAX_TEXT = 200  # characters kept of a string value
_PLAIN = (str, int, float, bool, type(None))
# What record() keeps of a detail, by exact type (cheaper than isinstance): dicts (e.g. the cost estimate) are read
# one level deep when rendered; lists (block keys) and objects (a prediction) are left out.
_KEPT = frozenset((*_PLAIN, dict))
_now = time.perf_counter  # the data plane's clock for started/ended


class DecisionLog:
    """``record(...)`` each finished attempt; ``to_json()`` the kept ones, newest first."""

    __slots__ = ("_ring",)

    def __init__(self, size: int = RECENT_DECISIONS):
        self._ring: deque[tuple] = deque(maxlen=size)

    @property
    def capacity(self) -> int:
        return self._ring.maxlen or 0

    def record(self, request: RouteRequest, decision: Decision, status: int, started: float, ended: float,
               first_token_at: float | None) -> None:
        """One answered attempt: ``started``, ``ended`` and ``first_token_at`` on :func:`time.perf_counter`."""
        detail = decision.detail
        items = detail.items() if len(detail) <= DETAIL_KEYS else itertools.islice(detail.items(), DETAIL_KEYS)
        detail = {k: v for k, v in items if type(v) in _KEPT}
        self._ring.append((ended, request.request_id, request.served_name, decision.replica.name, decision.tier,
                           decision.outcome, status, started, first_token_at, detail))

    def to_json(self) -> list[dict[str, Any]]:
        wall_offset = time.time() - _now()
        return [{"at": round(ended + wall_offset, 3), "request_id": request_id, "model": model, "replica": replica,
                 "tier": tier, "outcome": outcome, "status": status,
                 "ttft_ms": None if first_token_at is None else round((first_token_at - started) * 1000, 1),
                 "latency_ms": round((ended - started) * 1000, 1), "detail": _plain_detail(detail)}
                for (ended, request_id, model, replica, tier, outcome, status, started, first_token_at, detail)
                in reversed(self._ring)]


def _plain_detail(detail: dict[str, Any]) -> dict[str, Any]:
    """The detail as JSON: plain values (strings cut), and dict values' own plain entries."""
    kept: dict[str, Any] = {}
    for key, value in detail.items():
        if isinstance(value, dict):
            value = {str(k)[:MAX_TEXT]: _cut(v) for k, v in itertools.islice(value.items(), DETAIL_KEYS)
                     if isinstance(v, _PLAIN)}
        kept[str(key)[:MAX_TEXT]] = _cut(value)
    return kept


def _cut(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):  # NaN and infinities are not JSON
        return None
    return value[:MAX_TEXT] if isinstance(value, str) else value
