"""A held burst's ramp: how many requests in flight a replica that appears while requests for its model are held
may take, so that it gets them oldest first and never all in one instant.

An unknown replica is not full (:mod:`.capacity`): nothing is held back for it. But when requests are already
held, a replica that appears (the first after a start from zero, the only one back after its engine restarted or
an outage, an extra one after a step) would take the whole backlog in one instant, and its engine takes them in
the order their connections land, not the order they arrived: the oldest may wait behind dozens of later ones
(docs/autoscaling.md, "From zero: the held burst"). So while requests for its model are held, such a replica
takes :data:`START` requests in flight, the queue dispatching its oldest first (band, fair order, arrival), and the
ramp doubles on each scrape that shows them all in flight with its engine's KV cache below ``kv_target``.

A pace, not a cap: the engine's queue is first come, first served, so the requests it queues arrive in the order
the queue sent them, and the ramp goes on past a capacity learnt meanwhile. Capped at the learnt capacity, an
engine of 2 sequences ran one request of the ``standard`` class at a time (its ``max_fill`` keeps the other seat
for ``interactive``) and 75 of the bench's 109 requests expired held (docs/benchmarks/autoscale.md). Once nothing
is held, the ramp ends and the room is the capacity learnt, or unbounded while none is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..engines.probe import EngineLoad
from .capacity import MAX_CAPACITY, CapacityRule

# Requests in flight a replica starts its ramp with: its engine runs at least this many sequences at once (vLLM
# does not export its --max-num-seqs), so the oldest are never queued in it behind later ones.
START = 2


@dataclass(slots=True)
class Ramp:
    """One replica's ramp through a held burst."""

    limit: int  # requests in flight it may take now
    started: float  # the room's clock when it began
    held: int  # the requests held (at every gateway) when it began
    seen_at: float | None = None  # the ``at`` of the last scrape taken (each scrape counts once)
    doublings: int = 0

    def observe(self, load: EngineLoad, inflight: int, rule: CapacityRule, busy_share: float = 1.0) -> bool:
        """Learn from one scrape (``inflight``: every gateway's requests in flight there now): double the limit
        when they fill it (its ``busy_share``, the lowest class's ``max_fill``: a class fills no more) and the
        engine's KV cache is below ``kv_target``. True when it doubled."""
        if self.seen_at is not None and load.at <= self.seen_at:
            return False
        self.seen_at = load.at
        kv = load.kv_usage if load.kv_usage is not None and math.isfinite(load.kv_usage) else None
        if kv is None and load.kv_usage is not None or (kv is not None and kv >= rule.kv_target):
            return False  # a broken gauge says nothing of the room left
        if inflight < max(1, math.floor(self.limit * busy_share)) or self.limit >= MAX_CAPACITY:
            return False
        self.limit = min(MAX_CAPACITY, self.limit * 2)
        self.doublings += 1
        return True
