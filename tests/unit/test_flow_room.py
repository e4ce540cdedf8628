"""The room of overload control (llmgw/flow/room.py, capacity.py): capacity learnt per replica from synthetic
engine scrapes, the room per class, its split among gateways, and what a forged peer count can take."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from hypothesis import given, settings, strategies as st
from prometheus_client import CollectorRegistry

from llmgw.engines.probe import EngineLoad
from llmgw.flow.capacity import (
    BLOCKS as FOR_BLOCKS,
    BUDGET as FOR_BUDGET,
    CUT,
    MAX_CAPACITY,
    RAISE,
    SEATS as FOR_SEATS,
    UNBOUNDED,
    CapacityRule,
    ReplicaCapacity,
    queue_kind,
)
from llmgw.flow.model import DEFAULT_CLASSES, FlowSettings
from llmgw.flow.ramp import START as RAMP_START, Ramp
from llmgw.flow.room import EngineRoom
from llmgw.flow.room_metrics import RoomMetrics
from llmgw.metrics import Metrics
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router import load_scraper
from llmgw.router.load_scraper import schedule
from llmgw.router.output_allowance import BLOCK, BLOCKS, MIN_BLOCKS
from llmgw.router.replica import Replica, ReplicaState
from llmgw.router.router import EngineMetricsDemand, Router
from llmgw.router.tier import Decision, RouteRequest

INTERACTIVE, STANDARD, BATCH, BEST_EFFORT = DEFAULT_CLASSES
RULE = CapacityRule()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def load(at: float, running: float, waiting: float = 0.0, kv: float | None = 0.3) -> EngineLoad:
    return EngineLoad(running=running, waiting=waiting, at=at, kv_usage=kv)


# -- the learning, one replica ----------------------------------------------------------------------------------------


def test_a_replica_is_unknown_until_its_engine_says_it_is_full():
    learnt = ReplicaCapacity()
    for at in range(10):  # busy but not queueing: nothing learnt, nothing held
        assert learnt.observe(load(at, running=40, kv=0.7), inflight=40, demand=True, rule=RULE) is None
    assert learnt.limit() is None


def test_a_queue_on_two_scrapes_cuts_capacity_to_what_was_running():
    learnt = ReplicaCapacity()
    assert learnt.observe(load(1, running=32, waiting=4), 36, True, RULE) is None  # one scrape: maybe one step
    assert learnt.observe(load(2, running=32, waiting=5), 37, True, RULE) == CUT
    assert learnt.limit() == 32
    # More than its capacity in flight (sent before it was learnt): the engine's figure, no blind cut on cut.
    assert learnt.observe(load(3, running=32, waiting=5), 37, True, RULE) is None
    assert learnt.limit() == 32
    # At its capacity and the engine still queues: at least x0.9.
    assert learnt.observe(load(4, running=32, waiting=2), 32, True, RULE) == CUT
    assert learnt.limit() == math.floor(32 * 0.9)
    assert learnt.cuts == 2


def test_an_engine_still_admitting_its_queue_is_ramping_up_not_full():
    learnt = ReplicaCapacity()
    for at, running in enumerate((2, 4, 6, 8, 10)):  # a burst: the engine admits it a few per step
        learnt.observe(load(at, running=running, waiting=200 - running), 200, True, RULE)
    assert learnt.limit() is None


def test_a_burst_sent_before_the_capacity_was_known_takes_the_engines_figure_up_or_down():
    learnt = ReplicaCapacity()
    learnt.observe(load(1, running=2, waiting=198), 200, True, RULE)
    assert learnt.observe(load(2, running=2, waiting=198), 200, True, RULE) == CUT  # a slow start: 2 running
    assert learnt.limit() == 2
    assert learnt.observe(load(3, running=55, waiting=140, kv=1.0), 195, True, RULE) == RAISE
    assert learnt.limit() == 44  # what the full engine ran, scaled to the KV target, not the 2 of the ramp


def test_a_request_between_two_engine_steps_is_no_queue():
    learnt = ReplicaCapacity()
    for at in range(0, 20, 2):  # a waiting request now and then, never on two scrapes in a row
        learnt.observe(load(at, running=3, waiting=1), 4, True, RULE)
        learnt.observe(load(at + 1, running=4, waiting=0), 4, True, RULE)
    assert learnt.limit() is None
    learnt.observe(load(30, running=100, waiting=2), 102, True, RULE)  # 2 of 100: within waiting_slack
    learnt.observe(load(31, running=100, waiting=2), 102, True, RULE)
    assert learnt.limit() is None


def test_a_full_kv_cache_cuts_at_once_scaled_to_the_target_usage():
    learnt = ReplicaCapacity()
    assert learnt.observe(load(1, running=50, kv=1.0), 50, False, RULE) == CUT
    assert learnt.limit() == 40  # 50 x 0.8 / 1.0


def test_capacity_grows_while_the_engine_idles_with_a_backlog():
    learnt = ReplicaCapacity(capacity=10.0)
    assert learnt.observe(load(1, running=10, kv=0.4), inflight=10, demand=True, rule=RULE) == RAISE
    assert learnt.limit() == 11  # +1 at least
    learnt.capacity = 50.0
    assert learnt.observe(load(2, running=50, kv=0.4), inflight=50, demand=True, rule=RULE) == RAISE
    assert learnt.limit() == 55  # x1.1
    # A class below the highest fills only its max_fill: 42 of 55 in flight (the lowest's 75%) is at capacity.
    assert learnt.observe(load(3, running=42, kv=0.4), inflight=42, demand=True, rule=RULE) is None
    assert learnt.observe(load(4, running=42, kv=0.4), inflight=42, demand=True, rule=RULE, busy_share=0.75) == RAISE


def test_capacity_stays_without_evidence_that_it_can_take_more():
    learnt = ReplicaCapacity(capacity=20.0)
    assert learnt.observe(load(1, running=20, kv=0.4), 20, demand=False, rule=RULE) is None  # nobody waits
    assert learnt.observe(load(2, running=5, kv=0.4), 5, demand=True, rule=RULE) is None  # not at its capacity
    assert learnt.observe(load(3, running=20, kv=0.85), 20, demand=True, rule=RULE) is None  # KV above the target
    assert learnt.observe(load(3, running=20, kv=0.3), 20, demand=True, rule=RULE) is None  # the same scrape again
    assert learnt.limit() == 20 and learnt.raises == 0


def test_broken_gauges_neither_crash_nor_reach_past_the_bounds():
    learnt = ReplicaCapacity()
    assert learnt.observe(load(1, running=math.nan, waiting=math.inf, kv=math.nan), 0, True, RULE) is None
    learnt.observe(load(2, running=1e12, kv=5.0), 0, True, RULE)
    assert learnt.limit() == 100_000
    learnt.observe(load(3, running=0, kv=1.0), 0, True, RULE)
    assert learnt.limit() == RULE.min_capacity


# -- the room of a model ----------------------------------------------------------------------------------------------


class Peers:
    """The cluster's load sharing as the room sees it: the other gateways' requests held per model, and the output
    allowance they have in flight (None: one of them does not report it)."""

    def __init__(self) -> None:
        self.held: dict[str, list[int]] = {}
        self.output: dict[str, int] = {}
        self.source = None
        self.max_queued = 0
        self.listeners: list = []

    def count_queued(self, source, max_queued):
        self.source, self.max_queued = source, max_queued

    def peer_queued(self, model):
        return self.held.get(model, [])

    def peer_output(self, model):
        return self.output.get(model)

    def watch(self, listener):
        self.listeners.append(listener)


def make_room(replicas=("a", "b"), peers=None, settings=None, metrics=None):
    router = Router(build_registry(make_plugin_manager(())), Metrics())
    router.configure_model("m", "round_robin")
    for i, name in enumerate(replicas):
        router.add_replica(Replica(name=name, model="m", url=f"http://127.0.0.1:{9000 + i}"))
    clock = Clock()
    room = EngineRoom(router, peers, settings, metrics=metrics, clock=clock)
    queued = {"m": 0}
    room.count_queued(lambda model: queued.get(model, 0))
    return router, room, queued, clock


def scrape(router, room, name, at, running, waiting=0.0, kv=0.3):
    replica = router.replicas.get(name)
    replica.engine_load = load(at, running, waiting, kv)
    for listener in router.engine_load_listeners:
        listener(replica)


def learn(router, room, name, capacity, seats=None):
    """Make replica ``name``'s learnt capacity ``capacity`` (its engine full at that many running) and its seats
    ``seats`` (None: unknown, the capacity alone decides)."""
    scrape(router, room, name, 1, capacity, kv=1.0 * RULE.kv_target)
    scrape(router, room, name, 2, capacity, waiting=5)
    scrape(router, room, name, 3, capacity, waiting=5)
    learnt = room._learnt[router.replicas.get(name)]
    learnt.capacity, learnt.seats = float(capacity), seats


def test_the_room_asks_the_scraper_for_every_models_engines():
    router, room, _, _ = make_room()
    assert router.engine_metrics_demand is not None and router.engine_metrics_demand.interval == 0.25


def test_nothing_is_held_while_no_scrape_says_full():
    router, room, _, _ = make_room()
    assert room.free("m", BEST_EFFORT) == UNBOUNDED
    for at in range(5):
        scrape(router, room, "a", at, running=100, kv=0.85)
    router.replicas.get("a").local_inflight = 10_000
    assert room.free("m", INTERACTIVE) == UNBOUNDED
    learn(router, room, "a", 10)  # b is still unknown: not full
    assert room.free("m", INTERACTIVE) == UNBOUNDED


def test_the_room_is_capacity_less_inflight_over_routable_replicas():
    router, room, _, _ = make_room()
    learn(router, room, "a", 20)
    learn(router, room, "b", 20)
    a, b = router.replicas.get("a"), router.replicas.get("b")
    a.local_inflight, a.peer_inflight = 5, 3
    b.local_inflight = 25  # over its capacity: counts 0, never below
    assert room.free("m", INTERACTIVE) == 12
    b.state = ReplicaState.DOWN
    assert room.free("m", INTERACTIVE) == 12  # a down replica gives no room
    a.state = ReplicaState.DRAINING
    assert room.free("m", INTERACTIVE) == 0
    assert room.free("unknown-model", INTERACTIVE) == 0


def test_a_lower_class_fills_only_its_max_fill_of_the_capacity():
    router, room, _, _ = make_room()
    learn(router, room, "a", 50)
    learn(router, room, "b", 50)
    router.replicas.get("a").local_inflight = 80 // 2
    router.replicas.get("b").local_inflight = 80 // 2
    assert room.free("m", INTERACTIVE) == 20
    assert room.free("m", STANDARD) == 15  # 95 of 100
    assert room.free("m", BATCH) == 5  # 85 of 100
    assert room.free("m", BEST_EFFORT) == 0  # 75 of 100, already past


def test_a_held_back_class_makes_capacity_grow_while_the_engines_idle():
    router, room, queued, _ = make_room(replicas=("a",))
    learn(router, room, "a", 4)
    router.replicas.get("a").local_inflight = 3  # batch may fill floor(4 x 0.85) = 3
    assert room.free("m", BATCH) == 0
    queued["m"] = 1
    for at in range(10, 20):
        scrape(router, room, "a", at, running=router.replicas.get("a").inflight, kv=0.3)
        router.replicas.get("a").local_inflight = room.capacity(router.replicas.get("a"))
    assert room.capacity(router.replicas.get("a")) > 10


def test_the_room_is_shared_by_the_requests_each_gateway_has_in_flight_and_holds():
    peers = Peers()
    router, room, queued, _ = make_room(peers=peers)
    learn(router, room, "a", 50)
    learn(router, room, "b", 50)
    assert room.free("m", INTERACTIVE) == 100  # nobody else holds any: all of it
    peers.held["m"] = [30, 10]
    queued["m"] = 40
    assert room.free("m", INTERACTIVE) == 50  # a quota of 100 x 40 / 80
    queued["m"] = 0  # a request arriving to an empty queue counts as one waiting
    assert room.free("m", INTERACTIVE) == 100 * 1 // 41
    a, b = router.replicas.get("a"), router.replicas.get("b")
    a.peer_inflight, b.peer_inflight = 49, 50
    assert room.free("m", INTERACTIVE) == 1  # none of its own in flight: at least one, nobody starves
    a.peer_inflight, a.local_inflight = 0, 49
    assert room.free("m", INTERACTIVE) == 0  # 49 of its own in flight, beyond its quota: its turn comes as they end
    a.peer_inflight = 1
    assert room.free("m", INTERACTIVE) == 0
    assert peers.source() == {} and peers.max_queued == FlowSettings().max_queued
    queued["m"] = 7
    assert peers.source() == {"m": 7}  # what this gateway's load report says


def test_dispatching_one_request_after_another_stops_at_the_quota():
    """Before the next report, a gateway that dispatches while free() > 0 must not take the others' part of the
    room one request at a time."""
    peers = Peers()
    router, room, queued, _ = make_room(peers=peers)
    learn(router, room, "a", 10)
    learn(router, room, "b", 10)
    peers.held["m"] = [10]  # another gateway holds as many as this one: half the room each
    queued["m"] = 10
    dispatched = 0
    while room.free("m", INTERACTIVE) > 0:
        replica = router.replicas.get("ab"[dispatched % 2])
        replica.local_inflight += 1
        queued["m"] -= 1
        dispatched += 1
    assert dispatched == 10
    assert room.free("m", BATCH) == 0  # batch's quota is of the 85% it may fill


def test_a_forged_peer_count_cannot_take_all_the_room():
    peers = Peers()
    router, room, queued, _ = make_room(peers=peers, settings=FlowSettings(max_queued=100))
    learn(router, room, "a", 200)
    learn(router, room, "b", 200)
    queued["m"] = 100
    peers.held["m"] = [1 << 60]
    assert room.free("m", INTERACTIVE) == 200  # the forged count taken at max_queued: half the room
    peers.held["m"] = [1 << 60] * 256  # every origin the load sharing keeps, all forged
    assert room.free("m", INTERACTIVE) >= 1


def test_changed_returns_on_wake_a_scrape_a_peer_report_or_a_new_replica_and_else_after_the_poll():
    peers = Peers()
    router, room, _, _ = make_room(peers=peers)

    async def main():
        async def returns_on(poke) -> None:
            async with trio.open_nursery() as nursery:
                done = trio.Event()

                async def wait() -> None:
                    await room.changed("m")
                    done.set()

                nursery.start_soon(wait)
                await trio.testing.wait_all_tasks_blocked()
                poke()
                await trio.testing.wait_all_tasks_blocked()
                assert done.is_set()

        await returns_on(lambda: room.wake("m"))
        await returns_on(lambda: scrape(router, room, "a", 1, 3))
        await returns_on(lambda: peers.listeners[0]())
        await returns_on(lambda: router.add_replica(Replica(name="c", model="m", url="http://127.0.0.1:9009")))
        start = trio.current_time()
        await room.changed("m")
        assert 0.05 <= trio.current_time() - start < 0.06

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert room._events == {}  # nobody waits: no event kept


def test_saturation_and_its_metrics():
    registry = CollectorRegistry()
    router, room, _, clock = make_room(metrics=RoomMetrics(registry))
    assert room.saturation("m") == 0.0
    clock.now = 2.1
    scrape(router, room, "b", 2, running=5, kv=0.45)
    assert room.saturation("m") == 0.5  # b unknown: its KV usage over kv_high
    learn(router, room, "a", 10)
    router.replicas.get("a").local_inflight = 15
    assert room.saturation("m") == 1.5
    assert registry.get_sample_value("llmgw_flow_replica_capacity", {"model": "m", "replica": "a"}) == 10
    assert registry.get_sample_value("llmgw_flow_replica_capacity", {"model": "m", "replica": "b"}) is None
    assert registry.get_sample_value("llmgw_flow_replica_saturation", {"model": "m", "replica": "a"}) == 1.5
    assert registry.get_sample_value("llmgw_flow_room_free", {"model": "m"}) == math.inf
    assert registry.get_sample_value("llmgw_flow_capacity_changes_total", {"model": "m", "change": "cut"}) >= 1
    assert room.describe("m")["replicas"][0]["capacity"] == 10
    assert registry.get_sample_value("llmgw_flow_replica_kv_capacity_tokens", {"model": "m", "replica": "a"}) is None
    assert registry.get_sample_value("llmgw_flow_prompt_token_ratio", {"model": "m"}) == 1.0
    tell_kv(router, "a")
    route(router, "a", prompt_words=16, max_tokens=100)  # 80 characters: 21 estimated tokens
    assert registry.get_sample_value("llmgw_flow_replica_kv_capacity_tokens", {"model": "m", "replica": "a"}) == 8192
    assert registry.get_sample_value("llmgw_flow_replica_kv_held_tokens", {"model": "m", "replica": "a"}) == \
        router.replicas.get("a").local_inflight_tokens + 100


def test_the_scraper_takes_the_rooms_interval_when_it_is_shorter_than_the_tiers():
    demand = EngineMetricsDemand(0.25, 1.0)
    assert schedule(object(), None) == (None, 0.0)  # no tier interval, no room: not scraped
    assert schedule(object(), demand) == (0.25, 1.0)
    tier = SimpleNamespace(engine_metrics_interval=2.0, engine_metrics_timeout=None)
    assert schedule(tier, None) == (2.0, 1.0)
    assert schedule(tier, demand) == (0.25, 1.0)
    fast = SimpleNamespace(engine_metrics_interval=0.1, engine_metrics_timeout=0.05)
    assert schedule(fast, demand) == (0.1, 0.05)


def test_capacity_grows_with_a_lower_class_alone_filling_its_max_fill():
    router, room, queued, _ = make_room(replicas=("a",))
    learn(router, room, "a", 20)
    a = router.replicas.get("a")
    a.local_inflight = 19  # all that standard may fill: floor(20 x 0.95)
    assert room.free("m", STANDARD) == 0
    queued["m"] = 5
    scrape(router, room, "a", 10, running=19, kv=0.4)
    assert room.capacity(a) == 22
    room.settings = FlowSettings(classes=(INTERACTIVE,))  # one class filling all: 19 of 22 is not at capacity
    scrape(router, room, "a", 11, running=19, kv=0.4)
    assert room.capacity(a) == 22


gauge = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10**7).map(float))


@settings(max_examples=200)
@given(scrapes=st.lists(st.tuples(gauge, gauge, st.none() | gauge, st.integers(0, 10**6), st.booleans()),
                        max_size=30))
def test_any_engine_gauges_keep_the_capacity_unknown_or_within_its_bounds(scrapes):
    learnt = ReplicaCapacity()
    for at, (running, waiting, kv, inflight, demand) in enumerate(scrapes):
        learnt.observe(EngineLoad(running=running, waiting=waiting, at=float(at), kv_usage=kv), inflight, demand,
                       RULE, 0.75)
        assert learnt.limit() is None or RULE.min_capacity <= learnt.limit() <= MAX_CAPACITY


async def test_a_failing_listener_neither_ends_the_scraper_nor_keeps_the_others_from_hearing(monkeypatch, caplog,
                                                                                           autojump_clock):
    router, room, _, _ = make_room(replicas=("a",))
    a = router.replicas.get("a")

    async def scraped(replica, timeout, clock=None):
        return load(trio.current_time(), running=3)

    def broken(replica):
        raise RuntimeError("a listener's bug")

    monkeypatch.setattr(load_scraper, "scrape_once", scraped)
    router.engine_load_listeners.insert(0, broken)
    heard = []
    router.engine_load_listeners.append(heard.append)
    with trio.move_on_after(2.0):
        await load_scraper.scrape_engine_load(router, clock=trio.current_time)
    assert len(heard) >= 7 and set(heard) == {a}  # every 0.25 s, the room's interval
    assert sum("failed (logged once)" in r.message for r in caplog.records) == 1


# -- the room in KV tokens --------------------------------------------------------------------------------------------


def tell_kv(router, name, blocks=512, block_size=16):
    """Replica ``name``'s engine says its KV cache holds ``blocks`` x ``block_size`` tokens."""
    replica = router.replicas.get(name)
    replica.engine_load = EngineLoad(running=0, waiting=0, at=1, kv_usage=0.0, num_blocks=blocks,
                                     block_size=block_size)


def held(router, room, name):
    return room.held_tokens(router.replicas.get(name), router.models["m"].prompt_ratio)


def route(router, name, prompt_words, max_tokens):
    """Route a request of about ``prompt_words`` x 5 characters with ``max_tokens`` to replica ``name``."""
    request = RouteRequest("m", "/v1/chat/completions", {
        "model": "m", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": " ".join(["word"] * prompt_words)}]})
    decision = Decision(router.replicas.get(name))
    router.routed(request, decision)
    return request, decision


def test_a_batch_request_past_its_share_of_the_kv_cache_waits_while_an_interactive_one_fits():
    router, room, _, _ = make_room(replicas=("a",))
    tell_kv(router, "a")  # 8,192 tokens; batch may hold 85% of them: 6,963
    for _ in range(2):
        route(router, "a", prompt_words=1680, max_tokens=256)  # ~2,100 prompt + 256 output tokens
    assert 4600 < held(router, room, "a") < 4800
    assert room.free("m", BATCH) == UNBOUNDED  # the request count alone would let it through
    assert not room.fits("m", BATCH, 2400)
    assert room.fits("m", BATCH, 2000)
    assert room.fits("m", INTERACTIVE, 150)
    assert room.fits("m", INTERACTIVE, 3400)  # interactive's share is the whole cache


def test_the_tokens_in_flight_are_the_prompts_and_max_tokens_until_finished_and_the_peers_prompts():
    router, room, _, _ = make_room(replicas=("a", "b"))
    tell_kv(router, "a")
    tell_kv(router, "b")
    a = router.replicas.get("a")
    request, decision = route(router, "a", prompt_words=80, max_tokens=1000)
    assert held(router, room, "a") == a.local_inflight_tokens + 1000
    a.local_inflight = 1  # the data plane's count
    a.peer_inflight, a.peer_inflight_tokens = 2, 300  # another gateway's: their output at our mean per request
    assert held(router, room, "a") == a.local_inflight_tokens + 300 + 1000 + 2 * 1000
    router.finished(request, decision, None)
    a.local_inflight = 0
    # None of its own there: the others' output at the default 256 per request (in the room's own count, this
    # gateway's mean over the model's replicas while it has requests in flight elsewhere)
    assert a.local_inflight_output_tokens == 0 and held(router, room, "a") == 300 + 2 * 256
    # Summed over the replicas, each within the class's share: a request larger than one replica's share waits
    # for a whole share, never for ever.
    on_b = route(router, "b", prompt_words=10, max_tokens=6000)
    free = (6144 - 300 - 2 * 256) + (6144 - held(router, room, "b"))  # best-effort's 75% of each 8,192
    assert room.fits("m", BEST_EFFORT, free)
    assert not room.fits("m", BEST_EFFORT, free + 1)
    assert not room.fits("m", BEST_EFFORT, 50_000)
    router.finished(*on_b, None)
    assert room.fits("m", BEST_EFFORT, 50_000)  # b is empty: one whole share is free


def test_without_a_kv_capacity_scraped_the_tokens_hold_nothing_back():
    router, room, _, _ = make_room(replicas=("a", "b"))
    route(router, "a", prompt_words=100_000, max_tokens=100_000)
    assert room.fits("m", BEST_EFFORT, 10**9)
    tell_kv(router, "a")  # b's still unknown: not full
    assert room.fits("m", BEST_EFFORT, 10**9)
    tell_kv(router, "b", blocks=0)  # a broken cache config is no capacity
    assert room.fits("m", BEST_EFFORT, 10**9)
    tell_kv(router, "b")  # a is past its share, b empty: up to b's share fits
    assert room.fits("m", BEST_EFFORT, 6144)
    route(router, "b", prompt_words=10, max_tokens=100)
    assert not room.fits("m", BEST_EFFORT, 6144)
    assert room.describe("m")["replicas"][1]["kv_capacity_tokens"] == 8192


def test_the_prompt_estimate_is_scaled_by_what_the_engines_counted_in_the_answers_usage():
    router, room, _, _ = make_room(replicas=("a",))
    tell_kv(router, "a")
    request, decision = route(router, "a", prompt_words=400, max_tokens=256)
    estimate = decision.inflight_tokens
    assert held(router, room, "a") == estimate + 256  # nothing learnt yet: the estimate as it is
    assert room.fits("m", BATCH, 6000)
    router.finished(request, decision, {"prompt_tokens": 4 * estimate, "completion_tokens": 256})
    for _ in range(3):
        route(router, "a", prompt_words=400, max_tokens=256)
    assert held(router, room, "a") == 3 * (4 * estimate + 256)  # the engine's tokenizer counts 4x the estimate
    assert not room.fits("m", BATCH, 4 * estimate + 256)  # a fourth would pass batch's 6,963 of 8,192
    # The incoming request's estimate is scaled too (it would otherwise pass, to wait for blocks in the engine).
    left = 6963 - held(router, room, "a")
    assert room.fits("m", BATCH, left // 4) and not room.fits("m", BATCH, left // 4 + 1)
    # A forged or broken usage moves it boundedly: clamped samples, a moving average.
    ratio = router.models["m"].prompt_ratio
    for usage in (None, {"prompt_tokens": "many"}, {"prompt_tokens": True}, {"prompt_tokens": -5}):
        ratio.observe(estimate, usage)
    assert ratio.ratio == 4.0
    ratio.observe(1, {"prompt_tokens": 10**12})
    assert 4.0 < ratio.ratio <= 4.0 + 0.1 * (16.0 - 4.0)


def test_of_the_request_asking_only_the_prompt_is_scaled_its_output_allowance_counts_as_it_is():
    router, room, _, _ = make_room(replicas=("a",))
    tell_kv(router, "a")  # batch may hold 6,963 of 8,192
    request, decision = route(router, "a", prompt_words=400, max_tokens=256)
    estimate = decision.inflight_tokens
    router.finished(request, decision, {"prompt_tokens": 4 * estimate, "completion_tokens": 256})
    assert router.models["m"].prompt_ratio.ratio == 4.0
    route(router, "a", prompt_words=400, max_tokens=256)
    left = 6963 - held(router, room, "a")
    assert 4000 < left < 5000
    # A batch request of 100 estimated prompt tokens and max_tokens 2,000: 400 + 2,000 in the engine's count; scaled
    # whole, 8,400: it would wait for the replica to empty.
    assert room.fits("m", BATCH, 2100, output=2000)
    assert room.admits("m", BATCH, 0, 2100, output=2000)
    assert not room.fits("m", BATCH, 2100)  # no allowance said: all of it is prompt, the safe side
    # At the edge: the output one for one, the prompt four for one.
    assert room.fits("m", BATCH, 100 + left - 400, output=left - 400)
    assert not room.fits("m", BATCH, 100 + left - 399, output=left - 399)
    assert room.fits("m", BATCH, 10 + left - 40, output=left - 40)
    assert not room.fits("m", BATCH, 11 + left - 40, output=left - 40)
    # An allowance out of range is bounded by the whole: none below 0, all of it above.
    assert not room.fits("m", BATCH, left // 4 + 1, output=-5)
    assert room.fits("m", BATCH, left, output=10**9) and not room.fits("m", BATCH, left + 1, output=10**9)


def answer(router, replica, max_tokens, completion, times):
    """``times`` answers on ``replica`` that held ``completion`` of their ``max_tokens``: what the output allowance
    learns from."""
    for _ in range(times):
        request, decision = route(router, replica, prompt_words=10, max_tokens=max_tokens)
        router.finished(request, decision, {"prompt_tokens": decision.inflight_tokens,
                                            "completion_tokens": completion})


def test_the_output_reserved_is_what_the_models_answers_were_learnt_to_hold():
    router, room, _, _ = make_room(replicas=("a",))
    tell_kv(router, "a")  # batch may hold 6,963 of 8,192
    allowance = router.models["m"].output_allowance
    answer(router, "a", max_tokens=1000, completion=1000, times=BLOCK * MIN_BLOCKS - 1)
    route(router, "a", prompt_words=10, max_tokens=1000)
    assert held(router, room, "a") == router.replicas.get("a").local_inflight_tokens + 1000  # not learnt yet
    answer(router, "a", max_tokens=1000, completion=250, times=BLOCKS * BLOCK)  # answers now hold a quarter
    assert allowance.fraction == 0.25
    request, decision = route(router, "a", prompt_words=10, max_tokens=1000)
    assert decision.output_tokens == 250  # in flight: a quarter of its cap
    router.finished(request, decision, None)  # no usage (a stream cut short): nothing learnt, its tokens go
    assert allowance.answers == (BLOCK * MIN_BLOCKS - 1) + BLOCKS * BLOCK
    # The request asking reserves the same: 2,000 of output allowance holds 500 of the cache.
    prompt = held(router, room, "a")
    assert room.fits("m", BATCH, 6963 - prompt - 500 + 2000, output=2000)
    assert not room.fits("m", BATCH, 6963 - prompt - 500 + 2001, output=2000)
    # A request without max_tokens reserves the default whole (nothing bounds its answer), and teaches nothing.
    request = RouteRequest("m", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    decision = Decision(router.replicas.get("a"))
    router.routed(request, decision)
    assert decision.output_tokens == 256
    router.finished(request, decision, {"prompt_tokens": 3, "completion_tokens": 5000})
    assert allowance.fraction == 0.25


def test_an_allowance_learnt_too_low_is_caught_by_the_engines_kv_usage_cutting_the_capacity():
    """Answers learnt to hold a tenth of their max_tokens run to their caps: the tokens the room counts let more in
    than the cache holds, and the engine's KV usage at kv_high cuts the replica's capacity to what it runs."""
    router, room, _, _ = make_room(replicas=("a",))
    a = router.replicas.get("a")
    answer(router, "a", max_tokens=1000, completion=100, times=BLOCKS * BLOCK)  # answers held a tenth
    for _ in range(8):
        route(router, "a", prompt_words=10, max_tokens=1000)
        a.local_inflight += 1
    a.engine_load = EngineLoad(running=8, waiting=0, at=1, kv_usage=0.8, num_blocks=512, block_size=16)
    assert held(router, room, "a") < 0.2 * 8192  # the room's estimate: 8 x (the prompt + 100)
    assert room.free("m", INTERACTIVE) == UNBOUNDED
    a.engine_load = EngineLoad(running=8, waiting=0, at=2, kv_usage=0.95, num_blocks=512, block_size=16)
    room.scraped(a)  # the answers grew: the engine's cache is nearly full
    assert room.capacity(a) == math.floor(8 * RULE.kv_target / 0.95)
    assert room.free("m", INTERACTIVE) == 0


# -- seats: the sequences an engine runs at once ----------------------------------------------------------------------


def test_seats_are_what_the_engine_ran_when_it_queued_with_kv_to_spare():
    learnt = ReplicaCapacity()
    learnt.observe(load(1, running=8, waiting=3, kv=0.5), 11, True, RULE)
    assert learnt.seats is None  # one scrape: maybe one engine step
    learnt.observe(load(2, running=8, waiting=3, kv=0.5), 11, True, RULE)
    assert learnt.seats == 8
    # A queue for blocks with the cache nearly full says nothing of the seats; nor does a lower count later (a long
    # prompt waiting for blocks below kv_target): the highest figure stays.
    learnt.observe(load(3, running=5, waiting=3, kv=0.95), 8, True, RULE)
    learnt.observe(load(4, running=5, waiting=3, kv=0.95), 8, True, RULE)
    learnt.observe(load(5, running=6, waiting=3, kv=0.7), 9, True, RULE)
    learnt.observe(load(6, running=6, waiting=3, kv=0.7), 9, True, RULE)
    assert learnt.seats == 8
    learnt.observe(load(7, running=12, waiting=0, kv=0.6), 12, True, RULE)
    assert learnt.seats == 12  # the engine proves it runs more


def test_a_queue_for_blocks_at_fewer_running_than_the_engine_ran_says_nothing_of_its_seats():
    """Two long prompts hold the cache at 75%; the next waits for blocks with 4 running, not for a seat."""
    learnt = ReplicaCapacity()
    learnt.observe(load(1, running=8, waiting=0, kv=0.3), 8, True, RULE)  # it ran 8 before
    learnt.observe(load(2, running=4, waiting=2, kv=0.75), 6, True, RULE)
    learnt.observe(load(3, running=4, waiting=2, kv=0.75), 6, True, RULE)
    assert learnt.seats is None
    learnt.observe(load(4, running=8, waiting=2, kv=0.5), 10, True, RULE)
    learnt.observe(load(5, running=8, waiting=3, kv=0.5), 11, True, RULE)
    assert learnt.seats == 8


def test_seats_stay_unknown_while_the_engine_ramps_up_or_cannot_say_why_it_queues():
    ramping = ReplicaCapacity()
    for at, running in enumerate((2, 4, 6, 8)):
        ramping.observe(load(at, running=running, waiting=100, kv=0.2), 108, True, RULE)
    assert ramping.seats is None
    blind = ReplicaCapacity()  # no KV usage gauge: a queue for blocks and one for seats look the same
    blind.observe(load(1, running=8, waiting=3, kv=None), 11, True, RULE)
    blind.observe(load(2, running=8, waiting=3, kv=None), 11, True, RULE)
    assert blind.seats is None and blind.limit() == 8


def test_a_lower_class_keeps_its_share_of_each_replicas_seats_free():
    """Batch streams spread over the replicas must not take a replica's last seats: an interactive arrival routed
    there would wait inside the engine, where no priority applies."""
    router, room, _, _ = make_room()
    learn(router, room, "a", 9, seats=8)
    learn(router, room, "b", 9, seats=8)
    a, b = router.replicas.get("a"), router.replicas.get("b")
    a.local_inflight, b.local_inflight = 6, 2
    assert room.free("m", INTERACTIVE) == 10  # the capacity alone: 3 + 7
    # batch: floor(8 x 0.85) = 6 seats per replica; a has none left, b 4 (the summed capacity would allow 7)
    assert room.free("m", BATCH) == 4
    assert room.free("m", STANDARD) == 6  # floor(8 x 0.95) = 7: 1 on a, 5 on b; the summed rule allows 10 - 1 = 9
    b.peer_inflight = 4  # the other gateways' requests take seats too
    assert room.free("m", BATCH) == 0
    assert room.free("m", INTERACTIVE) == 6  # 3 + 3


def test_one_seat_is_never_kept_from_a_replica_that_has_but_one():
    router, room, _, _ = make_room(replicas=("a",))
    learn(router, room, "a", 1, seats=1)
    assert room.free("m", BEST_EFFORT) == 1  # floor(1 x 0.75) = 0 would hold best-effort for ever on an idle engine


def test_admits_is_free_less_pending_and_fits_in_one_pass():
    router, room, _, _ = make_room(replicas=("a",))
    learn(router, room, "a", 9, seats=8)
    scrape(router, room, "a", 10, running=0, kv=0.0)
    a = router.replicas.get("a")
    a.engine_load = EngineLoad(running=0, waiting=0, at=11, kv_usage=0.0, num_blocks=100, block_size=16)
    a.local_inflight, a.local_inflight_output_tokens = 4, 500
    assert room.free("m", BATCH) == 2
    assert room.admits("m", BATCH, pending=1, tokens=100)
    assert not room.admits("m", BATCH, pending=2, tokens=100)  # the queue's own admitted requests count
    assert not room.admits("m", BATCH, pending=0, tokens=861)  # floor(1,600 x 0.85) - 500 = 860 tokens
    assert room.admits("m", INTERACTIVE, pending=0, tokens=1100)
    for priority in DEFAULT_CLASSES:
        for pending in range(4):
            for tokens in (0, 500, 1500, 5000):
                assert room.admits("m", priority, pending, tokens) == (
                    room.free("m", priority) - pending > 0 and room.fits("m", priority, tokens))


def test_seats_learnt_from_the_scrapes_are_exposed_described_and_logged(caplog):
    registry = CollectorRegistry()
    router, room, _, _ = make_room(metrics=RoomMetrics(registry))
    assert registry.get_sample_value("llmgw_flow_replica_seats", {"model": "m", "replica": "a"}) is None
    with caplog.at_level("INFO", logger="llmgw.flow.room"):
        scrape(router, room, "a", 1, running=8, waiting=2, kv=0.4)
        scrape(router, room, "a", 2, running=8, waiting=3, kv=0.4)
    assert room.seats(router.replicas.get("a")) == 8
    assert registry.get_sample_value("llmgw_flow_replica_seats", {"model": "m", "replica": "a"}) == 8
    assert room.describe("m")["replicas"][0]["seats"] == 8
    assert any("runs 8 sequences at once" in r.getMessage() for r in caplog.records)
    router.replicas.get("a").local_inflight = 6  # floor(8 x 0.85): batch waits; b is unknown, so nothing is held
    assert room.free("m", BATCH) == UNBOUNDED
    scrape(router, room, "b", 3, running=8, waiting=2, kv=0.4)
    scrape(router, room, "b", 4, running=8, waiting=2, kv=0.4)
    assert room.free("m", BATCH) == 6  # b: 6 of its 8 seats; a: none


def test_the_kv_tokens_are_split_among_the_gateways_holding_requests_as_the_requests_are():
    """Three gateways admitting each against all the free tokens would each take them before the next report."""
    peers = Peers()
    router, room, queued, _ = make_room(peers=peers)
    tell_kv(router, "a")
    tell_kv(router, "b")
    a, b = router.replicas.get("a"), router.replicas.get("b")
    a.local_inflight, a.local_inflight_tokens, a.local_inflight_output_tokens = 2, 3000, 3000
    b.peer_inflight, b.peer_inflight_tokens = 2, 3000  # another gateway's, output at our mean: 1,500 each
    assert held(router, room, "b") == 3000 + 2 * 256  # alone, the default; the room's own count takes our mean
    assert room.fits("m", INTERACTIVE, 4384) and not room.fits("m", INTERACTIVE, 4385)  # 6,000 held on each
    peers.output["m"] = 200  # once their reports carry their output in flight: 100 each, so 3,200 held on b
    assert room.fits("m", INTERACTIVE, 2192 + 4992) and not room.fits("m", INTERACTIVE, 2192 + 4993)
    del peers.output["m"]  # a gateway of the version before among them: our mean again
    b.peer_inflight = b.peer_inflight_tokens = 0  # b empty: 8,192 free there
    assert room.fits("m", INTERACTIVE, 8192)
    peers.held["m"] = [10]
    queued["m"] = 10
    # Its demand 2 + 10 of every gateway's 22: a quota of 16,384 x 12 // 22 = 8,936 tokens, of which it holds 6,000.
    assert room.fits("m", INTERACTIVE, 2936) and not room.fits("m", INTERACTIVE, 2937)
    peers.held["m"] = []
    assert room.fits("m", INTERACTIVE, 8192)  # nobody else holds any: all of it
    peers.held["m"] = [10]
    a.local_inflight, a.local_inflight_tokens, a.local_inflight_output_tokens = 0, 0, 0
    assert room.fits("m", INTERACTIVE, 8192)  # none of its own in flight: one request, whatever the quota
    peers.held["m"] = [10_000_000]  # a forged count is taken at max_queued: still one request
    assert room.fits("m", INTERACTIVE, 8192)



# -- what an engine's queue waits for ---------------------------------------------------------------------------------


def sized(at: float, running: float, waiting: float, kv: float, num_blocks: int = 512) -> EngineLoad:
    """A scrape of an engine that exports its KV cache's size (16-token blocks: 8,192 tokens by default)."""
    return EngineLoad(running=running, waiting=waiting, at=at, kv_usage=kv, block_size=16, num_blocks=num_blocks)


def test_a_queue_is_for_blocks_when_the_free_cache_is_short_of_what_the_requests_in_flight_still_need():
    # 8,192 tokens at 80%: 1,638 free, and the requests in flight need 2,300 more (a long prompt waits).
    assert queue_kind(sized(1, 3, 1, kv=0.8), 3, needed_tokens=2300, seats=None, most_running=8,
                      rule=RULE) == FOR_BLOCKS
    # What the engine cannot size (no cache size, or no estimate of the need) counts as blocks unless it runs as
    # many as it ever ran below kv_target (then seats): the rule as it was.
    assert queue_kind(load(1, 3, 1, kv=0.3), 3, needed_tokens=10, seats=None, most_running=8, rule=RULE) == FOR_BLOCKS
    assert queue_kind(sized(1, 3, 1, kv=0.3), 3, needed_tokens=None, seats=None, most_running=8,
                      rule=RULE) == FOR_BLOCKS
    assert queue_kind(load(1, 8, 1, kv=0.3), 8, needed_tokens=None, seats=None, most_running=8, rule=RULE) == FOR_SEATS
    assert queue_kind(sized(1, 3, 1, kv=math.nan), 3, needed_tokens=0, seats=None, most_running=8,
                      rule=RULE) == FOR_BLOCKS


def test_a_queue_is_for_seats_at_the_engines_seats_and_else_for_the_steps_token_budget():
    assert queue_kind(sized(1, 8, 2, kv=0.4), 8, needed_tokens=300, seats=8, most_running=8, rule=RULE) == FOR_SEATS
    assert queue_kind(sized(1, 8, 2, kv=0.4), 8, needed_tokens=300, seats=None, most_running=8, rule=RULE) == FOR_SEATS
    # Fewer running than the engine ran (or than its seats), blocks for all that waits: a long prompt's chunked
    # prefill holds the step's budget and the requests behind it wait a step.
    assert queue_kind(sized(1, 3, 2, kv=0.4), 3, needed_tokens=300, seats=8, most_running=8, rule=RULE) == FOR_BUDGET
    assert queue_kind(sized(1, 3, 2, kv=0.4), 3, needed_tokens=300, seats=None, most_running=8, rule=RULE) == FOR_BUDGET


def test_a_queue_for_the_steps_budget_neither_cuts_nor_stops_a_raise():
    learnt = ReplicaCapacity()
    learnt.observe(sized(1, running=8, waiting=0, kv=0.3), 8, True, RULE, needed_tokens=0)  # it ran 8 before
    for at in (2, 3, 4):
        assert learnt.observe(sized(at, running=3, waiting=2, kv=0.35), 5, True, RULE, needed_tokens=600) is None
        assert learnt.queue == (FOR_BUDGET if at > 2 else None)  # two scrapes in a row make a queue
    assert learnt.limit() is None and learnt.seats is None
    # The same queue with the cache short of what the requests need: blocks, cut to what it runs.
    assert learnt.observe(sized(5, running=3, waiting=2, kv=0.8), 5, True, RULE, needed_tokens=2300) == CUT
    assert learnt.queue == FOR_BLOCKS and learnt.limit() == 3
    # A queue for the budget, at its capacity with requests held at a gateway: raised, scrape after scrape.
    assert learnt.observe(sized(6, running=3, waiting=1, kv=0.4), 3, True, RULE, needed_tokens=200) == RAISE
    assert learnt.observe(sized(7, running=3, waiting=1, kv=0.4), 4, True, RULE, needed_tokens=200) == RAISE
    assert learnt.queue == FOR_BUDGET and learnt.limit() == 5
    # One scrape of a queue for blocks stops a raise (two would cut).
    assert learnt.observe(sized(8, running=4, waiting=1, kv=0.8), 5, True, RULE, needed_tokens=2300) is None


def test_seats_are_not_learnt_from_a_queue_for_blocks_just_below_kv_target():
    """Three long prompts hold 79.8% of the cache at the start (the engine never ran more): the next one waits for
    blocks, not for a seat (the estimate of what it needs says so where the usage gauge alone could not)."""
    learnt = ReplicaCapacity()
    learnt.observe(sized(1, running=3, waiting=1, kv=0.798), 4, True, RULE, needed_tokens=2300)
    assert learnt.observe(sized(2, running=3, waiting=1, kv=0.798), 4, True, RULE, needed_tokens=2300) == CUT
    assert learnt.seats is None and learnt.queue == FOR_BLOCKS


def test_the_room_estimates_what_an_engine_must_still_find_and_counts_its_queues_by_kind():
    registry = CollectorRegistry()
    router, room, _, _ = make_room(replicas=("a",), metrics=RoomMetrics(registry))
    replica = router.replicas.get("a")
    replica.local_inflight, replica.local_inflight_tokens, replica.local_inflight_output_tokens = 5, 1000, 500
    # held: 1,000 prompt tokens (ratio 1) + 500 output = 1,500; the cache holds 10% of 8,192 = 819 of it now
    assert room.needed_tokens(replica, sized(1, 3, 2, kv=0.1)) == pytest.approx(1500 - 819.2)
    assert room.needed_tokens(replica, sized(1, 4, 2, kv=0.1)) is None  # 6 in the engine, 5 known: unsized
    assert room.needed_tokens(replica, load(1, 3, 2, kv=0.1)) is None  # no cache size
    for at, running in enumerate((5, 3, 3), start=1):  # it ran 5; then 3 with 2 waiting, twice: a budget queue
        replica.engine_load = sized(at, running, 5 - running, kv=0.1)
        for listener in router.engine_load_listeners:
            listener(replica)
    assert room.capacity(replica) is None
    assert registry.get_sample_value("llmgw_flow_engine_queues_total", {"model": "m", "kind": FOR_BUDGET}) == 1
    assert registry.get_sample_value("llmgw_flow_engine_queues_total", {"model": "m", "kind": FOR_BLOCKS}) == 0


# -- a held burst's slow start (llmgw/flow/ramp.py) -------------------------------------------------------------------


def test_a_replica_appearing_while_requests_are_held_takes_them_a_few_at_a_time_doubling_on_each_scrape(caplog):
    registry = CollectorRegistry()
    router, room, queued, clock = make_room(replicas=(), metrics=RoomMetrics(registry))
    queued["m"] = 10
    assert room.free("m", INTERACTIVE) == 0  # no replica: held
    router.add_replica(Replica(name="a", model="m", url="http://127.0.0.1:9000"))
    a = router.replicas.get("a")
    with caplog.at_level("INFO", logger="llmgw.flow.room"):
        assert room.free("m", INTERACTIVE) == RAMP_START  # not the whole backlog: it is unknown, not unbounded
    assert "10 requests are held" in caplog.text and "oldest first" in caplog.text
    assert room.describe("m")["replicas"][0]["ramp"] == RAMP_START
    a.local_inflight = RAMP_START
    assert room.free("m", INTERACTIVE) == 0
    scrape(router, room, "a", 1, running=RAMP_START)  # all it was given in flight, its KV cache has room: doubled
    assert room.ramp(a) == 2 * RAMP_START and room.free("m", INTERACTIVE) == RAMP_START
    scrape(router, room, "a", 2, running=RAMP_START)  # not filled: no faster
    assert room.ramp(a) == 2 * RAMP_START
    a.local_inflight = 2 * RAMP_START
    # Its engine queues (first come, first served: in the order the queue sent them): a pace, not a cap.
    scrape(router, room, "a", 3, running=RAMP_START, waiting=RAMP_START)
    scrape(router, room, "a", 4, running=RAMP_START, waiting=RAMP_START)  # twice: its capacity is learnt
    assert room.capacity(a) == RAMP_START and room.ramp(a) == 4 * RAMP_START
    assert room.free("m", INTERACTIVE) == 2 * RAMP_START  # the ramp goes on past the capacity while requests wait
    scrape(router, room, "a", 5, running=RAMP_START, waiting=6 * RAMP_START, kv=RULE.kv_target)
    a.local_inflight = 4 * RAMP_START
    scrape(router, room, "a", 6, running=RAMP_START, waiting=6 * RAMP_START, kv=RULE.kv_target)
    assert room.ramp(a) == 4 * RAMP_START  # its KV cache at kv_target: no more
    assert registry.get_sample_value("llmgw_flow_replica_ramp", {"model": "m", "replica": "a"}) == 4 * RAMP_START
    clock.now += 1.5
    queued["m"] = 0
    with caplog.at_level("INFO", logger="llmgw.flow.room"):
        scrape(router, room, "a", 7, running=RAMP_START)  # nothing held any more: the ramp ends
    assert room.ramp(a) is None
    assert room.free("m", INTERACTIVE) == 0  # its learnt capacity counts again
    assert "ends its ramp through a held burst after 1.50 s (nothing is held any more)" in caplog.text
    assert registry.get_sample_value("llmgw_flow_ramps_total", {"model": "m"}) == 1
    assert registry.get_sample_value("llmgw_flow_ramp_held_requests_total", {"model": "m"}) == 10
    assert registry.get_sample_value("llmgw_flow_ramp_seconds_total", {"model": "m"}) == 1.5
    assert registry.get_sample_value("llmgw_flow_replica_ramp", {"model": "m", "replica": "a"}) is None
    queued["m"] = 3  # held again, its capacity known: no ramp, the room is the capacity
    assert room.free("m", INTERACTIVE) == 0 and room.ramp(a) is None


def test_nothing_held_an_unknown_replica_stays_unbounded_and_one_already_busy_ramps_from_what_it_carries():
    router, room, queued, _ = make_room(replicas=("a",))
    a = router.replicas.get("a")
    a.local_inflight = 30
    assert room.free("m", INTERACTIVE) == UNBOUNDED and room.ramp(a) is None
    queued["m"] = 5  # held (say, for KV room): its 30 in flight without a queue are proven, not cut to a few
    assert room.ramp(a) is None and room.free("m", INTERACTIVE) == 0
    assert room.ramp(a) == 30
    queued["m"] = 0
    assert room.free("m", INTERACTIVE) == UNBOUNDED and room.ramp(a) is None  # ended at the next look


def test_the_ramp_ends_when_its_replica_leaves_and_never_doubles_on_a_full_cache_a_stale_or_broken_gauge():
    router, room, queued, _ = make_room(replicas=("a",))
    queued["m"] = 3
    a = router.replicas.get("a")
    assert room.free("m", INTERACTIVE) == RAMP_START
    a.local_inflight = RAMP_START
    scrape(router, room, "a", 1, running=RAMP_START, kv=RULE.kv_target)  # the cache fills: no more
    scrape(router, room, "a", 1, running=RAMP_START)  # the same scrape again
    scrape(router, room, "a", 2, running=math.nan, waiting=math.nan, kv=math.nan)
    assert room.ramp(a) == RAMP_START
    router.remove_replica(a)
    assert room._ramps == {}


def test_a_ramp_doubles_within_its_bounds_whatever_the_gauges():
    ramp = Ramp(RAMP_START, 0.0, 1)
    for at in range(40):
        ramp.observe(load(at, running=1e12, kv=0.1), inflight=1 << 40, rule=RULE)
    assert ramp.limit == MAX_CAPACITY


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(allow_nan=True), st.floats(allow_nan=True), st.one_of(st.none(), st.floats()),
                          st.integers(min_value=-10, max_value=1 << 40)), max_size=30))
def test_any_engine_gauges_keep_a_ramp_within_its_bounds(scrapes):
    ramp = Ramp(RAMP_START, 0.0, 1)
    for at, (running, waiting, kv, inflight) in enumerate(scrapes):
        before = ramp.limit
        doubled = ramp.observe(load(at, running, waiting, kv), inflight, RULE)
        assert RAMP_START <= ramp.limit <= MAX_CAPACITY
        assert ramp.limit == (min(MAX_CAPACITY, 2 * before) if doubled else before)
