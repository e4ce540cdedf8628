"""The usage side of one gateway process: the sink the data plane records into, its journal, store, flusher and
counters, and the questions asked of the store (``/admin/usage``, the budgets' spend at start).

Built by the gateway (:mod:`llmgw.gateway.tenancy_setup`) with the store of its state backend; :meth:`run` is its
background task. The data plane sees only :attr:`UsageService.sink`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import trio
from prometheus_client import CollectorRegistry

from .model import PERIODS, TenancySettings
from .pool_limiter import Spent
from .pools import period_start
from .usage import CACHED, HOUR, INPUT, NANO_USD, OUTPUT, Counts, UsageAggregator, add_to, hour_of
from .usage_flush import UsageFlusher
from .usage_journal import UsageJournal
from .usage_metrics import UsageMetrics
from .usage_query import UsageQuery, query_json, summarize, to_csv
from .usage_store import UsageStore


class UsageService:
    def __init__(self, settings: TenancySettings, store: UsageStore, journal_dir: Path | None,
                 registry: CollectorRegistry | None = None):
        self.sink = UsageAggregator()
        self.metrics = UsageMetrics(registry)
        self.sink.on_row.append(self.metrics.note)
        self.store = store
        self.journal = UsageJournal(journal_dir) if journal_dir is not None else None
        self.flusher = UsageFlusher(self.sink, store, self.journal, settings.usage_flush_interval,
                                    on_lost=self.metrics.lost.inc, on_shipped=self.metrics.shipped.inc)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Flush until cancelled (the journal opened, orphaned segments replayed beside); the counters follow
        every interval, the store or not."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.flusher.run)
            nursery.start_soon(self._publish)
            task_status.started()

    async def _publish(self) -> None:
        try:
            while True:
                await trio.sleep(self.flusher.interval)
                self.metrics.publish()
        finally:
            self.metrics.publish()

    @property
    def interval(self) -> float:
        return self.flusher.interval

    @interval.setter
    def interval(self, seconds: float) -> None:
        """A reload's ``tenancy.usage_flush_interval`` (from the next flush on)."""
        self.flusher.interval = seconds

    async def answer(self, query: UsageQuery) -> tuple[str, Any]:
        """``/admin/usage``'s answer: ``("csv", text)`` or ``("json", dict)``."""
        rows = await self.store.rows(query.since, query.until)
        items = summarize(rows, query)
        if query.format == "csv":
            return "csv", to_csv(items, query.group_by)
        return "json", query_json(items, query)

    async def budget_spent(self, settings: TenancySettings, now: float | None = None) -> list[Spent]:
        """What every key and team spent in the current day, month and in total (the limiter's seed at start)."""
        return await budget_spent(self.store, settings, time.time() if now is None else now)


async def budget_spent(store: UsageStore, settings: TenancySettings, now: float) -> list[Spent]:
    """Per key (``kind`` "key", its key id) and team, per budget period: tokens as ``settings`` counts them and
    nano-dollars, from the hour each period starts in (a period starts on an hour: days and months are UTC)."""
    starts = {period: period_start(period, now) for period in PERIODS}
    totals: dict[tuple[str, str, str], Counts] = {}
    for row, counts in await store.rows(hour_of(min(starts.values())), hour_of(now) + HOUR):
        for kind, name in (("key", row.key_id), ("team", row.team)):
            if not name:
                continue
            for period, start in starts.items():
                if row.hour >= start:
                    add_to(totals, (kind, name, period), counts)
    return [Spent(kind, name, period, settings.counted_tokens(c[INPUT], c[CACHED], c[OUTPUT]), c[NANO_USD])
            for (kind, name, period), c in totals.items()]
