"""Ships the sink's rows to the usage store every ``usage_flush_interval``, exactly once, whatever fails.

One task per process (:meth:`UsageFlusher.run`, in the gateway's nursery). Each round it cuts the journal, takes
the sink's rows (together, with no wait between: the rows are exactly the journal's lines before the cut) and
applies them as one :class:`~.usage_store.Batch` marked with the segment and offset. A store that does not answer
gets the same batch again, with back-off, until it takes it (the marker makes a repeat count once); meanwhile the
sink gathers the next rows. When they pass ``max_pending_rows`` (Redis away a long time, many keys) the sink's rows
are dropped from memory and the next batches are read back from the journal instead, at most
:data:`~.usage_store.MAX_BATCH_ROWS` rows each; without a journal they are lost, and counted
(``llmgw_tenant_usage_lost_total``) and logged. At start it replays the segments of processes that are gone; at
stop it flushes once more (what it cannot ship stays in the journal for the next start).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from typing import Callable

import trio

from ..backoff import RestartBackoff
from ..lograte import RepeatLimitedLog
from .usage import REQUESTS, UsageAggregator
from .usage_journal import Position, Segment, UsageJournal, read_rows
from .usage_store import MAX_BATCH_ROWS, Batch, StoreUnavailable, UsageStore

log = logging.getLogger(__name__)

MAX_PENDING_ROWS = 100_000  # rows held in memory while the store is away (about 300 bytes each)
STOP_FLUSH_SECONDS = 5.0  # the last flush at a graceful stop waits this long for the store


class UsageFlusher:
    def __init__(self, sink: UsageAggregator, store: UsageStore, journal: UsageJournal | None, interval: float,
                 max_pending_rows: int = MAX_PENDING_ROWS,
                 on_lost: Callable[[int], None] = lambda rows: None,
                 on_shipped: Callable[[int], None] = lambda rows: None):
        self.sink = sink
        self.store = store
        self.journal = journal
        self.interval = interval
        self.max_pending_rows = max_pending_rows
        self._on_lost = on_lost
        self._on_shipped = on_shipped
        self._process = f"process-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._batches = 0
        self._last_cut: Position | None = None
        self._dropped_from: int | None = None  # the sink's rows were dropped: they start here in the segment
        self._replay_from: int | None = None  # the next flush reads the current segment from here
        self.waiting = False  # the store refused the last attempt; True until a batch goes in
        self._log = RepeatLimitedLog(log, 60.0)
        self._in_flight: Batch | None = None  # a batch being applied (at a stop: applied again, as it was)
        if journal is not None:
            sink.on_row.append(journal.append)
        sink.max_rows, sink.on_full = max_pending_rows, self._bound

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Replay orphaned segments (beside the flushes), flush every ``interval`` until cancelled, and once more
        then."""
        if self.journal is not None:
            try:
                self.journal.open()
            except OSError as exc:
                log.error("usage journal: cannot write in %s (%s): usage is kept in memory only until it is "
                          "flushed, and a kill of this process would lose what was not; make the folder writable "
                          "and restart", self.journal.directory, exc)
                self.journal = None
        try:
            async with trio.open_nursery() as nursery:
                if self.journal is not None:
                    nursery.start_soon(self.replay_orphans)
                task_status.started()
                while True:
                    await trio.sleep(self.interval)
                    await self.flush()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(STOP_FLUSH_SECONDS):
                await self._last_flush()
            if self.journal is not None:
                self.journal.close()

    async def _last_flush(self) -> None:
        """At a stop: a batch the stop interrupted again, as it was (its marker stays exact), then the rest."""
        interrupted = self._in_flight
        if interrupted is not None and not await self._apply(interrupted, retry=False):
            return  # the journal keeps it (and what followed) for the next start
        await self.flush(retry=False)

    async def flush(self, retry: bool = True) -> None:
        """Ship what the sink gathered since the last flush (with ``retry``: until the store takes it)."""
        journal = self.journal
        position = self._last_cut = journal.cut() if journal is not None else None
        rows = self.sink.take()
        if position is None:
            self._batches += 1
            shipped = not rows or await self._apply(Batch(self._process, self._batches, rows), retry)
        elif self._replay_from is not None:  # the sink's rows are in the journal from there on
            shipped = await self._ship_journal(position, self._replay_from, retry)
        else:
            shipped = not rows or await self._apply(Batch(position.name, position.offset, rows), retry)
        if not shipped:
            return
        if position is not None:
            journal.shipped(position)  # type: ignore[union-attr]
        self._replay_from, self._dropped_from = self._dropped_from, None

    async def _ship_journal(self, position: Position, start: int, retry: bool) -> bool:
        """The segment's lines from ``start`` to ``position``, in batches of at most MAX_BATCH_ROWS rows."""
        path = self.journal.directory / position.name  # type: ignore[union-attr]
        while start < position.offset:
            rows, end, _ = await trio.to_thread.run_sync(read_rows, path, start, position.offset, MAX_BATCH_ROWS)
            if not await self._apply(Batch(position.name, end, rows), retry):
                self._replay_from = start
                return False
            start = end
        return True

    async def _apply(self, batch: Batch, retry: bool) -> bool:
        """``batch`` into the store; with ``retry`` until it goes in (False: it did not, and ``retry`` was off)."""
        backoff = RestartBackoff(min(self.interval, 0.5), 5.0)
        self._in_flight = batch
        while True:
            try:
                await self.store.apply(batch)
            except StoreUnavailable as exc:
                if not self.waiting:
                    self.waiting = True
                    log.warning("usage: the store does not take usage (%s); it waits in memory (up to %d rows)%s "
                                "and is shipped when the store is back", exc, self.max_pending_rows,
                                " and in the journal" if self.journal is not None else "")
                if not retry:
                    self._in_flight = None
                    if self.journal is None:  # the last flush: back to the sink, in case another comes
                        for row, counts in batch.rows.items():
                            self.sink.add(row, counts)
                    return False
                await trio.sleep(backoff.next_delay(None))
                continue
            self._in_flight = None
            if self.waiting:
                self.waiting = False
                log.info("usage: the store takes usage again")
            self._on_shipped(len(batch.rows))
            return True

    def _bound(self) -> None:
        """The sink holds more than ``max_pending_rows`` (the store away a long time, many keys): its rows leave
        memory (they are in the journal, from the last cut on; without one, they are lost)."""
        dropped = self.sink.take()
        cut = self._last_cut
        if cut is not None:
            if self._dropped_from is None:
                self._dropped_from = 0 if cut.finished else cut.offset
                log.warning("usage: more than %d rows wait for the store; they are read back from the journal "
                            "when it is back", self.max_pending_rows)
            return
        self._on_lost(len(dropped))
        self._log.log(logging.ERROR, "usage: more than %d rows waited for the store and this process has no "
                      "journal: %d rows of usage are lost (give the gateway a state dir to keep them)",
                      self.max_pending_rows, len(dropped), kind="lost")

    async def replay_orphans(self) -> None:
        """Ship the segments of processes that are gone (from the store's marker on), then delete them."""
        assert self.journal is not None
        for segment in self.journal.orphans():
            await self._replay(segment)

    async def _replay(self, segment: Segment) -> None:
        backoff = RestartBackoff(min(self.interval, 0.5), 5.0)
        while True:
            try:
                start = await self.store.shipped(segment.name) or 0
                break
            except StoreUnavailable:
                await trio.sleep(backoff.next_delay(None))
        answers = 0
        while True:
            rows, end, skipped = await trio.to_thread.run_sync(read_rows, segment.path, start, None, MAX_BATCH_ROWS)
            if skipped:
                log.warning("usage journal: %d lines of %s are not usage lines; skipped", skipped, segment.path)
            if end <= start:
                break
            await self._apply(Batch(segment.name, end, rows), True)
            answers += sum(counts[REQUESTS] for counts in rows.values())
            start = end
        log.info("usage journal: shipped %s, left by a process that ended before it could (%d answers)",
                 segment.name, answers)
        self.journal.forget(segment)  # type: ignore[union-attr]
