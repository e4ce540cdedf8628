"""Testing a routing-tier plugin without sockets: :class:`TierHarness` drives it the way the gateway does.

The harness builds llmgw's real :class:`~llmgw.router.router.Router` with the
installed plugins plus yours, gives the model real replicas, and plays each
attempt in the data plane's order: ``pick`` -> the replica's ``inflight`` and
``inflight_tokens`` count it (through this process's ``local_`` counters; set
``peer_inflight``/``peer_inflight_tokens`` to play other gateways' load) ->
``routed`` -> (``first_token``) -> (``attempt_failed``) -> ``finished`` -> the
counts are given back. So a tier tested here sees what it will see behind
``llmgw serve``::

    from llmgw.testing.plugins import TierHarness
    import my_tier_plugin

    async def test_it():   # with pytest-trio
        harness = TierHarness(my_tier_plugin, tier="my_tier", replicas=["a", "b"])
        decision = await harness.route({"model": "m", "prompt": "hello"})
        harness.finish(decision)
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..metrics import Metrics
from ..plugins_manager import Registry, build_registry, make_plugin_manager
from ..router.model import TierModel
from ..router.replica import Replica
from ..router.router import Router, replica_of
from ..router.tier import Decision, RouteRequest, RoutingTier

__all__ = ["TierHarness", "registry_with"]


def registry_with(*plugins: object) -> Registry:
    """The registry of every installed plugin plus ``plugins`` (modules or objects with ``@hookimpl``
    functions); one already installed through its entry point is not registered twice."""
    manager = make_plugin_manager()
    for plugin in plugins:
        if not manager.is_registered(plugin):
            manager.register(plugin)
    return build_registry(manager)


class TierHarness:
    """One model routed by ``tier`` (a name some plugin registers) over ``replicas`` (names; their URLs are
    never dialled). ``harness.replicas[name]`` is a replica whose ``state``, ``engine_load`` or ``labels`` a test
    may set; ``harness.tier`` the tier instance; ``harness.metrics`` the gateway metrics it counts into."""

    def __init__(self, *plugins: object, tier: str, replicas: Iterable[str] = ("a", "b"),
                 options: Mapping[str, Any] | None = None, model: str = "m"):
        self.model = model
        self.metrics = Metrics()
        self.router = Router(registry_with(*plugins), self.metrics)
        self.router.configure_model(model, tier, dict(options or {}),
                                    TierModel.of(model, tier, options))
        self.replicas: dict[str, Replica] = {}
        self._requests: dict[int, RouteRequest] = {}  # routed, unfinished decisions' requests, by id(decision)
        for i, name in enumerate(replicas):
            replica = Replica(name=name, model=model, url=f"http://127.0.0.1:{9 + i}")
            self.replicas[name] = replica
            self.router.add_replica(replica)

    @property
    def tier(self) -> RoutingTier:
        return self.router.models[self.model].tier

    def request(self, body: Mapping[str, Any] | None = None, path: str = "/v1/completions") -> RouteRequest:
        """A request for the model; ``body`` defaults to a one-word completion."""
        body = dict(body or {"prompt": "hello"})
        body.setdefault("model", self.model)
        return RouteRequest(self.model, path, body)

    async def route(self, body: Mapping[str, Any] | RouteRequest | None = None, *,
                    exclude: Iterable[str] = ()) -> Decision | None:
        """Pick a replica (not one named in ``exclude``) and hand the request to it: counted in its load, and
        ``routed``. None when no candidate is left. End every decision with :meth:`finish` or :meth:`fail`."""
        request = body if isinstance(body, RouteRequest) else self.request(body)
        decision = await self.router.pick(request, exclude=[self.replicas[name] for name in exclude])
        if decision is None:
            return None
        self._requests[id(decision)] = request
        replica_of(decision).local_inflight += 1
        self.router.routed(request, decision)
        return decision

    async def explain(self, body: Mapping[str, Any] | RouteRequest | None = None) -> dict:
        """What ``POST /admin/explain`` would answer for the request (the tier's explanation, every replica)."""
        request = body if isinstance(body, RouteRequest) else self.request(body)
        return await self.router.explain(request)

    def finish(self, decision: Decision, usage: dict | None = None, *, ttft: float | None = None) -> None:
        """The answer ended: ``first_token`` first when ``ttft`` is given, then ``finished`` with ``usage`` (what
        the engine's answer said; the tier gets it only if it ``wants_usage``)."""
        request = self._end(decision)
        if ttft is not None:
            self.router.first_token(request, decision, ttft)
        self.router.finished(request, decision, usage)

    def fail(self, decision: Decision, reason: str = "connect") -> None:
        """The attempt failed before any answer (``reason``: ``connect``, ``status_503``...): ``attempt_failed``,
        then ``finished`` without usage. Route again with ``exclude=[...]`` for the retry."""
        request = self._end(decision)
        self.router.attempt_failed(request, decision, reason)
        self.router.finished(request, decision, None)

    def decisions(self, outcome: str | None = None) -> float:
        """``llmgw_routing_decisions_total`` of the model (of one ``outcome``), as the gateway counts it."""
        total = 0.0
        for metric in self.metrics.decisions.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.labels.get("model") == self.model \
                        and (outcome is None or sample.labels.get("outcome") == outcome):
                    total += sample.value
        return total

    def _end(self, decision: Decision) -> RouteRequest:
        request = self._requests.pop(id(decision), None)
        if request is None:
            raise ValueError("this decision was not routed by this harness, or has ended already")
        replica_of(decision).local_inflight -= 1
        return request
