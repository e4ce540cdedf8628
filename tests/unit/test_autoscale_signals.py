"""The gateway's signal source (llmgw.autoscale.signals): the flow queue's and the peers' held requests, the
replicas' in-flight and KV usage, the drain rate and the last request, from local copies."""

from __future__ import annotations

from types import SimpleNamespace

from llmgw.autoscale.signals import GatewaySignals
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
