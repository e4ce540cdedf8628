"""Following the cluster's short-lived streams (load, learn, tiers, requests), with each read bounded by bytes.

A stream entry is read through a small Lua script (:data:`BOUNDED_READ`) that
returns the entries whose fields' total size is within what the stream's
honest sender writes, and only the *ids* of the others: an entry someone
wrote to Redis that is larger than that never crosses the wire, is never
parsed, and is counted in ``llmgw_cluster_bad_records_total{stream}`` (with
one WARNING per stream and process).

Every blocking read Redis has (``XREAD BLOCK``, ``BLPOP``, pub/sub) hands the
waiting reader what was written, so a reader is woken instead by a
:class:`Doorbell`: a connection of its own with Redis's client tracking on,
which tells of a change to the stream's key by the key's name only. A change
is read a round trip after it was written (as a blocking read would), and at
least every ``BLOCK_MS`` whatever the doorbell says.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, NamedTuple

import trio

from . import records
from .link import BLOCK_MS, RedisLink, Unavailable, describe_error, open_client

if TYPE_CHECKING:
    import coredis

    from ..config.schema import StateConfig

log = logging.getLogger(__name__)

ARMED_CHECK = 5.0  # seconds a doorbell waits for news before it checks its connection with a command

# KEYS[1] the stream; ARGV: read after this id ("$": only the stream's last id, to start from now), at most this
# many entries, at most this many bytes of names and values per entry (and the read ends once its entries weigh
# that much: a read is at most twice it). Answers {entries, oversized ids, last id}.
BOUNDED_READ = """
local key, after = KEYS[1], ARGV[1]
if after == '$' then
  if redis.call('EXISTS', key) == 0 then return {{}, {}, '0-0'} end
  local info = redis.call('XINFO', 'STREAM', key)
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then return {{}, {}, info[i + 1]} end
  end
  return redis.error_reply('XINFO STREAM has no last-generated-id')
end
local limit = tonumber(ARGV[3])
local kept, oversized, last, total = {}, {}, after, 0
for _, entry in ipairs(redis.call('XRANGE', key, '(' .. after, '+', 'COUNT', ARGV[2])) do
  local size = 0
  for _, part in ipairs(entry[2]) do size = size + #part end
  if size <= limit then
    kept[#kept + 1] = entry
    total = total + size
  else
    oversized[#oversized + 1] = entry[1]
  end
  last = entry[1]
  if total >= limit then break end
end
return {kept, oversized, last}
"""


class BoundedRead(NamedTuple):
    """One read: the entries' fields (in order), how many entries were too large to be read, the last id seen,
    and the entries' ids."""

    entries: list[dict[str, Any]]
    oversized: int
    last: bytes
    ids: list[bytes] = []


async def read_bounded(link: "RedisLink", operation: str, key: str, after: bytes, count: int,
                       max_bytes: int) -> BoundedRead:
    """At most ``count`` entries of stream ``key`` after id ``after`` (``b"$"``: none, the stream's last id), those
    larger than ``max_bytes`` left in Redis; :class:`~.link.Unavailable` as :meth:`RedisLink.call`."""
    answer: Any = await link.call(operation, lambda client: client.eval(BOUNDED_READ, keys=[key],
                                                                        args=[after, count, max_bytes]))
    try:
        kept, oversized, last = answer
        entries = [dict(records.iter_fields(_pairs(fields))) for _, fields in kept]
        return BoundedRead(entries, len(oversized), records.entry_id(last),
                           [records.entry_id(identifier) for identifier, _ in kept])
    except (TypeError, ValueError):  # not what the script answers: nothing taken, read from the same place again
        return BoundedRead([], 0, after)


def _pairs(fields: Any) -> dict[Any, Any]:
    """A script's flat ``[name, value, ...]`` as a map."""
    if isinstance(fields, dict):
        return fields
    return dict(zip(fields[::2], fields[1::2]))


class Doorbell:
    """Rings (:meth:`wait` returns) when stream ``key`` changes, and once whenever its connection was (re)made.

    Its connection has client tracking on (RESP3): Redis remembers the key once this connection read it
    (``XLEN``) and pushes an invalidation, the key's name only, at the next change. The key is read again (armed)
    before the ring, so a change after the reader's next read rings again."""

    def __init__(self, settings: "StateConfig", key: str):
        self.settings = settings
        self.key = key
        self._rung = trio.Event()
        self._refusal_told = False

    async def wait(self, timeout: float) -> None:
        """Until the next ring, or ``timeout`` seconds."""
        with trio.move_on_after(timeout):
            await self._rung.wait()
        self._rung = trio.Event()

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                async with open_client(self.settings) as client:
                    connection = await client.connection_pool.get_connection()
                    try:
                        await self._request(connection, b"CLIENT", b"TRACKING", b"ON")
                        failures = 0
                        changed = True  # whatever came before it was armed
                        while True:
                            await self._request(connection, b"XLEN", self.key)
                            if changed:
                                self._rung.set()
                            changed = await self._pushed(connection)
                    finally:
                        connection.invalidate()
            except* Exception as group:  # Redis away, restarted or refusing: the reader's own reads say so; rebuild
                # (``except*``: the client's pool is a nursery, so an error that lands as this task is cancelled
                # comes in one group with the Cancelled, which goes on; the error must not go with it)
                failures += 1
                self._failed(group)
                self._rung.set()
            await RedisLink.backoff(failures)

    def _failed(self, exc: ExceptionGroup[Exception]) -> None:
        from coredis.exceptions import ResponseError

        refused: BaseException | None = exc.split(ResponseError)[0]
        while isinstance(refused, BaseExceptionGroup):
            refused = refused.exceptions[0]
        if refused is not None and not self._refusal_told:
            self._refusal_told = True
            log.warning("cluster state: Redis refused client tracking for stream %s (%s): it is read once a second "
                        "instead of as it changes (an ACL user needs CLIENT TRACKING; logged once)", self.key,
                        refused)
        else:
            log.debug("cluster state: the doorbell of stream %s failed (%s)", self.key, describe_error(exc))

    async def _request(self, connection: Any, *command: bytes | str) -> Any:
        with trio.fail_after(self.settings.timeout):
            return await connection.create_request(*command)

    @staticmethod
    async def _pushed(connection: "coredis.connection.BaseConnection") -> bool:
        """Whether Redis pushed an invalidation within ``ARMED_CHECK`` seconds."""
        messages = connection.push_messages
        try:
            with trio.move_on_after(ARMED_CHECK):
                await messages.__anext__()
                return True
            return False
        finally:
            await messages.aclose()


async def follow_stream(link: "RedisLink", operation: str, key: str,
                        take: Callable[[list[dict[str, Any]]], Awaitable[None] | None], *, stream: str,
                        max_bytes: Callable[[], int], count: int = 1000) -> None:
    """Forever: hand ``take`` the fields of the entries added to stream ``key`` from now on, at most ``count`` at a
    time (an async ``take`` is awaited before the next read, so it can apply a large entry in slices); an entry
    larger than ``max_bytes()`` is left unread and counted as a bad record of ``stream``. After a failure, and the
    backoff, only what is new again counts: what these streams carry is short-lived."""
    doorbell = Doorbell(link.settings, key)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(doorbell.run)
        position = b"$"
        failures = 0
        told = False
        while True:
            try:
                read = await read_bounded(link, operation, key, position, count, max_bytes())
            except Unavailable:
                failures += 1
                position = b"$"
                await link.backoff(failures)
                continue
            failures = 0
            position = read.last
            if read.oversized:
                link.metrics.bad_records.labels(stream).inc(read.oversized)
                if not told:
                    told = True
                    log.warning("cluster state: %d entries of stream %s larger than its senders write (%d bytes) "
                                "were skipped unread: someone else writes to this cluster's Redis keys "
                                "(llmgw_cluster_bad_records_total{stream=\"%s\"}; logged once)", read.oversized,
                                key, max_bytes(), stream)
            if read.entries:
                taken = take(read.entries)
                if taken is not None:
                    await taken
            if not read.entries and not read.oversized:  # read to its end: until it changes
                await doorbell.wait(BLOCK_MS / 1000)
