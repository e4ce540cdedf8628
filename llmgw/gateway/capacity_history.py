"""The status page's replicas over time: per autoscaled deployment, a small bounded ring of this process's own
samples of its replicas (ready, starting, asleep, draining) against its demand (arrivals, requests queued here, in
flight cluster-wide), and the autoscaler's decisions.

:class:`CapacityHistory` samples every ``interval`` seconds what ``read()`` says (the gateway's
:func:`gateway_counts`) and keeps the last ``size`` samples of at most :data:`MAX_DEPLOYMENTS` models, and their last
:data:`MAX_DECISIONS` distinct decisions; a model that is no longer autoscaled leaves with its samples.
``GET /admin/capacity`` serves :meth:`CapacityHistory.to_json` (docs/ui.md). :func:`count_replicas` reads replicas
as ``/admin/replicas`` lists them, which is also how ``llmgw bench autoscale`` counts a fleet.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from ..autoscale.actuator import Autoscaler, autoscaled, parked_replicas

if TYPE_CHECKING:
    from ..control.plane import ControlPlane
    from .app import Gateway

log = logging.getLogger(__name__)

SAMPLE_INTERVAL = 2.0  # seconds between samples
SAMPLES = 300  # per deployment: ten minutes at SAMPLE_INTERVAL
MAX_DEPLOYMENTS = 64
MAX_DECISIONS = 20  # per deployment: the chart marks them; /admin/autoscale keeps the history
ROUTABLE = ("up", "unknown")  # a replica in these states takes requests (unknown: not probed yet)
NOT_STARTING = (*ROUTABLE, "down", "draining", "retiring", "unplaced")  # any other state is on its way up
COLUMNS = ("ready", "starting", "sleeping", "draining", "queued", "inflight", "arrivals")


@dataclass(frozen=True, slots=True)
class Decision:
    """An autoscaler's decision as the chart marks it: when (Unix seconds), what, and why."""

    at: float
    kind: str
    before: int
    after: int
    reason: str


@dataclass(frozen=True, slots=True)
class Counts:
    ready: int = 0  # routable
    starting: int = 0  # placed or waiting to be (or waking from sleep), not routable yet
    sleeping: int | None = None  # scaled down and asleep (sleep_mode, keep_warm); None: not known here
    draining: int = 0  # leaving: retiring or draining
    queued: int = 0  # requests held in this gateway's flow queue
    inflight: int = 0  # requests routed and not finished, every gateway's
    arrivals: float | None = None  # requests per second entering every gateway, as the autoscaler read them
    decisions: tuple[Decision, ...] = ()  # the autoscaler's newest (at most MAX_DECISIONS), oldest first


def count_replicas(listed: Iterable[Mapping[str, Any]], models: Collection[str]) -> dict[str, dict[str, int]]:
    """Per model of ``models``: its ``ready``, ``starting`` and ``draining`` (retiring or draining) replicas and
    their requests ``inflight``, from replicas listed as ``/admin/replicas`` lists them."""
    counts = {model: {"ready": 0, "starting": 0, "draining": 0, "inflight": 0} for model in models}
    for replica in listed:
        found = counts.get(replica.get("model", ""))
        if found is None:
            continue
        state = replica.get("state")
        if replica.get("retiring") or state == "draining":
            found["draining"] += 1
        elif state in ROUTABLE:
            found["ready"] += 1
        elif state not in NOT_STARTING:
            found["starting"] += 1
        found["inflight"] += int(replica.get("inflight") or 0)
    return counts


def autoscaler_view(control: "ControlPlane", models: Collection[str]) -> dict[str, dict[str, Any]]:
    """Per model of ``models`` that the leader's autoscaler scales: its replicas asleep, the arrivals it read and
    its deployments' newest decisions."""
    scale = control.scale
    if not isinstance(scale, Autoscaler):
        return {}
    to_unix = time.time() - trio.current_time()  # the decisions are timed on trio's clock
    found: dict[str, dict[str, Any]] = {}
    for key in autoscaled(control.config, scale.settings_of):
        model = control.config.profile(key).served_model_name
        if model not in models:
            continue
        view = found.setdefault(model, {"sleeping": 0, "arrivals": None, "decisions": ()})
        view["sleeping"] += parked_replicas(control, key, asleep=True)
        if (arrivals := scale.arrivals_per_s(key)) is not None:
            view["arrivals"] = round(arrivals, 3)  # every deployment of a model reads the model's arrivals
        decided = [Decision(round(d["at"] + to_unix, 1), d["kind"], d["from"], d["to"], d["reason"])
                   for d in scale.recent_decisions(key, MAX_DECISIONS)]
        view["decisions"] = tuple(sorted((*view["decisions"], *decided), key=lambda d: d.at)[-MAX_DECISIONS:])
    return found


def gateway_counts(gateway: "Gateway", models: Collection[str]) -> dict[str, Counts]:
    """``models``' counts as ``gateway`` sees them: the leader's control plane knows the replicas starting and
    asleep, and its autoscaler the arrivals and decisions; a follower knows the routed replicas only."""
    if not models:
        return {}
    control = gateway.control
    scaled: dict[str, dict[str, Any]] = {}
    if control is not None:
        listed: list[dict[str, Any]] = control.replicas_json()
        scaled = autoscaler_view(control, models)
    else:
        listed = [{"model": model, "state": r.state.value, "inflight": r.inflight}
                  for model in models for r in gateway.replicas.members(model)]
    counts = count_replicas(listed, models)
    return {model: Counts(ready=found["ready"], starting=found["starting"], draining=found["draining"],
                          inflight=found["inflight"],
                          queued=sum(q.requests for q in gateway.flow.queue.queued(model).values()),
                          **scaled.get(model, {}))
            for model, found in counts.items()}


class CapacityHistory:
    def __init__(self, read: Callable[[], Mapping[str, Counts]], interval: float = SAMPLE_INTERVAL,
                 size: int = SAMPLES, clock: Callable[[], float] = time.time):
        self.read = read
        self.interval = interval
        self.size = size
        self.clock = clock
        self._rings: dict[str, deque[tuple[float, Counts]]] = {}
        self._decisions: dict[str, deque[Decision]] = {}
        self._failing = False

    def record(self, at: float, counts: Mapping[str, Counts]) -> None:
        """One sample of every model in ``counts`` (the first :data:`MAX_DEPLOYMENTS` by name), and its decisions
        not kept yet; the others' rings are dropped."""
        kept = sorted(counts)[:MAX_DEPLOYMENTS]
        for model in set(self._rings) - set(kept):
            del self._rings[model]
            self._decisions.pop(model, None)
        for model in kept:
            self._rings.setdefault(model, deque(maxlen=self.size)).append((at, counts[model]))
            kept_decisions = self._decisions.setdefault(model, deque(maxlen=MAX_DECISIONS))
            newest = kept_decisions[-1].at if kept_decisions else float("-inf")
            kept_decisions.extend(d for d in counts[model].decisions
                                  if d.at > newest or (d.at == newest and d not in kept_decisions))

    def sample(self) -> None:
        try:
            counts = self.read()
        except Exception:  # a reading that fails must not end the sampler: said once, until it works again
            if not self._failing:
                log.exception("capacity history: reading the replicas' counts failed; the status page's chart "
                              "stops until it works again")
            self._failing = True
            return
        self._failing = False
        self.record(self.clock(), counts)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self.sample()
            await trio.sleep(self.interval)

    def to_json(self) -> dict[str, Any]:
        """Per model, its samples as columns: ``at`` (Unix seconds), then each of :data:`COLUMNS`; and its
        ``decisions`` (oldest first)."""
        deployments = []
        for model, ring in sorted(self._rings.items()):
            columns: dict[str, list] = {"at": [round(at, 1) for at, _ in ring]}
            for key in COLUMNS:
                columns[key] = [getattr(counts, key) for _, counts in ring]
            decisions = [{"at": d.at, "kind": d.kind, "from": d.before, "to": d.after, "reason": d.reason}
                         for d in self._decisions.get(model, ())]
            deployments.append({"model": model, **columns, "decisions": decisions})
        return {"interval_s": self.interval, "size": self.size, "deployments": deployments}
