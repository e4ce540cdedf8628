"""The gateway's signal source (llmgw.autoscale.signals): the flow queue's and the peers' held requests, the
replicas' in-flight and KV usage, the drain rate and the last request, from local copies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmgw.autoscale.signals import MAX_FIRST_TOKENS, MAX_MODELS, MIN_SPAN, TTFT_WINDOW, FirstTokens, GatewaySignals
from llmgw.engines.probe import EngineLoad
from llmgw.router.replica import Replica, ReplicaState


def router_with(*replicas: Replica):
    return SimpleNamespace(models={"tiny": SimpleNamespace(replicas=list(replicas))})


def test_queued_sums_this_gateways_queue_and_the_peers_reports_and_in_flight_counts_every_gateway():
    one = Replica("tiny-0", "tiny", "http://127.0.0.1:1", local_inflight=2, peer_inflight=3)
    source = GatewaySignals(router_with(one), lambda model: (4, 400), lambda model: [5, 1])
    signals = source.signals("tiny", now=10.0)
    assert (signals.queued, signals.queued_tokens, signals.inflight) == (10, 400, 5)
    assert signals.last_request_at == 10.0
    assert source.signals("other", now=10.0).inflight == 0  # a model with no route: nothing in flight


def test_kv_usage_is_the_mean_of_the_routable_replicas_that_said_it():
    up = Replica("a", "tiny", "http://127.0.0.1:1", state=ReplicaState.UP,
                 engine_load=EngineLoad(0, 0, 0.0, kv_usage=0.5))
    also = Replica("b", "tiny", "http://127.0.0.1:2", engine_load=EngineLoad(0, 0, 0.0, kv_usage=0.9))
    down = Replica("c", "tiny", "http://127.0.0.1:3", state=ReplicaState.DOWN,
                   engine_load=EngineLoad(0, 0, 0.0, kv_usage=0.1))
    silent = Replica("d", "tiny", "http://127.0.0.1:4")
    signals = GatewaySignals(router_with(up, also, down, silent), lambda model: (0, 0)).signals("tiny", 1.0)
    assert signals.kv_usage == 0.7
    assert GatewaySignals(router_with(silent), lambda model: (0, 0)).signals("tiny", 1.0).kv_usage is None


def test_an_idle_model_keeps_the_time_of_its_last_request_and_a_served_count_that_moved_is_one():
    replica = Replica("a", "tiny", "http://127.0.0.1:1")
    source = GatewaySignals(router_with(replica), lambda model: (0, 0))
    assert source.signals("tiny", now=100.0).last_request_at == 100.0  # a fresh source counts its start
    assert source.signals("tiny", now=200.0).last_request_at == 100.0
    replica.served = 3  # requests that came and went between two readings
    later = source.signals("tiny", now=202.0)
    assert later.last_request_at == 202.0 and later.served_per_s > 0
    replica.served = 0  # the replica left with its count: no negative rate
    assert source.signals("tiny", now=204.0).served_per_s >= 0


def test_models_no_longer_autoscaled_are_forgotten():
    source = GatewaySignals(router_with(), lambda model: (0, 0))
    source.signals("tiny", 1.0)
    source.signals("gone", 1.0)
    source.forget({"tiny"})
    assert source.signals("tiny", 50.0).last_request_at == 1.0
    assert source.signals("gone", 50.0).last_request_at == 50.0  # seen afresh


def test_arrivals_and_the_drain_rate_are_this_gateways_own_times_the_live_gateways():
    entered = {"tiny": 0}
    replica = Replica("a", "tiny", "http://127.0.0.1:1", state=ReplicaState.UP)
    source = GatewaySignals(router_with(replica), lambda model: (0, 0), entered=lambda model: entered[model],
                            gateways=lambda: 3)
    assert source.signals("tiny", now=0.0).arrivals_per_s == 0.0
    entered["tiny"] = replica.served = 4
    signals = source.signals("tiny", now=2.0)
    assert signals.arrivals_per_s == 6.0  # 2/s here, one gateway in three
    # served the same way: a replica that keeps up with the arrivals drains as fast as they come, not a third
    assert signals.served_per_s == 6.0 and signals.served_per_replica_s == 6.0
    entered["tiny"] = 1  # the queue forgot the model and counts afresh: no negative rate
    assert source.signals("tiny", now=4.0).arrivals_per_s >= 0


def peer(entered: int = 0, within: int = 0, seen: int = 0) -> SimpleNamespace:
    return SimpleNamespace(entered=entered, ttft_within=within, ttft_seen=seen)


def test_arrivals_sum_every_gateways_reported_counter_whatever_the_balancer_does():
    """Issue 32: the leader's own gateway saw 1 in 10 of the arrivals (an uneven balancer); the others' reports
    carry theirs. A peer's counter counts from its first report seen; one that fell (a restart) counts from 0; a
    gateway whose reports carry none (the version before) is taken to see the reporting ones' mean."""
    entered = {"tiny": 0}
    peers = {"gw-b": peer(500), "gw-c": peer(1000)}
    source = GatewaySignals(router_with(), lambda model: (0, 0), entered=lambda model: entered[model],
                            gateways=lambda: 3, peer_figures=lambda model: peers)
    assert source.signals("tiny", now=0.0).arrivals_per_s == 0.0  # what they counted before is not an arrival now
    entered["tiny"] = 2
    peers = {"gw-b": peer(508), "gw-c": peer(1010)}
    assert source.signals("tiny", now=2.0).arrivals_per_s == 10.0  # (2 + 8 + 10) / 2 s, not 1/s times 3
    peers = {"gw-b": peer(3), "gw-c": peer(1010)}  # gw-b restarted: 3 since
    assert source.signals("tiny", now=4.0).arrivals_per_s == pytest.approx(0.3 * 1.5 + 0.7 * 10.0)
    peers = {"gw-b": peer(13)}  # gw-c is gone, its arrivals stay counted; the third gateway now says nothing:
    later = source.signals("tiny", now=6.0).arrivals_per_s  # 10 in 2 s from the two reporting, of 3 gateways
    assert later == pytest.approx((0.3 * 5.0 + 0.7 * (0.3 * 1.5 + 0.7 * 10.0)) * 3 / 2)


def test_ttft_attainment_is_the_clusters_share_within_the_slo():
    first_tokens = FirstTokens(lambda: 0.0)
    for ttft in (0.2, 3.0):  # this gateway: 1 in 2 within the SLO
        first_tokens.observe("tiny", ttft)
    peers = {"gw-b": peer(within=9, seen=10), "gw-c": peer(within=0, seen=0)}
    source = GatewaySignals(router_with(), lambda model: (0, 0), first_tokens=first_tokens,
                            slo_of=lambda model: 1.0, peer_figures=lambda model: peers)
    assert source.signals("tiny", now=1.0).ttft_attainment == 10 / 12
    assert first_tokens.counts("tiny", 1.0, 1.0) == (1, 2)  # what this gateway reports


def test_a_rate_is_measured_over_at_least_min_span_once_it_has_shown():
    replica = Replica("a", "tiny", "http://127.0.0.1:1")
    source = GatewaySignals(router_with(replica), lambda model: (0, 0))
    source.signals("tiny", now=0.0)
    replica.served = 1
    first = source.signals("tiny", now=0.5).served_per_s
    assert first == 2.0  # the first requests after a quiet spell show their rate at once
    replica.served = 5
    assert source.signals("tiny", now=0.6).served_per_s == first  # 4 in 0.1 s is not folded in yet
    assert source.signals("tiny", now=0.5 + MIN_SPAN).served_per_s > first


def test_ttft_attainment_is_the_share_of_recent_first_tokens_within_the_deployments_slo():
    clock = [0.0]
    first_tokens = FirstTokens(lambda: clock[0])
    source = GatewaySignals(router_with(), lambda model: (0, 0), first_tokens=first_tokens,
                            slo_of=lambda model: 1.0 if model == "tiny" else None)
    assert source.signals("tiny", now=0.0).ttft_attainment is None  # no first token yet
    for ttft in (0.2, 0.5, 1.0, 3.0):
        first_tokens.observe("tiny", ttft)
    first_tokens.observe("other", 9.0)
    assert source.signals("tiny", now=1.0).ttft_attainment == 0.75
    assert source.signals("other", now=1.0).ttft_attainment is None  # no ttft_slo: not measured
    clock[0] = 50.0
    first_tokens.observe("tiny", 0.1)
    assert source.signals("tiny", now=TTFT_WINDOW + 10).ttft_attainment == 1.0  # the old ones left the window
    assert source.signals("tiny", now=200.0).ttft_attainment is None
    source.forget({"other"})  # a model no longer autoscaled: its first tokens go too, and come back afresh
    clock[0] = 200.0
    first_tokens.observe("tiny", 0.1)
    assert first_tokens.attainment("tiny", 1.0, 200.0) == 1.0


def test_first_tokens_are_bounded_per_model_and_in_models():
    first_tokens = FirstTokens(lambda: 0.0)
    for i in range(MAX_FIRST_TOKENS + 10):
        first_tokens.observe("tiny", 5.0 if i < 10 else 0.1)
    assert first_tokens.attainment("tiny", 1.0, 0.0) == 1.0  # the 10 oldest (slow) ones were dropped
    for i in range(MAX_MODELS + 5):
        first_tokens.observe(f"m{i}", 0.1)
    assert first_tokens.attainment(f"m{MAX_MODELS + 4}", 1.0, 0.0) is None


def test_the_drain_rate_per_replica_is_over_ready_replica_seconds_so_a_replica_just_ready_does_not_halve_it():
    one = Replica("a", "tiny", "http://127.0.0.1:1", state=ReplicaState.UP)
    new = Replica("b", "tiny", "http://127.0.0.1:2", state=ReplicaState.DOWN)  # starting: not routable yet
    source = GatewaySignals(router_with(one, new), lambda model: (0, 0))
    source.signals("tiny", now=0.0)
    one.served = 6
    assert source.signals("tiny", now=2.0).served_per_replica_s == pytest.approx(3.0)
    new.state = ReplicaState.UP  # ready now, nothing finished yet
    one.served = 12
    signals = source.signals("tiny", now=4.0)
    assert signals.served_per_replica_s == pytest.approx(3.0)  # 6 over the first one's 2 s alone
    one.served, new.served = 18, 6
    assert source.signals("tiny", now=6.0).served_per_replica_s == pytest.approx(3.0)  # 12 over 2 replicas x 2 s


def test_a_quiet_spell_leaves_the_drain_rate_per_replica_as_it_was_measured():
    """Ready replicas with nothing to do drain nothing: that is no measure of how fast they drain. Folded in, a
    quiet spell took the rate towards 0, and the next backlog read as a need for max ("over the 0.00/s a ready
    replica serves")."""
    one = Replica("a", "tiny", "http://127.0.0.1:1", state=ReplicaState.UP)
    source = GatewaySignals(router_with(one), lambda model: (0, 0))
    source.signals("tiny", now=0.0)
    one.served = 6
    assert source.signals("tiny", now=2.0).served_per_replica_s == pytest.approx(3.0)
    for now in range(4, 600, 2):  # ten minutes with nothing queued, in flight or finished
        assert source.signals("tiny", now=float(now)).served_per_replica_s == pytest.approx(3.0)
    one.local_inflight = 1  # work again: a span with requests in flight counts, even one that finished none
    source.signals("tiny", now=601.0)
    one.local_inflight = 0
    assert source.signals("tiny", now=604.0).served_per_replica_s < 3.0


def test_a_rising_arrival_rate_shows_within_a_span_and_a_falling_one_is_smoothed_slowly():
    entered = {"tiny": 0}
    source = GatewaySignals(router_with(), lambda model: (0, 0), entered=lambda model: entered[model])
    source.signals("tiny", now=0.0)
    for second in range(1, 4):  # 4/s for three spans
        entered["tiny"] += 4
        source.signals("tiny", now=float(second))
    assert source.signals("tiny", now=3.0).arrivals_per_s == pytest.approx(4.0)
    entered["tiny"] += 8  # the demand doubles: one span later most of the step shows
    doubled = source.signals("tiny", now=4.0).arrivals_per_s
    assert doubled == pytest.approx(0.7 * 8 + 0.3 * 4) and doubled > 1.5 * 4
    entered["tiny"] += 2  # it falls back: the average comes down by a third of the way only
    assert source.signals("tiny", now=5.0).arrivals_per_s == pytest.approx(0.3 * 2 + 0.7 * doubled)


def test_busy_is_each_ready_replicas_in_flight_over_its_seats_at_most_one_summed():
    full = Replica("a", "tiny", "http://127.0.0.1:1", state=ReplicaState.UP, local_inflight=3, peer_inflight=2)
    half = Replica("b", "tiny", "http://127.0.0.1:2", state=ReplicaState.UP, local_inflight=1)
    down = Replica("c", "tiny", "http://127.0.0.1:3", state=ReplicaState.DOWN, local_inflight=2)
    seats = {"a": 4, "b": None, "c": 2}  # b's engine not learnt yet: the model's seats (one profile) stand for it
    source = GatewaySignals(router_with(full, half, down), lambda model: (0, 0),
                            seats_of=lambda replica: seats[replica.name])
    assert source.signals("tiny", 1.0).busy == pytest.approx(1.0 + 1 / 4)
    unknown = GatewaySignals(router_with(half), lambda model: (0, 0))
    assert unknown.signals("tiny", 1.0).busy is None  # no engine's seats known: not read


def test_an_engines_learnt_seats_outlive_the_replica():
    replica = Replica("a", "tiny", "http://127.0.0.1:1", state=ReplicaState.UP, local_inflight=1)
    learnt: dict[str, int | None] = {"a": 2}
    source = GatewaySignals(router_with(replica), lambda model: (0, 0), seats_of=lambda r: learnt[r.name])
    assert source.signals("tiny", 1.0).busy == 0.5
    learnt["a"] = None  # a new engine behind the same replica, not learnt yet
    assert source.signals("tiny", 2.0).busy == 0.5
