"""Usage aggregated in memory per key, team, model, priority class and UTC hour: the data plane's :class:`UsageSink`.

:class:`UsageAggregator` takes every answer's usage (:meth:`~UsageAggregator.record`) and every refusal
(:meth:`~UsageAggregator.refused`) without waiting: a dictionary update per call. Its rows are
:class:`UsageRow` (key id, key name, team, model, hour) with :data:`FIELDS` counters each. The flusher
(:mod:`.usage_flush`) takes the rows gathered since its last flush (:meth:`~UsageAggregator.take`) and ships
them to the store; a hook (``on_record``, ``on_refused``) lets the journal and the Prometheus counters see
each call too.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable, NamedTuple, TypeVar

from .interfaces import OUT_OF_QUOTA, RATE_LIMITED, UsageRecord
from .model import Tenant

HOUR = 3600
MODEL_NOT_ALLOWED = "model_not_allowed"  # a 403: the key (or its team) may not use the model
REFUSAL_REASONS = (RATE_LIMITED, OUT_OF_QUOTA, MODEL_NOT_ALLOWED)

# The counters of a row, in this order everywhere (the store's columns, the journal's line, the API's JSON).
FIELDS = ("requests", "input_tokens", "cached_tokens", "output_tokens", "nano_usd",
          "answers_2xx", "answers_4xx", "answers_5xx", "answers_other",
          "refused_rate", "refused_quota", "refused_model")
REQUESTS, INPUT, CACHED, OUTPUT, NANO_USD = range(5)
_STATUS_FIELD = {2: 5, 4: 6, 5: 7}  # an answer's status class -> its counter; others: answers_other
_ANSWERS_OTHER = 8
REFUSAL_FIELD = {RATE_LIMITED: 9, OUT_OF_QUOTA: 10, MODEL_NOT_ALLOWED: 11}

Counts = list[int]  # len(FIELDS) counters of one row


def hour_of(at: float) -> int:
    """The UTC hour ``at`` (seconds since the epoch) falls in, as the epoch second it starts at."""
    return int(at // HOUR) * HOUR


class UsageRow(NamedTuple):
    """Who used what, and when: the identity of one aggregated row (a tuple: built and hashed in C, per answer)."""

    key_id: str
    key_name: str
    team: str  # "" for a key of no team
    model: str
    hour: int  # the UTC hour's first second since the epoch
    # The configured priority class the request had at the gateway's queue ("": it did not go through the queue,
    # or a row from before classes were counted); never a client's string, so their number is the config's.
    priority: str = ""


def zero() -> Counts:
    return [0] * len(FIELDS)


def add_into(total: Counts, counts: Counts) -> None:
    for index, value in enumerate(counts):
        if value:
            total[index] += value


Key = TypeVar("Key", bound=Hashable)


def add_to(totals: dict[Key, Counts], key: Key, counts: Counts) -> None:
    """Add ``counts`` to ``totals[key]`` (a copy of them when it is new)."""
    total = totals.get(key)
    if total is None:
        totals[key] = list(counts)
    else:
        add_into(total, counts)


def record_counts(record: UsageRecord) -> Counts:
    """The counters one answer adds to its row."""
    usage = record.usage
    prompt = usage.prompt_tokens
    counts = [1, prompt, min(usage.cached_tokens, prompt), usage.completion_tokens, usage.nano_usd, 0, 0, 0, 0, 0,
              0, 0]
    counts[_STATUS_FIELD.get(record.status // 100, _ANSWERS_OTHER)] = 1
    return counts


def refusal_counts(reason: str) -> Counts:
    """The counter one refusal adds to its row (``ValueError`` for a reason not in :data:`REFUSAL_REASONS`)."""
    if reason not in REFUSAL_FIELD:
        raise ValueError(f"unknown refusal reason {reason!r}: one of {', '.join(REFUSAL_REASONS)}")
    counts = zero()
    counts[REFUSAL_FIELD[reason]] = 1
    return counts


Rows = dict[UsageRow, Counts]


class UsageAggregator:
    """The in-memory :class:`~.interfaces.UsageSink`: rows since the last :meth:`take`.

    Its size is the number of distinct (key, model, hour) seen between two takes: the flusher takes every
    ``usage_flush_interval``, and holds what it could not ship (:mod:`.usage_flush` says how it is bounded).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._rows: Rows = {}
        self.on_row: list[Callable[[UsageRow, Counts], None]] = []  # the journal, the Prometheus counters
        self.max_rows: int | None = None  # past this many rows, ``on_full`` is called (the flusher's bound)
        self.on_full: Callable[[], None] = lambda: None

    def record(self, record: UsageRecord) -> None:
        """Count one answer an engine produced (its tokens, money and status class) in its key's hour."""
        row = UsageRow(record.key_id, record.key_name, record.team or "", record.model, hour_of(record.at),
                       record.priority or "")
        self._add(row, record_counts(record))

    def refused(self, tenant: Tenant, model: str, reason: str, at: float | None = None,
                priority: str | None = None) -> None:
        """Count one request refused before routing: ``reason`` is the 429's error type (``rate_limit_exceeded``,
        ``insufficient_quota``) or ``model_not_allowed`` (a 403); ``priority``: its class, when the gateway's queue
        gave it one (a request it shed)."""
        counts = refusal_counts(reason)
        team = tenant.team.name if tenant.team is not None else ""
        row = UsageRow(tenant.key_id, tenant.name, team, model, hour_of(self._clock() if at is None else at),
                       priority or "")
        self._add(row, counts)

    def _add(self, row: UsageRow, counts: Counts) -> None:
        for hook in self.on_row:
            hook(row, counts)
        self.add(row, counts)
        if self.max_rows is not None and len(self._rows) > self.max_rows:
            self.on_full()

    def add(self, row: UsageRow, counts: Counts) -> None:
        """Add ``counts`` to ``row`` (no hooks: rows put back)."""
        add_to(self._rows, row, counts)

    def take(self) -> Rows:
        """The rows gathered since the last take; this starts empty again."""
        rows, self._rows = self._rows, {}
        return rows

    @property
    def pending_rows(self) -> int:
        return len(self._rows)

