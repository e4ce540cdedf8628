"""A held burst's slow start: how many requests in flight a replica whose capacity is still unknown may take while
requests for its model are held at a gateway.

An unknown replica is not full (:mod:`.capacity`): nothing is held back for it. But when requests are already
held, a replica that appears (the first after a start from zero, the only one back after its engine restarted or
an outage, an extra one after a step) would take the whole backlog in one instant, and its engine takes them in
the order their connections land, not the order they arrived: the oldest may wait behind dozens of later ones
(docs/autoscaling.md, "Where the seconds of a start go"). So while requests for its model are held, such a
replica takes :data:`START` requests in flight, the queue dispatching its oldest first (band, fair order,
arrival), and the ramp doubles on each scrape that shows its engine running all it was given without a queue
and with its KV cache below ``kv_target``. Once its engine queues, its capacity is learnt as for any replica and
the ramp no longer counts; once nothing is held, it ends (the room is unbounded again until a capacity is learnt).
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

    def observe(self, load: EngineLoad, inflight: int, rule: CapacityRule) -> bool:
        """Learn from one scrape (``inflight``: every gateway's requests in flight there now): double the limit
        when they fill it and the engine neither queues nor fills its KV cache. True when it doubled."""
        if self.seen_at is not None and load.at <= self.seen_at:
            return False
        self.seen_at = load.at
        running = load.running if math.isfinite(load.running) else 0.0
        waiting = load.waiting if math.isfinite(load.waiting) else math.inf
        kv = load.kv_usage if load.kv_usage is not None and math.isfinite(load.kv_usage) else None
        if waiting >= max(1.0, rule.waiting_slack * running) or (kv is not None and kv >= rule.kv_target):
            return False
        if inflight < self.limit or self.limit >= MAX_CAPACITY:
            return False
        self.limit = min(MAX_CAPACITY, self.limit * 2)
        self.doublings += 1
        return True
