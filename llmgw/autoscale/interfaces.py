"""The seams of autoscaling, as Protocols.

The loop, on the leader only (every ``interval``)::

    views = [DeploymentView(..., signals=signals.signals(model, now), counts=counts_of(key), ...)]
    for decision in scaler.decide(now, views, free_gpus): log, metric, history
    control plane: desired_replicas() uses scaler.desired(key, configured) for each autoscaled deployment

A follower runs no scaler; its gateways still hold requests for a model with no replica (the flow queue, until
its deadline) and report them in their load reports, which is the signal that starts the first replica.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

from .model import DeploymentView, ModelSignals, ScaleDecision


class SignalSource(Protocol):
    def signals(self, model: str, now: float) -> ModelSignals:
        """``model``'s demand and state summed over every gateway, read from local copies (never waits on Redis)."""


class Scaler(Protocol):
    def decide(self, now: float, deployments: Sequence[DeploymentView],
               free_gpus: Mapping[str | None, int]) -> list[ScaleDecision]:
        """The steps to take now (also "hold" decisions whose reason changed, for the record); ``free_gpus`` by
        GPU class (None: any class) is what placement could still give. Pure: no I/O, no await."""

    def desired(self, key: str, configured: int) -> int:
        """The replica count the control plane should run for deployment ``key`` (``configured`` when the
        deployment is not autoscaled or no decision was made yet: then its ``min_replicas``... ``max_replicas``
        clamp of it)."""

    def history(self, key: str | None = None) -> list[ScaleDecision]:
        """The recent decisions (bounded), newest last, for /admin/autoscale, ``llmgw status`` and /ui."""
