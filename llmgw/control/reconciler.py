"""The reconciler: desired replicas (the config's deployments) against observed shards (what agents report).

:meth:`Reconciler.plan` is pure bookkeeping: given the desired replicas and the
inventory's nodes, it updates its *assignments* (replicas placed on nodes at a
generation) and returns the actions that bring the cluster closer to the
config, in a stable order, each with its reason. It sends nothing itself; the
control plane carries the actions out. Running it again with nothing new
returns nothing: every command is sent at most once per agent session (a
reconnected agent's Register says what it still runs, and what is missing is
asked for again).

The rules, in order:

1. An assignment nobody wants any more (deployment removed, replicas lowered,
   profile changed) is *retired*: taken out of routing gracefully by the
   control plane, then its shards are drained (or stopped when it never
   served).
2. A desired replica without an assignment *adopts* a complete gang of
   reported shards with its profile fingerprint, on the nodes and GPUs they
   run on (no restart). A replica whose own assignment has never served
   gives way to a reported copy that is serving (the control plane restarted
   and placed it before the node holding it reconnected); one that has served
   never does: a report cannot re-point a replica to another node's endpoint
   when its engine crashes. Shards whose placement the control plane could
   not verify (``NodeRecord.unproven``, see :mod:`llmgw.control.identity`) are
   never adopted.
3. The rest are *placed* (``placement.plan_all``, existing placements kept),
   but only ``place_after`` (the start-up grace, so agents can reconnect and
   report what runs before anything new is started).
4. Each assigned shard a reachable node does not run is *started*; each shard
   of a released retiring assignment is *drained* or *stopped*; each shard a
   node reports that no assignment owns (stale generation, stale fingerprint,
   unwanted replica, incomplete gang) is *stopped*.

Nothing is done about nodes that are not reachable: their shards keep their
last known state, and the router keeps probing them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Mapping

from .. import wire
from ..logfields import log_fields
from .fingerprint import profile_kv_key_mode
from .inventory import NodeRecord, NodeState

log = logging.getLogger(__name__)

DRAIN_TIMEOUT = 600.0  # what an agent waits for an engine's own in-flight requests after the router let go
STOP_GRACE = 30.0  # SIGTERM to SIGKILL
SLEEP_TIMEOUT = 120.0  # each HTTP call of a SleepShard: level 1 copies the weights to CPU memory first
SLEEP_LEVEL = 1  # weights offloaded to CPU memory, KV cache dropped: the same model wakes from it


# -- desired state ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DesiredReplica:
    replica_id: str
    profile: Any  # llmgw.config.Profile
    deployment: Any  # llmgw.config.Deployment
    fingerprint: str

    @property
    def model(self) -> str:
        return self.profile.served_model_name


def desired_replicas(config, fingerprint: Callable[[Any], str],
                     counts: Mapping[str, int] | None = None) -> dict[str, DesiredReplica]:
    """Every replica the config's deployments ask for, by id (placement's numbering: ``"{profile}-{i}"``);
    ``counts``: the replicas of autoscaled deployments by profile name, instead of the config's ``replicas``."""
    from .placement import replica_ids

    return {replica_id: DesiredReplica(replica_id, config.profile(deployment.profile), deployment,
                                       fingerprint(config.profile(deployment.profile)))
            for deployment, replica_id in replica_ids(config.deployments, counts)}


def shard_profile(profile) -> wire.ShardProfile:
    """A config profile as the wire carries it to agents."""
    return wire.ShardProfile(
        name=profile.name, engine=profile.engine, engine_bin=profile.engine_bin, model_path=profile.model_path,
        served_model_name=profile.served_model_name, tp=profile.tp, pp=profile.pp, args=list(profile.args),
        env=dict(profile.env), lora_adapters=[wire.LoraModule(a.name, a.path) for a in profile.lora_adapters],
        kv_events=profile.kv_events, kv_key_mode=profile_kv_key_mode(profile), startup_timeout=profile.startup_timeout,
        scheduling_policy=profile.scheduling_policy, sleep_mode=profile.sleep_mode,
        long_prefill_token_threshold=profile.long_prefill_token_threshold or 0)


# -- assignments ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardSlot:
    """One rank of an assignment: where it runs and under which id."""

    shard_id: str
    node_id: str
    rank: int
    gpu_indices: tuple[int, ...]
    gpu_uuids: tuple[str, ...]


def shard_id_of(replica_id: str, generation: int, rank: int) -> str:
    return f"{replica_id}-g{generation}-r{rank}"


@dataclass
class Assignment:
    """A replica placed (or adopted) on nodes at one generation; rank 0 is the leader and the endpoint."""

    replica_id: str
    profile: str
    model: str
    fingerprint: str
    generation: int
    slots: list[ShardSlot]
    leader_address: str = ""
    leader_port: int = 0
    origin: str = "placed"  # or "adopted"
    retiring: str = ""  # why it is being taken down; "" while it is wanted
    drain: bool = True  # retire by DrainShard (it served) rather than StopShard
    released: bool = False  # the router let go of it: its shards may be told to stop
    served: bool = False  # its leader was Ready once: no reported copy replaces it
    keep_warm: float = 0.0  # retiring: once out of routing, its engine is kept running this long (parked), not drained
    sleep_mode: bool = False  # its profile runs the engine with sleep mode: parked, it sleeps; adopted asleep, it wakes

    @property
    def key(self) -> str:
        return f"{self.replica_id}@{self.generation}"

    @property
    def leader(self) -> ShardSlot:
        return self.slots[0]

    @property
    def node_ids(self) -> list[str]:
        return [slot.node_id for slot in self.slots]


# -- actions ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    kind: ClassVar[str] = ""
    reason: str

    def describe(self) -> str:
        raise NotImplementedError

    def fields(self) -> dict[str, str | int | None]:
        """What the action is about, as log fields (``node``, ``shard``, ``replica``, ``generation``)."""
        return {}


@dataclass(frozen=True)
class Command(Action):
    """Send ``message`` (StartShard, StopShard, DrainShard, SleepShard or WakeShard) to ``node_id``."""

    node_id: str = ""
    message: wire.StartShard | wire.StopShard | wire.DrainShard | wire.SleepShard | wire.WakeShard | None = None

    @property
    def kind(self) -> str:  # type: ignore[override]
        return {wire.StartShard: "start", wire.StopShard: "stop", wire.DrainShard: "drain", wire.SleepShard: "sleep",
                wire.WakeShard: "wake"}[type(self.message)]

    def describe(self) -> str:
        assert self.message is not None  # every command carries one (the default only orders the fields)
        extra = ""
        if isinstance(self.message, wire.StartShard):
            extra = f" on GPUs {list(self.message.gpu_indices)}"
        return f"{self.kind} shard {self.message.shard_id} on {self.node_id}{extra}: {self.reason}"

    def fields(self) -> dict[str, str | int | None]:
        assert self.message is not None
        replica = self.message.replica_id if isinstance(self.message, wire.StartShard) else None
        return {"node": self.node_id, "shard": self.message.shard_id, "replica": replica}


@dataclass(frozen=True)
class _OfAssignment(Action):
    """An action on one assignment (a replica's generation and its slots)."""

    assignment: Assignment | None = None

    def fields(self) -> dict[str, str | int | None]:
        a = self.assignment
        assert a is not None  # always given (the default only orders the fields)
        nodes = sorted(set(a.node_ids))
        return {"replica": a.replica_id, "generation": a.generation, "node": nodes[0] if len(nodes) == 1 else None}


@dataclass(frozen=True)
class Place(_OfAssignment):
    kind: ClassVar[str] = "place"

    def describe(self) -> str:
        a = self.assignment
        assert a is not None  # always given (the default only orders the fields)
        where = ", ".join(f"r{s.rank}@{s.node_id}{list(s.gpu_indices)}" for s in a.slots)
        return f"place replica {a.replica_id} (generation {a.generation}) on {where}: {self.reason}"


@dataclass(frozen=True)
class Adopt(_OfAssignment):
    kind: ClassVar[str] = "adopt"

    def describe(self) -> str:
        a = self.assignment
        assert a is not None  # always given (the default only orders the fields)
        return (f"adopt replica {a.replica_id} (generation {a.generation}) running on {', '.join(a.node_ids)}: "
                f"{self.reason}")


@dataclass(frozen=True)
class Retire(_OfAssignment):
    kind: ClassVar[str] = "retire"

    def describe(self) -> str:
        a = self.assignment
        assert a is not None  # always given (the default only orders the fields)
        how = "drain" if a.drain else "stop"
        return f"retire replica {a.replica_id} (generation {a.generation}, then {how} its shards): {self.reason}"


@dataclass(frozen=True)
class Unplaceable(Action):
    kind: ClassVar[str] = "unplaced"
    replica_id: str = ""
    reasons: tuple[tuple[str, str], ...] = ()  # (node id, why it was rejected)
    first: bool = True  # the replica was placeable (or new) until now

    def describe(self) -> str:
        why = "; ".join(f"{node}: {reason}" for node, reason in self.reasons) or "no nodes"
        return f"cannot place replica {self.replica_id}: {why}"

    def fields(self) -> dict[str, str | int | None]:
        return {"replica": self.replica_id}


# -- the reconciler ---------------------------------------------------------------------------------------------------


class Reconciler:
    def __init__(self, placer: Callable[..., Any], *, place_after: float = 0.0):
        """``placer(desired, nodes, reconciler, existing assignments)`` -> ``placement.PlanResult``; see
        :func:`place_with_plan_all`."""
        self.placer = placer
        self.place_after = place_after
        self.assignments: dict[str, Assignment] = {}  # by key
        self.unplaced: dict[str, tuple[tuple[str, str], ...]] = {}
        self._commanded: dict[str, tuple[str, int]] = {}  # shard id -> (command kind, session serial)
        self._last_generation = 0
        # Why a wanted replica's id left the desired set: the config dropped it, or an autoscaler scaled it down.
        self.unwanted_reason: Callable[[Assignment], str] = lambda a: "no longer in the config's deployments"
        # How long an unwanted replica's engine is kept warm (autoscaling's scale-down: a later step up adopts it).
        self.keep_warm: Callable[[Assignment], float] = lambda a: 0.0
        self.parked: dict[str, float] = {}  # shard id -> until when its engine is kept warm, unowned and unrouted

    # -- queries -------------------------------------------------------------------------------------------------

    def active(self) -> dict[str, Assignment]:
        """Wanted assignments by replica id."""
        return {a.replica_id: a for a in self.assignments.values() if not a.retiring}

    def owner(self, shard_id: str) -> tuple[Assignment, ShardSlot] | None:
        for assignment in self.assignments.values():
            for slot in assignment.slots:
                if slot.shard_id == shard_id:
                    return assignment, slot
        return None

    def used_gpus(self, node_id: str, nodes: Mapping[str, NodeRecord] | None = None) -> set[int]:
        """GPUs of ``node_id`` held by assignments, or by shards it reports that no assignment owns."""
        used = {i for a in self.assignments.values() for s in a.slots if s.node_id == node_id for i in s.gpu_indices}
        node = (nodes or {}).get(node_id)
        if node is not None:
            owned = self._owned_ids()
            for report in node.shards.values():
                if report.shard_id not in owned and report.state is not wire.ShardState.STOPPED:
                    used.update(report.gpu_indices)
        return used

    def release(self, key: str) -> bool:
        """The router let go of a retiring assignment; its shards may now be stopped."""
        assignment = self.assignments.get(key)
        if assignment is None or not assignment.retiring or assignment.released:
            return False
        assignment.released = True
        return True

    # -- planning ------------------------------------------------------------------------------------------------

    def plan(self, desired: Mapping[str, DesiredReplica], nodes: Mapping[str, NodeRecord], *, now: float,
             wall_ms: int) -> list[Action]:
        actions: list[Action] = []
        self._note_served(nodes)
        self._retire_unwanted(desired, actions)
        self._adopt(desired, nodes, actions)
        if now >= self.place_after:
            self._place(desired, nodes, wall_ms, actions)
        self._command_assigned(desired, nodes, actions, now)
        if now >= self.place_after:
            self._stop_strays(desired, nodes, actions, now)
        self._forget_finished(nodes)
        return actions

    def _retire(self, assignment: Assignment, reason: str, actions: list[Action], *, drain: bool = True) -> None:
        assignment.retiring = reason
        assignment.drain = drain
        actions.append(Retire(reason, assignment))

    def _note_served(self, nodes: Mapping[str, NodeRecord]) -> None:
        for assignment in self.assignments.values():
            if not assignment.served and self._leader_state(assignment, nodes) is wire.ShardState.READY:
                assignment.served = True

    def _retire_unwanted(self, desired: Mapping[str, DesiredReplica], actions: list[Action]) -> None:
        for assignment in self._sorted(self.assignments.values()):
            if assignment.retiring:
                continue
            wanted = desired.get(assignment.replica_id)
            if wanted is None:
                assignment.keep_warm = self.keep_warm(assignment)
                self._retire(assignment, self.unwanted_reason(assignment), actions)
            elif wanted.fingerprint != assignment.fingerprint:
                self._retire(assignment, f"profile {wanted.profile.name} changed (fingerprint "
                                         f"{assignment.fingerprint[:12]} -> {wanted.fingerprint[:12]})", actions)

    def _adopt(self, desired: Mapping[str, DesiredReplica], nodes: Mapping[str, NodeRecord],
               actions: list[Action]) -> None:
        gangs = self._reported_gangs(nodes)
        for replica_id in sorted(desired):
            wanted = desired[replica_id]
            candidates = [g for g in gangs.get(replica_id, []) if self._adoptable(wanted, g, nodes)]
            if not candidates:
                continue
            best = max(candidates, key=lambda g: (_leader_ready(g), g[0][1].generation))
            current = self.active().get(replica_id)
            if current is not None:
                if not _leader_ready(best) or current.served:
                    continue
                self._retire(current, f"a serving copy (generation {best[0][1].generation}) was reported: "
                                      "adopting it instead", actions, drain=False)
            assignment = self._assignment_from_reports(wanted, best, nodes)
            self.assignments[assignment.key] = assignment
            self.unplaced.pop(replica_id, None)
            warm = [self.parked.pop(slot.shard_id) for slot in assignment.slots if slot.shard_id in self.parked]
            if best[0][1].state is wire.ShardState.SLEEPING:
                why = "its engine sleeps since it was scaled down: woke it (a hot start)"
            elif warm:
                why = "its engine was kept warm since it was scaled down: a hot start"
            else:
                why = f"reported running with fingerprint {wanted.fingerprint[:12]}"
            actions.append(Adopt(why, assignment))

    def _reported_gangs(self, nodes: Mapping[str, NodeRecord]) -> dict[str, list[list[tuple[str, wire.ShardReport]]]]:
        """Unowned live shards reported by reachable nodes, grouped by (replica, generation), ranks in order."""
        owned = self._owned_ids()
        groups: dict[tuple[str, int], list[tuple[str, wire.ShardReport]]] = {}
        for node_id in sorted(nodes):
            node = nodes[node_id]
            if not node.reachable:
                continue
            for report in node.shards.values():
                if report.shard_id in owned or not report.state.alive or report.state is wire.ShardState.DRAINING \
                        or report.shard_id in node.unproven:
                    continue
                groups.setdefault((report.replica_id, report.generation), []).append((node_id, report))
        gangs: dict[str, list[list[tuple[str, wire.ShardReport]]]] = {}
        for (replica_id, _), members in sorted(groups.items()):
            gangs.setdefault(replica_id, []).append(sorted(members, key=lambda m: m[1].rank))
        return gangs

    def _adoptable(self, wanted: DesiredReplica, gang: list[tuple[str, wire.ShardReport]],
                   nodes: Mapping[str, NodeRecord]) -> bool:
        profile, placement = wanted.profile, wanted.deployment.placement
        if [report.rank for _, report in gang] != list(range(profile.nodes)):
            return False  # incomplete (or duplicated) gang: all ranks or none
        for node_id, report in gang:
            node = nodes[node_id]
            if report.fingerprint != wanted.fingerprint or report.node_count != profile.nodes:
                return False
            if placement.nodes and node_id not in placement.nodes:
                return False
            if any(node.register.labels.get(k) != v for k, v in placement.node_selector.items()):
                return False
            held = {i for a in self.assignments.values() for s in a.slots if s.node_id == node_id
                    for i in s.gpu_indices}
            if held & set(report.gpu_indices):
                return False
        return True

    def _assignment_from_reports(self, wanted: DesiredReplica, gang: list[tuple[str, wire.ShardReport]],
                                 nodes: Mapping[str, NodeRecord]) -> Assignment:
        slots = []
        for node_id, report in gang:
            by_index = {gpu.index: gpu.uuid for gpu in nodes[node_id].register.gpus}
            slots.append(ShardSlot(report.shard_id, node_id, report.rank, tuple(report.gpu_indices),
                                   tuple(by_index.get(i, "") for i in report.gpu_indices)))
        generation = gang[0][1].generation
        self._last_generation = max(self._last_generation, generation)
        return Assignment(wanted.replica_id, wanted.profile.name, wanted.model, wanted.fingerprint, generation, slots,
                          leader_address=nodes[gang[0][0]].address, leader_port=0, origin="adopted",
                          sleep_mode=wanted.profile.sleep_mode)

    def _place(self, desired: Mapping[str, DesiredReplica], nodes: Mapping[str, NodeRecord], wall_ms: int,
               actions: list[Action]) -> None:
        active = self.active()
        missing = {rid for rid in desired if rid not in active}
        for rid in list(self.unplaced):
            if rid not in missing:
                del self.unplaced[rid]
        if not missing or not nodes:
            return  # nothing to place, or no node registered yet: nothing could be placed
        result = self.placer(desired, nodes, self, {rid: a for rid, a in active.items() if rid in desired})
        for placed in sorted(result.placed, key=lambda p: p.replica_id):
            if placed.replica_id not in missing:
                continue
            wanted = desired[placed.replica_id]
            generation = self._next_generation(wall_ms)
            slots = [ShardSlot(shard_id_of(placed.replica_id, generation, s.rank), s.node_id, s.rank,
                               tuple(s.gpu_indices), tuple(s.gpu_uuids or ()))
                     for s in sorted(placed.shards, key=lambda s: s.rank)]
            leader = min(placed.shards, key=lambda s: s.rank)
            assignment = Assignment(placed.replica_id, wanted.profile.name, wanted.model, wanted.fingerprint,
                                    generation, slots, leader_address=leader.leader_address,
                                    leader_port=leader.leader_port, sleep_mode=wanted.profile.sleep_mode)
            self.assignments[assignment.key] = assignment
            self.unplaced.pop(placed.replica_id, None)
            missing.discard(placed.replica_id)
            actions.append(Place(f"deployment of profile {wanted.profile.name}: a cold start", assignment))
        for unplaced in sorted(result.unplaced, key=lambda u: u.replica_id):
            if unplaced.replica_id not in missing:
                continue
            reasons = tuple(sorted((str(k), str(v)) for k, v in (unplaced.reasons or {}).items()))
            if self.unplaced.get(unplaced.replica_id) != reasons:
                first = unplaced.replica_id not in self.unplaced
                self.unplaced[unplaced.replica_id] = reasons
                actions.append(Unplaceable("no node fits", unplaced.replica_id, reasons, first))

    def _command_assigned(self, desired: Mapping[str, DesiredReplica], nodes: Mapping[str, NodeRecord],
                          actions: list[Action], now: float) -> None:
        for assignment in self._sorted(self.assignments.values()):
            if assignment.retiring and not assignment.released:
                continue
            if assignment.retiring and assignment.keep_warm > 0 and self._park(assignment, nodes, now, actions):
                continue
            for slot in assignment.slots:
                node = nodes.get(slot.node_id)
                if node is None or not node.reachable:
                    continue
                report = node.shards.get(slot.shard_id)
                if not assignment.retiring:
                    if report is not None and report.state is wire.ShardState.SLEEPING:
                        if self._once(slot.shard_id, "wake", node.session_serial):
                            actions.append(Command(
                                f"replica {assignment.replica_id} is wanted again", slot.node_id,
                                wire.WakeShard(slot.shard_id, f"replica {assignment.replica_id} is wanted again",
                                               desired[assignment.replica_id].profile.startup_timeout)))
                        continue
                    if report is not None and report.state is not wire.ShardState.STOPPED:
                        continue
                    if assignment.origin == "adopted" and len(assignment.slots) > 1:
                        self._retire(assignment, f"rank {slot.rank} of the adopted gang is gone from "
                                                 f"{slot.node_id}: the gang restarts as a whole", actions, drain=False)
                        break
                    if self._once(slot.shard_id, "start", node.session_serial):
                        why = "not running on its node" if report is None else f"stopped ({report.reason})"
                        actions.append(Command(why, slot.node_id, self.start_message(
                            desired[assignment.replica_id], assignment, slot)))
                elif report is not None and report.state is not wire.ShardState.STOPPED:
                    drain = assignment.drain and report.state is not wire.ShardState.FAILED
                    kind = "drain" if drain else "stop"
                    if self._once(slot.shard_id, kind, node.session_serial):
                        message = (wire.DrainShard(slot.shard_id, assignment.retiring, DRAIN_TIMEOUT, STOP_GRACE)
                                   if drain else wire.StopShard(slot.shard_id, assignment.retiring, STOP_GRACE))
                        actions.append(Command(assignment.retiring, slot.node_id, message))

    def _park(self, assignment: Assignment, nodes: Mapping[str, NodeRecord], now: float,
              actions: list[Action]) -> bool:
        """Keep a released retiring assignment's engine running, unowned, for its ``keep_warm`` (a step up within
        it adopts it); True when parked. Only a whole gang whose leader is ready (or asleep) is parked. With
        ``sleep_mode`` the leader's engine is put to sleep (its GPU memory given up; vLLM's sleep reaches every
        rank); the adoption wakes it."""
        state = self._leader_state(assignment, nodes)
        if state not in (wire.ShardState.READY, wire.ShardState.SLEEPING):
            return False
        for slot in assignment.slots:
            self.parked[slot.shard_id] = now + assignment.keep_warm
        asleep = assignment.sleep_mode
        log.info("replica %s (generation %d) is kept warm for %gs: out of routing, its engine %s; a step up "
                 "within that time adopts it (a hot start), else it is stopped", assignment.replica_id,
                 assignment.generation, assignment.keep_warm, "is put to sleep" if asleep else "runs on",
                 extra=log_fields(replica=assignment.replica_id, generation=assignment.generation))
        del self.assignments[assignment.key]
        leader = assignment.leader
        node = nodes.get(leader.node_id)
        if asleep and state is wire.ShardState.READY and node is not None \
                and self._once(leader.shard_id, "sleep", node.session_serial):
            why = f"scaled down with keep_warm {assignment.keep_warm:g}s and sleep_mode: its GPU memory given up"
            actions.append(Command(why, leader.node_id, wire.SleepShard(leader.shard_id, why, SLEEP_LEVEL,
                                                                        SLEEP_TIMEOUT)))
        return True

    def _stop_strays(self, desired: Mapping[str, DesiredReplica], nodes: Mapping[str, NodeRecord],
                     actions: list[Action], now: float) -> None:
        owned = self._owned_ids()
        active = self.active()
        for node_id in sorted(nodes):
            node = nodes[node_id]
            if not node.reachable:
                continue
            for shard_id in sorted(node.shards):
                report = node.shards[shard_id]
                if shard_id in owned or report.state is wire.ShardState.STOPPED:
                    self.parked.pop(shard_id, None)
                    continue
                warm_until = self.parked.get(shard_id)
                if warm_until is not None and now < warm_until and not self.unplaced:
                    continue  # kept warm: stopped when its time is up, or at once when a replica cannot be placed
                if self._once(shard_id, "stop", node.session_serial):
                    why = ("its placement is not proven (not started by this control plane's StartShard)"
                           if shard_id in node.unproven
                           else "kept warm after a scale-down, " + (
                               "until a replica could not be placed (its GPUs are wanted)" if now < warm_until
                               else "and no step up adopted it in time") if warm_until is not None
                           else _why_stray(report, desired.get(report.replica_id), active.get(report.replica_id)))
                    actions.append(Command(why, node_id, wire.StopShard(shard_id, why, STOP_GRACE)))

    def _forget_finished(self, nodes: Mapping[str, NodeRecord]) -> None:
        for key, assignment in list(self.assignments.items()):
            if assignment.retiring and assignment.released and all(
                    _gone(nodes.get(slot.node_id), slot.shard_id) for slot in assignment.slots):
                log.info("replica %s (generation %d) is retired: every shard stopped", assignment.replica_id,
                         assignment.generation,
                         extra=log_fields(replica=assignment.replica_id, generation=assignment.generation))
                del self.assignments[key]
        known = self._owned_ids() | {sid for node in nodes.values() for sid in node.shards}
        for shard_id in list(self._commanded):
            if shard_id not in known:
                del self._commanded[shard_id]
        for shard_id in list(self.parked):
            if shard_id not in known:
                del self.parked[shard_id]

    # -- helpers -------------------------------------------------------------------------------------------------

    def start_message(self, wanted: DesiredReplica, assignment: Assignment, slot: ShardSlot) -> wire.StartShard:
        """The StartShard of ``slot`` (also sent again, same generation, to carry a new placement proof)."""
        profile = wanted.profile
        return wire.StartShard(
            shard_id=slot.shard_id, replica_id=assignment.replica_id, rank=slot.rank,
            node_count=len(assignment.slots), leader_address=assignment.leader_address,
            leader_port=assignment.leader_port, gpu_indices=list(slot.gpu_indices), gpu_uuids=list(slot.gpu_uuids),
            http_port=0, profile=shard_profile(profile), pool=wanted.deployment.pool or "",
            fingerprint=assignment.fingerprint, generation=assignment.generation,
            engine_api_key=profile.api_key or "", cpu_threads=profile.cpu_threads or 0)

    def _leader_state(self, assignment: Assignment, nodes: Mapping[str, NodeRecord]) -> wire.ShardState | None:
        node = nodes.get(assignment.leader.node_id)
        report = node.shards.get(assignment.leader.shard_id) if node is not None else None
        return report.state if report is not None else None

    def _once(self, shard_id: str, kind: str, session_serial: int) -> bool:
        """True (and remembered) unless ``kind`` was already sent for this shard on this session."""
        if self._commanded.get(shard_id) == (kind, session_serial):
            return False
        self._commanded[shard_id] = (kind, session_serial)
        return True

    def _owned_ids(self) -> set[str]:
        return {slot.shard_id for a in self.assignments.values() for slot in a.slots}

    def _next_generation(self, wall_ms: int) -> int:
        """Monotonic across control-plane restarts without a state file: wall-clock milliseconds, or one more."""
        self._last_generation = max(wall_ms, self._last_generation + 1)
        return self._last_generation

    @staticmethod
    def _sorted(assignments: Iterable[Assignment]) -> list[Assignment]:
        return sorted(assignments, key=lambda a: (a.replica_id, a.generation))


def _leader_ready(gang: list[tuple[str, wire.ShardReport]]) -> bool:
    return gang[0][1].state is wire.ShardState.READY


def _gone(node: NodeRecord | None, shard_id: str) -> bool:
    """The shard no longer runs, as far as a reachable node says (an unreachable node's shards are not gone)."""
    if node is None:
        return True
    if not node.reachable:
        return False
    report = node.shards.get(shard_id)
    return report is None or report.state is wire.ShardState.STOPPED


def _why_stray(report: wire.ShardReport, wanted: DesiredReplica | None, current: Assignment | None) -> str:
    if wanted is None:
        return f"replica {report.replica_id or '?'} is not in the config's deployments"
    if report.fingerprint != wanted.fingerprint:
        return f"runs an old profile (fingerprint {report.fingerprint[:12] or 'none'})"
    if current is not None and current.generation != report.generation:
        return f"stale generation {report.generation} (replica {report.replica_id} runs generation " \
               f"{current.generation})"
    return "an incomplete gang, or its GPUs are taken"


def schedulable(node: NodeRecord) -> bool:
    """New replicas go only to nodes that are connected (not suspect, not disconnected)."""
    return node.reachable and node.state is NodeState.CONNECTED


def node_views(nodes: Mapping[str, NodeRecord], reconciler: Reconciler) -> list:
    """Every known node as placement sees it (``placement.NodeView``s): its GPUs held by assignments or by shards
    it reports that no assignment owns marked used; only connected ones take new replicas."""
    from . import placement

    return [placement.NodeView.from_register(
        nodes[node_id].register, used_gpus=reconciler.used_gpus(node_id, nodes),
        schedulable=schedulable(nodes[node_id]),
        unschedulable_reason=f"{nodes[node_id].state.value}: {nodes[node_id].state_reason}")
        for node_id in sorted(nodes)]


def place_with_plan_all(desired: Mapping[str, DesiredReplica], nodes: Mapping[str, NodeRecord],
                        reconciler: Reconciler, existing: Mapping[str, Assignment]):
    """The default placer: :func:`llmgw.control.placement.plan_all` over every known node (only connected ones
    take new replicas), with the GPUs held by assignments and unowned shards marked used, and the existing
    assignments kept where they are."""
    from . import placement

    views = node_views(nodes, reconciler)
    profiles = {d.profile.name: d.profile for d in desired.values()}
    deployments = list({id(d.deployment): d.deployment for d in desired.values()}.values())
    kept = {}
    for replica_id, assignment in existing.items():
        shards = [placement.ShardPlacement(slot.node_id, slot.rank, list(slot.gpu_indices), list(slot.gpu_uuids),
                                           assignment.leader_address, assignment.leader_port)
                  for slot in assignment.slots]
        kept[replica_id] = placement.ReplicaPlacement(replica_id, assignment.profile, shards)
    wanted = [(d.deployment, replica_id) for replica_id, d in desired.items()]  # in the config's order
    return placement.plan_all(list(profiles.values()), deployments, views, existing=kept, wanted=wanted)
