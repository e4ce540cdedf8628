"""What ``llmgw bench chaos`` saw the autoscaler do: its count and decisions for the autoscaled deployment.

:class:`ScalerLog` polls the leader's ``/admin/autoscale`` for the whole run (whoever leads: a fault may move
the lead) and keeps each reading and each decision the first time it was seen; :meth:`ScalerLog.window` says
what happened to the count during one fault: the desired count before and after, the lowest and highest in
between, and the decisions made (``hold`` apart). A fault must not make the scaler step up (the load is
steady), step below what runs, or forget what runs (a new leader starts from the replicas it adopts).

A new leader's ``desired`` during its adoption window is its ``max`` by design (nothing is placed then, so
that every replica still running can be adopted): a reading whose ``started_from`` is still ``null`` is not a
count the scaler runs toward, and is left out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import trio

POLL = 0.25


class Leader(Protocol):
    async def autoscaled(self) -> dict | None: ...

    async def leader(self) -> tuple | None: ...


@dataclass
class ScalerWindow:
    before: int | None  # desired, the last reading before the fault
    after: int | None  # desired, the last reading of the window
    lowest: int | None  # desired, every reading of the window (adoption windows apart)
    highest: int | None
    decisions: list[str]  # "up 1->2", in the order seen
    reasons: list[str] = field(default_factory=list)  # "B: up 1->2: <the scaler's reason>", the same order

    @property
    def stepped(self) -> bool:
        """Whether the scaler stepped, or its count moved, during the fault (a steady load needs no step)."""
        moved = self.before is not None and any(
            count not in (None, self.before) for count in (self.lowest, self.highest, self.after))
        return moved or bool(self.decisions)


@dataclass
class ScalerLog:
    readings: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, desired), the scaler started
    decisions: list[tuple[float, str, str]] = field(default_factory=list)  # (first seen, "kind a->b", why)
    known: set[tuple] = field(default_factory=set)  # (leader, at, kind, from, to): each decision once

    async def run(self, rig: Leader) -> None:
        while True:
            found = await rig.leader()
            deployment = await rig.autoscaled()
            if found is not None and deployment is not None:
                self.record(found[0].name, deployment, time.monotonic())
            await trio.sleep(POLL)

    def record(self, leader: str, deployment: dict, at: float) -> None:
        if deployment.get("started_from") is not None and deployment.get("desired") is not None:
            self.readings.append((at, int(deployment["desired"])))
        for decision in deployment.get("decisions") or []:
            key = (leader, decision.get("at"), decision.get("kind"), decision.get("from"), decision.get("to"))
            if key in self.known:
                continue
            self.known.add(key)
            if decision.get("kind") != "hold":
                what = f"{decision.get('kind')} {decision.get('from')}->{decision.get('to')}"
                self.decisions.append((at, what, f"{leader}: {what}: {decision.get('reason')}"))

    def window(self, start: float, end: float) -> ScalerWindow:
        before = [desired for at, desired in self.readings if at < start]
        within = [desired for at, desired in self.readings if start <= at <= end]
        return ScalerWindow(before=before[-1] if before else None, after=within[-1] if within else None,
                            lowest=min(within, default=None), highest=max(within, default=None),
                            decisions=[what for at, what, _ in self.decisions if start <= at <= end],
                            reasons=[why for at, _, why in self.decisions if start <= at <= end])
