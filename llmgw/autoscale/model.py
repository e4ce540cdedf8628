"""The value types of autoscaling: a deployment's bounds and targets, the signals a decision reads, the decision.

A deployment is keyed by its profile name (``Deployment.profile``): an autoscaled profile has one deployment.
The leader's control plane runs the deployment's *desired* count (between ``min_replicas`` and ``max_replicas``)
instead of the config's fixed ``replicas``; replicas starting count toward capacity (pending-aware), and at most
one scale step is in flight per deployment unless the backlog proves more is needed.

Every type here is immutable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ScaleKind = Literal["up", "down", "hold", "from_zero", "to_zero", "give", "take"]


@dataclass(frozen=True, slots=True)
class AutoscaleSettings:
    """One deployment's ``replicas: {min, max}`` and ``autoscale:`` keys (llmgw/config/schema.py maps them here)."""

    min_replicas: int = 1
    max_replicas: int = 1
    # The targets, in the router's terms. A deployment needs more replicas while any is exceeded.
    queued_per_replica: float = 4.0  # requests waiting at the gateways per serving-or-starting replica
    kv_usage: float = 0.85  # mean KV-cache usage of its ready replicas
    ttft_slo: float | None = None  # seconds; when set, first-token SLO attainment below ``attainment`` scales up
    attainment: float = 0.95
    # Ahead of saturation: the busy seats of the ready replicas, forecast ``lookahead`` ahead (about the engine's
    # cold start), may fill at most this share of the provisioned replicas.
    utilisation: float = 0.7
    lookahead: float = 60.0
    # Stability: a need must hold this long before it is acted on; a scale-down also waits for the last step's
    # replica to have served this long (no reversal while the effect of a step is not yet visible).
    scale_up_after: float = 5.0
    scale_down_after: float = 300.0
    idle_to_zero: float = 600.0  # with min_replicas 0: no request for this long returns it to 0
    keep_warm: float = 0.0  # a replica scaled down keeps its engine running, unrouted, this long: a hot start
    priority: int = 0  # cross-model moves: a higher priority (or larger backlog per GPU) may take idle GPUs

    @property
    def autoscaled(self) -> bool:
        return self.max_replicas > self.min_replicas


@dataclass(frozen=True, slots=True)
class ReplicaCounts:
    """A deployment's replicas as the control plane knows them now."""

    ready: int = 0  # routed, serving
    starting: int = 0  # placed and started, not yet ready (they count toward capacity: pending-aware)
    draining: int = 0  # leaving: not counted
    unplaceable: int = 0  # wanted but no GPUs fit them

    @property
    def provisioned(self) -> int:
        return self.ready + self.starting


@dataclass(frozen=True, slots=True)
class ModelSignals:
    """What every gateway reports of one model, summed (the leader reads peers' load reports and its own queue)."""

    model: str
    at: float  # trio.current_time() of the reading
    queued: int = 0  # requests waiting at the gateways' flow queues (all classes)
    queued_tokens: int = 0
    inflight: int = 0  # routed and not finished, every gateway
    arrivals_per_s: float = 0.0  # requests entering the gateways, smoothed
    served_per_s: float = 0.0  # requests finished, smoothed (the drain rate)
    served_per_replica_s: float = 0.0  # requests finished per ready replica-second, smoothed (0: not measured)
    kv_usage: float | None = None  # mean over ready replicas; None: unknown
    busy: float | None = None  # the ready replicas' busy seats, in replicas (sum of in flight / seats, each at most 1)
    ttft_attainment: float | None = None  # share of recent first tokens within the deployment's ttft_slo
    last_request_at: float | None = None  # when a request for the model last arrived at any gateway


@dataclass(frozen=True, slots=True)
class DeploymentView:
    """One autoscaled deployment as a decision sees it."""

    key: str  # the profile name
    model: str  # served_model_name
    settings: AutoscaleSettings
    counts: ReplicaCounts
    desired: int  # what the control plane is running toward now
    gpus_per_replica: int
    gpu_class: str | None
    signals: ModelSignals


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """One deployment's step, with the reason an operator reads in /admin/autoscale, the log and /ui."""

    key: str
    model: str
    at: float
    current: int  # desired before
    desired: int  # desired after (== current for "hold")
    kind: ScaleKind
    reason: str  # e.g. "12 queued over 2 replicas > target 4 per replica for 5.0 s"
    taken_from: str | None = None  # "take": the deployment that gives a replica (its own "give" decision follows)
