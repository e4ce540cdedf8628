"""The router: per model, the routing tier that picks among the model's replicas.

The replicas live in a :class:`~llmgw.router.replicas.ReplicaSet`; the router
builds a route for every model declared there (and keeps it in step with the
declarations), each route reading its replicas from the set. Tiers are built
from plugin factories once, when a model is configured. A
tier that defers (returns None) or fails falls back to round-robin, so a
broken third-party tier never stops traffic. The router keeps every
replica's ``local_inflight_tokens`` (an estimate of the prompt tokens of the
requests this process routed there and has not finished: canonical characters
/ 4) whatever the tier; tiers read ``inflight_tokens``, ours plus the other
gateways' latest. It also answers :meth:`Router.explain` for
``POST /admin/explain``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, cast

from ..kv.index import KvIndex
from ..kv.metrics import KvMetrics
from .canonical import estimated_prompt_tokens
from .decode_cost import DEFAULT_OUTPUT_TOKENS, max_output_tokens
from .model import TierModel
from .output_allowance import DEFAULT_QUANTILE, OutputAllowance
from .prompt_ratio import PromptTokenRatio
from .replica import Replica
from .replicas import STATIC, ReplicaSet
from .tier import Decision, RouteRequest, RoutingTier, SharedLearning, TierServices, as_routing_tier

if TYPE_CHECKING:
    from ..metrics import Metrics
    from ..plugins_manager import Registry

log = logging.getLogger(__name__)


@dataclass
class ModelRoute:
    name: str
    tier_name: str
    tier: RoutingTier
    fallback: RoutingTier
    replicas: list[Replica] = field(default_factory=list)  # the ReplicaSet's live list of the model
    options: dict[str, Any] = field(default_factory=dict)
    declared: TierModel | None = None  # the ReplicaSet declaration it was built with (None: configured directly)
    prompt_ratio: PromptTokenRatio = field(default_factory=PromptTokenRatio)  # the engines' count over our estimate
    output_allowance: OutputAllowance = field(default_factory=OutputAllowance)  # of max_tokens, what answers hold


@dataclass(frozen=True)
class EngineMetricsDemand:
    """Every model's engines scraped at least every ``interval`` seconds, each scrape within ``timeout``, whatever
    its tier asks (overload control's room learns from them: llmgw/flow/room.py)."""

    interval: float
    timeout: float


class LearningBus(Protocol):
    """Where each model's :class:`~llmgw.router.tier.SharedLearning` comes from (llmgw.cluster's tier learning)."""

    def for_model(self, model: str) -> SharedLearning: ...


def replica_of(decision: Decision) -> Replica:
    """The router's own :class:`Replica` behind a decision's read-only view: tiers pick among the replicas the
    router gave them, so it is always one."""
    return cast(Replica, decision.replica)


class Router:
    def __init__(self, registry: Registry, metrics: Metrics | None = None, replicas: ReplicaSet | None = None,
                 kv_index: KvIndex | None = None) -> None:
        """``replicas``: the set whose models and replicas are routed (a bare table by default);
        ``kv_index``: the KV index the kv_index tiers read (a new one by default)."""
        self.registry = registry
        self.metrics = metrics
        self.replicas = replicas if replicas is not None else ReplicaSet()
        self.models: dict[str, ModelRoute] = {}
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> the model whose replicas serve it
        # One KV index for every model (replica names are unique): the control plane applies the agents' KV
        # changes to it, the kv_index tiers read it (TierServices.kv_index).
        self.kv_index = kv_index if kv_index is not None else KvIndex(clock=time.monotonic)
        if metrics is not None and getattr(metrics, "registry", None) is not None:
            KvMetrics.for_registry(metrics.registry).track_index(self.kv_index, self.model_of_replica)
        self._tier_errors_logged: set[str] = set()
        self.learning: LearningBus | None = None  # set by a cluster's shared state before any model is declared
        # Read by the engine load scraper (llmgw/router/load_scraper.py): a floor on every model's scrape interval,
        # and who is told of each replica's new engine_load.
        self.engine_metrics_demand: EngineMetricsDemand | None = None
        self.engine_load_listeners: list[Callable[[Replica], None]] = []
        self.first_token_listeners: list[Callable[[str, float], None]] = []  # (model, ttft s): the autoscaler's
        self.output_quantile: float | None = DEFAULT_QUANTILE  # every model's OutputAllowance (flow.output_quantile)
        self.replicas.watch_models(self._declaration_changed)
        for name in self.replicas.declared_models():
            self._declaration_changed(name)

    def _declaration_changed(self, name: str) -> None:
        """Follow the replica set's declarations of ``name``: build or rebuild its route, or remove it."""
        declared = self.replicas.model(name)
        if declared is None:
            self.remove_model(name)
            return
        route = self.models.get(name)
        if route is None or route.declared != declared:
            route = self.configure_model(name, declared.routing, declared.routing_options, declared)
            route.declared = declared
        self.set_adapters(name, self.replicas.adapters(name))

    def configure_model(self, name: str, tier_name: str, options: Mapping[str, Any] | None = None,
                        model: TierModel | None = None) -> ModelRoute:
        """Create or re-tier a model; its replicas are kept.

        The tier is built with ``model`` (its ``routing`` and ``routing_options`` replaced by ``tier_name`` and
        ``options``), or a plain :class:`TierModel` of ``name`` without one.
        """
        replicas = self.replicas.members(name)
        routing_options = dict(options or {})
        model_config = dataclasses.replace(model or TierModel(name), name=name, routing=tier_name,
                                           routing_options=routing_options)
        services = TierServices(registry=self.registry, metrics=self.metrics, replicas=replicas, model=name,
                                kv_index=self.kv_index,
                                learning=self.learning.for_model(name) if self.learning is not None else None)
        tier = as_routing_tier(self.registry.get("routing_tiers", tier_name)(model_config, services))
        fallback = as_routing_tier(self.registry.get("routing_tiers", "round_robin")(model_config, services))
        route = ModelRoute(name, tier_name, tier, fallback, replicas, routing_options,
                           output_allowance=OutputAllowance(self.output_quantile))
        previous = self.models.get(name)
        if previous is not None:  # re-tiered: the engines' tokenizer and the clients' answers are the same
            route.prompt_ratio = previous.prompt_ratio
            route.output_allowance = previous.output_allowance
        self.models[name] = route
        return route

    def set_output_quantile(self, quantile: float | None) -> None:
        """Every model's output allowance reserves this quantile of what its answers held (None: ``max_tokens``
        whole), from now on; for the models configured later too."""
        self.output_quantile = quantile
        for route in list(self.models.values()):
            route.output_allowance.set_quantile(quantile)

    def add_replica(self, replica: Replica) -> None:
        """Put ``replica`` into the router's set (a static one; the gateway's sources use the set directly)."""
        if replica not in self.replicas:
            self.replicas.add(replica, STATIC)

    def remove_replica(self, replica: Replica) -> None:
        self.replicas.discard(replica)

    def remove_model(self, name: str) -> None:
        self.models.pop(name, None)
        self.set_adapters(name, ())

    def set_adapters(self, model: str, adapters: Iterable[str]) -> None:
        """The LoRA adapters ``model``'s replicas serve: a request naming one is routed as ``model``."""
        self.adapters = {a: m for a, m in self.adapters.items() if m != model}
        for adapter in adapters:
            if adapter in self.models:
                log.warning("LoRA adapter %s of model %s has the name of a model; requests go to the model",
                            adapter, model)
                continue
            self.adapters[adapter] = model

    def has_routable_replica(self, model: str) -> bool:
        """Whether ``model`` (a served name, not an adapter) has a replica that may take a request now."""
        route = self.models.get(model)
        return route is not None and any(replica.routable for replica in route.replicas)

    def resolve(self, name: str) -> tuple[str, str | None] | None:
        """``(model, adapter)`` for a name a client asked for (``adapter`` None for a model), or None."""
        if name in self.models:
            return name, None
        model = self.adapters.get(name)
        return (model, name) if model is not None and model in self.models else None

    def model_of_replica(self, name: str) -> str:
        """The model replica ``name`` serves ("" when no model has it)."""
        return self.replicas.model_of(name)

    def all_replicas(self) -> Iterable[Replica]:
        return iter(self.replicas)

    def candidates(self, model: str, exclude: Iterable[Replica] = ()) -> list[Replica]:
        route = self.models[model]
        excluded = set(exclude)
        return [r for r in route.replicas if r.routable and r not in excluded]

    async def pick(self, request: RouteRequest, exclude: Iterable[Replica] = ()) -> Decision | None:
        """A routable replica for ``request`` not in ``exclude``, or None when there is none."""
        route = self.models[request.model]
        candidates = self.candidates(request.model, exclude)
        if not candidates:
            return None
        decision = None
        try:
            decision = await route.tier.pick(request, candidates)
        except Exception:
            if route.tier_name not in self._tier_errors_logged:
                self._tier_errors_logged.add(route.tier_name)
                log.exception("routing tier %r failed; falling back to round_robin (logged once)", route.tier_name)
            if self.metrics is not None:
                self.metrics.decisions.labels(request.model, route.tier_name, "error").inc()
        if decision is None or decision.replica not in candidates:
            decision = await route.fallback.pick(request, candidates)
            assert decision is not None  # the fallback (round robin) always picks one of the candidates
            decision.outcome = "fallback"
        if self.metrics is not None:
            self.metrics.decisions.labels(request.model, decision.tier or route.tier_name, decision.outcome).inc()
        return decision

    async def explain(self, request: RouteRequest) -> dict[str, Any]:
        """What the model's tier would do with ``request`` and why, changing no state.

        Tiers whose ``explain(request, candidates)`` answers (not None) speak for
        themselves; for others only the replicas and their load are known,
        since asking such a tier to pick would change its state.
        """
        route = self.models[request.model]
        candidates = self.candidates(request.model)
        answer: dict[str, Any] = {"model": route.name, "tier": route.tier_name, "pick": None, "outcome": None}
        if not candidates:
            answer["outcome"] = "no_replica"
        else:
            try:
                result = route.tier.explain(request, candidates)
                if inspect.isawaitable(result):
                    result = await result
            except Exception as exc:  # an operator tool: show the failure rather than a bare 500
                log.exception("routing tier %r failed to explain a request", route.tier_name)
                answer.update(outcome="error", error=f"{type(exc).__name__}: {exc}")
            else:
                if result is None:
                    answer["outcome"] = "not_explainable"
                    answer["note"] = (f"routing tier {route.tier_name!r} has no explain(); its pick cannot be "
                                      "shown without routing the request")
                else:
                    answer.update(result)
        answer.setdefault("replicas", [])
        explained = {entry.get("name") for entry in answer["replicas"]}
        for replica in route.replicas:  # every replica appears, with why it is not a candidate
            if replica.name not in explained:
                answer["replicas"].append({"name": replica.name, "candidate": replica in candidates})
        by_name = {r.name: r for r in route.replicas}
        for entry in answer["replicas"]:
            known = by_name.get(entry.get("name"))
            if known is not None:  # the totals the tier reads: ours plus the other gateways' latest
                entry.update(state=known.state.value, inflight=known.inflight, inflight_tokens=known.inflight_tokens)
        return answer

    # -- one attempt's hooks (the data plane calls them; docs/plugins.md, "Hook order") ------------------------------

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        """The request is being handed to ``decision.replica``: its prompt tokens count in the replica's
        ``local_inflight_tokens`` (hence ``inflight_tokens``) and its output allowance (of its ``max_tokens``, what
        the model's answers were learnt to hold: :class:`OutputAllowance`) in ``local_inflight_output_tokens``
        from now on, and the tier learns of it."""
        route = self.models.get(request.model)
        if not decision.inflight_tokens:
            decision.inflight_tokens = estimated_prompt_tokens(request)
            cap = max_output_tokens(request.body)
            if cap is None:
                decision.output_tokens = int(DEFAULT_OUTPUT_TOKENS)
            else:
                decision.output_tokens = route.output_allowance.tokens(cap) if route is not None else cap
            replica = replica_of(decision)
            replica.local_inflight_tokens += decision.inflight_tokens
            replica.local_inflight_output_tokens += decision.output_tokens
        if decision.prefill_tokens > 0 and not decision.queued:
            decision.queued = True
            replica_of(decision).queue_prefill(id(decision), decision.prefill_tokens, time.monotonic())
        if route is not None:
            self._notify(route, "routed", route.tier.routed, request, decision)

    def first_token(self, request: RouteRequest, decision: Decision, ttft: float) -> None:
        """The response's first output token arrived ``ttft`` seconds after the request did (once per decision;
        later calls are ignored)."""
        if decision.ttft is not None or decision.ended:
            return
        decision.ttft = ttft
        self._unqueue(decision)
        for listener in self.first_token_listeners:
            listener(request.model, ttft)
        route = self.models.get(request.model)
        if route is not None:
            self._notify(route, "first_token", route.tier.first_token, request, decision, ttft)

    def attempt_failed(self, request: RouteRequest, decision: Decision, reason: str) -> None:
        """The attempt failed before any of its answer was relayed (``reason``: the failure's kind); the data
        plane may pick again without this replica. :meth:`finished` must still follow."""
        route = self.models.get(request.model)
        if route is not None and not decision.ended:
            self._notify(route, "attempt_failed", route.tier.attempt_failed, request, decision, reason)

    def finished(self, request: RouteRequest, decision: Decision, usage: dict[str, Any] | None) -> None:
        """The attempt ended (answered, failed or abandoned): its tokens leave the replica's
        ``local_inflight_tokens`` and the tier is told, once however often this is called. Its ``usage`` teaches
        the model's :class:`PromptTokenRatio` and :class:`OutputAllowance`."""
        if decision.ended:
            return
        decision.ended = True
        self._unqueue(decision)
        route = self.models.get(request.model)
        if decision.inflight_tokens:
            if route is not None and usage is not None:
                route.prompt_ratio.observe(decision.inflight_tokens, usage)
                route.output_allowance.observe(max_output_tokens(request.body), usage)
            replica = replica_of(decision)
            replica.local_inflight_tokens = max(0, replica.local_inflight_tokens - decision.inflight_tokens)
            replica.local_inflight_output_tokens = max(0, replica.local_inflight_output_tokens - decision.output_tokens)
            decision.inflight_tokens = decision.output_tokens = 0
        if route is not None:
            self._notify(route, "finished", route.tier.finished, request, decision,
                         usage if route.tier.wants_usage is True else None)

    @staticmethod
    def _unqueue(decision: Decision) -> None:
        """Its prefill is done (a first token) or will never be (the attempt ended): off the replica's queue."""
        if decision.queued:
            decision.queued = False
            replica_of(decision).unqueue_prefill(id(decision), decision.prefill_tokens)

    def _notify(self, route: ModelRoute, hook: str, method: Callable[..., object], *args: object) -> None:
        try:
            method(*args)
        except Exception:
            key = f"{route.tier_name}.{hook}"
            if key not in self._tier_errors_logged:
                self._tier_errors_logged.add(key)
                log.exception("routing tier %r failed in %s (logged once)", route.tier_name, hook)
