"""The gateway queue (llmgw/flow/queue.py) against a fake room, on Trio's mock clock: bands, fair shares, deadlines,
overflow, Retry-After, cancellation and the fast path."""

from __future__ import annotations

import math
import random
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings, strategies as st
from prometheus_client import CollectorRegistry

from llmgw.flow import queue as flow_queue
from llmgw.flow.fair import FairBand
from llmgw.flow.interfaces import Room
from llmgw.flow.metrics import FlowMetrics
from llmgw.flow.model import (
    DEFAULT_CLASSES,
    EXPIRED,
    OVERFLOW,
    UNSERVABLE,
    Admitted,
    FlowRequest,
    FlowSettings,
    PriorityClass,
    Shed,
)
from llmgw.flow.queue import FlowQueue, Queued
from llmgw.flow.shedding import (
    ERRORS_LEARNT,
    FACTOR_MAX,
    IDLE_IN_TIME,
    MAX_MARKS,
    TURN_IN_TIME,
    UNKNOWN,
    VERDICTS,
    WOULD_EXPIRE,
    Verdicts,
    WaitErrors,
    unservable_on_arrival,
)

INTERACTIVE, STANDARD, BATCH, BEST_EFFORT = DEFAULT_CLASSES
MODEL = "m"


class FakeRoom(Room):
    """``capacity`` requests per model (of which a class may fill its ``max_fill`` with ``fill``); ``inflight``:
    the routed ones. ``kv_tokens``: the KV capacity in tokens, of which a class fills its ``max_fill`` (None:
    unknown, the tokens hold nothing back); ``inflight_tokens``: the routed ones' costs."""

    def __init__(self, capacity: int, fill: bool = False, kv_tokens: int | None = None):
        self.capacity = capacity
        self.fill = fill
        self.kv_tokens = kv_tokens
        self.prompt_ratio = 1.0  # engine tokens per estimated prompt token, as EngineRoom learns it
        self.inflight = 0
        self.inflight_tokens = 0
        self.held: dict[str, int] = {}  # a class's room forced to 0 (by name): a room that is not monotonic
        self.broken = False  # free() raises: a bug in the room
        self.ramping_now = False  # a replica takes the held requests in a ramp
        self._changed = trio.Event()

    def free(self, model: str, priority: PriorityClass) -> int:
        if self.broken:
            raise ZeroDivisionError("a bug in the room")
        if priority.name in self.held:
            return 0
        return math.floor(self.capacity * (priority.max_fill if self.fill else 1.0)) - self.inflight

    def fits(self, model: str, priority: PriorityClass, tokens: int, output: int = 0) -> bool:
        if self.kv_tokens is None:
            return True
        need = round((tokens - output) * self.prompt_ratio) + output
        return need <= math.floor(self.kv_tokens * priority.max_fill) - self.inflight_tokens

    async def changed(self, model: str) -> None:
        with trio.move_on_after(0.05):
            await self._changed.wait()

    def wake(self, model: str) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def saturation(self, model: str) -> float:
        return self.inflight / self.capacity

    def ramping(self, model: str) -> bool:
        return self.ramping_now


def request(priority: PriorityClass = STANDARD, flow: str = "a", cost: int = 100, *, wait: float | None = None,
            weight: float = 1.0, output: int = 0, prompt: int | None = None) -> FlowRequest:
    deadline = trio.current_time() + (priority.max_wait if wait is None else wait)
    return FlowRequest(MODEL, flow, priority, cost, deadline, weight, output=output, prompt=prompt)


class Harness:
    """A queue in a nursery and a data plane of sorts: an admitted request is routed (in flight on the fake room)
    for ``hold`` seconds, then finishes and wakes the room."""

    def __init__(self, nursery: trio.Nursery, capacity: int, flow_settings: FlowSettings | None = None,
                 fill: bool = False, kv_tokens: int | None = None):
        self.registry = CollectorRegistry()
        self.room = FakeRoom(capacity, fill, kv_tokens)
        self.queue = FlowQueue(flow_settings or FlowSettings(), self.room, FlowMetrics(self.registry))
        self.nursery = nursery
        self.admitted: list[FlowRequest] = []
        self.outcomes: dict[int, Admitted | Shed] = {}

    @classmethod
    async def open(cls, nursery: trio.Nursery, capacity: int, flow_settings: FlowSettings | None = None,
                   fill: bool = False, kv_tokens: int | None = None) -> Harness:
        h = cls(nursery, capacity, flow_settings, fill, kv_tokens)
        await nursery.start(h.queue.run)
        return h

    async def serve(self, req: FlowRequest, hold: float = 1.0) -> None:
        outcome = await self.queue.enter(req)
        self.outcomes[id(req)] = outcome
        if isinstance(outcome, Admitted):
            assert self.room.inflight + self.pending() <= self.room.capacity, "admitted beyond the room"
            if self.room.kv_tokens is not None:
                assert self.room.inflight_tokens + self.pending_tokens() <= self.room.kv_tokens, \
                    "admitted beyond the KV room"
            self.admitted.append(req)
            self.room.inflight += 1
            self.room.inflight_tokens += req.cost
            self.queue.release(outcome)
            try:
                await trio.sleep(hold)
            finally:  # finished, or its client left: the replica's place is free again either way
                self.room.inflight -= 1
                self.room.inflight_tokens -= req.cost
                self.room.wake(MODEL)

    def start(self, req: FlowRequest, hold: float = 1.0) -> FlowRequest:
        self.nursery.start_soon(self.serve, req, hold)
        return req

    def pending(self) -> int:
        return self.queue.snapshot().get(MODEL, {}).get("pending", 0)

    def pending_tokens(self) -> int:
        return self.queue.snapshot().get(MODEL, {}).get("pending_tokens", 0)

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


async def occupy(h: Harness, n: int, hold: float) -> None:
    """Fill ``n`` places of the room for ``hold`` seconds (requests of another flow, admitted at once)."""
    for _ in range(n):
        h.start(request(INTERACTIVE, flow="occupant", cost=1), hold)
    await trio.testing.wait_all_tasks_blocked()


@asynccontextmanager
async def harness(capacity: int, flow_settings: FlowSettings | None = None, fill: bool = False,
                  kv_tokens: int | None = None):
    """A :class:`Harness` whose tasks (the queue, the requests it started) are cancelled at the block's end."""
    async with trio.open_nursery() as nursery:
        yield await Harness.open(nursery, capacity, flow_settings, fill, kv_tokens)
        nursery.cancel_scope.cancel()


def run_on_mock_clock(fn) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


# The fast path.


def admitted_at_once(queue: FlowQueue, req: FlowRequest) -> Admitted | None:
    """The outcome of ``req``'s fast path: Admitted when it returned without awaiting, None when it must wait."""
    coroutine = queue.enter(req)
    try:
        coroutine.send(None)
    except StopIteration as done:
        assert isinstance(done.value, Admitted)
        return done.value
    except RuntimeError:  # the slow path, with no run() started
        return None
    coroutine.close()
    return None


async def test_a_request_with_room_is_admitted_without_awaiting():
    queue = FlowQueue(FlowSettings(), FakeRoom(4))  # run() not even started: the fast path needs no task
    coroutine = queue.enter(request())
    with pytest.raises(StopIteration) as done:
        coroutine.send(None)
    outcome = done.value.value
    assert isinstance(outcome, Admitted) and outcome.waited == 0.0 and outcome.position == 0
    assert queue.snapshot()[MODEL]["pending"] == 1
    queue.release(outcome)
    assert queue.snapshot()[MODEL]["pending"] == 0


async def test_an_admission_holds_its_place_until_released(autojump_clock):
    async with harness(capacity=1) as h:
        first = await h.queue.enter(request())
        assert isinstance(first, Admitted)
        # Not released yet: the room still says 1 free, but the queue counts the admission as pending.
        late = h.start(request(wait=0.5))
        await trio.sleep(1)
        assert isinstance(h.outcomes[id(late)], Shed)
        h.queue.release(first)


async def test_an_arrival_queues_behind_a_waiter_of_its_class_even_when_room_appears(autojump_clock):
    async with harness(capacity=1) as h:
        await occupy(h, 1, hold=1.0)
        first = h.start(request(flow="a"), hold=10)
        await trio.testing.wait_all_tasks_blocked()
        h.room.capacity = 2  # room for one more; the dispatcher has not looked yet when the next one arrives
        second = h.start(request(flow="b"), hold=10)
        await trio.testing.wait_all_tasks_blocked()
        assert h.admitted[1:] == [first]  # the waiter got the place, the arrival waits
        await trio.sleep(1.5)  # the occupant finished
        assert h.admitted[1:] == [first, second]


async def test_lower_classes_admitted_at_once_while_nothing_of_their_class_or_above_waits(autojump_clock):
    async with harness(capacity=10, fill=True) as h:
        await occupy(h, 9, hold=5.0)
        # interactive may fill 100%, standard 95% (9 of 10): a standard request waits, an interactive one does not.
        waiting = h.start(request(STANDARD))
        await trio.testing.wait_all_tasks_blocked()
        assert id(waiting) not in h.outcomes
        quick = await h.queue.enter(request(INTERACTIVE))
        assert isinstance(quick, Admitted) and quick.waited == 0.0
        h.queue.release(quick)


# Bands.


async def test_a_lower_band_waits_while_a_higher_one_waits(autojump_clock):
    async with harness(capacity=1) as h:
        await occupy(h, 1, hold=1.0)
        batch = [h.start(request(BATCH, flow=f"b{i}"), hold=1.0) for i in range(3)]
        await trio.testing.wait_all_tasks_blocked()
        interactive = [h.start(request(INTERACTIVE, flow=f"i{i}", wait=30), hold=1.0) for i in range(3)]
        await trio.sleep(20)
        later = h.admitted[1:]  # (tasks started together begin in any order: compare the bands as sets)
        assert set(map(id, later[:3])) == set(map(id, interactive)) and set(map(id, later[3:])) == set(map(id, batch))


async def test_a_band_is_held_while_a_band_above_waits_even_with_room_for_it(autojump_clock):
    async with harness(capacity=1) as h:
        h.room.held["interactive"] = 0  # no room for interactive requests, room for the others
        interactive = h.start(request(INTERACTIVE, wait=30))
        await trio.testing.wait_all_tasks_blocked()
        batch = h.start(request(BATCH))
        await trio.sleep(1)
        assert h.admitted == []
        del h.room.held["interactive"]
        h.room.wake(MODEL)
        await trio.testing.wait_all_tasks_blocked()
        assert h.admitted == [interactive]
        await trio.sleep(1.1)
        assert h.admitted == [interactive, batch]


# Fair shares within a band.


def tokens_by_flow(admitted: list[FlowRequest]) -> dict[str, int]:
    out: dict[str, int] = {}
    for req in admitted:
        out[req.flow] = out.get(req.flow, 0) + req.cost
    return out


async def test_a_burst_of_one_flow_does_not_starve_another_of_its_band(autojump_clock):
    async with harness(capacity=2) as h:
        await occupy(h, 2, hold=0.5)
        for i in range(200):  # the burst arrives first, in big requests
            h.start(request(flow="burst", cost=900 + (i % 3) * 100, wait=1000), hold=0.5)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(600):
            h.start(request(flow="steady", cost=300, wait=1000), hold=0.5)
        await trio.sleep(60)  # 240 dispatches: both flows still backlogged
        shares = tokens_by_flow(h.admitted[2:])
        assert len(h.admitted) - 2 > 100 and sum(shares.values()) > 50_000
        assert abs(shares["burst"] - shares["steady"]) <= 0.1 * max(shares.values()), shares


async def test_flows_share_in_proportion_to_their_weights(autojump_clock):
    async with harness(capacity=1) as h:
        await occupy(h, 1, hold=0.1)
        for _ in range(300):
            h.start(request(flow="heavy", cost=100, weight=2.0, wait=1000), hold=0.1)
            h.start(request(flow="light", cost=100, weight=1.0, wait=1000), hold=0.1)
        await trio.sleep(15)  # 150 dispatches of 600
        shares = tokens_by_flow(h.admitted[1:])
        assert abs(shares["heavy"] - 2 * shares["light"]) <= 200, shares


costs = st.integers(min_value=1, max_value=5000)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.sampled_from("ab"), costs), st.just("pop")), max_size=200))
def test_two_backlogged_equal_flows_stay_within_one_request_of_each_other(events):
    """Any interleaving of arrivals of two flows and dispatches made while both have requests waiting: the tokens
    dispatched to each never differ by more than the largest request's cost."""

    class Item:
        def __init__(self, flow: str, cost: int):
            self.flow, self.cost, self.weight = flow, cost, 1.0

    band: FairBand[Item] = FairBand()
    waiting = {"a": 0, "b": 0}
    served = {"a": 0, "b": 0}
    largest = 0
    for event in [("a", 1), ("b", 1), *events]:  # both flows start together
        if event == "pop":
            if not (waiting["a"] and waiting["b"]):
                continue
            item = band.pop()
            assert item is not None
            waiting[item.flow] -= 1
            served[item.flow] += item.cost
            assert abs(served["a"] - served["b"]) <= largest
        else:
            flow, cost = event
            band.push(Item(flow, cost))
            waiting[flow] += 1
            largest = max(largest, cost)
    assert len(band) == sum(waiting.values()) and band.tokens >= 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from("ab"), costs), min_size=2, max_size=40))
def test_the_dispatcher_keeps_two_backlogged_flows_within_one_request(arrivals):
    """Through the queue: requests of two flows arrive in any interleaving while the model is full, then are
    dispatched one at a time; while both still wait, their tokens never differ by more than the largest cost."""
    arrivals = [("a", 1), ("b", 1), *arrivals]

    async def main() -> None:
        async with harness(capacity=1) as h:
            await occupy(h, 1, hold=1.0)
            for flow, cost in arrivals:  # one at a time: the arrival order is the list's
                h.start(request(flow=flow, cost=cost, wait=1e6), hold=1.0)
                await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(len(arrivals) + 2)
            left = {"a": sum(1 for f, _ in arrivals if f == "a"), "b": sum(1 for f, _ in arrivals if f == "b")}
            served = {"a": 0, "b": 0}
            largest = max(cost for _, cost in arrivals)
            for req in h.admitted[1:]:
                if not (left["a"] and left["b"]):
                    break
                left[req.flow] -= 1
                served[req.flow] += req.cost
                assert abs(served["a"] - served["b"]) <= largest
            assert len(h.admitted) == len(arrivals) + 1

    run_on_mock_clock(main)


def test_a_flow_that_leaves_and_comes_back_keeps_neither_credit_nor_debt_beyond_a_request():
    class Item:
        def __init__(self, flow: str, cost: int):
            self.flow, self.cost, self.weight = flow, cost, 1.0

    band: FairBand[Item] = FairBand()
    band.push(Item("b", 100))
    for _ in range(50):
        band.push(Item("a", 100))
    assert [band.pop().flow for _ in range(21)] == ["b"] + ["a"] * 20  # type: ignore[union-attr]
    for _ in range(10):  # b was away while a was served: it starts level with a, not 20 requests behind
        band.push(Item("b", 100))
    order = [band.pop().flow for _ in range(6)]  # type: ignore[union-attr]
    assert order == ["b", "a", "b", "a", "b", "a"]


def test_the_tokens_before_an_arrival_are_its_flows_and_the_others_fair_shares():
    class Item:
        def __init__(self, flow: str, cost: int, weight: float = 1.0):
            self.flow, self.cost, self.weight = flow, cost, weight

    band: FairBand[Item] = FairBand()
    for _ in range(100):
        band.push(Item("heavy", 100))
    assert band.tokens_before("new", 1.0) == 0  # level with heavy's head: next (or right after it)
    for _ in range(3):
        band.push(Item("light", 100))
    assert band.tokens_before("light", 1.0) == 300 + 300  # its own three, and heavy's as many meanwhile
    assert band.tokens_before("light", 3.0) == 300 + 100  # with three times the weight, a third of it
    assert band.tokens_before("heavy", 1.0) == 10_000 + 300  # behind its own burst, light all served first


def test_removing_a_request_keeps_the_bands_order_and_counts():
    class Item:
        def __init__(self, flow: str, cost: int):
            self.flow, self.cost, self.weight = flow, cost, 1.0

    band: FairBand[Item] = FairBand()
    a1, a2, b1 = Item("a", 10), Item("a", 20), Item("b", 30)
    for item in (a1, a2, b1):
        band.push(item)
    band.remove(a1)  # the head of its flow
    band.remove(a1)  # twice: nothing
    assert len(band) == 2 and band.tokens == 50 and band.newest() is b1
    assert [band.pop(), band.pop(), band.pop()] == [a2, b1, None]


# Deadlines, the drain rate and Retry-After.


async def measure_drain(h: Harness, rate_tokens: int = 1000, priority: PriorityClass = INTERACTIVE) -> None:
    """Keep a backlog for 2 s while requests of 100 tokens (of ``priority``) go through one place every 0.1 s:
    1,000 tokens/s, 10 requests/s."""
    h.room.capacity = 1
    for _ in range(25):
        h.start(request(priority, flow="warm", cost=rate_tokens // 10, wait=100), hold=0.1)
    await trio.sleep(3)
    assert not h.queue.queued(MODEL)


async def wait_behind(h: Harness, n: int, priority: PriorityClass = STANDARD) -> None:
    """The room held by a long stream, and ``n`` patient requests of 100 tokens (flow ``ahead``) waiting."""
    await occupy(h, 1, hold=100)
    for _ in range(n):
        h.start(request(priority, flow="ahead", cost=100, wait=100))
    await trio.testing.wait_all_tasks_blocked()


async def test_a_waiter_is_shed_expired_at_its_deadline(autojump_clock):
    async with harness(capacity=1) as h:
        await occupy(h, 1, hold=100)
        started = trio.current_time()
        outcome = await h.queue.enter(request(BATCH, wait=5))
        assert isinstance(outcome, Shed) and outcome.reason == EXPIRED
        assert trio.current_time() - started == pytest.approx(5) and outcome.waited == pytest.approx(5)
        assert h.queue.queued(MODEL) == {} and h.pending() == 0
        assert h.sample("llmgw_flow_shed_total", model=MODEL, **{"class": "batch"}, reason="expired") == 1


async def test_a_request_the_queue_cannot_serve_before_its_deadline_is_shed_at_once(autojump_clock):
    async with harness(capacity=1) as h:
        await measure_drain(h)
        rate = h.queue.snapshot()[MODEL]["drain_rate"]
        assert rate == pytest.approx(1000, rel=0.1)
        await wait_behind(h, 30)  # 3,000 tokens ahead: about 3 s at 1,000 tokens/s
        started = trio.current_time()
        outcome = await h.queue.enter(request(STANDARD, flow="ahead", cost=100, wait=1.0))
        assert isinstance(outcome, Shed) and outcome.reason == UNSERVABLE
        assert trio.current_time() == started and outcome.waited == 0.0
        assert (outcome.position, outcome.tokens_ahead, outcome.ahead_class) == (30, 3000, "standard")
        assert outcome.retry_after == 4  # ceil(3,000 / ~1,000 tokens/s), the rate a little under 1,000
        # One whose deadline leaves time for the queue ahead waits instead; and so does one of another flow with
        # the short deadline: the fair order puts it next, whatever the other flow has waiting.
        patient = h.start(request(STANDARD, flow="ahead", cost=100, wait=10))
        other = h.start(request(STANDARD, flow="other", cost=100, wait=1.0))
        await trio.testing.wait_all_tasks_blocked()
        assert id(patient) not in h.outcomes and id(other) not in h.outcomes


async def test_nothing_is_shed_early_while_a_replica_takes_the_held_requests_in_a_ramp(autojump_clock):
    async with harness(capacity=1) as h:
        await measure_drain(h)
        await wait_behind(h, 30)  # about 3 s at the rate measured
        h.room.ramping_now = True  # a replica appeared and takes them at a pace: the rate says nothing yet
        late = h.start(request(STANDARD, flow="ahead", cost=100, wait=1.0))  # shed at once, else
        waiter = h.start(request(STANDARD, flow="ahead", cost=100, wait=1.4))
        await trio.sleep(0.5)  # looked at, with 0.9 s left for about 3 s: shed, else
        assert id(late) not in h.outcomes and id(waiter) not in h.outcomes
        await trio.sleep(1.0)  # their deadlines still hold
        assert h.outcomes[id(late)].reason == EXPIRED and h.outcomes[id(waiter)].reason == EXPIRED
        h.room.ramping_now = False  # the ramp over, the rate counts again
        outcome = await h.queue.enter(request(STANDARD, flow="ahead", cost=100, wait=1.0))
        assert isinstance(outcome, Shed) and outcome.reason == UNSERVABLE


@pytest.mark.parametrize("peers", [False, True])
async def test_with_no_drain_measured_a_request_is_never_shed_before_its_deadline(autojump_clock, peers):
    async with harness(capacity=1) as h:
        if peers:  # the other gateways measured another band: that says nothing of this one
            h.queue.peers = FakePeers({BATCH.rank: [1500]}, [30])
        await wait_behind(h, 30)
        started = trio.current_time()
        outcome = await h.queue.enter(request(STANDARD, flow="late", cost=100, wait=1.0))
        assert isinstance(outcome, Shed) and outcome.reason == EXPIRED
        assert trio.current_time() - started == pytest.approx(1.0)
        assert outcome.retry_after == FlowSettings().retry_after_min  # no rate: no guess either


class FakePeers:
    """The other gateways' reports as the queue reads them: per band the rates they trust, the requests they hold."""

    def __init__(self, rates: dict[int, list[int]], held: list[int]):
        self._rates, self._held = rates, held

    def rates(self, model: str, rank: int) -> list[int]:
        return self._rates.get(rank, [])

    def held(self, model: str) -> list[int]:
        return self._held


async def test_a_gateway_without_its_own_rate_sheds_at_once_on_its_share_of_the_peers_rates(autojump_clock):
    """Issue 31 through 3 gateways: this one has measured nothing, the two others trust 1,500 tokens/s for the
    band and hold 90 requests to this one's 30: the cluster drains 4,500 tokens/s, this gateway's share a quarter."""
    async with harness(capacity=1) as h:
        h.queue.peers = FakePeers({STANDARD.rank: [1500, 1500], BATCH.rank: [99_999]}, [45, 45])
        await wait_behind(h, 30)  # 3,000 tokens ahead: about 2.7 s at 1,125 tokens/s
        started = trio.current_time()
        outcome = await h.queue.enter(request(STANDARD, flow="ahead", cost=100, wait=1.0))
        assert isinstance(outcome, Shed) and outcome.reason == UNSERVABLE
        assert trio.current_time() == started
        assert outcome.retry_after == 3  # ceil(3,000 / 1,125)
        # What this gateway tells the others is its own rate alone: none measured yet.
        assert h.queue.trusted_drains(MODEL) == ()


async def test_a_gateways_own_trusted_rate_is_what_it_publishes_and_predicts_with(autojump_clock):
    async with harness(capacity=1) as h:
        h.queue.peers = FakePeers({INTERACTIVE.rank: [1_000_000]}, [1])  # a peer far quicker: not used once it has
        # its own
        await measure_drain(h)
        [(rank, rate)] = h.queue.trusted_drains(MODEL)
        assert rank == INTERACTIVE.rank and rate == pytest.approx(1000, rel=0.1)
        await wait_behind(h, 10, INTERACTIVE)  # 1,000 tokens ahead: about 1 s at its own rate (a millisecond at the
        # peer's)
        shed = await h.queue.enter(request(INTERACTIVE, flow="ahead", cost=100, wait=0.5))
        assert isinstance(shed, Shed) and shed.reason == UNSERVABLE and shed.retry_after == 2


async def test_retry_after_is_the_queue_ahead_over_the_drain_rate_within_its_bounds(autojump_clock):
    flow_settings = FlowSettings(retry_after_min=2, retry_after_max=20)
    async with harness(capacity=1, flow_settings=flow_settings) as h:
        await measure_drain(h, priority=BATCH)  # batch's own rate: 1,000 tokens/s
        await occupy(h, 1, hold=1000)
        given = []
        for ahead in (0, 1, 100):  # 0, 10,000 and 1,000,000 tokens waiting
            for _ in range(ahead):
                h.start(request(BATCH, flow="ahead", cost=10_000, wait=10_000))
            await trio.testing.wait_all_tasks_blocked()
            shed = await h.queue.enter(request(BATCH, flow="ahead", cost=1, wait=0.5))
            assert isinstance(shed, Shed)
            rate = h.queue.snapshot()[MODEL]["drain_rate"]  # as the shed saw it (the stalls lower it)
            given.append((shed.reason, shed.retry_after, math.ceil(shed.tokens_ahead / rate)))
        assert given[0] == (EXPIRED, 2, 0)  # nothing ahead: the lower bound
        assert given[1][0] == UNSERVABLE and given[1][1] == given[1][2] and 10 <= given[1][1] < 20
        assert given[2][:2] == (UNSERVABLE, 20) and given[2][2] > 1000  # the upper bound
        assert h.sample("llmgw_flow_retry_after_seconds_count", model=MODEL, **{"class": "batch"}) == 3


# Overflow.


async def test_overflow_sheds_the_newest_of_the_lowest_band_and_may_be_the_arrival(autojump_clock):
    flow_settings = FlowSettings(max_queued=3, max_queued_tokens=10_000)
    async with harness(capacity=1, flow_settings=flow_settings) as h:
        await occupy(h, 1, hold=100)
        b1 = h.start(request(BATCH, flow="x"))
        await trio.testing.wait_all_tasks_blocked()
        b2 = h.start(request(BATCH, flow="y"))
        await trio.testing.wait_all_tasks_blocked()
        s1 = h.start(request(STANDARD, flow="z"))
        await trio.testing.wait_all_tasks_blocked()
        i1 = h.start(request(INTERACTIVE, flow="z"))  # full: the newest batch request makes way
        await trio.testing.wait_all_tasks_blocked()
        shed = h.outcomes[id(b2)]
        assert isinstance(shed, Shed) and shed.reason == OVERFLOW and "max_queued 3" in shed.detail
        b3 = h.start(request(BATCH, flow="x"))  # full again, and it is the lowest and newest itself
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(h.outcomes[id(b3)], Shed) and h.outcomes[id(b3)].reason == OVERFLOW
        # Tokens: one interactive request bigger than all the batch ones sheds them all, then fits.
        big = h.start(request(INTERACTIVE, flow="big", cost=9_700))
        await trio.testing.wait_all_tasks_blocked()
        assert isinstance(h.outcomes[id(b1)], Shed) and id(big) not in h.outcomes
        assert h.queue.queued(MODEL) == {"interactive": Queued(2, 9_800), "standard": Queued(1, 100)}
        assert [id(r) in h.outcomes for r in (s1, i1)] == [False, False]
        assert h.sample("llmgw_flow_shed_total", model=MODEL, **{"class": "batch"}, reason="overflow") == 3


# Cancellation.


async def test_a_waiter_that_leaves_gives_up_its_place(autojump_clock):
    async with harness(capacity=1) as h:
        await occupy(h, 1, hold=1.0)
        with trio.move_on_after(0.5):
            await h.queue.enter(request(flow="gone"))
        assert h.queue.queued(MODEL) == {} and h.pending() == 0
        after = h.start(request(flow="next"))
        await trio.sleep(2)
        assert h.admitted[1:] == [after]


async def test_a_waiter_admitted_and_cancelled_before_it_heard_releases_its_place(autojump_clock):
    async with harness(capacity=1) as h:
        await occupy(h, 1, hold=100)
        scope = trio.CancelScope()
        outcome: list[object] = []

        async def client() -> None:
            with scope:
                outcome.append(await h.queue.enter(request()))

        h.nursery.start_soon(client)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()  # the client leaves: its task is woken with Cancelled, but has not run yet ...
        h.room.capacity = 2
        h.queue._admit_ready(h.queue._models[MODEL])  # ... when the dispatcher admits it
        assert h.pending() == 1
        await trio.testing.wait_all_tasks_blocked()
        assert outcome == [] and h.pending() == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(DEFAULT_CLASSES), st.sampled_from("abc"), st.integers(1, 500),
                          st.floats(0, 3), st.floats(0.01, 2), st.one_of(st.none(), st.floats(0, 4))),
                min_size=1, max_size=40),
       st.integers(1, 4))
def test_cancellation_at_any_point_never_leaks_a_place(arrivals, capacity):
    """Requests arrive, wait, are admitted, finish, expire or are cancelled at any moment (their client leaves):
    the queue never admits beyond the room, and once all are done nothing is pending or queued."""

    async def main() -> None:
        async with harness(capacity=capacity) as h:

            async def client(req_args, arrive: float, hold: float, leave: float | None) -> None:
                await trio.sleep(arrive)
                priority, flow, cost = req_args
                with trio.move_on_after(math.inf if leave is None else leave):
                    await h.serve(request(priority, flow, cost, wait=priority.max_wait), hold)

            async with trio.open_nursery() as clients:
                for priority, flow, cost, arrive, hold, leave in arrivals:
                    clients.start_soon(client, (priority, flow, cost), arrive, hold, leave)
            await trio.testing.wait_all_tasks_blocked()
            assert h.pending() == 0 and h.room.inflight == 0 and h.queue.queued(MODEL) == {}
            assert isinstance(await h.queue.enter(request(BEST_EFFORT)), Admitted)  # the room is all there

    run_on_mock_clock(main)


# What the queue tells.


async def test_snapshot_queued_and_metrics_tell_what_waits(autojump_clock):
    async with harness(capacity=1) as h:
        await occupy(h, 1, hold=10)
        h.start(request(BATCH, cost=300, wait=100))
        await trio.sleep(1)
        h.start(request(BATCH, cost=200, wait=100))
        h.start(request(INTERACTIVE, cost=50, wait=100))
        await trio.sleep(1)
        assert h.queue.queued(MODEL) == {"batch": Queued(2, 500), "interactive": Queued(1, 50)}
        assert h.queue.queued("other") == {}
        snap = h.queue.snapshot()[MODEL]
        assert snap["pending"] == 0 and snap["drain_rate"] is None
        assert snap["classes"]["batch"] == {"queued": 2, "queued_tokens": 500, "oldest_wait": 2.0, "recent_sheds": {}}
        assert snap["classes"]["interactive"]["oldest_wait"] == 1.0
        labels = {"model": MODEL, "class": "batch"}
        assert h.sample("llmgw_flow_queued", **labels) == 2 and h.sample("llmgw_flow_queued_tokens", **labels) == 500
        await trio.sleep(30)  # all served, one after the other
        assert h.queue.queued(MODEL) == {} and h.sample("llmgw_flow_queued", **labels) == 0
        assert h.sample("llmgw_flow_admitted_total", **labels) == 2
        assert h.sample("llmgw_flow_wait_seconds_count", **labels) == 2
        # The occupant leaves at 10 s, the interactive request goes first, then the batch ones a second apart.
        assert h.sample("llmgw_flow_wait_seconds_sum", **labels) == pytest.approx((11 - 0) + (12 - 1))
        assert h.sample("llmgw_flow_drain_tokens_per_second", model=MODEL) > 0


async def test_a_room_that_fails_leaves_the_queue_running_and_is_logged(autojump_clock, caplog):
    async with harness(capacity=1) as h:
        await occupy(h, 1, hold=100)
        waiter = h.start(request(wait=5))
        await trio.testing.wait_all_tasks_blocked()
        h.room.broken = True
        h.room.wake(MODEL)
        await trio.sleep(6)
        assert h.outcomes[id(waiter)].reason == EXPIRED  # type: ignore[union-attr]
        assert "dispatching m's queue failed" in caplog.text and "ZeroDivisionError" in caplog.text
        h.room.broken = False
        h.room.capacity = 2
        assert isinstance(await h.queue.enter(request()), Admitted)


async def test_release_twice_is_refused_and_logged(caplog):
    queue = FlowQueue(FlowSettings(), FakeRoom(1))
    admitted = await queue.enter(request())
    assert isinstance(admitted, Admitted)
    queue.release(admitted)
    queue.release(admitted)
    assert queue.snapshot()[MODEL]["pending"] == 0
    assert "released twice" in caplog.text


async def test_models_with_nothing_waiting_or_held_are_forgotten_beyond_a_bound():
    queue = FlowQueue(FlowSettings(), FakeRoom(1))
    held = await queue.enter(FlowRequest("kept", "a", STANDARD, 1, math.inf))
    for i in range(3000):  # names a hostile client made up, had the data plane let them through
        admitted = await queue.enter(FlowRequest(f"m{i}", "a", STANDARD, 1, math.inf))
        queue.release(admitted)  # type: ignore[arg-type]
    models = queue.snapshot()
    assert len(models) <= 1024 and models["kept"]["pending"] == 1
    queue.release(held)  # type: ignore[arg-type]


# The room in KV tokens.


async def test_a_batch_request_the_token_room_refuses_waits_while_an_interactive_one_fits():
    # 8,000 KV tokens; batch fills at most 85% of them (6,800): two 2,400-token batch requests are in flight,
    # a third would bring them to 7,200. Plenty of room in requests.
    room = FakeRoom(capacity=8, kv_tokens=8000)
    room.inflight, room.inflight_tokens = 2, 4800
    queue = FlowQueue(FlowSettings(), room)
    assert admitted_at_once(queue, request(BATCH, cost=2400)) is None
    assert admitted_at_once(queue, request(INTERACTIVE, cost=150)) is not None


async def test_admitted_tokens_not_yet_released_count_against_the_token_room():
    queue = FlowQueue(FlowSettings(), FakeRoom(capacity=8, kv_tokens=8000))
    first = admitted_at_once(queue, request(BATCH, cost=2400))
    second = admitted_at_once(queue, request(BATCH, cost=2400))
    assert first is not None and second is not None
    assert queue.snapshot()[MODEL]["pending_tokens"] == 4800
    assert admitted_at_once(queue, request(BATCH, cost=2400)) is None  # 7,200 pending > 6,800
    queue.release(first)
    assert queue.snapshot()[MODEL]["pending_tokens"] == 2400
    assert admitted_at_once(queue, request(BATCH, cost=2400)) is not None


async def test_the_queue_hands_the_room_the_output_allowance_apart_so_only_the_prompt_is_scaled():
    # The engines count 4 tokens per estimated prompt token; 1,000 KV tokens, interactive may fill them all. A
    # 600-token request of which 500 are max_tokens holds 100 x 4 + 500 = 900: it fits (scaled whole: 2,400).
    room = FakeRoom(capacity=8, kv_tokens=1000)
    room.prompt_ratio = 4.0
    queue = FlowQueue(FlowSettings(), room)
    first = admitted_at_once(queue, request(INTERACTIVE, cost=600, output=500))
    assert first is not None
    # Admitted and not yet released, its output stays apart too: a second would need (200 x 4) + 1,000 = 1,800.
    assert admitted_at_once(queue, request(INTERACTIVE, cost=600, output=500)) is None
    queue.release(first)
    assert admitted_at_once(queue, request(INTERACTIVE, cost=600, output=500)) is not None
    # Without an output allowance the whole estimate is prompt, scaled whole: 600 x 4 does not fit.
    assert admitted_at_once(queue, request(INTERACTIVE, cost=600)) is None


async def test_an_output_allowance_out_of_range_is_bounded_by_the_cost():
    room = FakeRoom(capacity=8, kv_tokens=1000)
    room.prompt_ratio = 4.0
    queue = FlowQueue(FlowSettings(), room)
    # A negative allowance counts as none (all prompt); one above the cost as the cost (no prompt left, not less).
    assert admitted_at_once(queue, request(INTERACTIVE, cost=300, output=-10_000)) is None  # 1,200 > 1,000
    held = admitted_at_once(queue, request(INTERACTIVE, cost=1000, output=10**9))
    assert held is not None
    assert admitted_at_once(queue, request(INTERACTIVE, cost=1, output=1)) is None  # the 1,000 pending fill it
    queue.release(held)


async def test_a_waiter_is_dispatched_with_its_output_counted_apart(autojump_clock):
    async with harness(capacity=100, kv_tokens=1000) as h:
        h.room.prompt_ratio = 4.0
        blocker = h.start(request(INTERACTIVE, flow="i", cost=600, output=600), hold=1.0)  # 600 held in flight
        await trio.testing.wait_all_tasks_blocked()
        waiter = h.start(request(BATCH, flow="b", cost=400, output=300), hold=1.0)  # 100 x 4 + 300 = 700
        await trio.testing.wait_all_tasks_blocked()
        assert blocker in h.admitted and waiter not in h.admitted  # 600 + 700 > 850, batch's share
        await trio.sleep(1.5)
        assert waiter in h.admitted  # 700 <= 850 once the blocker ended: not 1,600 scaled whole
        assert h.pending_tokens() == 0


async def test_the_room_counts_a_request_by_its_prompt_in_the_routers_estimate_when_given_not_by_its_cost():
    """The cost (the tenancy's estimate: one token per body byte, what fair shares count) of a long prompt is about 4
    times the router's estimate (characters / 4) that the engines' prompt-token ratio is learnt against: scaled by
    that ratio it would be counted 4 times over."""
    room = FakeRoom(capacity=8, kv_tokens=1000)
    room.prompt_ratio = 4.0
    queue = FlowQueue(FlowSettings(), room)
    # cost 2,200 (scaled: 8,500, past the cache); its prompt in the router's estimate 150: 150 x 4 + 100 = 700
    first = admitted_at_once(queue, request(BATCH, cost=2200, output=100, prompt=150))
    assert first is not None
    # Admitted and not yet routed, it is held the same way: a second would bring it to 1,400, past batch's 850.
    assert admitted_at_once(queue, request(BATCH, cost=2200, output=100, prompt=150)) is None
    queue.release(first)
    assert admitted_at_once(queue, request(BATCH, cost=2200, output=100, prompt=150)) is not None
    assert admitted_at_once(FlowQueue(FlowSettings(), room), request(BATCH, cost=2200, output=100)) is None


async def test_a_waiter_is_dispatched_by_its_prompt_in_the_routers_estimate(autojump_clock):
    async with harness(capacity=100, kv_tokens=1000) as h:
        h.room.prompt_ratio = 4.0
        blocker = h.start(request(INTERACTIVE, flow="i", cost=600, output=600), hold=1.0)  # 600 held in flight
        await trio.testing.wait_all_tasks_blocked()
        waiter = h.start(request(BATCH, flow="b", cost=800, output=50, prompt=60), hold=1.0)  # 60 x 4 + 50 = 290
        await trio.testing.wait_all_tasks_blocked()
        assert blocker in h.admitted and waiter not in h.admitted  # 600 + 290 > 850, batch's share
        await trio.sleep(1.5)
        assert waiter in h.admitted and h.pending_tokens() == 0  # its cost scaled (3,050) would never fit


async def test_with_the_kv_capacity_unknown_only_requests_are_counted():
    room = FakeRoom(capacity=8, fill=True)  # no scrape told the KV capacity
    room.inflight_tokens = 10**9
    queue = FlowQueue(FlowSettings(), room)
    for _ in range(6):  # batch's 85% of 8 requests
        assert admitted_at_once(queue, request(BATCH, cost=100_000)) is not None
    assert admitted_at_once(queue, request(BATCH, cost=1)) is None


async def test_the_dispatcher_admits_waiters_as_kv_tokens_free_up_never_beyond_them(autojump_clock):
    async with harness(capacity=100, kv_tokens=8000) as h:
        batch = [h.start(request(BATCH, flow="b", cost=2400), hold=1.0) for _ in range(6)]
        await trio.testing.wait_all_tasks_blocked()
        assert len(h.admitted) == 2  # 4,800 of batch's 6,800; the serve() asserts check the KV room on each
        late = h.start(request(INTERACTIVE, flow="i", cost=150), hold=1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert late in h.admitted  # interactive's share is the whole cache: it never waits behind batch's tokens
        await trio.sleep(3.5)
        assert all(req in h.admitted for req in batch)
        assert h.pending_tokens() == 0


# -- Early shedding (llmgw/flow/shedding.py) on Trio's mock clock --


def verdicts(h: Harness, cls: str) -> dict[str, float]:
    return {v: h.sample("llmgw_flow_early_shed_verdicts_total", model=MODEL, **{"class": cls}, verdict=v)
            for v in VERDICTS}


async def test_each_band_is_predicted_at_its_own_rate_not_the_models_mixed_one(autojump_clock):
    # Batch requests of 3,000 tokens go through one place every 0.1 s (30,000 tokens/s measured for the model);
    # interactive ones of 100 tokens through the same place: 1,000 tokens/s when interactive is what is served.
    async with harness(capacity=1) as h:
        for _ in range(25):
            h.start(request(BATCH, flow="batch", cost=3000, wait=100), hold=0.1)
        await trio.sleep(3)
        await measure_drain(h)  # interactive, 100 tokens each, one every 0.1 s
        await occupy(h, 1, hold=100)
        for _ in range(15):  # 1,500 interactive tokens ahead: 1.5 s at interactive's rate, 0.05 s at the mix's
            h.start(request(INTERACTIVE, flow="a", cost=100, wait=100))
        await trio.testing.wait_all_tasks_blocked()
        started = trio.current_time()
        shed = await h.queue.enter(request(INTERACTIVE, flow="a", cost=100, wait=1.0))
        assert isinstance(shed, Shed) and shed.reason == UNSERVABLE and trio.current_time() == started
        assert 2 <= shed.retry_after <= 3  # the whole band ahead, 1,500 tokens, at ~1,000 tokens/s, rounded up


async def test_a_request_is_never_shed_early_while_its_model_has_room(autojump_clock):
    async with harness(capacity=100) as h:
        await measure_drain(h)
        h.room.capacity = 100
        h.room.held = {"standard": 0}
        for _ in range(30):  # 3,000 tokens ahead: ~3 s at the drain rate measured
            h.start(request(STANDARD, flow="ahead", cost=100, wait=100))
        await trio.testing.wait_all_tasks_blocked()
        # Room for them all appears; before the dispatcher has looked, a request with 1 s left arrives behind them.
        h.room.held.clear()
        outcome = await h.queue.enter(request(STANDARD, flow="ahead", cost=100, wait=1.0))
        assert isinstance(outcome, Admitted) and outcome.position == 30
        # Held again: the same arrival is shed at once.
        h.room.held = {"standard": 0}
        for _ in range(30):
            h.start(request(STANDARD, flow="ahead", cost=100, wait=100))
        await trio.testing.wait_all_tasks_blocked()
        outcome = await h.queue.enter(request(STANDARD, flow="ahead", cost=100, wait=1.0))
        assert isinstance(outcome, Shed) and outcome.reason == UNSERVABLE


async def test_a_waiter_is_shed_once_its_predicted_wait_passes_its_deadline(autojump_clock):
    async with harness(capacity=1) as h:
        await measure_drain(h)
        await occupy(h, 1, hold=100)
        waiter = h.start(request(STANDARD, flow="s", cost=100, wait=5.0))
        await trio.sleep(0.5)
        assert id(waiter) not in h.outcomes
        for _ in range(80):  # 8,000 interactive tokens arrive ahead of it: ~8 s at 1,000 tokens/s, more than 1.5 x
            h.start(request(INTERACTIVE, flow="i", cost=100, wait=100))  # the 4.5 s it has left
        await trio.sleep(0.5)
        outcome = h.outcomes[id(waiter)]
        assert isinstance(outcome, Shed) and outcome.reason == UNSERVABLE
        assert 0.5 <= outcome.waited <= 0.7  # at the next look (every 0.1 s), long before its 5 s
        assert outcome.retry_after >= 8 and outcome.detail.startswith("8000 tokens wait ahead of it")
        assert h.sample("llmgw_flow_shed_total", model=MODEL, **{"class": "standard"}, reason="unservable") == 1


async def test_an_early_shed_is_judged_wrong_when_its_band_empties_in_time_and_right_when_it_would_expire(
        autojump_clock):
    async with harness(capacity=1) as h:
        await measure_drain(h)
        await occupy(h, 1, hold=100)
        for _ in range(30):  # 3,000 tokens ahead, ~3 s
            h.start(request(STANDARD, flow="ahead", cost=100, wait=100))
        await trio.testing.wait_all_tasks_blocked()
        shed = await h.queue.enter(request(STANDARD, flow="ahead", cost=100, wait=1.0))
        assert isinstance(shed, Shed) and shed.reason == UNSERVABLE
        h.room.capacity = 100  # a replica joins: the whole band goes at once, well within the shed one's 1 s
        h.room.wake(MODEL)
        await trio.sleep(0.2)
        assert verdicts(h, "standard") == {IDLE_IN_TIME: 1, TURN_IN_TIME: 0, WOULD_EXPIRE: 0, UNKNOWN: 0}

        h.room.capacity = 1
        await trio.sleep(2)  # the band's requests (1 s each) ended
        await wait_behind(h, 30)
        shed = await h.queue.enter(request(STANDARD, flow="ahead", cost=100, wait=1.0))
        assert isinstance(shed, Shed) and shed.reason == UNSERVABLE
        await trio.sleep(1.5)  # nothing moved: it would have expired
        assert verdicts(h, "standard") == {IDLE_IN_TIME: 1, TURN_IN_TIME: 0, WOULD_EXPIRE: 1, UNKNOWN: 0}


async def test_at_four_times_the_capacity_sheds_are_early_and_rarely_wrong(autojump_clock):
    """Poisson arrivals of two interactive tenants at 4x what the room serves (4 places, 0.2 s each: 20 req/s) for
    20 s: the requests shed are answered at once rather than at their 2 s deadline, those admitted waited within
    it, and the room is kept full: the class is not starved by its own prediction."""
    rng = random.Random(31)
    async with harness(capacity=4) as h:
        sent = []  # (when, request)
        start = trio.current_time()
        end = start + 20
        while trio.current_time() < end:
            req = request(INTERACTIVE, flow=rng.choice("ab"), cost=rng.randint(80, 120))
            sent.append((trio.current_time() - start, h.start(req, hold=0.2)))
            await trio.sleep(rng.expovariate(80.0))
        await trio.sleep(3)
        outcomes = [(at, h.outcomes[id(r)]) for at, r in sent]
        served = [o for _, o in outcomes if isinstance(o, Admitted)]
        early = [(at, o) for at, o in outcomes if isinstance(o, Shed) and o.reason == UNSERVABLE]
        expired = [o for _, o in outcomes if isinstance(o, Shed) and o.reason == EXPIRED]
        assert len(served) + len(early) + len(expired) == len(sent)
        assert len(served) == pytest.approx(20 * 20, rel=0.1)  # the room kept full
        assert all(o.waited <= INTERACTIVE.max_wait for o in served)
        # Nothing is shed early until the drain rate is trusted (two half-second samples of backlog): those that
        # arrived meanwhile wait, and a few of them are shed later or expire. From then on, 99% of the sheds are
        # answered on arrival.
        assert len(expired) <= 0.01 * len(sent)
        settled = [o for at, o in early if at >= 2.0]
        assert len(settled) > 0.9 * len(early)
        assert sorted(o.waited for o in settled)[int(len(settled) * 0.99)] == 0.0
        # Shed a little before the predicted wait reaches the deadline, most would have had their turn in
        # time, in the place of another (the queue stayed busy); almost none while the class's queue emptied (the
        # few shed in the last 2 s of arrivals): the room was never left idle for want of the requests shed.
        judged = verdicts(h, "interactive")
        assert sum(judged.values()) == len(early)
        assert judged[IDLE_IN_TIME] <= 0.02 * len(early)


def test_verdicts_stay_bounded_and_judge_what_they_drop():
    marks = Verdicts()
    dropped = []
    for i in range(MAX_MARKS + 10):
        dropped += marks.mark(start=10.0**9 + i, served=0, deadline=100.0 + i, now=50.0)
    assert marks.pending == MAX_MARKS and dropped == [UNKNOWN] * 10  # still within their deadline: unknown
    assert marks.judge(vnow=0.0, served=0, now=10_000.0) == [WOULD_EXPIRE] * MAX_MARKS
    assert marks.pending == 0



async def test_a_band_not_yet_measured_is_predicted_at_the_models_requests_per_second(autojump_clock):
    # Interactive requests of 100 tokens went through one place every 0.1 s: 10 requests/s, 1,000 tokens/s. Five
    # batch requests of 3,000 tokens wait: they take a place each, so 0.5 s, not the 15 s of 15,000 tokens at
    # 1,000 tokens/s: a batch request with 2 s left is not shed.
    async with harness(capacity=1) as h:
        await measure_drain(h)
        await occupy(h, 1, hold=0.1)
        ahead = [h.start(request(BATCH, flow="b", cost=3000, wait=100), hold=0.1) for _ in range(5)]
        await trio.testing.wait_all_tasks_blocked()
        outcome = await h.queue.enter(request(BATCH, flow="b", cost=3000, wait=2.0))
        assert isinstance(outcome, Admitted)
        assert all(isinstance(h.outcomes[id(r)], Admitted) for r in ahead)



async def test_a_request_arriving_in_a_long_stall_is_shed_at_once_not_at_its_deadline(autojump_clock):
    """The room is held by a long stream: the drain rate (1,000 tokens/s, an average over dispatches) predicts the
    100 tokens ahead gone in 0.15 s, but nothing has gone for 1.9 s: an interactive arrival with 2 s is told at
    once (a stall that lasted 1.9 s is expected to last about as long again), not after waiting 2 s."""
    async with harness(capacity=1) as h:
        await measure_drain(h)
        await occupy(h, 1, hold=100)
        h.start(request(INTERACTIVE, flow="ahead", cost=100, wait=100))
        await trio.sleep(0.5)
        early = h.start(request(INTERACTIVE, flow="early", cost=100, wait=2.0))
        await trio.testing.wait_all_tasks_blocked()
        assert id(early) not in h.outcomes  # 0.5 s of stall: it may still be served in time, so it waits
        await trio.sleep(1.4)
        started = trio.current_time()
        outcome = await h.queue.enter(request(INTERACTIVE, flow="ahead", cost=100, wait=2.0))
        assert isinstance(outcome, Shed) and outcome.reason == UNSERVABLE and trio.current_time() == started
        assert outcome.retry_after == 2  # the stall so far, 1.9 s, rounded up


def test_the_factor_on_arrival_is_learnt_from_the_waits_over_their_predictions():
    errors = WaitErrors()
    for _ in range(ERRORS_LEARNT - 1):
        errors.served(predicted=0.5, waited=0.5)
    assert errors.factor() is None  # too few outcomes: 10% of the deadline is the slack
    assert unservable_on_arrival(1.7, 2.0, None) is False and unservable_on_arrival(1.9, 2.0, None) is True
    errors.served(predicted=0.5, waited=0.5)
    assert errors.factor() == pytest.approx(1 / 0.9)  # never less slack than 10% of the deadline
    assert unservable_on_arrival(1.7, 2.0, errors.factor()) is False
    assert unservable_on_arrival(1.9, 2.0, errors.factor()) is True
    for _ in range(ERRORS_LEARNT):  # waits 3 times as long as predicted, all served in time: no reason to shed
        errors.served(predicted=0.2, waited=0.6)
    assert errors.factor() == pytest.approx(1 / 0.9)
    errors.missed(predicted=1.0, left=2.0)  # one missed its deadline: the waits' 90th percentile counts
    assert errors.factor() == pytest.approx(3.0)
    assert unservable_on_arrival(0.6, 2.0, errors.factor()) is False
    assert unservable_on_arrival(0.7, 2.0, errors.factor()) is True
    # A waiter that missed its deadline counts as over it by a look's interval; a prediction of 0 as 50 ms.
    for _ in range(ERRORS_LEARNT * 8):
        errors.missed(predicted=0.0, left=2.0)
    assert errors.factor() == pytest.approx(2.1 / 0.05)
    assert unservable_on_arrival(0.5, 2.0, errors.factor()) is False  # within FACTOR_MAX: the queue keeps a buffer
    assert unservable_on_arrival(0.51, 2.0, errors.factor()) is True and FACTOR_MAX == 4.0


async def test_a_class_whose_waits_missed_their_predictions_is_shed_on_arrival_not_at_its_deadline(autojump_clock):
    """The drain rate says 1,000 tokens/s (requests of 100 tokens, 0.1 s each), but the room is held by a long
    stream: the waiters admitted on that prediction expire at their deadline (the slow refusals of issue 31). Once
    the class has seen 8 of them, an arrival predicted to wait about 0.75 s of its 2 s is shed at once: its class's
    waits came to many times what was predicted. On a fresh queue the same arrival waits (0.75 s is within 90% of
    its 2 s)."""
    async with harness(capacity=1) as h:
        await measure_drain(h)
        await occupy(h, 1, hold=100)
        missed = [h.start(request(INTERACTIVE, flow=f"m{i}", cost=100, wait=2.0)) for i in range(ERRORS_LEARNT)]
        await trio.sleep(2.5)
        assert all(h.outcomes[id(r)].reason == EXPIRED for r in missed)  # type: ignore[union-attr]
        assert h.sample("llmgw_flow_wait_prediction_error_seconds_count", model=MODEL, **{"class": "interactive"},
                        outcome="expired") == ERRORS_LEARNT
        assert h.sample("llmgw_flow_wait_prediction_factor", model=MODEL, **{"class": "interactive"}) == 0.0
        for _ in range(7):  # 700 tokens of its own flow ahead: ~0.75 s at the rate measured
            h.start(request(INTERACTIVE, flow="ahead", cost=100, wait=100))
        await trio.testing.wait_all_tasks_blocked()
        started = trio.current_time()
        outcome = await h.queue.enter(request(INTERACTIVE, flow="ahead", cost=100, wait=2.0))
        assert isinstance(outcome, Shed) and outcome.reason == UNSERVABLE and trio.current_time() == started
        assert h.sample("llmgw_flow_wait_prediction_factor", model=MODEL, **{"class": "interactive"}) > FACTOR_MAX

    async with harness(capacity=1) as fresh:
        await measure_drain(fresh)
        await occupy(fresh, 1, hold=100)
        for _ in range(7):
            fresh.start(request(INTERACTIVE, flow="ahead", cost=100, wait=100))
        await trio.testing.wait_all_tasks_blocked()
        waiter = fresh.start(request(INTERACTIVE, flow="ahead", cost=100, wait=2.0))
        await trio.sleep(0.05)
        assert id(waiter) not in fresh.outcomes  # admitted to wait on the prediction alone


async def test_a_look_at_the_waiters_costs_a_bounded_time_newest_first(autojump_clock, monkeypatch):
    monkeypatch.setattr(flow_queue, "RECHECK_MAX", 10)
    async with harness(capacity=1) as h:
        await measure_drain(h)
        await occupy(h, 1, hold=1000)
        waiters = []
        for _ in range(15):  # 1.5 s of work within 90% of their 20 s; one after the other
            waiters.append(h.start(request(STANDARD, flow="s", cost=100, wait=20)))
            await trio.testing.wait_all_tasks_blocked()
        assert h.queue.queued(MODEL)["standard"].requests == 15
        for _ in range(300):  # 30 s of interactive work ahead of them all: more than 1.5 x 20 s
            h.start(request(INTERACTIVE, flow="i", cost=100, wait=1000))

        def shed() -> list[FlowRequest]:
            return [r for r in waiters if isinstance(h.outcomes.get(id(r)), Shed)]

        while not shed():
            await trio.sleep(0.01)
        assert shed() == waiters[5:]  # one look: the newest 10 (the most ahead of them)
        await trio.sleep(0.3)
        assert shed() == waiters
