"""The offline oracle of ``llmgw bench autoscale``: the fewest replicas that serve a trace it knows in advance.

At each instant a model *needs* ``ceil(demand)`` replicas (demand in replicas' worth of the measured per-replica
capacity, :mod:`.autoscale_traces`), kept within the trace's ``min`` and ``max``. Knowing the future, the oracle
starts a replica one ready time (the engine's cold start) before it is needed and stops it the moment it is not:
its provisioned count at ``t`` is the largest need over ``[t, t + ready]``. Its replica-seconds (starting ones
counted, as for the arms) are the floor an autoscaler is measured against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .autoscale_traces import Trace, instants


def needed(trace: Trace, model: str, fleet_seconds: float) -> int:
    """The replicas ``model`` needs at that instant of the trace."""
    demand = trace.demand(model, fleet_seconds)
    return min(trace.max_replicas, max(trace.min_replicas, math.ceil(demand - 1e-9)))


@dataclass(frozen=True)
class OraclePlan:
    step: float  # wall seconds between points
    factor: float  # fleet seconds per wall second
    needed: list[int]  # at each point
    provisioned: list[int]  # at each point: needed now or within the ready time

    @property
    def replica_seconds(self) -> float:
        """In fleet seconds (what a real fleet would pay for)."""
        return sum(self.provisioned) * self.step * self.factor


def plan(trace: Trace, model: str, factor: float, ready_seconds: float, step: float) -> OraclePlan:
    """The oracle's counts every ``step`` wall seconds of ``trace``; ``ready_seconds`` in fleet seconds."""
    points = instants(trace.seconds / factor, step)
    need = [needed(trace, model, t * factor) for t in points]
    ahead = max(0, math.ceil(ready_seconds / factor / step - 1e-9))
    # A need past the trace's end is the last one's (the trace would go on as it ends).
    provisioned = [max(need[i:i + ahead + 1]) for i in range(len(need))]
    return OraclePlan(step, factor, need, provisioned)
