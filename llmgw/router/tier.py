"""What a routing tier is: the interface every tier plugin implements, and the scorers scoring tiers combine.

A tier is built per model by the factory its plugin registers
(``register_routing_tiers``) and asked, per request, to pick one of the
model's routable replicas. Tiers may keep state (a prefix tree, a KV index)
and learn from :meth:`RoutingTier.routed` and :meth:`RoutingTier.finished`.
A tier may also :meth:`~RoutingTier.explain` the pick it would make, without
making it (``POST /admin/explain``).

A :class:`Scorer` (``register_scorers``) rates each candidate replica in
[0, 1]; scoring tiers such as ``prefix_tree`` weight scorers by name from
their ``routing_options``, so a third party can add one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from .replica import Replica


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

    ``inflight_tokens`` is what the router added to ``replica.inflight_tokens``
    when the request was routed, and takes off again when it finishes.
    ``ttft`` is set by :meth:`llmgw.router.router.Router.first_token`.
    """

    replica: Replica
    outcome: str = "pick"
    tier: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    inflight_tokens: int = 0
    ttft: float | None = None  # seconds from the request's arrival to its first output token, once seen


@dataclass
class TierServices:
    """What the router offers tiers: the plugin registry, metrics, the model's name and replica list, a clock,
    and the router's one KV index (:class:`llmgw.kv.index.KvIndex`, fed by the control plane with the agents'
    KV changes; None outside a router)."""

    registry: Any = None
    metrics: Any = None
    replicas: Sequence[Replica] = ()
    model: str = ""
    clock: Callable[[], float] = time.monotonic
    kv_index: Any = None


class RoutingTier(Protocol):
    name: str

    async def pick(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision | None:
        """Pick one of ``candidates`` (routable, not yet tried for this request; never empty).

        Return None to defer to the next tier of the fallback chain.
        """

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        """Called once, just before the request is sent to ``decision.replica``. Every routed decision is
        :meth:`finished` exactly once, also when the attempt fails and the request is retried elsewhere."""

    def finished(self, request: RouteRequest, decision: Decision, usage: dict[str, Any] | None) -> None:
        """Called when the response ended; ``usage`` is the engine's usage block when it was seen.

        Tiers that set a class attribute ``wants_usage = True`` get the body's ``usage`` (or a stream's final
        usage chunk) when the response had one; the others always get None.
        """

    # Optional:
    # def first_token(self, request, decision, ttft) -> None
    #     The response's first output token arrived ``ttft`` seconds after the request reached the gateway
    #     (a stream: its first data event with output; otherwise the whole body). At most once per decision,
    #     between routed() and finished(); never for a response without output (an error).
    # async def explain(self, request, candidates) -> dict
    #     The pick this tier would make for ``request`` and why, as JSON-able data, changing no state
    #     (no tree insert, no round-robin step). A plain ``def`` is accepted too. Keys the
    #     control API relies on: ``pick`` (a replica name or None) and ``outcome``; scoring tiers
    #     add ``replicas``: one entry per candidate with its ``scores``. See ``docs/routing.md``.


@dataclass(slots=True)
class ScoreContext:
    """What a scoring tier knows about one request, aligned with its ``candidates`` list.

    ``matched_chars[i]`` is how much of the request's canonical text candidate
    ``i`` is believed to hold (0 below the tier's ``min_match_chars``, and when
    the tier has no prefix view);
    ``loads[i]`` its effective in-flight requests (router-side, or the engine's
    running + waiting when a fresh scrape says more); ``inflight_tokens[i]``
    the router's estimate of prompt tokens in flight to it.
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

    def score(self, request: RouteRequest, candidates: Sequence[Replica], context: ScoreContext) -> Sequence[float]:
        ...
