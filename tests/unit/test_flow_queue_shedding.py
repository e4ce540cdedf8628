"""Early shedding in the gateway queue (llmgw/flow/queue.py, llmgw/flow/shedding.py) on Trio's mock clock: each
band's drain rate, the predicted wait at arrival and while waiting, Retry-After from the same estimate, and the
verdicts that tell how many early sheds would have been served in time."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing
from test_flow_queue import BATCH, INTERACTIVE, MODEL, STANDARD, Harness, harness, measure_drain, occupy, request

from llmgw.flow import queue as flow_queue
from llmgw.flow.model import EXPIRED, UNSERVABLE, Admitted, FlowRequest, Shed
from llmgw.flow.shedding import IDLE_IN_TIME, MAX_MARKS, TURN_IN_TIME, UNKNOWN, VERDICTS, WOULD_EXPIRE, Verdicts


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
        await occupy(h, 1, hold=100)
        for _ in range(30):
            h.start(request(STANDARD, flow="ahead", cost=100, wait=100))
        await trio.testing.wait_all_tasks_blocked()
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
