"""The autoscaler on the leader: the loop that feeds the scaler and the counts the control plane runs.

:class:`Autoscaler` is the control plane's :class:`~llmgw.control.interfaces.ReplicaCounter`. For each autoscaled
deployment (``settings_of(deployment)`` says ``max_replicas > min_replicas``) it tells the control plane how many
replicas to run: ``scaler.desired(key, start)``, where ``start`` is what ran when this leader's control plane
began placing (the replicas it adopted, clamped to min..max: a new leader never starts from zero). During the
adoption window it asks for ``max_replicas``, so that every running replica can be adopted (nothing new is placed
in that window). Every ``interval`` it builds a :class:`~.model.DeploymentView` per deployment from the control
plane's assignments (ready, starting, draining, unplaceable), the free GPUs per class from the registered nodes,
and the :class:`~.interfaces.SignalSource`; hands them to ``scaler.decide``; logs and counts each decision
once (:class:`~.metrics.AutoscaleMetrics`) and asks for a reconcile when a count changed. The scaler itself is
pure (llmgw/autoscale/scaler.py); this module is its only caller in the product.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable

import trio

from ..control.fingerprint import profile_fingerprint
from ..control.reconciler import node_views
from ..logfields import log_fields
from ..wire import ShardState
from .gpus import free_gpus_of
from .interfaces import Scaler, SignalSource
from .metrics import AutoscaleMetrics
from .model import AutoscaleSettings, DeploymentView, ReplicaCounts, ScaleDecision

if TYPE_CHECKING:
    from ..config import Config
    from ..config.schema import Deployment
    from ..control.plane import ControlPlane

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 1.0
STEPS_UP = ("up", "from_zero", "take")
MAX_START_NOTES = 1000  # the scaler keeps 500 decisions by default: their notes outlive them a little


def autoscaled(config: "Config", settings_of: Callable[["Deployment"], AutoscaleSettings | None]
               ) -> dict[str, tuple["Deployment", AutoscaleSettings]]:
    """The config's autoscaled deployments by profile name (a profile that is autoscaled has one deployment)."""
    found = {}
    for deployment in config.deployments:
        settings = settings_of(deployment)
        if settings is not None and settings.autoscaled:
            found[deployment.profile] = (deployment, settings)
    return found


def autoscaled_models(config: "Config", settings_of: Callable[["Deployment"], AutoscaleSettings | None]
                      ) -> frozenset[str]:
    """The served model names of the autoscaled deployments: their requests wait for a replica (none may run)."""
    return frozenset(config.profile(key).served_model_name for key in autoscaled(config, settings_of))


def clamp(count: int, settings: AutoscaleSettings) -> int:
    return max(settings.min_replicas, min(settings.max_replicas, count))


class Autoscaler:
    def __init__(self, scaler: Scaler, settings_of: Callable[["Deployment"], AutoscaleSettings | None],
                 signals: SignalSource, metrics: AutoscaleMetrics,
                 interval: Callable[[], float] = lambda: DEFAULT_INTERVAL):
        """``interval()``: seconds between steps (read at each: a reload changes it)."""
        self.scaler = scaler
        self.settings_of = settings_of
        self.signals = signals
        self.metrics = metrics
        self.interval = interval
        self.started: dict[str, int] = {}  # key -> the replicas running when placing began (this term's start)
        self._asked: dict[str, int] = {}  # the counts last handed to the control plane
        self.views: dict[str, DeploymentView] = {}  # the last step's, for /admin/autoscale
        self._start_notes: OrderedDict[tuple, str] = OrderedDict()  # a step up's "woke ..." or "a cold start"

    # -- ReplicaCounter ------------------------------------------------------------------------------------------

    def counts(self, control: "ControlPlane") -> dict[str, int]:
        placing = trio.current_time() >= control.reconciler.place_after
        counts = {}
        for key, (_, settings) in autoscaled(control.config, self.settings_of).items():
            if not placing:
                counts[key] = settings.max_replicas  # adopt whatever runs; nothing new is placed yet
                continue
            if key not in self.started:
                running = running_replicas(control, key)
                self.started[key] = clamp(running, settings)
                log.info("autoscale: deployment %s starts from the %d replicas running (%d adopted or to adopt; "
                         "min %d, max %d)", key, self.started[key], running, settings.min_replicas,
                         settings.max_replicas, extra=log_fields(deployment=key))
            counts[key] = clamp(self.scaler.desired(key, self.started[key]), settings)
        self._asked = counts
        return counts

    def keep_warm(self, control: "ControlPlane", profile: str) -> float:
        found = autoscaled(control.config, self.settings_of).get(profile)
        return found[1].keep_warm if found is not None else 0.0

    def retire_reason(self, profile: str, count: int) -> str:
        return f"scaled down: autoscaled deployment {profile} runs {count} replica{'' if count == 1 else 's'}"

    async def run(self, control: "ControlPlane", *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(self.interval())
            try:
                self.step(control)
            except Exception:  # a bug in one step must not end the control plane: the next one tries again
                log.exception("autoscale: a step failed; the replica counts stay as they are until the next one")

    # -- one step ------------------------------------------------------------------------------------------------

    def step(self, control: "ControlPlane") -> list[ScaleDecision]:
        now = trio.current_time()
        if now < control.reconciler.place_after:
            return []  # the adoption window: the counts start from what is adopted
        deployments = autoscaled(control.config, self.settings_of)
        self.views = {key: self.view(control, key, settings, now) for key, (_, settings) in deployments.items()}
        forget = getattr(self.signals, "forget", None)
        if forget is not None:
            forget({view.model for view in self.views.values()})
        decisions = self.scaler.decide(now, list(self.views.values()), self.free_gpus(control))
        self.metrics.record([self._with_start_note(control, d) for d in decisions])
        before = dict(self._asked)
        counts = self.counts(control)
        self.metrics.observe(now, list(self.views.values()), counts,
                             {key: parked_replicas(control, key, asleep=True) for key in deployments})
        if counts != before:
            control.request_reconcile()
        return decisions

    def _with_start_note(self, control: "ControlPlane", decision: ScaleDecision) -> ScaleDecision:
        """A step up's reason says how its replicas start: woken from sleep (a hot start), or cold; kept for
        /admin/autoscale's ``start``."""
        if decision.kind not in STEPS_UP or decision.desired <= decision.current:
            return decision
        note = start_note(decision.desired - decision.current, parked_replicas(control, decision.key, asleep=True),
                          parked_replicas(control, decision.key))
        self._start_notes[_note_key(decision)] = note
        while len(self._start_notes) > MAX_START_NOTES:
            self._start_notes.popitem(last=False)
        return dataclasses.replace(decision, reason=f"{decision.reason}; {note}")

    def view(self, control: "ControlPlane", key: str, settings: AutoscaleSettings, now: float) -> DeploymentView:
        profile = control.config.profile(key)
        return DeploymentView(key=key, model=profile.served_model_name, settings=settings,
                              counts=replica_counts(control, key), desired=self._asked.get(key, settings.min_replicas),
                              gpus_per_replica=profile.gpus, gpu_class=profile.gpu_class,
                              signals=self.signals.signals(profile.served_model_name, now))

    def free_gpus(self, control: "ControlPlane") -> dict[str | None, int]:
        """Free GPUs on the nodes that take new replicas, in all (``None``) and per GPU class an autoscaled
        profile asks for."""
        nodes = control.inventory.nodes
        views = node_views(nodes, control.reconciler)
        for view in views:  # an engine kept warm gives its GPUs up as soon as a placement wants them
            view.used_gpus -= {i for sid, report in nodes[view.node_id].shards.items()
                               if sid in control.reconciler.parked for i in report.gpu_indices}
        return free_gpus_of(views, control.config)

    # -- reading it ----------------------------------------------------------------------------------------------

    def describe(self, control: "ControlPlane") -> dict[str, Any]:
        """``/admin/autoscale``'s deployments: bounds, counts, signals and their recent decisions."""
        deployments = {}
        for key, (_, settings) in autoscaled(control.config, self.settings_of).items():
            view = self.views.get(key)
            counts = replica_counts(control, key)
            entry: dict[str, Any] = {
                "model": control.config.profile(key).served_model_name, "min": settings.min_replicas,
                "max": settings.max_replicas, "desired": self._asked.get(key), "started_from": self.started.get(key),
                "ready": counts.ready, "starting": counts.starting, "draining": counts.draining,
                "unplaceable": counts.unplaceable, "sleeping": parked_replicas(control, key, asleep=True),
                "waking": waking_replicas(control, key), "signals": None,
                "decisions": [decision_json(d, self._start_notes.get(_note_key(d)))
                              for d in self.scaler.history(key)]}
            if view is not None:
                s = view.signals
                entry["signals"] = {"queued": s.queued, "queued_tokens": s.queued_tokens, "inflight": s.inflight,
                                    "arrivals_per_s": round(s.arrivals_per_s, 3),
                                    "served_per_s": round(s.served_per_s, 3),
                                    "served_per_replica_s": round(s.served_per_replica_s, 3), "kv_usage": s.kv_usage,
                                    "busy": None if s.busy is None else round(s.busy, 3),
                                    "ttft_attainment": s.ttft_attainment,
                                    "idle_s": None if s.last_request_at is None
                                    else round(max(0.0, s.at - s.last_request_at), 3)}
            deployments[key] = entry
        status = getattr(self.scaler, "status", None)  # llmgw's scaler says what it waits for; a stand-in may not
        waiting = status(trio.current_time()) if status is not None else {}
        for key, entry in deployments.items():
            entry["scaler"] = waiting.get("deployments", {}).get(key)
        return {"interval_s": self.interval(), "deployments": deployments, "move": waiting.get("move")}


    def recent_decisions(self, key: str, count: int) -> list[dict[str, Any]]:
        """Deployment ``key``'s newest ``count`` decisions as /admin/autoscale lists them, oldest first (the status
        page marks them)."""
        return [decision_json(d, self._start_notes.get(_note_key(d))) for d in self.scaler.history(key)[-count:]]

    def arrivals_per_s(self, key: str) -> float | None:
        """The arrivals the last step read for deployment ``key`` (None before its first step)."""
        view = self.views.get(key)
        return None if view is None else view.signals.arrivals_per_s


def running_replicas(control: "ControlPlane", key: str) -> int:
    """The replicas of deployment ``key`` that run now: those the control plane holds, and those a reachable node
    reports serving (not draining, not asleep) with the profile's fingerprint that it has not adopted yet (the
    adoption happens in the same reconcile pass that first asks for the counts after the adoption window)."""
    fingerprint = profile_fingerprint(control.config.profile(key))
    held = {a.replica_id for a in control.reconciler.active().values() if a.profile == key}
    reported = {report.replica_id for node in control.inventory.nodes.values() if node.reachable
                for sid, report in node.shards.items()
                if report.rank == 0 and report.state.alive
                and report.state not in (ShardState.DRAINING, ShardState.SLEEPING)
                and report.fingerprint == fingerprint and sid not in node.unproven
                and sid not in control.reconciler.parked and report.replica_id.startswith(f"{key}-")}
    return len(held | reported)


def parked_replicas(control: "ControlPlane", key: str, *, asleep: bool = False) -> int:
    """Replicas of deployment ``key`` scaled down and kept warm (unowned, unrouted): a step up adopts them;
    ``asleep``: only those whose engines sleep (sleep mode), which the adoption wakes."""
    fingerprint = profile_fingerprint(control.config.profile(key))
    return sum(1 for node in control.inventory.nodes.values() for sid, report in node.shards.items()
               if report.rank == 0 and sid in control.reconciler.parked
               and (report.state is ShardState.SLEEPING if asleep else report.state.alive)
               and report.fingerprint == fingerprint and report.replica_id.startswith(f"{key}-"))


def waking_replicas(control: "ControlPlane", key: str) -> int:
    """Replicas of deployment ``key`` wanted again and waking (counted as starting too)."""
    return sum(1 for a in control.reconciler.active().values() if a.profile == key
               and (report := control.inventory.shard(a.leader.node_id, a.leader.shard_id)) is not None
               and report.state is ShardState.WAKING)


def replica_counts(control: "ControlPlane", key: str) -> ReplicaCounts:
    """Deployment ``key``'s replicas as the control plane knows them: routable ones ready, the rest wanted
    starting (placed, or waiting to be), retiring ones draining, those no node fits unplaceable."""
    ready = starting = draining = 0
    for assignment in control.reconciler.assignments.values():
        if assignment.profile != key:
            continue
        if assignment.retiring:
            draining += 1
            continue
        replica = control.deployed.replica(assignment.replica_id, assignment.key)
        if replica is not None and replica.routable:
            ready += 1
        else:
            starting += 1
    active = control.reconciler.active()
    unplaceable = 0
    for replica_id, wanted in control.desired.items():
        if wanted.profile.name != key or replica_id in active:
            continue
        if replica_id in control.reconciler.unplaced:
            unplaceable += 1
        else:
            starting += 1  # wanted, not placed yet: it will start (pending-aware)
    return ReplicaCounts(ready=ready, starting=starting, draining=draining, unplaceable=unplaceable)


def decision_json(decision: ScaleDecision, start: str | None = None) -> dict[str, Any]:
    """A decision for /admin/autoscale; ``start``: how a step up's replicas start (:func:`start_note`)."""
    return {"at": round(decision.at, 3), "kind": decision.kind, "from": decision.current, "to": decision.desired,
            "reason": f"{decision.reason}; {start}" if start else decision.reason, "taken_from": decision.taken_from,
            "start": start}


def start_note(added: int, sleeping: int, parked: int) -> str:
    """How ``added`` replicas of a step up start when ``parked`` of the deployment's are kept warm, ``sleeping``
    of them asleep: those are adopted (the sleeping ones woken, the others as they run), the rest start cold."""
    woken = min(added, sleeping)
    warm = min(added - woken, parked - sleeping)
    cold = added - woken - warm
    parts = ([f"woke {woken} sleeping replica{'' if woken == 1 else 's'} (a hot start)"] if woken else []) + \
        ([f"adopted {_replicas(warm)} kept warm (a hot start)"] if warm else []) + \
        ([f"{cold} cold start{'' if cold == 1 else 's'}" if woken or warm or cold > 1 else "a cold start"]
         if cold else [])
    return " and ".join(parts)


def _replicas(count: int) -> str:
    return f"{count} replica{'' if count == 1 else 's'}"


def _note_key(decision: ScaleDecision) -> tuple:
    return decision.key, decision.at, decision.kind, decision.desired

