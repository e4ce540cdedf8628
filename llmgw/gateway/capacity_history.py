"""The status page's replicas over time: per autoscaled deployment, a small bounded ring of this process's own
samples of its replicas (ready, starting) against its demand (requests queued here, in flight cluster-wide).

:class:`CapacityHistory` samples every ``interval`` seconds what ``read()`` says (the gateway's
:func:`gateway_counts`) and keeps the last ``size`` samples of at most :data:`MAX_DEPLOYMENTS` models; a model that
is no longer autoscaled leaves with its samples. ``GET /admin/capacity`` serves :meth:`CapacityHistory.to_json`
(docs/ui.md). :func:`count_replicas` reads replicas as ``/admin/replicas`` lists them, which is also how
``llmgw bench autoscale`` counts a fleet.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from .app import Gateway

log = logging.getLogger(__name__)

SAMPLE_INTERVAL = 2.0  # seconds between samples
SAMPLES = 300  # per deployment: ten minutes at SAMPLE_INTERVAL
MAX_DEPLOYMENTS = 64
ROUTABLE = ("up", "unknown")  # a replica in these states takes requests (unknown: not probed yet)
NOT_STARTING = (*ROUTABLE, "down", "draining", "retiring", "unplaced")  # any other state is on its way up


@dataclass(frozen=True, slots=True)
class Counts:
    ready: int = 0  # routable
    starting: int = 0  # placed or waiting to be, not routable yet
    queued: int = 0  # requests held in this gateway's flow queue
    inflight: int = 0  # requests routed and not finished, every gateway's


def count_replicas(listed: Iterable[Mapping[str, Any]], models: Collection[str]) -> dict[str, dict[str, int]]:
    """Per model of ``models``: its ``ready`` and ``starting`` replicas and their requests ``inflight``, from
    replicas listed as ``/admin/replicas`` lists them (a retiring replica counts as neither)."""
    counts = {model: {"ready": 0, "starting": 0, "inflight": 0} for model in models}
    for replica in listed:
        found = counts.get(replica.get("model", ""))
        if found is None or replica.get("retiring"):
            continue
        state = replica.get("state")
        if state in ROUTABLE:
            found["ready"] += 1
        elif state not in NOT_STARTING:
            found["starting"] += 1
        found["inflight"] += int(replica.get("inflight") or 0)
    return counts


def gateway_counts(gateway: "Gateway", models: Collection[str]) -> dict[str, Counts]:
    """``models``' counts as ``gateway`` sees them: the leader's control plane knows the replicas starting; a
    follower knows the routed ones only."""
    if not models:
        return {}
    control = gateway.control
    if control is not None:
        listed: list[dict[str, Any]] = control.replicas_json()
    else:
        listed = [{"model": model, "state": r.state.value, "inflight": r.inflight}
                  for model in models for r in gateway.replicas.members(model)]
    counts = count_replicas(listed, models)
    return {model: Counts(queued=sum(q.requests for q in gateway.flow.queue.queued(model).values()), **found)
            for model, found in counts.items()}


class CapacityHistory:
    def __init__(self, read: Callable[[], Mapping[str, Counts]], interval: float = SAMPLE_INTERVAL,
                 size: int = SAMPLES, clock: Callable[[], float] = time.time):
        self.read = read
        self.interval = interval
        self.size = size
        self.clock = clock
        self._rings: dict[str, deque[tuple[float, Counts]]] = {}
        self._failing = False

    def record(self, at: float, counts: Mapping[str, Counts]) -> None:
        """One sample of every model in ``counts`` (the first :data:`MAX_DEPLOYMENTS` by name); the others'
        rings are dropped."""
        kept = sorted(counts)[:MAX_DEPLOYMENTS]
        for model in set(self._rings) - set(kept):
            del self._rings[model]
        for model in kept:
            self._rings.setdefault(model, deque(maxlen=self.size)).append((at, counts[model]))

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
        """Per model, its samples as columns: ``at`` (Unix seconds), ``ready``, ``starting``, ``queued``,
        ``inflight``."""
        deployments = []
        for model, ring in sorted(self._rings.items()):
            columns: dict[str, list] = {"at": [round(at, 1) for at, _ in ring]}
            for key in ("ready", "starting", "queued", "inflight"):
                columns[key] = [asdict(counts)[key] for _, counts in ring]
            deployments.append({"model": model, **columns})
        return {"interval_s": self.interval, "size": self.size, "deployments": deployments}
