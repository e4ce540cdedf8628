"""A gateway's part of autoscaling: which models wait for a replica, and the autoscaler its control plane runs.

Every gateway (leader or follower) holds the requests of an autoscaled model in its flow queue while it has no
routable replica (:attr:`DataPlane.holds`), and answers ``/ready`` for it; those held requests go out in its load
reports, which is the signal that starts the first replica. The leader's control plane (built for each term, or
once without a shared state) gets an :class:`~llmgw.autoscale.actuator.Autoscaler` reading this process's flow
queue and the peers' load reports (:class:`~llmgw.autoscale.signals.GatewaySignals`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import trio
from prometheus_client import CollectorRegistry

from ..autoscale.actuator import Autoscaler, autoscaled, autoscaled_models
from ..autoscale.interfaces import Scaler
from ..autoscale.metrics import AutoscaleMetrics
from ..autoscale.model import AutoscaleSettings
from ..autoscale.scaler import TargetScaler
from ..autoscale.seats import declared_seats
from ..autoscale.signals import FirstTokens, GatewaySignals
from .load_figures import GatewayFigures

if TYPE_CHECKING:
    from ..cluster.load import LoadSharing
    from ..config import Config
    from ..config.schema import Deployment
    from ..control.plane import ControlPlane
    from ..router.replica import Replica
    from ..router.router import Router
    from .flow_setup import GatewayFlow

SettingsOf = Callable[["Deployment"], AutoscaleSettings | None]
ScalerOf = Callable[["Config"], Scaler]


def configured_settings(deployment: "Deployment") -> AutoscaleSettings | None:
    """A deployment's ``replicas: {min, max}`` and ``autoscale:`` keys; None for a fixed ``replicas: N``."""
    return deployment.autoscale_settings() if deployment.autoscaled else None


def target_scaler(config: "Config") -> Scaler:
    """llmgw's scaler (llmgw/autoscale/scaler.py), with the config's settings and history size."""
    return TargetScaler.from_config(config)


class GatewayAutoscale:
    def __init__(self, config: "Config", router: "Router", flow: "GatewayFlow", sharing: "LoadSharing | None",
                 registry: CollectorRegistry, scaler: ScalerOf = target_scaler,
                 settings_of: SettingsOf = configured_settings):
        """``scaler(config)``: a new scaler for each control plane (a new leader's starts afresh, from the adopted
        counts); ``settings_of(deployment)``: its autoscale settings (None: its fixed ``replicas``)."""
        self.router = router
        self.flow = flow
        self.sharing = sharing
        self.registry = registry
        self.scaler = scaler
        self.settings_of = settings_of
        self.models: frozenset[str] = frozenset()
        self.slos: dict[str, float] = {}
        self.declared_seats: dict[str, int] = {}  # served model -> its profile's --max-num-seqs
        self.default_fill = 1.0  # the default class's max_fill: the share of a replica's seats its requests fill
        self.first_tokens = FirstTokens(trio.current_time)  # this gateway's, for the TTFT attainment signal
        router.first_token_listeners.append(self.first_tokens.observe)
        self.apply(config)
        if sharing is not None:  # the leader, whichever gateway it is, reads the cluster's arrivals and first tokens
            sharing.report_figures(GatewayFigures(router, flow.queue, self.first_tokens, self._slo_of).own)

    def apply(self, config: "Config") -> None:
        """A (re)loaded config: which models are autoscaled, and their ``ttft_slo``."""
        self.config = config
        self.models = autoscaled_models(config, self.settings_of)
        self.slos = {config.profile(key).served_model_name: settings.ttft_slo
                     for key, (_, settings) in autoscaled(config, self.settings_of).items()
                     if settings.ttft_slo is not None}
        flow = config.flow.settings()
        self.default_fill = flow.by_name()[flow.default_class].max_fill if flow.enabled else 1.0
        self.declared_seats = {profile.served_model_name: seats for profile in
                               (config.profile(key) for key in autoscaled(config, self.settings_of))
                               if (seats := declared_seats(profile.args)) is not None}

    def holds(self, model: str) -> bool:
        return model in self.models

    def attach(self, control: "ControlPlane") -> None:
        """Give a new control plane its autoscaler (before it runs)."""
        sharing = self.sharing
        signals = GatewaySignals(self.router, self._held,
                                 sharing.peer_queued if sharing is not None else lambda model: [],
                                 entered=self.flow.queue.entered,
                                 gateways=(lambda: 1 + len(sharing.peers)) if sharing is not None else lambda: 1,
                                 first_tokens=self.first_tokens, slo_of=self._slo_of,
                                 peer_figures=sharing.peer_figures if sharing is not None else lambda model: {},
                                 seats_of=self._seats_of)
        control.scale = Autoscaler(self.scaler(self.config), self.settings_of, signals,
                                   AutoscaleMetrics.for_registry(self.registry), lambda: self.config.autoscale.interval)

    def _slo_of(self, model: str) -> float | None:
        """The ``ttft_slo`` of the autoscaled deployment serving ``model`` (None: none set, or not autoscaled)."""
        return self.slos.get(model)

    def _seats_of(self, replica: "Replica") -> int | None:
        """The requests in flight ``replica`` takes before it is full: its engine's seats (what the flow room
        learnt, else what its profile declares) as the default class may fill them (the room admits that class
        to ``floor(seats x max_fill)``, at least 1: a 2-seat engine takes one ``standard`` request at a time), or the
        room's learnt capacity when lower (an engine whose KV cache or queue cut it is full there); None when
        neither is known."""
        seats = self.flow.room.seats(replica)
        seats = seats if seats is not None else self.declared_seats.get(replica.model)
        if seats is not None:
            seats = max(1, math.floor(seats * self.default_fill))
        known = [limit for limit in (seats, self.flow.room.capacity(replica)) if limit is not None and limit > 0]
        return min(known) if known else None

    def _held(self, model: str) -> tuple[int, int]:
        queued = self.flow.queue.queued(model).values()
        return sum(q.requests for q in queued), sum(q.tokens for q in queued)
