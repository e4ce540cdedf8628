"""The usage store of a cluster (``state.backend: redis``): one Redis hash per UTC hour, counters added by a script.

``<prefix>tenancy:usage:<hour>`` (the hour's first epoch second) holds a field per row and counter:
``["<key id>","<key name>","<team>","<model>"]|<counter>`` (the row as a JSON array; the counter's name from
:data:`~.usage.FIELDS`) with the total so far; the sorted set ``<prefix>tenancy:usage:hours`` lists the hours that
have one. A batch is one script (:data:`APPLY`): it compares the batch's
offset with its journal's marker ``<prefix>tenancy:usage:shipped:<journal>``, adds with ``HINCRBY`` and moves the
marker, all or nothing as far as a retry is concerned. An hour's hash expires :data:`RETENTION_SECONDS` after its
last write, a marker :data:`~.usage_store.MARKER_SECONDS` after its own.

Reading trusts nothing in Redis: fields that are not ours are skipped, counters are clamped to 0..2^63, and an hour
gives at most :data:`MAX_FIELDS_PER_HOUR` fields (read with ``HSCAN``, never all at once).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from ..cluster.link import RedisLink, Unavailable
from ..cluster.records import Keys
from ..lograte import RepeatLimitedLog
from .usage import FIELDS, HOUR, Counts, UsageRow, hour_of, zero
from .usage_journal import MAX_TEXT
from .usage_store import MARKER_SECONDS, RETENTION_SECONDS, Batch, StoreUnavailable

log = logging.getLogger(__name__)

MAX_FIELDS_PER_HOUR = 1_200_000  # 100,000 rows of 12 counters; past it an hour's answer is cut short (logged)
SCAN_COUNT = 1000
MAX_HOURS_READ = RETENTION_SECONDS // HOUR + 1  # hours one read lists (more in the index: not ours)
MAX_COUNTER = 2**63 - 1
_FIELD_INDEX = {name: index for index, name in enumerate(FIELDS)}

# KEYS: the marker, the index of hours, then the hours' hashes. ARGV: offset, marker ttl, hash ttl, the oldest
# hour kept, then per hash: its hour, a count n and n (field, increment) pairs.
APPLY = """
local done = tonumber(redis.call('GET', KEYS[1]))
if done and done >= tonumber(ARGV[1]) then return 0 end
local i = 5
for h = 3, #KEYS do
  redis.call('ZADD', KEYS[2], ARGV[i], ARGV[i])
  local count = tonumber(ARGV[i + 1])
  i = i + 2
  for _ = 1, count do
    redis.call('HINCRBY', KEYS[h], ARGV[i], ARGV[i + 1])
    i = i + 2
  end
  redis.call('EXPIRE', KEYS[h], ARGV[3])
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""


def row_field(row: UsageRow, counter: str) -> str:
    """The hash field of ``row``'s ``counter``: a row of no class keeps the 4 texts it had before classes."""
    identity = [row.key_id, row.key_name, row.team, row.model]
    if row.priority:
        identity.append(row.priority)
    return json.dumps(identity, separators=(",", ":")) + "|" + counter


def parse_field(raw: bytes, hour: int) -> tuple[UsageRow, int] | None:
    """A field's row and counter index, or None when it is not a field :func:`row_field` wrote."""
    identity, _, counter = raw.rpartition(b"|")
    index = _FIELD_INDEX.get(counter.decode("latin-1"))
    if index is None or len(identity) > 5 * (MAX_TEXT + 8):
        return None
    try:
        value = json.loads(identity)
    except ValueError:
        return None
    if not isinstance(value, list) or len(value) not in (4, 5) or not all(isinstance(part, str) for part in value):
        return None
    return UsageRow(value[0], value[1], value[2], value[3], hour, value[4] if len(value) == 5 else ""), index


def _counter(raw: Any) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        return 0
    return min(max(value, 0), MAX_COUNTER)


class RedisUsageStore:
    """Hourly usage in Redis, through the gateway's :class:`~llmgw.cluster.link.RedisLink`."""

    def __init__(self, link: RedisLink, keys: Keys, clock: Callable[[], float] = time.time,
                 retention: int = RETENTION_SECONDS):
        self.link = link
        self.prefix = keys.prefix + "tenancy:usage:"
        self._clock = clock
        self.retention = retention
        self._log = RepeatLimitedLog(log, 60.0)

    def hour_key(self, hour: int) -> str:
        return f"{self.prefix}{hour}"

    @property
    def hours_key(self) -> str:
        """A sorted set of the hours that have a hash (so that a long range reads only those)."""
        return f"{self.prefix}hours"

    def _oldest_hour(self) -> int:
        return hour_of(self._clock() - self.retention)

    def marker_key(self, journal: str) -> str:
        return f"{self.prefix}shipped:{journal}"

    async def apply(self, batch: Batch) -> bool:
        by_hour: dict[int, list[str | int]] = {}
        for row, counts in batch.rows.items():
            pairs = by_hour.setdefault(row.hour, [])
            for name, value in zip(FIELDS, counts):
                if value:
                    pairs += [row_field(row, name), value]
        keys = [self.marker_key(batch.journal), self.hours_key, *(self.hour_key(hour) for hour in by_hour)]
        args: list[str | int] = [batch.offset, MARKER_SECONDS, self.retention, self._oldest_hour()]
        for hour, pairs in by_hour.items():
            args += [hour, len(pairs) // 2, *pairs]
        try:
            answer = await self.link.call("usage_apply", lambda client: client.eval(APPLY, keys=keys, args=args))
        except Unavailable as exc:
            raise StoreUnavailable(f"Redis: {exc}") from None
        return answer == 1

    async def shipped(self, journal: str) -> int | None:
        try:
            raw = await self.link.call("usage_shipped", lambda client: client.get(self.marker_key(journal)))
        except Unavailable as exc:
            raise StoreUnavailable(f"Redis: {exc}") from None
        return None if raw is None else _counter(raw)

    async def rows(self, since: int, until: int) -> list[tuple[UsageRow, Counts]]:
        from coredis.tokens import PureToken  # coredis is imported only by a process that uses Redis

        low = max(since, self._oldest_hour())
        try:
            listed = await self.link.call("usage_read", lambda client: client.zrange(
                self.hours_key, low, f"({until}", sortby=PureToken.BYSCORE, offset=0, count=MAX_HOURS_READ))
        except Unavailable as exc:
            raise StoreUnavailable(f"Redis: {exc}") from None
        hours = sorted({int(raw) for raw in listed if isinstance(raw, bytes) and raw.isdigit()
                        and int(raw) % HOUR == 0})
        found: list[tuple[UsageRow, Counts]] = []
        for hour in hours:
            found += (await self._hour(hour)).items()
        return found

    async def _hour(self, hour: int) -> dict[UsageRow, Counts]:
        key = self.hour_key(hour)
        rows: dict[UsageRow, Counts] = {}
        cursor, fields, skipped = 0, 0, 0
        while True:
            try:
                cursor, page = await self.link.call(
                    "usage_read", lambda client: client.hscan(key, cursor, count=SCAN_COUNT))  # noqa: B023
            except Unavailable as exc:
                raise StoreUnavailable(f"Redis: {exc}") from None
            for raw_field, raw_value in page.items():
                parsed = parse_field(raw_field, hour) if isinstance(raw_field, bytes) else None
                if parsed is None:
                    skipped += 1
                    continue
                row, index = parsed
                counts = rows.get(row)
                if counts is None:
                    rows[row] = counts = zero()
                counts[index] = _counter(raw_value)
            fields += len(page)
            if not cursor:
                break
            if fields >= MAX_FIELDS_PER_HOUR:
                self._log.log(logging.ERROR, "usage: the hour %s in Redis (%s) has more than %d fields; its answer "
                              "is cut short there", hour, key, MAX_FIELDS_PER_HOUR, kind="hour_too_big")
                break
        if skipped:
            self._log.log(logging.WARNING, "usage: %d fields of %s in Redis are not usage counters; skipped", skipped,
                          key, kind="foreign_fields")
        return rows
