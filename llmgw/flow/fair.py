"""One band's fair order: its flows share the dispatches by tokens in proportion to their weight, FCFS within a flow.

Start-time fair queueing (SFQ) by tokens: each flow has a virtual time, the tokens it was dispatched divided by its
weight; the next request dispatched is the head of the backlogged flow with the smallest virtual time (the oldest
flow on a tie), which then advances by ``cost / weight``. So two backlogged flows of equal weight are never more
than one request's cost apart in tokens at any moment (not only at the end of a round, as with deficit round
robin), whatever their requests' sizes, and a flow that starts (or comes back) begins at the band's virtual time,
the start of the last request dispatched: it neither inherits credit for the time it was away nor owes for it. A
cancelled request leaves its flow's virtual time as it was, so nothing is to be repaired when a waiter leaves.

Cost: O(log flows) per push and pop (a heap of the backlogged flows, stale entries skipped), O(requests of that
flow) to remove a request from the middle of its flow.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

MIN_WEIGHT = 1e-3  # a weight of 0 (or less) would divide by zero: such a flow is served, slowly


class Fair(Protocol):
    """What the band needs of a queued item."""

    @property
    def flow(self) -> str: ...
    @property
    def cost(self) -> int: ...
    @property
    def weight(self) -> float: ...


Item = TypeVar("Item", bound=Fair)


class _Flow(Generic[Item]):
    __slots__ = ("name", "items", "tokens", "vtime", "entry")

    def __init__(self, name: str, vtime: float):
        self.name = name
        self.items: deque[Item] = deque()
        self.tokens = 0  # the costs of its items
        self.vtime = vtime
        self.entry = -1  # the sequence number of its valid heap entry; -1 while it has nothing waiting


class FairBand(Generic[Item]):
    """The requests of one band, in fair order. ``tokens``: the sum of their costs."""

    def __init__(self) -> None:
        self._flows: dict[str, _Flow[Item]] = {}
        self._heap: list[tuple[float, int, _Flow[Item]]] = []
        self._seq = 0
        self._vnow = 0.0  # the band's virtual time: the start of the last request dispatched
        self._members: dict[Item, None] = {}  # every item waiting, in arrival order
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self) -> Iterator[Item]:
        """The items waiting, oldest first."""
        return iter(self._members)

    def newest_first(self) -> Iterator[Item]:
        """The items waiting, newest first."""
        return reversed(self._members)

    def newest(self) -> Item | None:
        return next(reversed(self._members), None)

    def push(self, item: Item) -> None:
        flow = self._flows.get(item.flow)
        if flow is None:
            flow = self._flows[item.flow] = _Flow(item.flow, self._vnow)
        flow.items.append(item)
        flow.tokens += item.cost
        self._members[item] = None
        self.tokens += item.cost
        if len(flow.items) == 1:
            flow.vtime = max(flow.vtime, self._vnow)
            self._schedule(flow)

    def peek(self) -> Item | None:
        """The item to dispatch next (None: none waits)."""
        heap = self._heap
        while heap:
            _, seq, flow = heap[0]
            if flow.entry == seq:
                return flow.items[0]
            heapq.heappop(heap)  # stale: its flow emptied or was scheduled again since
        return None

    def pop(self) -> Item | None:
        """Take the item :meth:`peek` names, advancing its flow's virtual time by its cost over its weight."""
        item = self.peek()
        if item is None:
            return None
        _, _, flow = heapq.heappop(self._heap)
        flow.items.popleft()
        self._forget_member(item, flow)
        self._vnow = flow.vtime
        flow.vtime += item.cost / max(item.weight, MIN_WEIGHT)
        if flow.items:
            self._schedule(flow)
        else:
            self._idle(flow)
        return item

    def remove(self, item: Item) -> None:
        """Take ``item`` out wherever it is (it left); its flow's virtual time is unchanged."""
        if item not in self._members:
            return
        flow = self._flows[item.flow]
        flow.items.remove(item)
        self._forget_member(item, flow)
        if not flow.items:  # else its heap entry stands: it is keyed by the flow's virtual time, not its head
            self._idle(flow)

    def tokens_before(self, flow_name: str, weight: float) -> int:
        """The tokens this band would dispatch before a request of ``flow_name`` arriving now (an estimate): the
        requests its flow has waiting, and of every other flow what it is served until the band's virtual time
        reaches this request's start. O(flows)."""
        own = self._flows.get(flow_name)
        waiting = own.tokens if own is not None else 0
        start = self.start_of(flow_name, weight)
        total = float(waiting)
        for flow in self._flows.values():
            if flow is own or not flow.items:
                continue
            total += min(flow.tokens, max(0.0, start - flow.vtime) * max(flow.items[0].weight, MIN_WEIGHT))
        return math.ceil(total)

    def start_of(self, flow_name: str, weight: float) -> float:
        """The virtual start of a request of ``flow_name`` arriving now: it is dispatched once the band's virtual
        time (:attr:`vnow`) has reached it."""
        own = self._flows.get(flow_name)
        if own is None:
            return self._vnow
        return max(own.vtime, self._vnow) + own.tokens / max(weight, MIN_WEIGHT)

    @property
    def vnow(self) -> float:
        """The band's virtual time: the start of the last request dispatched (it never goes back)."""
        return self._vnow

    def _forget_member(self, item: Item, flow: _Flow[Item]) -> None:
        del self._members[item]
        self.tokens -= item.cost
        flow.tokens -= item.cost

    def _schedule(self, flow: _Flow[Item]) -> None:
        self._seq += 1
        flow.entry = self._seq
        heapq.heappush(self._heap, (flow.vtime, self._seq, flow))

    def _idle(self, flow: _Flow[Item]) -> None:
        flow.entry = -1
        # A flow ahead of the band's virtual time is remembered, so that leaving and coming back cannot clear its
        # lead; the others would start at the band's time anyway. Those remembered are swept once they are many.
        if flow.vtime <= self._vnow:
            del self._flows[flow.name]
        elif len(self._flows) > 1024 + 2 * len(self._members):
            self._flows = {name: f for name, f in self._flows.items() if f.items or f.vtime > self._vnow}
