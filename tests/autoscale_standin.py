"""A stand-in :class:`~llmgw.autoscale.interfaces.Scaler` for the product's autoscaling tests: simple, pending-aware.

It is not the product's scaler (llmgw/autoscale/scaler.py): its rules are just enough to drive the control plane
through every path the actuator must carry out, and it records every view it was shown:

- a deployment needs ``ceil((queued + inflight) / queued_per_replica)`` replicas (1 when anything waits);
- up one (``from_zero`` from 0) when it needs more than it has provisioned (ready + starting), only while none
  is starting (pending-aware), and when the GPUs are free; else ``take`` one from a deployment above its min with
  nothing queued or in flight (that one's ``give``);
- down one (``to_zero`` to 0) when it has needed fewer for ``scale_down_after`` (``idle_to_zero`` when that
  reaches 0, counted from the last request).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from llmgw.autoscale.model import DeploymentView, ScaleDecision


class StandInScaler:
    def __init__(self) -> None:
        self.desired_counts: dict[str, int] = {}
        self.decisions: list[ScaleDecision] = []
        self.views: list[tuple[float, DeploymentView]] = []
        self._fewer_since: dict[str, float] = {}

    def desired(self, key: str, configured: int) -> int:
        return self.desired_counts.get(key, configured)

    def history(self, key: str | None = None) -> list[ScaleDecision]:
        return [d for d in self.decisions if key is None or d.key == key][-50:]

    def decide(self, now: float, deployments: Sequence[DeploymentView],
               free_gpus: Mapping[str | None, int]) -> list[ScaleDecision]:
        made: list[ScaleDecision] = []
        free = dict(free_gpus)
        for view in deployments:
            self.views.append((now, view))
            self.desired_counts.setdefault(view.key, view.desired)
        for view in deployments:
            current = self.desired_counts[view.key]
            settings, signals, counts = view.settings, view.signals, view.counts
            demand = signals.queued + signals.inflight
            need = math.ceil(demand / settings.queued_per_replica) if demand else 0
            need = min(settings.max_replicas, max(settings.min_replicas, need))
            if need > current and counts.starting == 0 and counts.provisioned == current:
                kind = "from_zero" if current == 0 else "up"
                pool = view.gpu_class if view.gpu_class in free else None
                if free.get(pool, 0) >= view.gpus_per_replica:
                    free[pool] -= view.gpus_per_replica
                    made.append(self._set(view, now, current + 1, kind,
                                          f"{demand} waiting or in flight need {need} replicas, {current} run"))
                else:
                    made.extend(self._take(view, now, current, deployments))
                self._fewer_since.pop(view.key, None)
            elif need < current:
                since = self._fewer_since.setdefault(view.key, now)
                window = settings.idle_to_zero if current == 1 else settings.scale_down_after
                idle_since = signals.last_request_at if current == 1 and signals.last_request_at else since
                if now - max(since, idle_since) >= window:
                    made.append(self._set(view, now, current - 1, "to_zero" if current == 1 else "down",
                                          f"{demand} waiting or in flight need {need} for {window:g}s"))
                    self._fewer_since.pop(view.key, None)
            else:
                self._fewer_since.pop(view.key, None)
        self.decisions.extend(made)
        return made

    def _take(self, view: DeploymentView, now: float, current: int,
              deployments: Sequence[DeploymentView]) -> list[ScaleDecision]:
        for other in deployments:
            had = self.desired_counts[other.key]
            idle = other.signals.queued + other.signals.inflight == 0
            if other.key != view.key and idle and had > other.settings.min_replicas:
                give = self._set(other, now, had - 1, "give", f"idle: a replica's GPUs go to {view.key}")
                take = self._set(view, now, current + 1, "take", f"no free GPU: takes one of {other.key}'s",
                                 taken_from=other.key)
                return [take, give]
        return []

    def _set(self, view: DeploymentView, now: float, desired: int, kind, reason: str,
             taken_from: str | None = None) -> ScaleDecision:
        current = self.desired_counts[view.key]
        self.desired_counts[view.key] = desired
        return ScaleDecision(view.key, view.model, now, current, desired, kind, reason, taken_from)
