"""A replica's load as two halves: this process's exact counts and the other gateways' latest (docs/scaling.md).

Tiers, ``explain`` and ``/admin/replicas`` see the sums; this process only ever counts its own half, and its
``llmgw_inflight_requests`` series exports that half alone (Prometheus sums the gateways' series).
"""

from __future__ import annotations

from llmgw.gateway.dataplane import DataPlane, DataPlaneSettings
from llmgw.hookspecs import hookimpl
from llmgw.metrics import Metrics
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.replica import Replica
from llmgw.router.router import Router
from llmgw.router.tier import Decision, ReplicaView, RouteRequest, RoutingTier


class Seeing(RoutingTier):
    """Picks the first candidate and writes down the load it saw of each."""

    name = "seeing"

    def __init__(self, model, services):
        self.seen: dict[str, tuple[int, int]] = {}

    async def pick(self, request, candidates):
        self.seen = {r.name: (r.inflight, r.inflight_tokens) for r in candidates}
        return Decision(candidates[0], tier=self.name)


class SeeingPlugin:
    @hookimpl
    def register_routing_tiers(self):
        return {"seeing": Seeing}


def make_router(metrics: Metrics | None = None):
    router = Router(build_registry(make_plugin_manager([SeeingPlugin()])), metrics or Metrics())
    router.configure_model("m", "seeing")
    replicas = [Replica(name=n, model="m", url=f"http://127.0.0.1:{9000 + i}") for i, n in enumerate("ab")]
    for r in replicas:
        router.add_replica(r)
    return router, replicas


def request():
    return RouteRequest(model="m", path="/v1/completions", body={"model": "m", "prompt": "x" * 400})


async def test_a_tier_and_explain_see_this_gateways_load_plus_the_other_gateways_latest():
    router, (a, b) = make_router()
    a.local_inflight, a.local_inflight_tokens = 2, 300
    a.peer_inflight, a.peer_inflight_tokens = 5, 7000  # other gateways' requests there
    b.peer_inflight, b.peer_inflight_tokens = 1, 40  # only theirs
    await router.pick(request())
    assert router.models["m"].tier.seen == {"a": (7, 7300), "b": (1, 40)}
    assert isinstance(a, ReplicaView)
    explained = (await router.explain(request()))["replicas"]
    assert {e["name"]: (e["inflight"], e["inflight_tokens"]) for e in explained} == {"a": (7, 7300), "b": (1, 40)}
    shown = a.as_json()  # /admin/replicas: the sums and both halves
    assert {k: shown[k] for k in ("inflight", "inflight_tokens", "local_inflight", "local_inflight_tokens",
                                  "peer_inflight", "peer_inflight_tokens")} == {
        "inflight": 7, "inflight_tokens": 7300, "local_inflight": 2, "local_inflight_tokens": 300,
        "peer_inflight": 5, "peer_inflight_tokens": 7000}


async def test_routed_and_finished_count_only_this_gateways_tokens():
    router, (a, _) = make_router()
    a.peer_inflight_tokens = 1000
    decision = await router.pick(request())
    router.routed(request(), decision)
    assert a.local_inflight_tokens == decision.inflight_tokens > 0 and a.peer_inflight_tokens == 1000
    assert a.inflight_tokens == 1000 + decision.inflight_tokens
    a.peer_inflight_tokens = 5  # the other gateways' figure changed meanwhile
    router.finished(request(), decision, None)
    assert (a.local_inflight_tokens, a.peer_inflight_tokens, a.inflight_tokens) == (0, 5, 5)


async def test_the_data_plane_counts_its_own_requests_and_the_metric_exports_only_them():
    metrics = Metrics()
    router, (a, _) = make_router(metrics)
    plane = DataPlane(router, None, metrics, DataPlaneSettings())
    a.peer_inflight = 4  # other gateways export their own series; ours must not count theirs again

    def exported():
        return metrics.registry.get_sample_value("llmgw_inflight_requests", {"model": "m", "replica": "a"})

    plane._load(a, +1)
    plane._load(a, +1)
    assert (a.local_inflight, a.peer_inflight, a.inflight) == (2, 4, 6) and exported() == 2
    plane._load(a, -1)
    a.peer_inflight = 9
    assert exported() == 1
