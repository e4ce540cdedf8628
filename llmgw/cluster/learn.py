"""What routing learns is shared: each process's predictions reach every other process's KV index through Redis.

When the ``kv_index`` tier routes a request it *predicts* that the chosen
replica holds the prompt's blocks (:meth:`~llmgw.kv.index.KvIndex.predict`),
so that the next requests sharing the prefix go there too before the engine's
events arrive. :class:`PredictionSharing` makes that true across the gateway
processes of a cluster:

- the index's prediction listener (:meth:`PredictionSharing.heard`, on the
  routing path) only appends ``(replica, wall clock ms, ttl ms, keys)`` to a
  bounded buffer; a full buffer drops the prediction (counted): routing never
  waits on anything here;
- a background task sends what accumulated as one stream entry (one ``XADD``,
  the stream trimmed to about ``LEARN_STREAM_LENGTH`` entries) as soon as there
  is something; while it waits on Redis the next batch accumulates;
- every process reads the stream (a blocking read with a deadline) and applies
  the *other* origins' predictions with ``predict(..., remote=True)``: the
  listener does not hear them (no echo), and they count for what is left of
  their ``ttl``, from when the origin made them (its wall clock, so clocks
  within a fraction of the ttl: same host, or NTP); a prediction already
  expired, or for a replica not in this process's table or unknown to its
  index, is ignored.

A remote prediction then lives and ends as a local one does (its ttl, a store
of its blocks settling it, a RESET or forget dropping it), except that nothing
here unpredicts it when the other process's request fails: it expires.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import trio

from . import records
from .link import RedisLink
from .outbox import Outbox, opened
from .records import Keys
from .streams import follow_stream

if TYPE_CHECKING:
    from ..kv.index import KvIndex
    from ..router.replicas import ReplicaSet
    from .metrics import ClusterMetrics

LEARN_STREAM_LENGTH = 10_000  # entries kept (approximately): only the last few seconds' matter
MAX_PENDING = records.LEARN_MAX_PREDICTIONS  # predictions waiting to be sent: a batch holds no more
MAX_PENDING_KEYS = records.LEARN_MAX_KEYS  # their block keys (a batch stays a few MB); the readers' bound too
ENTRIES_PER_READ = 1000
KEYS_PER_SLICE = 16_384  # a received batch is applied this many keys at a time, the loop served in between


class PredictionSharing:
    """This process's predictions to the cluster's ``learn`` stream, the other processes' into its KV index."""

    def __init__(self, link: RedisLink, keys: Keys, replicas: "ReplicaSet", kv_index: "KvIndex",
                 metrics: "ClusterMetrics", origin: str, signer: records.Signer | None = None,
                 wall_clock: Callable[[], float] = time.time):
        self.link = link
        self.signer = signer or records.Signer(None)
        self.keys = keys
        self.replicas = replicas
        self.kv_index = kv_index
        self.metrics = metrics
        self.origin = origin
        self.wall_clock = wall_clock
        self._pending: list[tuple[str, int, int, Sequence[int]]] = []
        self._pending_keys = 0
        # A remote prediction lives at most as long as this process's tiers predict for (their predicted_ttl: the
        # index's default, or the longest one heard here), never the 600 s a sender could write.
        self.ttl_limit_ms = int(kv_index.predicted_ttl * 1000)
        self._counted = {direction: metrics.predictions.labels(direction)
                         for direction in ("sent", "received", "dropped", "ignored")}
        self.outbox = Outbox(link, keys.learn, "learn_send", LEARN_STREAM_LENGTH, origin, self.signer,
                             self.take_pending, self._counted["sent"].inc, self._counted["dropped"].inc)
        kv_index.add_prediction_listener(self.heard)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.outbox.run)
            nursery.start_soon(self._receive)
            task_status.started()

    # -- this process's predictions --------------------------------------------------------------------------------

    def heard(self, replica_id: str, keys: Sequence[int], ttl: float) -> None:
        """The index's prediction listener (the routing path): buffer it, or drop it when the buffer is full."""
        if len(self._pending) >= MAX_PENDING or self._pending_keys + len(keys) > MAX_PENDING_KEYS:
            self._counted["dropped"].inc()
            return
        ttl_ms = min(int(ttl * 1000), records.MAX_LEARNED_TTL_MS)
        if ttl_ms > self.ttl_limit_ms:
            self.ttl_limit_ms = ttl_ms
        self._pending.append((replica_id, int(self.wall_clock() * 1000), ttl_ms, keys))
        self._pending_keys += len(keys)
        self.outbox.ready()

    def take_pending(self) -> list[list[Any]]:
        """What accumulated, as learn items, and an empty buffer; those that expired waiting are dropped."""
        pending, self._pending, self._pending_keys = self._pending, [], 0
        now_ms = int(self.wall_clock() * 1000)
        items = [records.learn_item(replica, made, ttl, keys) for replica, made, ttl, keys in pending
                 if made + ttl > now_ms]
        if len(items) < len(pending):
            self._counted["dropped"].inc(len(pending) - len(items))
        return items

    # -- the others' predictions -----------------------------------------------------------------------------------

    async def _receive(self) -> None:
        await follow_stream(self.link, "learn_read", self.keys.learn, self.take_batches, stream="learn",
                            max_bytes=lambda: records.LEARN_MAX_BYTES + records.ENTRY_FIELDS_BYTES,
                            count=ENTRIES_PER_READ)

    async def take_batches(self, batches: list[dict[str, Any]]) -> None:
        for fields in batches:
            await self.take_batch(fields)

    async def take_batch(self, fields: dict[str, Any]) -> int:
        """Apply one stream entry's predictions if another process made them, ``KEYS_PER_SLICE`` keys at a time
        with a checkpoint in between (a batch of the sender's largest never stalls the loop); how many were
        applied."""
        predictions = opened(fields, self.origin, self.signer,
                             lambda raw: records.decode_learn_batch(raw, self.ttl_limit_ms),
                             self.metrics.bad_records.labels("learn").inc, records.LEARN_MAX_BYTES)
        if not predictions:
            return 0
        routed = {replica.name for replica in self.replicas}
        applied = 0
        in_slice = 0
        for prediction in predictions:
            if prediction.replica not in routed:
                continue
            for start in range(0, max(len(prediction.keys), 1), KEYS_PER_SLICE):
                if in_slice >= KEYS_PER_SLICE:
                    in_slice = 0
                    await trio.lowlevel.checkpoint()
                part = prediction.keys[start:start + KEYS_PER_SLICE]
                in_slice += len(part)
                age = min(max(int(self.wall_clock() * 1000) - prediction.made_ms, 0), prediction.ttl_ms)
                left = (prediction.ttl_ms - age) / 1000
                if left <= 0 or self.kv_index.predict(prediction.replica, part, left, remote=True) is None:
                    break
            else:
                applied += 1
        self._counted["received"].inc(applied)
        if applied < len(predictions):
            self._counted["ignored"].inc(len(predictions) - applied)
        return applied
