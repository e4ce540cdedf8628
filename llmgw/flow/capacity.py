"""One replica's capacity, learnt from its engine's own state: how many requests in flight (all gateways') it
takes before it queues or runs out of KV cache.

The rule (an AIMD loop on the engine's scraped gauges, at most one step per scrape):

- *cut*: the engine queues for seats or blocks (``waiting`` at least ``max(1, waiting_slack x running)`` on two
  scrapes in a row, and ``running`` no higher than at the first: a request that arrived between two engine steps
  waits for one step, and an engine still admitting its queue is ramping up, neither a sign of a full engine; and
  the queue is one of a full engine, :func:`queue_kind`) or its KV
  cache is nearly full (``kv_usage >= kv_high``): the capacity drops to what the engine was running (scaled down
  by ``kv_target / kv_usage`` when the cache is the limit), and at least by ``decrease`` (x0.9) when it already
  was that low. While more than the capacity is in flight (a burst sent before it was known, or a cut that has
  not taken effect yet) the engine's figure is taken as it is, even when higher: the engine proves it runs that
  many, and cutting again for requests that were sent before the last cut would drive the capacity to nothing;
- *raise*: the engine waits for nothing (or only for its step's token budget) and its cache is below
  ``kv_target``, while requests are held at a gateway
  for the model (``demand``) and the replica is at its capacity (``busy_share`` of it in flight, the most the
  lowest class fills): x``increase`` (at least +1);
- otherwise it stays.

Three queues look alike in the engine's ``waiting`` gauge (:func:`queue_kind`): for *seats* (every sequence slot
taken), for *blocks* (its free KV cache, ``(1 - kv_usage) x`` its blocks x block size, short of what the waiting
requests need: the room's estimate, ``needed_tokens``, of what the requests in flight there will hold less
what the cache holds now) and for the *step's token budget* (vLLM's
``max_num_batched_tokens``, which it does not export: a long prompt's chunked prefill takes a whole step's budget
and the requests behind it wait a step or two while the engine has free slots and cache). Only the first two say
the engine is full; a budget queue (fewer running than the engine was ever seen running, or than its seats, with
blocks for what waits) neither cuts nor stops a raise: cutting on it set a replica's capacity to what its engine
ran while it had seats and cache for more (docs/overload.md, "Where the room was lost"). An engine whose KV
capacity or usage is unknown, or a queue whose need the room cannot estimate, counts as full (the rule as it was).

Its *seats* (the sequences its engine runs at once, vLLM's ``--max-num-seqs``, which vLLM does not export) are
learnt beside it: the engine's ``running`` when it queues for seats (the same two-scrape queue as a cut) while its
KV cache is below ``kv_target``: then requests wait for a sequence slot. A queue for blocks (a long prompt waiting
for its blocks with the cache at 75%) or for the budget says nothing of the seats. Kept as the highest such figure, and
raised at once when the engine is seen running more. Unknown (None) until the engine queued so; an engine that
exports no KV usage never says which it queues for, and its seats stay unknown.

Before a replica's first scrape that says it is full, its capacity is *unknown* (None): the room does not hold
back for it (an unknown replica is not full). When its scrapes stop the last learnt value is kept, neither cut
nor raised: the engine's ``/metrics`` going quiet is no sign it emptied, and the in-flight
counts still fall as its requests end, so the room it gives back is real.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..engines.probe import EngineLoad

CUT, RAISE = "cut", "raise"
SEATS, BLOCKS, BUDGET = "seats", "blocks", "budget"  # what an engine's queue waits for (queue_kind)
QUEUE_KINDS = (SEATS, BLOCKS, BUDGET)
UNBOUNDED = 1 << 30  # the room of a model with a replica of unknown capacity (the room holds nothing back)
MAX_CAPACITY = 100_000  # requests in flight on one replica, at most (a forged or broken gauge cannot go beyond)


@dataclass(frozen=True, slots=True)
class CapacityRule:
    kv_high: float = 0.9  # KV usage at or above which the engine counts as full
    kv_target: float = 0.8  # KV usage below which a replica with demand may take more
    waiting_slack: float = 0.05  # waiting requests, as a share of the running ones, that are not yet a queue
    decrease: float = 0.9  # a cut is at least to this share of the capacity
    increase: float = 1.1  # a raise is to this share of it, at least +1
    min_capacity: int = 1  # never below: one request at a time still gets through


def queue_kind(load: EngineLoad, running: float, needed_tokens: float | None, seats: int | None,
               most_running: float, rule: CapacityRule) -> str:
    """What an engine's queue waits for. Sized (its free KV cache and ``needed_tokens`` known): BLOCKS when the
    cache is short of them, else SEATS when it runs as many as its seats (unknown: as many as it was ever seen
    running), else BUDGET (its step's token budget: a chunked prefill, or a request between two steps). Unsized:
    SEATS when it runs as many as it ever ran with its KV usage below ``kv_target``, else BLOCKS (the safe side)."""
    free = load.kv_free_tokens
    busiest = running >= max(1.0, most_running)
    if free is None or needed_tokens is None or not math.isfinite(free):
        kv = load.kv_usage
        return SEATS if busiest and kv is not None and kv < rule.kv_target else BLOCKS
    if free < needed_tokens:
        return BLOCKS
    return SEATS if busiest or (seats is not None and running >= seats) else BUDGET


@dataclass(slots=True)
class ReplicaCapacity:
    """What is learnt of one replica (one engine: a new engine starts unknown again)."""

    capacity: float | None = None  # requests in flight; None: unknown, do not hold back
    seen_at: float | None = None  # the ``at`` of the last scrape taken (each scrape counts once)
    queued_before: bool = False  # the previous scrape showed a queue
    running_before: float = 0.0  # and this many running
    cuts: int = 0
    raises: int = 0
    seats: int | None = None  # the sequences its engine runs at once; None: unknown
    most_running: float = 0.0  # the most it was seen running
    queue: str | None = None  # what its engine queued for on this scrape and the one before (QUEUE_KINDS), else None

    def limit(self) -> int | None:
        """The requests in flight it takes, None when unknown."""
        return None if self.capacity is None else int(self.capacity)

    def observe(self, load: EngineLoad, inflight: int, demand: bool, rule: CapacityRule,
                busy_share: float = 1.0, needed_tokens: float | None = None) -> str | None:
        """Learn from one scrape (``inflight``: the cluster's requests in flight there now; ``demand``: requests
        for its model wait at a gateway; ``busy_share``: the share of the capacity in flight from which the replica
        counts as at its capacity, the lowest class's ``max_fill``, since a class fills no more; ``needed_tokens``:
        the KV tokens its engine's waiting requests need, the room's estimate, None when it has none). Returns CUT,
        RAISE or None; a scrape already seen changes nothing."""
        if self.seen_at is not None and load.at <= self.seen_at:
            return None
        self.seen_at = load.at
        kv = load.kv_usage if load.kv_usage is not None and math.isfinite(load.kv_usage) else None
        running = load.running if math.isfinite(load.running) else 0.0
        waiting = load.waiting if math.isfinite(load.waiting) else 0.0
        queued = waiting >= max(1.0, rule.waiting_slack * running)
        queued_twice = queued and self.queued_before and running <= self.running_before
        self.queued_before, self.running_before = queued, running
        kind = queue_kind(load, running, needed_tokens, self.seats, self.most_running, rule) if queued else None
        self.queue = kind if queued_twice else None
        if self.seats is not None and running > self.seats:  # the engine proves it runs more
            self.seats = min(MAX_CAPACITY, math.floor(running))
        if queued_twice and kv is not None and kv < rule.kv_target and kind == SEATS:
            self.seats = max(self.seats or 0, min(MAX_CAPACITY, math.floor(running)))
        self.most_running = max(self.most_running, running)
        full = kind is not None and kind != BUDGET  # a queue for the step's budget is no sign of a full engine
        if (queued_twice and full) or (kv is not None and kv >= rule.kv_high):
            target = max(0.0, running)  # what the full engine runs, scaled to the KV target when KV is the limit
            if kv is not None and kv >= rule.kv_high:
                target *= rule.kv_target / kv
            if self.capacity is not None and inflight <= self.capacity:  # full at its capacity: lower it
                target = min(target, self.capacity * rule.decrease)
            # Else it is unknown, or more than it is in flight (sent before it was learnt, or it was cut since):
            # the engine's own figure is the estimate, up or down.
            return self._set(target, rule)
        if self.capacity is None or not demand or full or (kv is not None and kv >= rule.kv_target):
            return None
        if inflight < self.capacity * busy_share - 1:  # not at its capacity: no sign it can take more
            return None
        return self._set(max(self.capacity + 1, self.capacity * rule.increase), rule)

    def _set(self, target: float, rule: CapacityRule) -> str | None:
        """Capacity to ``target`` (whole, within bounds); CUT when it went down (or was unknown), RAISE up."""
        before = self.capacity
        self.capacity = float(min(MAX_CAPACITY, max(rule.min_capacity, math.floor(target))))
        if before is not None and self.capacity == before:
            return None
        if before is None or self.capacity < before:
            self.cuts += 1
            return CUT
        self.raises += 1
        return RAISE
