"""What a routing tier is: the interface every tier plugin implements, what it is given, and the scorers
scoring tiers combine.

A tier is built per model by the factory its plugin registers
(``register_routing_tiers``): ``factory(model: TierModel, services: TierServices)``.
Per request the router asks it to :meth:`~RoutingTier.pick` one of the
model's routable replicas, then tells it what became of that *attempt*, in
this order:

- :meth:`~RoutingTier.routed`: the request is being handed to the replica (before any of its answer);
- :meth:`~RoutingTier.first_token`: at most once, when the first output token arrived;
- :meth:`~RoutingTier.attempt_failed`: the attempt failed before any of its answer was relayed, and the
  request may be sent to another replica (the router then calls ``pick`` again, without this one);
- :meth:`~RoutingTier.finished`: exactly once per routed attempt, failed ones included.

A tier may also :meth:`~RoutingTier.explain` the pick it would make, without
making it (``POST /admin/explain``).

Plugins subclass :class:`RoutingTier` (through :mod:`llmgw.plugin`) and get
every optional part as a no-op default. A tier that does not subclass it
(duck-typed, :class:`TierProtocol`) still works: :func:`as_routing_tier` wraps
it once, when the model is configured, so the router never looks a method up
per request.

A :class:`Scorer` (``register_scorers``) rates each candidate replica in
[0, 1]; scoring tiers such as ``prefix_tree`` weight scorers by name from
their ``routing_options``, so a third party can add one.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Protocol, Sequence, runtime_checkable

from ..engines.probe import EngineLoad
from .replica import ReplicaState

if TYPE_CHECKING:
    from ..kv.index import KvIndexView
    from ..metrics import Metrics
    from ..plugins_manager import Registry


@runtime_checkable
class ReplicaView(Protocol):
    """What a tier may read of a replica (``llmgw.plugin.Replica``); a tier never changes one.

    ``inflight`` counts the requests handed to the replica and not yet finished
    (streamed or not; counted from :meth:`RoutingTier.routed`),
    ``inflight_tokens`` the router's estimate of their prompt tokens (canonical
    characters / 4 + 1 each), for every tier; ``queued_tokens`` and
    ``queued_requests`` the prefill queued there (the ``Decision.prefill_tokens``
    of requests without a first token yet). All are this gateway's own exact
    count plus the other gateways' latest figures when several route as one
    cluster (docs/scaling.md), so a tier balances the cluster's load, not only
    its own share. ``engine_load`` is the engine's own queue gauges from its
    last ``/metrics`` scrape (only when a tier asked for scrapes with
    ``engine_metrics_interval``), else None.
    """

    @property
    def name(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def routable(self) -> bool: ...
    @property
    def state(self) -> ReplicaState: ...
    @property
    def reason(self) -> str: ...
    @property
    def weight(self) -> int: ...
    @property
    def inflight(self) -> int: ...
    @property
    def inflight_tokens(self) -> int: ...
    @property
    def engine_id(self) -> str: ...
    @property
    def queued_tokens(self) -> int: ...
    @property
    def queued_requests(self) -> int: ...
    @property
    def queued_since(self) -> float | None: ...
    @property
    def served(self) -> int: ...
    @property
    def engine_load(self) -> EngineLoad | None: ...
    @property
    def labels(self) -> Mapping[str, str]: ...


@dataclass(slots=True)
class RouteRequest:
    """What a tier may look at: the model, the API path and the parsed JSON body.

    A request for a LoRA adapter is routed among its base model's replicas:
    ``model`` is the base model and ``adapter`` the adapter's name (also the
    body's ``model``, unchanged, since the engine serves the adapter by name).

    ``canonical_text`` caches :func:`llmgw.router.canonical.canonical_text` of the
    body, so the tier and the router's load accounting render it once.
    """

    model: str
    path: str
    body: dict[str, Any]
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    request_id: str = ""
    canonical_text: str | None = None
    adapter: str | None = None  # the LoRA adapter the body's "model" names; ``model`` is then its base model

    @property
    def served_name(self) -> str:
        """The name the client asked for: the adapter's, or the model's."""
        return self.adapter or self.model


@dataclass(slots=True)
class Decision:
    """A tier's pick. ``outcome`` labels ``llmgw_routing_decisions_total`` (e.g. hit, miss, load_override).

    ``replica`` must be one of the candidates the tier was given. ``detail`` is
    the tier's own (it sees the same object in the later hooks).
    ``inflight_tokens`` is what the router added to the replica's
    ``local_inflight_tokens`` when the request was routed, and takes off again
    when it finishes; ``output_tokens`` likewise in ``local_inflight_output_tokens``
    (the request's output allowance: the share of its ``max_tokens`` the model's answers were learnt to hold,
    :class:`llmgw.router.output_allowance.OutputAllowance`; 256 when it sets none).
    ``prefill_tokens``, when the tier sets it, is what the router counts in the
    replica's ``local_queued_tokens`` from the moment the request is routed to its
    first token (or its end): the one ledger of queued prefill, shared with the
    other gateways of a cluster.
    ``ttft`` is set by :meth:`llmgw.router.router.Router.first_token`.
    ``stream`` is a streamed answer's token timings (:class:`llmgw.gateway.latency.StreamWatch`: its
    ``first_token_at``, ``last_token_at`` and per-bucket gap ``counts``, growing while it runs), set by the
    data plane before the first token: what a tier learns decode speed from (read it, never change it).
    """

    replica: ReplicaView
    outcome: str = "pick"
    tier: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    inflight_tokens: int = 0
    output_tokens: int = 0  # the output tokens the router counts as held on the replica (the flow room's KV estimate)
    prefill_tokens: int = 0  # the tier's estimate of the prompt tokens the replica must compute (not cached)
    queued: bool = field(default=False, repr=False)  # set by the router while prefill_tokens count as queued there
    ttft: float | None = None  # seconds from the request's arrival to its first output token, once seen
    ended: bool = field(default=False, repr=False)  # set by the router once the tier was told it finished
    stream: Any = field(default=None, repr=False)  # a streamed answer's token timings, set by the data plane


def _installed_plugins() -> "Registry":
    from ..plugins_manager import default_registry

    return default_registry()


@dataclass
class TierServices:
    """What the router offers a tier.

    - ``registry``: the plugin registry (``registry.get("scorers", name)``...); outside a router, the installed
      plugins';
    - ``metrics``: the gateway's metrics (``metrics.registry`` is the Prometheus registry a tier adds its own
      series to), None outside a gateway;
    - ``replicas``: the model's replicas (live: the router adds and removes them);
    - ``model``: the model's name; ``clock``: the monotonic clock ``EngineLoad.at`` is on;
    - ``kv_index``: the router's one KV index, as a tier may use it (:class:`llmgw.kv.index.KvIndexView`: read,
      predict, observe; its confirmed blocks come from the engines' events, written by the control plane or a
      follower of the cluster's shared state); None outside a router;
    - ``learning``: with several gateways in one cluster, what this tier learns and shares with the same model's
      tiers in the other processes (:class:`SharedLearning`); None when the process routes alone.
    """

    registry: "Registry" = field(default_factory=_installed_plugins)
    metrics: "Metrics | None" = None
    replicas: Sequence[ReplicaView] = ()
    model: str = ""
    clock: Callable[[], float] = time.monotonic
    kv_index: "KvIndexView | None" = None
    learning: "SharedLearning | None" = None


Explanation = Mapping[str, Any]


class SharedLearning(Protocol):
    """A model's channel to its tiers in the other gateway processes of a cluster (docs/scaling.md)."""

    def publish(self, kind: str, payload: list[Any]) -> None:
        """Share ``payload`` (a few msgpack-able scalars) under ``kind``; never blocks, may be dropped."""

    def subscribe(self, kind: str, handler: Callable[[list[Any]], None]) -> None:
        """``handler(payload)`` for every ``kind`` payload the other processes publish for this model."""


class RoutingTier(abc.ABC):
    """The base class of routing tiers: :meth:`pick` is required, everything else has a default.

    A base class rather than only a Protocol, because the defaults are behaviour a tier inherits (no-op hooks,
    no usage, no option checks, not explainable) and one the router can then call without asking first.
    A tier that cannot subclass it may still implement :class:`TierProtocol`: :func:`as_routing_tier` adds the
    same defaults around it.

    Class attributes:

    - ``name``: the tier's name, as registered (decisions are labelled with ``Decision.tier``, or the name the
      config gave when that is empty);
    - ``wants_usage``: True to get the response's ``usage`` in :meth:`finished` (else always None);
    - ``engine_metrics_interval`` / ``engine_metrics_timeout``: seconds; set the interval to have the gateway
      scrape each replica's ``/metrics`` into ``replica.engine_load``.
    """

    name: str = ""
    wants_usage: bool = False
    engine_metrics_interval: float | None = None
    engine_metrics_timeout: float | None = None

    @classmethod
    def check_options(cls, options: Mapping[str, Any], registry: "Registry | None" = None) -> list[str]:
        """Problems with a model's ``routing_options`` for this tier, one message each (``llmgw config check``,
        ``serve`` and reloads report them with the config line). Default: none."""
        return []

    @abc.abstractmethod
    async def pick(self, request: RouteRequest, candidates: Sequence[ReplicaView]) -> Decision | None:
        """Pick one of ``candidates`` (routable, not yet tried for this request; never empty).

        Return None to defer to the fallback (``round_robin``). Runs on the request path: keep it to
        microseconds; it may ``await`` (with a deadline), but the replica loads it reads may change meanwhile.
        """

    def routed(self, request: RouteRequest, decision: Decision) -> None:  # noqa: B027 (a no-op default: tiers override what they use)
        """The request is being handed to ``decision.replica``, before any of its answer (streamed or not).

        Once per attempt. The replica's ``inflight`` and ``inflight_tokens`` already count it."""

    def first_token(self, request: RouteRequest, decision: Decision, ttft: float) -> None:  # noqa: B027 (a no-op default: tiers override what they use)
        """The first output token arrived ``ttft`` seconds after the request reached the gateway (a stream: its
        first data event with output; otherwise the whole body, when it held one token). At most once per
        attempt, between :meth:`routed` and :meth:`finished`; never for an answer without output."""

    def attempt_failed(self, request: RouteRequest, decision: Decision, reason: str) -> None:  # noqa: B027 (a no-op default: tiers override what they use)
        """The attempt failed before any of its answer reached the client, and the request may be sent to
        another replica (then :meth:`pick` is called again, without this one). ``reason`` is the failure's kind:
        ``connect``, ``tls``, ``closed_before_request`` (nothing reached the engine) and
        ``status_502``/``status_503``/``status_504`` are retried; after ``closed_after_request`` the request is
        sent on once only when the replica's engine is gone; after anything else (``timeout``, ``protocol``...)
        it is answered with the error. :meth:`finished` follows at once."""

    def finished(self, request: RouteRequest, decision: Decision, usage: dict[str, Any] | None) -> None:  # noqa: B027 (a no-op default: tiers override what they use)
        """The attempt ended: its answer was relayed (or broke off), it failed, or the client went away.
        Exactly once per :meth:`routed` attempt. ``usage`` is the engine's usage block when the tier
        ``wants_usage`` and the answer had one, else None."""

    def explain(self, request: RouteRequest, candidates: Sequence[ReplicaView]
                ) -> Explanation | None | Awaitable[Explanation | None]:
        """The pick this tier would make for ``request`` and why, as JSON-able data, changing no state (no
        learning, no round-robin step); plain or ``async``. Keys the control API relies on: ``pick`` (a replica
        name or None) and ``outcome``; scoring tiers add ``replicas``: one entry per candidate with its
        ``scores``. None (the default): not explainable."""
        return None


@runtime_checkable
class TierProtocol(Protocol):
    """The least a tier must have when it does not subclass :class:`RoutingTier`: a name and ``pick``. Any of
    ``routed``, ``first_token``, ``attempt_failed``, ``finished``, ``explain``, ``wants_usage`` it has are used."""

    name: str

    async def pick(self, request: RouteRequest, candidates: Sequence[ReplicaView]) -> Decision | None: ...


_OPTIONAL_HOOKS = ("routed", "first_token", "attempt_failed", "finished", "explain")


class _DuckTier(RoutingTier):
    """A tier that does not subclass :class:`RoutingTier`: its own hooks where it has them, the defaults
    elsewhere (looked up once); any other attribute (``tree``, ``engine_metrics_interval``...) is the tier's."""

    def __init__(self, tier: TierProtocol):
        self.tier = tier
        self.name = getattr(tier, "name", "") or type(tier).__name__
        self.wants_usage = getattr(tier, "wants_usage", False) is True
        for setting in ("engine_metrics_interval", "engine_metrics_timeout"):  # the base class's would hide them
            setattr(self, setting, getattr(tier, setting, None))
        for hook in _OPTIONAL_HOOKS:
            method = getattr(tier, hook, None)
            if callable(method):
                setattr(self, hook, method)

    async def pick(self, request: RouteRequest, candidates: Sequence[ReplicaView]) -> Decision | None:
        return await self.tier.pick(request, candidates)

    def __getattr__(self, name: str) -> Any:
        if name == "tier":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.tier, name)


def as_routing_tier(tier: RoutingTier | TierProtocol) -> RoutingTier:
    """``tier`` itself when it subclasses :class:`RoutingTier`, else wrapped with its defaults."""
    return tier if isinstance(tier, RoutingTier) else _DuckTier(tier)


@dataclass(slots=True)
class ScoreContext:
    """What a scoring tier knows about one request, aligned with its ``candidates`` list.

    ``matched_chars[i]`` is how much of the request's canonical text candidate
    ``i`` is believed to hold (0 below the tier's ``min_match_chars``, and when
    the tier has no prefix view);
    ``loads[i]`` its effective in-flight requests (router-side, or the engine's
    running + waiting when a fresh scrape says more); ``inflight_tokens[i]``
    the router's estimate of prompt tokens in flight to it (both the cluster's:
    this gateway's plus the other gateways' latest, as :class:`ReplicaView`).
    """

    prompt_chars: int
    matched_chars: Sequence[int]
    loads: Sequence[float]
    inflight_tokens: Sequence[int]
    now: float


class Scorer(Protocol):
    """Rates candidates for one request: one float in [0, 1] per candidate, higher is better.

    Built by ``factory(options)`` from ``register_scorers`` with the model's
    ``routing_options`` mapping; the factory may list the keys it reads in
    ``option_keys``. Called on the request path, so keep it to microseconds
    and never block.
    """

    name: str
    option_keys: Sequence[str] = ()

    def score(self, request: RouteRequest, candidates: Sequence[ReplicaView], context: ScoreContext
              ) -> Sequence[float]:
        ...
