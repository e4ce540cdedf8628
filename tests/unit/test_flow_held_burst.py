"""A held burst on Trio's mock clock: the gateway queue (llmgw/flow/queue.py) and the real room
(llmgw/flow/room.py) with a modelled engine, requests held while a model has no replica, then the replica appears.
The queue dispatches the oldest first and only as the replica's ramp (llmgw/flow/ramp.py) allows, so the engine
never takes the whole backlog in one instant and takes it in the order it arrived."""

from __future__ import annotations

from collections import Counter

import trio
import trio.testing

from llmgw.engines.probe import EngineLoad
from llmgw.flow.model import DEFAULT_CLASSES, Admitted, FlowRequest, FlowSettings
from llmgw.flow.queue import FlowQueue
from llmgw.flow.ramp import START as RAMP_START
from llmgw.flow.room import EngineRoom
from llmgw.metrics import Metrics
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.replica import Replica
from llmgw.router.router import Router

INTERACTIVE, STANDARD, BATCH, _ = DEFAULT_CLASSES
SEATS = 2  # the engine's sequences at once (unknown to the gateway)
STEP = 0.25  # the room's scrape interval, as by default


class Engine:
    """A FCFS engine of SEATS sequences, each request ``hold`` seconds once it has a seat; the order requests land
    in is the order it serves them."""

    def __init__(self, router: Router, replica: Replica, hold: float):
        self.router, self.replica, self.hold = router, replica, hold
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.started: dict[int, float] = {}  # when each request got a seat (its first token)
        self.most_in_flight = 0

    def take(self, index: int) -> None:
        self.waiting.append(index)
        self.most_in_flight = max(self.most_in_flight, len(self.running) + len(self.waiting))

    async def run(self, room: EngineRoom) -> None:
        while True:
            while self.waiting and len(self.running) < SEATS:
                index = self.waiting.pop(0)
                self.running.append(index)
                self.started[index] = trio.current_time()
                trio.lowlevel.spawn_system_task(self._finish, index, room)
            await trio.sleep(0.01)

    async def _finish(self, index: int, room: EngineRoom) -> None:
        await trio.sleep(self.hold)
        self.running.remove(index)
        self.replica.local_inflight -= 1
        room.wake("m")

    async def scrape(self) -> None:
        while True:
            self.replica.engine_load = EngineLoad(running=len(self.running), waiting=len(self.waiting),
                                                  at=trio.current_time(), kv_usage=0.2)
            for listener in self.router.engine_load_listeners:
                listener(self.replica)
            await trio.sleep(STEP)


async def held_burst(count: int, hold: float, priorities=None, appear_at: float = 5.0,
                     shed: list[int] | None = None, spacing: float = 0.1,
                     deadline: float = 60.0) -> tuple[dict[int, float], Engine, list[int]]:
    """``count`` requests arrive ``spacing`` s apart for a model with no replica, each with ``deadline`` seconds to
    be dispatched; at ``appear_at`` its replica appears (``shed``: where to note those shed instead of failing).
    Returns
    when the queue admitted each (those of one pass at the same moment: Trio wakes them in any order), the engine,
    and what the room allowed in flight at each admission."""
    router = Router(build_registry(make_plugin_manager(())), Metrics())
    router.configure_model("m", "round_robin")
    room = EngineRoom(router, clock=trio.current_time)
    queue = FlowQueue(FlowSettings(), room)
    room.count_queued(lambda model: sum(q.requests for q in queue.queued(model).values()))
    replica = Replica(name="a", model="m", url="http://127.0.0.1:9000")
    engine = Engine(router, replica, hold)
    admitted: dict[int, float] = {}
    allowed: list[int] = []

    async def ask(index: int) -> None:
        priority = priorities[index] if priorities else BATCH
        outcome = await queue.enter(FlowRequest("m", "t", priority, 100, trio.current_time() + deadline))
        if shed is not None and not isinstance(outcome, Admitted):
            shed.append(index)
            return
        assert isinstance(outcome, Admitted), outcome
        admitted[index] = trio.current_time()
        limit = room.ramp(replica)
        assert limit is not None  # every one of them went out in the ramp
        allowed.append(limit)
        replica.local_inflight += 1  # routed: the replica's in-flight count holds it now
        queue.release(outcome)
        engine.take(index)

    async with trio.open_nursery() as nursery:
        await nursery.start(queue.run)
        async with trio.open_nursery() as asking:
            for index in range(count):
                asking.start_soon(ask, index)
                await trio.sleep(spacing)
            await trio.sleep(appear_at - spacing * count)
            assert not admitted  # nothing to send them to
            router.add_replica(replica)
            nursery.start_soon(engine.run, room)
            nursery.start_soon(engine.scrape)
        with trio.fail_after(120):
            while engine.waiting or engine.running:
                await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    return admitted, engine, allowed


def in_order(times: dict[int, float], order) -> bool:
    """Whether the requests of ``order`` were each at the same moment as the one before or later."""
    moments = [times[index] for index in order]
    return moments == sorted(moments)


def served_as_admitted(admitted: dict[int, float], started: dict[int, float]) -> bool:
    """Whether a request admitted before another got its seat no later. Those admitted in one pass of the queue
    (the few the room allows at once) land in the engine in any order: Trio wakes them in any order."""
    return all(started[i] <= started[j] for i in admitted for j in admitted if admitted[i] < admitted[j])


def test_a_held_burst_goes_out_oldest_first_a_few_at_a_time_and_its_engine_serves_it_in_that_order():
    admitted, engine, allowed = trio.run(held_burst, 30, 1.0, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(admitted) == 30 and in_order(admitted, range(30))  # the queue's order: arrival, in one band and flow
    # Never the whole backlog at once: the ramp's 2 first (of which the batch class fills its 85%: 1), then twice
    # as many on each scrape.
    assert allowed[0] == RAMP_START
    passes = [n for _, n in sorted(Counter(admitted.values()).items())]
    assert passes[:5] == [1, 2, 3, 7, 14], passes
    # Its seats taken oldest first: the first request's first token is the first (with the one sent beside it).
    assert served_as_admitted(admitted, engine.started)
    assert engine.started[0] == min(engine.started.values())


def test_a_held_burst_goes_out_band_first_then_in_arrival_order():
    priorities = [BATCH, STANDARD, BATCH, INTERACTIVE, STANDARD, BATCH, INTERACTIVE, BATCH]
    admitted, engine, _ = trio.run(held_burst, len(priorities), 0.5, priorities,
                                   clock=trio.testing.MockClock(autojump_threshold=0))
    order = [3, 6, 1, 4, 0, 2, 5, 7]
    assert in_order(admitted, order) and served_as_admitted(admitted, engine.started)
    assert admitted[3] < admitted[7]


def test_nothing_is_shed_early_on_the_paced_drain_of_a_held_burst():
    # The bench's start from zero: 79 held over the 29 s the engine takes to start, each with 50 s to be
    # dispatched; served 2 at a time in 0.6 s each (3.3/s), the last is dispatched 24 s after the start, in time.
    shed: list[int] = []
    admitted, engine, _ = trio.run(held_burst, 79, 0.6, None, 29.0, shed, 29.0 / 79, 50.0,
                                   clock=trio.testing.MockClock(autojump_threshold=0))
    assert shed == [] and len(admitted) == 79
    assert served_as_admitted(admitted, engine.started)
