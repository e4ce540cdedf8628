"""The router's decision pipeline and the health state machine, without sockets."""

from __future__ import annotations

import pytest
import trio

from llmgw.hookspecs import hookimpl
from llmgw.metrics import Metrics
from llmgw.plugins_manager import PluginError, build_registry, make_plugin_manager
from llmgw.router.health import HealthSettings, HealthTracker
from llmgw.router.replica import Replica, ReplicaState
from llmgw.router.router import Router
from llmgw.router.tier import Decision, RouteRequest, RoutingTier


def make_router(*plugins, model="m", tier="round_robin", replicas=("a", "b", "c")):
    registry = build_registry(make_plugin_manager(plugins))
    metrics = Metrics()
    router = Router(registry, metrics)
    router.configure_model(model, tier)
    made = [Replica(name=n, model=model, url=f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(replicas)]
    for r in made:
        router.add_replica(r)
    return router, made, metrics


def request(model="m"):
    return RouteRequest(model=model, path="/v1/completions", body={"model": model, "prompt": "x"})


async def test_round_robin_cycles_and_skips_unroutable_replicas():
    router, (a, b, c), _ = make_router()
    picks = [(await router.pick(request())).replica.name for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    b.state = ReplicaState.DOWN
    picks = [(await router.pick(request())).replica.name for _ in range(4)]
    assert "b" not in picks and set(picks) == {"a", "c"}


async def test_pick_excludes_tried_replicas_and_returns_none_when_exhausted():
    router, (a, b, c), _ = make_router()
    assert (await router.pick(request(), exclude=[a, b])).replica is c
    assert await router.pick(request(), exclude=[a, b, c]) is None


class Broken:
    name = "broken"

    def __init__(self, model, services):
        pass

    async def pick(self, request, candidates):
        raise RuntimeError("bug in a third-party tier")

    def routed(self, request, decision):
        raise RuntimeError("also broken")

    def finished(self, request, decision, usage):
        pass


class BrokenPlugin:
    @hookimpl
    def register_routing_tiers(self):
        return {"broken": Broken}


async def test_a_failing_tier_falls_back_to_round_robin_and_is_counted():
    router, replicas, metrics = make_router(BrokenPlugin(), tier="broken")
    decision = await router.pick(request())
    assert decision.replica in replicas and decision.outcome == "fallback"
    router.routed(request(), decision)  # must not raise
    assert metrics.decisions.labels("m", "broken", "error")._value.get() == 1


def test_two_plugins_claiming_one_name_is_an_error():
    class Dup:
        @hookimpl
        def register_routing_tiers(self):
            return {"round_robin": Broken}

    with pytest.raises(PluginError, match="round_robin"):
        build_registry(make_plugin_manager((Dup(),)))


def test_unknown_tier_names_the_known_ones():
    registry = build_registry(make_plugin_manager())
    with pytest.raises(PluginError, match="round_robin"):
        registry.get("routing_tiers", "nope")


def test_health_state_machine():
    metrics = Metrics()
    tracker = HealthTracker(HealthSettings(failures_to_down=2, successes_to_up=2, passive_failures_to_down=3), metrics)
    r = Replica(name="r", model="m", url="http://127.0.0.1:1")
    tracker.probe_result(r, True, "ok")
    tracker.probe_result(r, True, "ok")
    assert r.state is ReplicaState.UP
    tracker.probe_result(r, False, "refused")
    assert r.state is ReplicaState.UP  # one failed probe is not enough
    tracker.probe_result(r, False, "refused")
    assert r.state is ReplicaState.DOWN and "refused" in r.reason
    assert metrics.replica_up.labels("m", "r")._value.get() == 0
    tracker.probe_result(r, True, "ok")
    assert r.state is ReplicaState.DOWN  # needs two good probes
    tracker.probe_result(r, True, "ok")
    assert r.state is ReplicaState.UP
    for _ in range(2):
        tracker.request_failed(r, "HTTP 500")
    tracker.request_succeeded(r)
    tracker.request_failed(r, "HTTP 500")
    assert r.state is ReplicaState.UP  # failures must be consecutive
    for _ in range(2):
        tracker.request_failed(r, "HTTP 500")
    assert r.state is ReplicaState.DOWN and "3 requests failed" in r.reason


def test_passive_failures_keep_a_replica_whose_probe_passes_out_only_until_the_next_probe():
    tracker = HealthTracker(HealthSettings(successes_to_up=3, passive_failures_to_down=2))
    r = Replica(name="r", model="m", url="http://127.0.0.1:1")
    for _ in range(3):
        tracker.probe_result(r, True, "ok")
    for _ in range(2):
        tracker.request_failed(r, "HTTP 503")
    assert r.state is ReplicaState.DOWN
    tracker.probe_result(r, True, "ok")
    assert r.state is ReplicaState.UP and r.consecutive_failures == 0  # one passing probe, not successes_to_up
    for _ in range(2):
        tracker.request_failed(r, "HTTP 503")
    tracker.probe_result(r, False, "HTTP 503")  # the probe agrees it is unwell: the usual way back
    tracker.probe_result(r, True, "ok")
    assert r.state is ReplicaState.DOWN


async def test_going_down_on_request_failures_wakes_the_prober_at_once(autojump_clock):
    tracker = HealthTracker(HealthSettings(interval=60.0, passive_failures_to_down=1))
    r = Replica(name="r", model="m", url="http://127.0.0.1:1")
    async with trio.open_nursery() as nursery:
        waited = []

        async def wait():
            start = trio.current_time()
            await tracker.wait_for_next_probe(r)
            waited.append(trio.current_time() - start)

        nursery.start_soon(wait)
        await trio.sleep(5)
        tracker.request_failed(r, "connect refused")
    assert waited == [5]  # not the 60 s interval
    await wait()
    assert waited[1] == 60  # nothing failed: the full interval


def test_an_unprobed_replica_that_fails_its_first_probe_is_down_at_once():
    tracker = HealthTracker(HealthSettings(failures_to_down=3))
    r = Replica(name="r", model="m", url="http://127.0.0.1:1")
    assert r.routable
    tracker.probe_result(r, False, "refused")
    assert not r.routable


def test_replica_secrets_stay_out_of_repr():
    r = Replica(name="r", model="m", url="http://127.0.0.1:1", api_key="engine-secret")
    assert "engine-secret" not in repr(r)
    assert "engine-secret" not in str(r.as_json())


async def test_lora_adapters_route_as_their_base_model_with_the_adapter_in_the_canonical_text():
    from llmgw.router.canonical import canonical_text

    router, replicas, _ = make_router()
    router.set_adapters("m", ["sql-lora"])
    assert router.resolve("sql-lora") == ("m", "sql-lora") and router.resolve("m") == ("m", None)
    assert router.resolve("other") is None
    adapter_request = RouteRequest(model="m", path="/v1/completions", body={"model": "sql-lora", "prompt": "x"},
                                   adapter="sql-lora")
    assert (await router.pick(adapter_request)).replica in replicas
    assert canonical_text(adapter_request) != canonical_text(request())  # the tree keeps them apart
    assert adapter_request.served_name == "sql-lora"
    router.remove_model("m")
    assert router.resolve("sql-lora") is None and router.adapters == {}


class PickOnly:  # a third-party tier that does not subclass RoutingTier and has no hook but pick
    name = "pick_only"
    engine_metrics_interval = 5.0

    def __init__(self, model, services):
        self.picks = 0

    async def pick(self, request, candidates):
        self.picks += 1
        return Decision(candidates[-1], outcome="last", tier=self.name)


class PickOnlyPlugin:
    @hookimpl
    def register_routing_tiers(self):
        return {"pick_only": PickOnly}


async def test_a_tier_with_only_pick_gets_the_default_hooks_and_keeps_its_own_attributes():
    router, (a, b, c), metrics = make_router(PickOnlyPlugin(), tier="pick_only")
    decision = await router.pick(request())
    assert decision.replica is c and decision.outcome == "last"
    router.routed(request(), decision)
    router.first_token(request(), decision, 0.1)
    router.attempt_failed(request(), decision, "connect")
    router.finished(request(), decision, {"prompt_tokens": 1})
    assert c.inflight_tokens == 0
    tier = router.models["m"].tier
    assert tier.picks == 1 and tier.engine_metrics_interval == 5.0 and tier.wants_usage is False
    explained = await router.explain(request())
    assert explained["outcome"] == "not_explainable" and explained["pick"] is None
    assert metrics.decisions.labels("m", "pick_only", "last")._value.get() == 1


class Counting(RoutingTier):
    name = "counting"
    wants_usage = True

    def __init__(self, model, services):
        self.heard: list[tuple] = []

    async def pick(self, request, candidates):
        return Decision(candidates[0], tier=self.name)

    def attempt_failed(self, request, decision, reason):
        self.heard.append(("attempt_failed", reason))

    def first_token(self, request, decision, ttft):
        self.heard.append(("first_token", ttft))

    def finished(self, request, decision, usage):
        self.heard.append(("finished", usage))


class CountingPlugin:
    @hookimpl
    def register_routing_tiers(self):
        return {"counting": Counting}


async def test_a_tier_hears_finished_once_per_attempt_and_nothing_of_it_after():
    router, (a, b, c), _ = make_router(CountingPlugin(), tier="counting")
    decision = await router.pick(request())
    router.routed(request(), decision)
    assert a.inflight_tokens == decision.inflight_tokens > 0
    router.first_token(request(), decision, 0.2)
    router.first_token(request(), decision, 0.3)
    router.finished(request(), decision, {"completion_tokens": 1})
    router.finished(request(), decision, None)
    router.attempt_failed(request(), decision, "connect")
    router.first_token(request(), decision, 0.4)
    assert router.models["m"].tier.heard == [("first_token", 0.2), ("finished", {"completion_tokens": 1})]
    assert a.inflight_tokens == 0
