"""The control plane of one gateway: inventory, agent service, reconciler and deployed replicas, wired together.

:class:`ControlPlane` is the agent service's session handler: it records what
agents register and report (refusing reports about shards placed on another
node), and reconciles after every change and every ``RECONCILE_INTERVAL``:
the :class:`~llmgw.control.reconciler.Reconciler` decides, this class carries
the actions out (commands to agents' sessions, log lines, metrics) and keeps
the replica set in step (:class:`~llmgw.control.deployed.DeployedReplicas`).

It is built from narrow parts, never the gateway: the
:class:`~llmgw.control.interfaces.ReplicaTable` its deployed replicas go into
(the router's :class:`~llmgw.router.replicas.ReplicaSet`), the
:class:`~llmgw.control.interfaces.KvWriter` the agents' KV changes go into (the
router's :class:`~llmgw.kv.index.KvIndex`), the plugin registry and the
metrics registry.

After a start, nothing new is placed for ``heartbeat_interval + 1`` seconds
(agents reconnect at least that often), so the engines that survived a
control-plane restart are adopted rather than started twice; during that
window a request that finds no routable replica of its model waits for one
(:meth:`ControlPlane.wait_for_replica`) instead of being refused. Without a
join token only the embedded agent can join, and there is no such wait. The
window ends early once nothing can be waiting for adoption
(:meth:`ControlPlane.nothing_to_adopt`): every node that ever joined (the
identity store) has registered again, or, outside a cluster, none ever joined
and no agent reports a running shard (a fresh start).

Nodes prove who they are (:mod:`llmgw.control.identity`): every StartShard to
a remote node carries a placement proof for that node, and a report of a
shard no assignment owns (one to adopt) is recorded as *unproven*, never
adopted and stopped, unless its proof checks out for the node reporting it
(refusals counted in ``llmgw_agent_refused_total{reason="unproven_shard"}``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import TYPE_CHECKING

import trio

from .. import wire
from ..kv.index import refusal_reason
from ..kv.metrics import KvMetrics
from ..logfields import log_fields
from ..router.replicas import DEPLOYED
from ..wire.liveness import adoption_window
from .agent_service import AgentService, AgentSession, SessionSettings, send_error
from .deployed import DeployedReplicas
from .fingerprint import profile_fingerprint
from .identity import MAX_NODE_ID, NodeIdentities, default_control_state_dir
from .inventory import Inventory
from .metrics import ControlMetrics
from .reconciler import (
    Action,
    Adopt,
    Assignment,
    Command,
    DesiredReplica,
    Reconciler,
    Unplaceable,
    desired_replicas,
    place_with_plan_all,
)
from .report_check import REFUSE_INVALID, ReportCheck

if TYPE_CHECKING:
    from ..config import Config
    from ..wire.channel import Channel
    from .interfaces import KvWriter, ReplicaCounter, ReplicaTable

log = logging.getLogger(__name__)

RECONCILE_INTERVAL = 5.0
ADOPTION_CHECK = 0.05  # seconds between checks whether the adoption window can end early (a cheap look)
REFUSE_FOREIGN = "foreign_shard"
REFUSE_UNPROVEN = "unproven_shard"


class ControlPlane:
    def __init__(self, replicas: "ReplicaTable", kv_index: "KvWriter", registry, metrics_registry, config: "Config",
                 placement_key: bytes | None = None, previous_placement_key: bytes | None = None):
        """``placement_key``: a cluster's (every candidate derives the same), instead of one kept on disk;
        ``previous_placement_key``: the one of its previous secret, during a rotation (proofs made with it are
        accepted, and issued anew with the current key)."""
        self.replicas = replicas
        self.kv_index = kv_index
        self.id = uuid.uuid4().hex[:12]
        self.metrics = ControlMetrics.for_registry(metrics_registry)
        self.kv_metrics = KvMetrics.for_registry(metrics_registry)
        self._kv_refusals_told: set[tuple[str, str, str]] = set()
        self._unproven_told: set[tuple[str, str]] = set()  # (node, shard): logged and told once per session
        self._invalid_told: set[tuple[str, str]] = set()  # (node, problem): logged and told once per session
        self.reports = ReportCheck(own_ports=(config.listen.port, config.control_listen.port))
        self.inventory = Inventory(on_change=self.request_reconcile, metrics=self.metrics)
        self.identities = NodeIdentities(config.agents.control_state_dir or default_control_state_dir(),
                                         placement_key=placement_key,
                                         previous_placement_key=previous_placement_key)
        self.agents = AgentService(self.inventory, self, SessionSettings.from_config(config.agents),
                                   identities=self.identities, metrics=self.metrics, control_plane_id=self.id,
                                   reports=self.reports)
        self.reconciler = Reconciler(place_with_plan_all)
        self.deployed = DeployedReplicas(replicas, registry, self._released,
                                         on_failure=self.metrics.replica_build_failures.inc)
        self.config = config
        self.desired: dict[str, DesiredReplica] = {}
        # Sizes the autoscaled deployments (on the leader; set before run): llmgw.autoscale's Autoscaler.
        self.scale: ReplicaCounter | None = None
        self._held: tuple[str, ...] = ()  # the profiles declared for the scale, with or without replicas
        self._wake = trio.Event()
        self._running = False
        kv_index.add_resync_listener(self._ask_kv_resync)

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def wait_for_replica(self, model: str, poll: float = 0.05) -> bool:
        """Whether a routable replica of ``model`` appeared, waiting at most until the adoption window ends.

        The data plane calls it for a request that found none: right after a restart the engines still run,
        but their agents have not reconnected yet, so the request waits for them rather than getting a 503.
        """
        if trio.current_time() >= self.reconciler.place_after:
            return False
        found = False
        with trio.move_on_at(self.reconciler.place_after):
            while not any(replica.routable for replica in self.replicas.members(model)):
                await trio.sleep(poll)
            found = True
        self.metrics.requests_held.labels(model, "routed" if found else "none").inc()
        return found

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        remote = bool(SessionSettings.from_config(self.config.agents).join_tokens)
        grace = adoption_window(self.config.agents.heartbeat_interval) if remote else 0.0
        started = trio.current_time()
        self.reconciler.place_after = started + grace
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.agents.run)
                await nursery.start(self.deployed.run)
                if self.scale is not None:
                    scale = self.scale
                    self.reconciler.unwanted_reason = self._unwanted_reason
                    self.reconciler.keep_warm = lambda assignment: scale.keep_warm(self, assignment.profile)
                    await nursery.start(self.scale.run, self)
                self._running = True
                self.apply_config(self.config)
                task_status.started()
                if grace:
                    log.info("waiting up to %gs for agents to report running shards before placing new ones", grace)
                    nursery.start_soon(self._end_adoption_window, started)
                while True:
                    with trio.move_on_after(RECONCILE_INTERVAL):
                        await self._wake.wait()
                    self._wake = trio.Event()
                    try:
                        self.reconcile()
                    except Exception:  # a bug in one pass must not stop the gateway: the next pass tries again
                        self.metrics.reconcile_failures.inc()
                        log.exception("a reconcile pass failed; the control plane carries on")
        finally:
            self.freeze()  # over (its term ended): nothing it still holds may command an agent

    async def _end_adoption_window(self, started: float) -> None:
        """Reconcile when the adoption window ends: at its deadline, or earlier, as soon as nothing can be waiting
        for adoption (checked every ``ADOPTION_CHECK`` seconds)."""
        while trio.current_time() < self.reconciler.place_after:
            why = self.nothing_to_adopt()
            if why is not None:
                self.reconciler.place_after = trio.current_time()
                log.info("placing now, %.2fs after the start, not at the adoption window's end: %s",
                         self.reconciler.place_after - started, why)
                break
            await trio.sleep_until(min(self.reconciler.place_after, trio.current_time() + ADOPTION_CHECK))
        self.request_reconcile()

    def nothing_to_adopt(self) -> str | None:
        """Why no engine can be waiting for adoption any more; None while one may be.

        The embedded agent (when configured) must have registered: its ledger's engines are in its Register.
        Then either every node in the identity store (each node that ever joined) has registered again, or the
        store is empty and no registered node reports a shard: a fresh start, nothing placed before. In a cluster
        only the first holds (a node may have joined another leader, and Redis may have lost its identity)."""
        nodes = self.inventory.nodes
        agents = self.config.agents
        if agents.embedded:
            node = nodes.get(agents.embedded_node_id)
            if node is None or not node.reachable:
                return None
        known = self.identities.node_ids()
        if known:
            if all(n in nodes and nodes[n].reachable for n in known):
                return f"every node that joined before ({len(known)}) has registered again"
            return None
        if self.config.state.shared or any(node.shards for node in nodes.values()):
            return None
        return "a fresh start: no node joined before (no identity stored) and no agent reports a running shard"

    def apply_config(self, config: "Config") -> None:
        """Take a (re)loaded config: new desired replicas, models, agent settings; reconciled at once."""
        self.config = config
        self.agents.settings = SessionSettings.from_config(config.agents)
        self._take_desired(force=True)
        self.request_reconcile()

    def _take_desired(self, *, force: bool = False) -> None:
        """The desired replicas: the config's deployments, at the scale's counts for those it sizes; the models
        declared anew when the set of replicas changed (or ``force``: a new config)."""
        counts = self.scale.counts(self) if self.scale is not None else None
        desired = desired_replicas(self.config, profile_fingerprint, counts)
        held = tuple(sorted(counts or ()))
        if force or desired.keys() != self.desired.keys() or held != self._held:
            self.desired, self._held = desired, held
            self.deployed.configure_models(desired, [self.config.profile(name) for name in held])
        else:
            self.desired = desired

    def _unwanted_reason(self, assignment: Assignment) -> str:
        counts = self.scale.counts(self) if self.scale is not None else {}
        if assignment.profile in counts:
            assert self.scale is not None
            return self.scale.retire_reason(assignment.profile, counts[assignment.profile])
        return "no longer in the config's deployments"

    def freeze(self) -> None:
        """Stop reconciling and commanding agents for good (the gateway is stopping its embedded engines on exit,
        or this control plane's run ended with its term)."""
        self._running = False

    def closing(self) -> None:
        """The gateway is stopping: sessions that end from now on are no news (logged quietly)."""
        self.inventory.closing = True

    # -- agents' connections -------------------------------------------------------------------------------------

    async def accept_in_process(self, channel: "Channel") -> None:
        """Serve an in-process agent's channel (the embedded agent: trusted)."""
        await self.agents.accept_in_process(channel)

    def forget_node(self, node_id: str) -> bool:
        """Drop a node's identity (``POST /admin/nodes/ID/forget``); False when no such node is known."""
        return self.agents.forget(node_id)

    def request_reconcile(self) -> None:
        self._wake.set()

    # -- reconciling ---------------------------------------------------------------------------------------------

    def reconcile(self) -> list[Action]:
        if not self._running:
            return []
        if self.scale is not None:
            self._take_desired()
        nodes = self.inventory.nodes
        actions = self.reconciler.plan(self.desired, nodes, now=trio.current_time(), wall_ms=int(time.time() * 1000))
        for action in actions:
            self._carry_out(action)
            if isinstance(action, Adopt) and action.assignment is not None:
                self._prove_adopted(action.assignment)
        self._sync_routing()
        self._forget_stopped_strays()
        return actions

    def _carry_out(self, action: Action) -> None:
        self.metrics.reconcile_actions.labels(action.kind).inc()
        if isinstance(action, Unplaceable):
            if action.first:
                self.metrics.placement_failures.inc()
            log.warning("%s", action.describe(), extra=log_fields(**action.fields()))
            return
        # A StartShard carries out the Place or Adopt just logged; the agent logs the engine it spawns.
        starts = isinstance(action, Command) and isinstance(action.message, wire.StartShard)
        log.log(logging.DEBUG if starts else logging.INFO, "%s", action.describe(),
                extra=log_fields(**action.fields()))
        if isinstance(action, Command):
            node = self.inventory.nodes.get(action.node_id)
            session = node.session if node is not None else None
            assert action.message is not None
            if session is None or not session.post(self._with_proof(node, action.message)):
                log.warning("could not send %s to %s: its session is gone (it is sent again when it reconnects)",
                            action.kind, action.node_id, extra=log_fields(**action.fields()))

    def _with_proof(self, node, message: wire.Message) -> wire.Message:
        """A StartShard for a remote node carries the proof that it was placed there (for its adoption later)."""
        if not isinstance(message, wire.StartShard) or node.session.trusted:
            return message
        return dataclasses.replace(message, placement_proof=self.identities.placement_proof(node.node_id, message))

    def _sync_routing(self) -> None:
        self.deployed.sync(list(self.reconciler.assignments.values()), self._leader_report, self._api_key)

    def _leader_report(self, assignment: Assignment) -> wire.ShardReport | None:
        return self.inventory.shard(assignment.leader.node_id, assignment.leader.shard_id)

    def _api_key(self, assignment: Assignment) -> str | None:
        desired = self.desired.get(assignment.replica_id)
        return desired.profile.api_key if desired is not None else None

    def _released(self, key: str) -> None:
        assignment = self.reconciler.assignments.get(key)
        if assignment is not None and not any(a.replica_id == assignment.replica_id and not a.retiring
                                              for a in self.reconciler.assignments.values()):
            self.kv_index.remove(assignment.replica_id)  # it left the replica set for good
        if self.reconciler.release(key):
            self.request_reconcile()

    def _forget_stopped_strays(self) -> None:
        owned = {slot.shard_id for a in self.reconciler.assignments.values() for slot in a.slots}
        for node_id, node in self.inventory.nodes.items():
            stopped = [sid for sid, report in node.shards.items()
                       if sid not in owned and report.state is wire.ShardState.STOPPED]
            if stopped:
                self.inventory.forget_shards(node_id, stopped)

    # -- the agent service's handler -----------------------------------------------------------------------------

    def on_register(self, session: AgentSession, register: wire.Register) -> AgentSession | None:
        reports = [r for r in register.shards
                   if self._valid_report(session, register.address, r) and self._own_shard(session, r.shard_id)]
        unproven = [r.shard_id for r in reports if not self._proven(session, r)]
        registered = self.inventory.register(dataclasses.replace(register, shards=reports), session, unproven)
        for report in reports:
            self._prove_anew(session, report)
        return registered

    def on_message(self, session: AgentSession, message: wire.Message) -> None:
        if isinstance(message, wire.ShardStatus):
            node = self.inventory.nodes.get(session.node_id)
            if node is not None and self._valid_report(session, node.address, message.shard) \
                    and self._own_shard(session, message.shard.shard_id):
                self.inventory.update_shard(session.node_id, message.shard, self._proven(session, message.shard))
                self._prove_anew(session, message.shard)
        elif isinstance(message, wire.KvChanges):
            self._hand_kv_changes(session, message)
        elif isinstance(message, wire.ErrorMessage):
            log.warning("node %s reports an error (%s) about %s: %s", session.node_id, message.code,
                        message.about or "-", message.message, extra=log_fields(node=session.node_id))
        else:
            session.post(wire.ErrorMessage(code="unexpected", message=f"{type(message).__name__} is not a message "
                                                                      "an agent sends"))

    def _hand_kv_changes(self, session: AgentSession, changes: wire.KvChanges) -> None:
        """KV-cache changes of a shard placed on the sender go to the router's KV index, under the replica id
        the control plane gave that shard; any other is refused and counted
        (``llmgw_kv_changes_refused_total{node,reason}``): ``unknown_replica`` (no such shard is placed),
        ``foreign_replica`` (placed on another node), ``replica_mismatch`` (the message names another replica).
        """
        owner = self.reconciler.owner(changes.shard_id)
        tried = (session.node_id, changes.shard_id, "adopt")
        if owner is None and tried not in self._kv_refusals_told \
                and self.inventory.shard(session.node_id, changes.shard_id) is not None:
            self._kv_refusals_told.add(tried)  # once per session: a stray's changes must not reconcile every 25 ms
            # A shard the node reported but the reconciler has not adopted yet (right after a control-plane
            # restart, the agent's FULL copy can arrive before the next reconcile): adopt it now, or the FULL
            # would be lost and the index would trust the deltas that follow.
            self.reconcile()
            owner = self.reconciler.owner(changes.shard_id)
        placed_on = owner[1].node_id if owner is not None else None
        reason = refusal_reason(changes, session.node_id, placed_on)
        if reason is None and owner is not None and changes.replica_id and changes.replica_id != owner[0].replica_id:
            reason = "replica_mismatch"
        if reason is not None or owner is None:  # refusal_reason refuses what is placed nowhere
            self._refuse_kv(session, changes, reason or "unknown_replica", placed_on)
            return
        assignment = owner[0]
        if assignment.retiring or changes.data_parallel_rank != 0:
            # A retiring replica is about to leave the index; other data-parallel ranks are not applied until
            # the data plane pins requests to a rank (their FULL copies would replace rank 0's keys).
            return
        # Applied whatever the model's tier is (the index is cheap to keep): a reload that switches the model to
        # kv_index then finds it up to date, not stale.
        self.kv_index.apply(assignment.replica_id, changes)

    def _ask_kv_resync(self, replica_id: str, mode: str, reason: str) -> None:
        """The router's index of ``replica_id`` drifted (:mod:`llmgw.kv.drift`): ask the agent running its leader
        shard for a resync (a replica this control plane did not place is not its business: static replicas
        resync their own subscription)."""
        if not self._running:
            return  # a control plane whose term is over commands no agent
        for assignment in self.reconciler.assignments.values():
            if assignment.replica_id == replica_id and not assignment.retiring:
                leader = assignment.leader
                node = self.inventory.nodes.get(leader.node_id)
                message = wire.KvResync(shard_id=leader.shard_id, replica_id=replica_id, mode=mode, reason=reason)
                if node is None or node.session is None or not node.session.post(message):
                    log.warning("could not ask node %s for a KV resync of replica %s: its session is gone (its "
                                "reconnect sends a full copy)", leader.node_id, replica_id,
                                extra=log_fields(node=leader.node_id, replica=replica_id))
                return

    def _refuse_kv(self, session: AgentSession, changes: wire.KvChanges, reason: str, placed_on: str | None) -> None:
        self.kv_metrics.changes_refused.labels(session.node_id, reason).inc()
        key = (session.node_id, changes.shard_id, reason)
        if key in self._kv_refusals_told:  # told once per session: the agent sends every 25 ms
            return
        self._kv_refusals_told.add(key)
        where = f"placed on node {placed_on}" if placed_on else "not placed by this control plane"
        message = (f"KV changes for shard {changes.shard_id} (replica {changes.replica_id or '?'}) refused: "
                   f"{reason}; the shard is {where}")
        log.warning("node %s (%s): %s", session.node_id, session.peer, message,
                    extra=log_fields(node=session.node_id, shard=changes.shard_id))
        session.post(wire.ErrorMessage(code=f"kv_{reason}", message=message, about=changes.shard_id))

    def on_end(self, session: AgentSession, reason: str) -> None:
        node = self.inventory.nodes.get(session.node_id)
        if node is not None and node.session is session:
            # The stream that fed this node's replicas' KV index is gone: they stay routable, but their index
            # is not trusted (the tree routes them) until the agent's FULL copy on reconnect.
            for assignment in self.reconciler.assignments.values():
                if assignment.leader.node_id == session.node_id:
                    self.kv_index.forget(assignment.replica_id)
        self._kv_refusals_told = {k for k in self._kv_refusals_told if k[0] != session.node_id}
        self._unproven_told = {k for k in self._unproven_told if k[0] != session.node_id}
        self._invalid_told = {k for k in self._invalid_told if k[0] != session.node_id}
        self.inventory.session_ended(session.node_id, session, reason)

    def _valid_report(self, session: AgentSession, node_address: str, report: wire.ShardReport) -> bool:
        """A shard report passes :mod:`llmgw.control.report_check` before it is recorded (so before anything is
        built from it); one that does not is refused: counted in ``llmgw_agent_refused_total{reason=
        "invalid_report"}``, logged and told to the node once per session and problem."""
        problem = self.reports.shard_problem(report, node_address)
        if problem is None:
            return True
        message = f"shard report refused: {problem}"
        about = report.shard_id[:MAX_NODE_ID]
        if (session.node_id, problem) in self._invalid_told:
            self.metrics.agent_refused.labels(REFUSE_INVALID).inc()
        else:
            self._invalid_told.add((session.node_id, problem))
            send_error(session, REFUSE_INVALID, message, about, count=lambda code, text: self.agents.refused(
                code, f"{text} ({session.peer})"))
        return False

    def _own_shard(self, session: AgentSession, shard_id: str) -> bool:
        """A node speaks only for the shards placed on it; a report about another node's shard is refused."""
        owner = self.reconciler.owner(shard_id)
        if owner is None or owner[1].node_id == session.node_id:
            return True
        message = f"shard {shard_id} is placed on node {owner[1].node_id}, not on {session.node_id}"
        self.agents.refused(REFUSE_FOREIGN, f"node {session.node_id} ({session.peer}): refused: {message}")
        session.post(wire.ErrorMessage(code=REFUSE_FOREIGN, message=message, about=shard_id))
        return False

    def _proven(self, session: AgentSession, report: wire.ShardReport) -> bool:
        """A report may be adopted: the shard is placed on this node, the node is this process's own, or the
        report's placement proof checks out for this node. Otherwise it is recorded as unproven (not adopted,
        stopped) and the refusal counted and told, for a live shard."""
        if session.trusted or self.reconciler.owner(report.shard_id) is not None \
                or self.identities.proven(session.node_id, report):
            return True
        if report.state.alive:
            self.metrics.agent_refused.labels(REFUSE_UNPROVEN).inc()
            if (session.node_id, report.shard_id) not in self._unproven_told:  # a node may repeat it every status
                self._unproven_told.add((session.node_id, report.shard_id))
                message = (f"shard {report.shard_id} (replica {report.replica_id or '?'}) has no valid placement "
                           f"proof for node {session.node_id}: it is not adopted")
                log.warning("node %s (%s): refused: %s", session.node_id, session.peer, message,
                            extra=log_fields(node=session.node_id, shard=report.shard_id))
                session.post(wire.ErrorMessage(code=REFUSE_UNPROVEN, message=message, about=report.shard_id))
        return False

    def _prove_adopted(self, assignment: Assignment) -> None:
        """The shards of an assignment just adopted (their reports came before: the plane did not own them yet)."""
        for slot in assignment.slots:
            node = self.inventory.nodes.get(slot.node_id)
            report = node.shards.get(slot.shard_id) if node is not None else None
            if node is not None and node.session is not None and report is not None:
                self._prove_anew(node.session, report)

    def _prove_anew(self, session: AgentSession, report: wire.ShardReport) -> None:
        """A shard this plane owns whose proof was made with the previous cluster secret's key gets one made with
        the current key (its StartShard again, same generation: the agent keeps the proof, the engine runs on),
        so that dropping the previous secret costs no adoption later."""
        if session.trusted or not report.state.alive or not self.identities.proven_by_previous(session.node_id,
                                                                                                report):
            return
        owner = self.reconciler.owner(report.shard_id)
        desired = self.desired.get(owner[0].replica_id) if owner is not None else None
        if owner is None or desired is None or owner[0].generation != report.generation or owner[0].retiring:
            return
        proof = self.identities.placement_proof(session.node_id, report)
        message = dataclasses.replace(self.reconciler.start_message(desired, *owner), placement_proof=proof)
        if session.post(message):
            self.metrics.proofs_reissued.inc()
            log.info("node %s: shard %s's placement proof was made with the previous cluster secret: issued anew "
                     "with the current one", session.node_id, report.shard_id,
                     extra=log_fields(node=session.node_id, shard=report.shard_id))

    # -- views for the admin API ---------------------------------------------------------------------------------

    def nodes_json(self) -> list[dict]:
        nodes = self.inventory.nodes
        return [self.inventory.node_json(nodes[n], self.reconciler.used_gpus(n, nodes)) for n in sorted(nodes)]

    def kv_fed(self) -> list[str]:
        """The deployed replicas in routing whose profile has KV events (their agents relay them)."""
        return [replica_id for replica_id in self.deployed.routed
                if replica_id in self.desired and self.desired[replica_id].profile.kv_events]

    def replicas_json(self) -> list[dict]:
        """Every deployed replica: placed ones with their shards, then the ones waiting for a placement."""
        entries = []
        seen = set()
        for assignment in sorted(self.reconciler.assignments.values(), key=lambda a: (a.replica_id, a.generation)):
            seen.add(assignment.replica_id)
            entries.append(self._assignment_json(assignment))
        now = trio.current_time()
        for replica_id in sorted(set(self.desired) - seen):
            wanted = self.desired[replica_id]
            reasons = self.reconciler.unplaced.get(replica_id)
            if reasons is not None:
                state, reason = "unplaced", "; ".join(f"{n}: {r}" for n, r in reasons) or "no nodes"
            elif not self.inventory.nodes:
                state, reason = "pending", "no node has registered yet"
            elif now < self.reconciler.place_after:
                state, reason = "pending", "waiting for agents to report running shards"
            else:
                state, reason = "pending", "not placed yet"
            entries.append({"name": replica_id, "replica_id": replica_id, "model": wanted.model, "url": "",
                            "source": DEPLOYED, "state": state, "reason": reason, "profile": wanted.profile.name,
                            "node": None, "generation": None, "shards": []})
        return entries

    def _assignment_json(self, assignment: Assignment) -> dict:
        routed = self.deployed.replica(assignment.replica_id, assignment.key)
        shards = []
        for slot in assignment.slots:
            report = self.inventory.shard(slot.node_id, slot.shard_id)
            node = self.inventory.nodes.get(slot.node_id)
            shards.append({
                "shard_id": slot.shard_id, "node": slot.node_id, "rank": slot.rank,
                "gpu_indices": list(slot.gpu_indices), "gpu_uuids": list(slot.gpu_uuids),
                "leader_address": assignment.leader_address, "leader_port": assignment.leader_port,
                "state": report.state.value if report is not None else "unknown",
                "pid": report.pid if report is not None else 0,
                "reason": report.reason if report is not None else "not reported yet",
                "endpoint": report.endpoint if report is not None else "",
                "restarts": report.restarts if report is not None else 0,
                "node_state": node.state.value if node is not None else "unknown",
            })
        if routed is not None:
            body = self.replicas.describe(routed)
        else:
            leader = shards[0]
            state = "retiring" if assignment.retiring else "starting"
            body = {"name": assignment.replica_id, "model": assignment.model, "url": leader["endpoint"],
                    "source": DEPLOYED, "state": state,
                    "reason": assignment.retiring or f"leader shard is {leader['state']}", "inflight": 0,
                    "inflight_tokens": 0, "local_inflight": 0, "local_inflight_tokens": 0, "peer_inflight": 0,
                    "peer_inflight_tokens": 0, "served": 0, "consecutive_failures": 0, "labels": {}}
        body.update({"replica_id": assignment.replica_id, "profile": assignment.profile,
                     "node": assignment.leader.node_id,
                     "generation": assignment.generation, "origin": assignment.origin,
                     "retiring": assignment.retiring, "leader_address": assignment.leader_address,
                     "shards": shards})
        return body
