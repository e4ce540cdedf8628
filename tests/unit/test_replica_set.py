"""The replica set: declarations from two sources, the router's routes following them, and replica lifecycles."""

from __future__ import annotations

import trio
import trio.testing

from llmgw.metrics import Metrics
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.health import HealthSettings, HealthTracker
from llmgw.router.model import LoraRef, TierModel
from llmgw.router.replica import Replica, ReplicaState
from llmgw.router.replicas import DEPLOYED, STATIC, ReplicaSet
from llmgw.router.router import Router


def router_over(replicas: ReplicaSet) -> Router:
    return Router(build_registry(make_plugin_manager()), Metrics(), replicas)


def test_a_route_follows_the_declarations_of_both_sources():
    replicas = ReplicaSet()
    router = router_over(replicas)
    static = TierModel("m", "round_robin", lora_adapters=(LoraRef("m-fr", "/fr"),))
    replicas.declare_model(STATIC, static)
    route = router.models["m"]
    replicas.declare_model(STATIC, static)  # the same again: the route (and its tier's state) is kept
    assert router.models["m"] is route and router.resolve("m-fr") == ("m", "m-fr")

    deployed = TierModel("m", "round_robin", model_path="/weights", lora_adapters=(LoraRef("m-de", "/de"),))
    replicas.declare_model(DEPLOYED, deployed)  # a changed declaration rebuilds the route with it
    assert router.models["m"] is not route and router.models["m"].declared == deployed
    assert replicas.adapters("m") == ["m-fr", "m-de"] and router.resolve("m-de") == ("m", "m-de")

    route = router.models["m"]
    assert replicas.withdraw_model(STATIC, "m") is False  # the deployed source still serves it
    assert router.models["m"] is route and router.resolve("m-fr") is None
    assert replicas.withdraw_model(DEPLOYED, "m") is True
    assert "m" not in router.models and router.resolve("m-de") is None and replicas.model("m") is None


def test_a_router_built_over_a_set_with_declarations_routes_them_and_reads_its_live_lists():
    replicas = ReplicaSet()
    replicas.declare_model(STATIC, TierModel("m"))
    a = Replica("a", "m", "http://127.0.0.1:9001")
    replicas.add(a, STATIC)
    router = router_over(replicas)
    assert router.models["m"].replicas == [a] and router.candidates("m") == [a]
    b = Replica("b", "m", "http://127.0.0.1:9002")
    replicas.add(b, DEPLOYED)
    assert router.models["m"].replicas == [a, b] and router.model_of_replica("b") == "m"
    assert [replicas.describe(r)["source"] for r in router.all_replicas()] == [STATIC, DEPLOYED]
    assert replicas.of_source(DEPLOYED) == [b]
    replicas.discard(a)
    assert router.candidates("m") == [b] and replicas.get("a") is None and replicas.source_of(a) is None


async def test_add_opens_a_pool_and_probes_remove_releases_them_drain_waits_for_in_flight_requests():
    metrics = Metrics()
    health = HealthTracker(HealthSettings(interval=60.0, timeout=1.0), metrics)
    replicas = ReplicaSet(health, metrics, connect_timeout=1.0)

    def up():
        return metrics.registry.get_sample_value("llmgw_replica_up", {"model": "m", "replica": "a"})

    async with trio.open_nursery() as nursery:
        await nursery.start(replicas.run)
        replica = Replica("a", "m", "http://127.0.0.1:9")  # nothing listens: the first probe takes it down
        assert replicas.add(replica, STATIC) and replica.pool is not None
        await trio.testing.wait_all_tasks_blocked()
        assert replica.state is ReplicaState.DOWN and up() == 0

        replica.local_inflight = 1
        with trio.fail_after(5):
            async with trio.open_nursery() as draining:
                draining.start_soon(replicas.drain, replica, "going", 60.0)
                await trio.testing.wait_all_tasks_blocked()
                assert replica.state is ReplicaState.DRAINING and replicas.members("m") == [replica]
                replica.local_inflight = 0  # the last request finished: the drain ends
        assert replica not in replicas and replicas.members("m") == [] and up() is None  # its gauge went too
        nursery.cancel_scope.cancel()


async def test_drain_waits_for_the_other_gateways_in_flight_requests_too():
    replicas = ReplicaSet()  # no health tracker, no pools: only the table
    replica = Replica("a", "m", "http://127.0.0.1:9", peer_inflight=1)  # another gateway still has one there
    assert replicas.add(replica, STATIC)
    with trio.fail_after(5):
        async with trio.open_nursery() as draining:
            draining.start_soon(replicas.drain, replica, "going", 3.0)
            await trio.sleep(0.3)  # several of the drain's looks: this process has nothing in flight there
            assert replica.state is ReplicaState.DRAINING and replica in replicas
            replica.peer_inflight = 0  # the other gateway's request finished
            ended = trio.current_time()
        assert trio.current_time() - ended < 1.0  # the drain saw it, not its timeout
    assert replica not in replicas and replicas.members("m") == []


async def test_a_stale_peer_figure_holds_a_drain_no_longer_than_its_timeout():
    replicas = ReplicaSet()
    replica = Replica("a", "m", "http://127.0.0.1:9", peer_inflight=2)  # a gateway that died said so last
    assert replicas.add(replica, STATIC)
    with trio.fail_after(5):
        await replicas.drain(replica, "going", 0.2)
    assert replica not in replicas


def test_a_replica_whose_tls_files_cannot_be_used_is_not_added():
    from llmgw.tls import TlsClientOptions

    replicas = ReplicaSet(connect_timeout=1.0)
    replica = Replica("a", "m", "https://127.0.0.1:9", tls=TlsClientOptions(ca_file="/nonexistent/ca.pem"))
    assert replicas.add(replica, STATIC) is False and replica not in replicas and replicas.members("m") == []
