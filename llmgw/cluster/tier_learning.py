"""What routing tiers learn, shared between the gateway processes of a cluster (the tiers' side of it).

A tier gets a :class:`ModelLearning` through ``TierServices.learning`` (None
when the process is alone): it :meth:`~ModelLearning.publish` es what it
learnt (a kind and a small msgpack-able payload: the prefix tree's routed
text and replica, a cost model's observation of an engine's time to first
token) and :meth:`~ModelLearning.subscribe` s a handler per kind for what the
other processes learnt about the same model. Publishing only appends to a
bounded buffer (a full one drops, counted): the routing path never waits.
:class:`TierLearning` sends the buffer as one signed entry of the cluster's
``tiers`` stream as soon as there is something (:class:`~.outbox.Outbox`), and hands every other
process's items to the handlers of their model and kind (a handler that
fails is logged once, and the others still run).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import trio

from . import records
from .link import RedisLink
from .outbox import Outbox, opened
from .records import Keys
from .streams import follow_stream

if TYPE_CHECKING:
    from .metrics import ClusterMetrics

log = logging.getLogger(__name__)

TIERS_STREAM_LENGTH = 10_000
MAX_PENDING = records.MAX_TIER_ITEMS  # items waiting to be sent: a batch holds no more, the readers' bound too
Handler = Callable[[list[Any]], None]


class ModelLearning:
    """One model's view of the shared learning: what its tier publishes and which handlers hear the others."""

    def __init__(self, bus: "TierLearning", model: str):
        self.bus = bus
        self.model = model

    def publish(self, kind: str, payload: list[Any]) -> None:
        """Share ``payload`` (msgpack-able, small) with the other processes' tiers of this model; never blocks."""
        self.bus.put([self.model, kind, payload])

    def subscribe(self, kind: str, handler: Handler) -> None:
        """``handler(payload)`` for every ``kind`` item another process publishes for this model (the last
        handler subscribed per model and kind: a rebuilt tier replaces its predecessor)."""
        self.bus.handlers[(self.model, kind)] = handler


class TierLearning:
    def __init__(self, link: RedisLink, keys: Keys, metrics: "ClusterMetrics", origin: str,
                 signer: records.Signer | None = None):
        self.link = link
        self.keys = keys
        self.origin = origin
        self.signer = signer or records.Signer(None)
        self.handlers: dict[tuple[str, str], Handler] = {}
        self._pending: list[list[Any]] = []
        self._pending_bytes = 0  # their msgpack size, at most (records.tier_item_bytes): the readers' bound
        self._failed: set[tuple[str, str]] = set()
        self._counted = {direction: metrics.tier_learning.labels(direction)
                         for direction in ("sent", "received", "dropped", "ignored")}
        self.outbox = Outbox(link, keys.tiers, "tiers_send", TIERS_STREAM_LENGTH, origin, self.signer, self._take,
                             self._counted["sent"].inc, self._counted["dropped"].inc)

    def for_model(self, model: str) -> ModelLearning:
        return ModelLearning(self, model)

    def put(self, item: list[Any]) -> None:
        size = records.tier_item_bytes(item)
        if len(self._pending) >= MAX_PENDING or self._pending_bytes + size > records.MAX_TIER_BATCH_BYTES:
            self._counted["dropped"].inc()
            return
        self._pending.append(item)
        self._pending_bytes += size
        self.outbox.ready()

    def _take(self) -> list[list[Any]]:
        items, self._pending, self._pending_bytes = self._pending, [], 0
        return items

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.outbox.run)
            nursery.start_soon(partial(follow_stream, self.link, "tiers_read", self.keys.tiers, self.take_batches,
                                       stream="tiers",
                                       max_bytes=lambda: records.MAX_TIER_BATCH_BYTES + records.ENTRY_FIELDS_BYTES))
            task_status.started()

    def take_batches(self, batches: list[dict[str, Any]]) -> None:
        for fields in batches:
            self.take_batch(fields)

    def take_batch(self, fields: dict[str, Any]) -> None:
        """Hand another process's items to the handlers of their model and kind."""
        items = opened(fields, self.origin, self.signer, records.decode_tier_batch,
                       self.link.metrics.bad_records.labels("tiers").inc)
        if items is None:
            return
        for model, kind, payload in items:
            handler = self.handlers.get((model, kind))
            if handler is None:
                self._counted["ignored"].inc()
                continue
            try:
                handler(payload)
            except Exception:  # a payload a tier cannot use: logged once per model and kind, the rest go on
                self._counted["ignored"].inc()
                if (model, kind) not in self._failed:
                    self._failed.add((model, kind))
                    log.exception("cluster state: the %s tier learning of model %s could not be applied "
                                  "(logged once)", kind, model)
                continue
            self._counted["received"].inc()
