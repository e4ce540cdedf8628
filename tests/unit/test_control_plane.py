"""The control plane in-process: a real ReplicaSet, KvIndex, Router and static source, agents scripted over memory
channels (the same AgentService path the embedded agent takes). No Gateway, no subprocess."""

from __future__ import annotations

import dataclasses
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio
import trio.testing

from llmgw import wire
from llmgw.agent.discovery import discover
from llmgw.config import parse_config
from llmgw.control.plane import ControlPlane
from llmgw.control.static import StaticReplicas
from llmgw.kv.index import KvIndex
from llmgw.metrics import Metrics
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.health import HealthSettings, HealthTracker
from llmgw.router.replicas import DEPLOYED, STATIC, ReplicaSet
from llmgw.router.router import Router
from llmgw.wire.channel import ChannelClosed, memory_channel_pair

NODES = Path(__file__).resolve().parents[1] / "fixtures" / "nodes"
UNUSED = "http://127.0.0.1:9"  # the discard port: nothing listens, so probes fail fast (health is not under test)

STATIC_TINY = """
models:
  - name: tiny
    routing: round_robin
    replicas:
      - url: http://127.0.0.1:9
        name: ext-0
"""

DEPLOYED_TINY = """
profiles:
  - name: sim
    engine: sim
    model_path: tiny
    served_model_name: tiny
    routing: round_robin
deployments:
  - profile: sim
    replicas: 1
"""


JOIN_TOKEN = "a-join-token"


def remote_config(control_state_dir: Path, *parts: str):
    """Remote agents join with :data:`JOIN_TOKEN`; heartbeats every 0.2 s (adoption window: 1.2 s); the scripted
    agents send none, so silence is judged only after a minute."""
    return parse_config(f"""
agents:
  token: {JOIN_TOKEN}
  heartbeat_interval: 0.2s
  suspect_after: 60s
  disconnected_after: 120s
  control_state_dir: {control_state_dir}
""" + "".join(parts))


def config(*parts: str):
    return parse_config("agents: {embedded: true}\n" + "".join(parts))


@dataclass
class Parts:
    replicas: ReplicaSet
    kv_index: KvIndex
    router: Router
    static: StaticReplicas
    plane: ControlPlane
    metrics: Metrics

    def apply(self, cfg) -> None:
        """What Gateway.reload does with a new config."""
        self.static.apply(cfg)
        self.plane.apply_config(cfg)

    def refused(self, node: str, reason: str) -> float:
        return self.metrics.registry.get_sample_value("llmgw_kv_changes_refused_total",
                                                      {"node": node, "reason": reason}) or 0.0


@asynccontextmanager
async def control_plane(cfg, term: trio.CancelScope | None = None):
    """The parts, running; ``term``: the scope the control plane runs in (a cluster's term), cancelled by the test."""
    registry = build_registry(make_plugin_manager())
    metrics = Metrics()
    replicas = ReplicaSet(HealthTracker(HealthSettings(interval=60.0, timeout=1.0), metrics), metrics,
                          connect_timeout=1.0)
    kv_index = KvIndex()
    parts = Parts(replicas, kv_index, Router(registry, metrics, replicas, kv_index),
                  StaticReplicas(replicas, kv_index, registry, metrics.registry),
                  ControlPlane(replicas, kv_index, registry, metrics.registry, cfg), metrics)
    async with trio.open_nursery() as nursery:
        await nursery.start(replicas.run)
        await nursery.start(parts.static.run)
        parts.static.apply(cfg)
        await nursery.start(run_in, parts.plane.run, term or trio.CancelScope())
        yield parts
        nursery.cancel_scope.cancel()


async def run_in(run, scope: trio.CancelScope, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with scope:
        await run(task_status=task_status)


async def settled() -> None:
    """Every task (sessions, reconciler, drains) has done what the last message asked and waits again."""
    await trio.testing.wait_all_tasks_blocked()


class Agent:
    """One node's agent, scripted: registers, reads what the control plane sends, reports shards, sends KV changes."""

    def __init__(self, node_id: str, fixture: str):
        self.node_id = node_id
        self.register = discover(f"fixture:{NODES / fixture}.json", node_id=node_id, address="127.0.0.1")
        self.channel = None
        self.errors: list[wire.ErrorMessage] = []

    async def connect(self, plane: ControlPlane) -> None:
        self.channel, control_end = memory_channel_pair(f"agent {self.node_id}")
        await plane.accept_in_process(control_end)
        await self.channel.send(self.register)
        assert (await self.next(wire.Registered)).accepted

    def dial(self, plane: ControlPlane, nursery: trio.Nursery) -> None:
        """Connect as a remote agent does: the connection is served from a task of ``nursery`` (the control
        server's connection task, outside the control plane), as the ``/agent`` route serves an accepted
        websocket."""
        self.channel, control_end = memory_channel_pair(f"agent {self.node_id}")
        nursery.start_soon(plane.agents.serve, control_end)

    async def join(self, plane: ControlPlane, nursery: trio.Nursery) -> None:
        self.dial(plane, nursery)
        await self.channel.send(dataclasses.replace(self.register, token=JOIN_TOKEN))
        assert (await self.next(wire.Registered)).accepted

    async def closed(self) -> list:
        """What was still sent before the channel closed (fails if it stays open)."""
        seen = []
        with trio.fail_after(5):
            while True:
                try:
                    seen.append(await self.channel.receive())
                except ChannelClosed:
                    return seen

    async def next(self, kind: type):
        """The next message of ``kind`` (heartbeats skipped, errors kept in ``errors``)."""
        with trio.fail_after(5):
            while True:
                message = await self.channel.receive()
                if isinstance(message, kind):
                    return message
                if isinstance(message, wire.ErrorMessage):
                    self.errors.append(message)

    async def start_ready(self) -> wire.StartShard:
        """Take the next StartShard and report its shard Ready (at an address nothing listens on)."""
        start = await self.next(wire.StartShard)
        await self.report(start, wire.ShardState.READY)
        return start

    async def drained(self, start: wire.StartShard) -> None:
        """Take the DrainShard of the shard ``start`` started and report it stopped."""
        assert (await self.next(wire.DrainShard)).shard_id == start.shard_id
        await self.report(start, wire.ShardState.STOPPED)

    async def report(self, start: wire.StartShard, state: wire.ShardState) -> None:
        await self.channel.send(wire.ShardStatus(shard=wire.ShardReport(
            shard_id=start.shard_id, replica_id=start.replica_id, rank=start.rank, node_count=start.node_count,
            state=state, pid=4242, fingerprint=start.fingerprint, generation=start.generation,
            gpu_indices=list(start.gpu_indices), endpoint=UNUSED, model=start.profile.served_model_name)))
        await settled()

    async def kv(self, shard_id: str, replica_id: str, *keys: int) -> None:
        await self.channel.send(wire.KvChanges(shard_id=shard_id, replica_id=replica_id, kind=wire.KvChangeKind.FULL,
                                               block_size=16, stored=list(keys)))
        await settled()

    async def error(self) -> wire.ErrorMessage:
        return self.errors.pop(0) if self.errors else await self.next(wire.ErrorMessage)


async def test_a_placed_replica_enters_the_set_as_deployed_and_only_its_node_feeds_its_kv_index():
    async with control_plane(config(DEPLOYED_TINY)) as parts:
        a, b = Agent("a", "tiny-2gpu-a"), Agent("b", "tiny-2gpu-b")
        await a.connect(parts.plane)
        start = await a.start_ready()

        replica = parts.replicas.get(start.replica_id)
        assert replica is not None and replica.url == UNUSED and replica.model == "tiny"
        assert parts.replicas.source_of(replica) == DEPLOYED
        assert parts.router.models["tiny"].replicas == [replica]  # the route reads the set
        assert [r["source"] for r in parts.plane.replicas_json()] == [DEPLOYED]

        await a.kv(start.shard_id, start.replica_id, 1, 2, 3)
        assert parts.kv_index.keys(start.replica_id) == {1, 2, 3}

        # Another node speaking for a shard placed on a: refused, counted, told; the index unchanged.
        await b.connect(parts.plane)
        await b.kv(start.shard_id, start.replica_id, 7)
        assert parts.kv_index.keys(start.replica_id) == {1, 2, 3}
        assert parts.refused("b", "foreign_replica") == 1
        assert (await b.error()).code == "kv_foreign_replica"


async def test_a_static_replica_is_never_touched_by_the_control_plane():
    async with control_plane(config(STATIC_TINY, DEPLOYED_TINY)) as parts:
        static = parts.replicas.get("ext-0")
        assert parts.replicas.source_of(static) == STATIC
        parts.kv_index.apply("ext-0", wire.KvChanges(kind=wire.KvChangeKind.FULL, block_size=16, stored=[5]))

        a = Agent("a", "tiny-2gpu-a")
        await a.connect(parts.plane)
        start = await a.start_ready()
        assert parts.router.models["tiny"].replicas == [static, parts.replicas.get(start.replica_id)]

        # KV changes naming the static replica come from no shard the control plane placed: refused.
        await a.kv(start.shard_id, start.replica_id, 1)
        await a.kv("ext-0", "ext-0", 6)
        assert parts.refused("a", "unknown_replica") == 1
        assert (await a.error()).code == "kv_unknown_replica"
        assert parts.kv_index.keys("ext-0") == {5}

        # The deployment goes: its replica drains out and is released; the static one stays, routed.
        parts.apply(config(STATIC_TINY, DEPLOYED_TINY.replace("replicas: 1", "replicas: 0")))
        await settled()
        assert parts.replicas.get(start.replica_id) is None
        assert list(parts.replicas) == [static] and parts.router.models["tiny"].replicas == [static]
        assert start.replica_id not in parts.kv_index.replicas() and parts.kv_index.keys("ext-0") == {5}
        await a.drained(start)
        assert parts.plane.replicas_json() == []


async def test_an_agent_session_ending_leaves_static_replicas_and_their_index_alone():
    async with control_plane(config(STATIC_TINY, DEPLOYED_TINY)) as parts:
        parts.kv_index.apply("ext-0", wire.KvChanges(kind=wire.KvChangeKind.FULL, block_size=16, stored=[5]))
        a = Agent("a", "tiny-2gpu-a")
        await a.connect(parts.plane)
        start = await a.start_ready()
        await a.kv(start.shard_id, start.replica_id, 1)
        assert parts.kv_index.healthy(start.replica_id)

        # The stream that fed the deployed replica's index is gone: that index is no longer trusted, the static
        # replica's is untouched; both stay routed.
        await a.channel.aclose()
        await settled()
        assert not parts.kv_index.healthy(start.replica_id) and parts.kv_index.keys(start.replica_id) == set()
        assert parts.kv_index.healthy("ext-0") and parts.kv_index.keys("ext-0") == {5}
        assert [parts.replicas.source_of(r) for r in parts.router.models["tiny"].replicas] == [STATIC, DEPLOYED]


async def test_a_reload_moves_a_model_between_sources():
    async with control_plane(config(STATIC_TINY)) as parts:
        static = parts.replicas.get("ext-0")
        assert parts.router.models["tiny"].declared.model_path is None
        a = Agent("a", "tiny-2gpu-a")
        await a.connect(parts.plane)

        # Static -> deployed: the static replica drains out (its index with it), a deployed one comes in.
        parts.kv_index.apply("ext-0", wire.KvChanges(kind=wire.KvChangeKind.FULL, block_size=16, stored=[5]))
        parts.apply(config(DEPLOYED_TINY))
        start = await a.start_ready()
        deployed = parts.replicas.get(start.replica_id)
        assert static not in parts.replicas and parts.replicas.get("ext-0") is None
        assert "ext-0" not in parts.kv_index.replicas()
        assert parts.replicas.source_of(deployed) == DEPLOYED
        route = parts.router.models["tiny"]
        assert route.replicas == [deployed] and route.declared.model_path == "tiny"  # built from the profile

        # Deployed -> static: the deployed replica drains out and is released; the route stays, now static's.
        parts.apply(config(STATIC_TINY))
        await settled()
        again = parts.replicas.get("ext-0")
        assert again is not None and again is not static and parts.replicas.source_of(again) == STATIC
        assert deployed not in parts.replicas and start.replica_id not in parts.kv_index.replicas()
        route = parts.router.models["tiny"]
        assert route.replicas == [again] and route.declared.model_path is None
        await a.drained(start)
        assert parts.plane.replicas_json() == []

        # Neither source: the model is gone.
        parts.apply(config())
        await settled()
        assert "tiny" not in parts.router.models and list(parts.replicas) == []


async def test_a_replica_whose_build_raises_stays_out_and_the_others_keep_routing():
    two = DEPLOYED_TINY.replace("replicas: 1", "replicas: 2")
    async with control_plane(config(two)) as parts:
        a = Agent("a", "tiny-2gpu-a")
        await a.connect(parts.plane)
        first, second = await a.start_ready(), await a.next(wire.StartShard)
        healthy = parts.replicas.get(first.replica_id)
        assert healthy is not None

        # A report that never passed the node-report check (put straight into the inventory): building its
        # replica raises (port out of range). Contained: counted, the healthy replica untouched, the loop alive.
        parts.plane.inventory.update_shard("a", wire.ShardReport(
            shard_id=second.shard_id, replica_id=second.replica_id, state=wire.ShardState.READY, pid=1,
            fingerprint=second.fingerprint, generation=second.generation, gpu_indices=list(second.gpu_indices),
            endpoint="http://127.0.0.1:99999", model="tiny"))
        await settled()
        samples = parts.metrics.registry.get_sample_value
        assert samples("llmgw_replica_build_failures_total") == 1
        assert parts.replicas.get(second.replica_id) is None
        assert parts.replicas.get(first.replica_id) is healthy and parts.router.models["tiny"].replicas == [healthy]

        # A pass that raises as a whole (a bug anywhere in it) is counted, and the next pass runs.
        plan = parts.plane.reconciler.plan

        def broken(*args, **kwargs):
            raise RuntimeError("a bug in one pass")

        parts.plane.reconciler.plan = broken  # type: ignore[method-assign]
        parts.plane.request_reconcile()
        await settled()
        assert samples("llmgw_reconcile_failures_total") == 1
        parts.plane.reconciler.plan = plan  # type: ignore[method-assign]
        await a.report(second, wire.ShardState.READY)  # its real report: it enters routing
        assert {r.name for r in parts.router.models["tiny"].replicas} == {first.replica_id, second.replica_id}
        assert samples("llmgw_replica_build_failures_total") == 1


async def test_a_shard_report_that_fails_the_check_is_refused_and_told():
    async with control_plane(config(DEPLOYED_TINY)) as parts:
        a = Agent("a", "tiny-2gpu-a")
        await a.connect(parts.plane)
        start = await a.next(wire.StartShard)
        for endpoint in ("http://127.0.0.1:99999", "http://[::1", "http://h:abc", "http://10.0.0.9:8000"):
            await a.channel.send(wire.ShardStatus(shard=wire.ShardReport(
                shard_id=start.shard_id, replica_id=start.replica_id, state=wire.ShardState.READY, pid=1,
                fingerprint=start.fingerprint, generation=start.generation, gpu_indices=list(start.gpu_indices),
                endpoint=endpoint, model="tiny")))
            await settled()
            error = await a.error()
            assert error.code == "invalid_report" and error.about == start.shard_id and "endpoint" in error.message
            assert parts.replicas.get(start.replica_id) is None
            assert parts.plane.inventory.shard("a", start.shard_id) is None  # never recorded
        assert parts.metrics.registry.get_sample_value("llmgw_agent_refused_total",
                                                       {"reason": "invalid_report"}) == 4


async def test_the_end_of_its_term_closes_every_session_the_control_plane_admitted_and_it_commands_nothing_after(
        tmp_path, caplog):
    term = trio.CancelScope()
    async with trio.open_nursery() as connections:  # the control server's: where /agent's connection tasks run
        async with control_plane(remote_config(tmp_path, DEPLOYED_TINY), term) as parts:
            plane = parts.plane
            a, b, late = Agent("a", "tiny-2gpu-a"), Agent("b", "tiny-2gpu-b"), Agent("late", "tiny-2gpu-b")
            await a.join(plane, connections)
            start = await a.start_ready()  # placed once the adoption window is over
            assert parts.replicas.get(start.replica_id) is not None
            b.dial(plane, connections)  # admitted, its Register not sent yet
            await settled()

            term.cancel()  # the term ends (its lease expired, was taken, or a write was fenced)
            await a.closed()
            assert await b.closed() == []  # nothing: not even a refusal
            assert "the control plane stops: 1 remote agent sessions are closed" in caplog.text
            assert "node a is disconnected: this control plane stopped" in caplog.text
            # The control plane of a term that is over commands nobody, whatever it still holds...
            assert plane.reconcile() == []
            assert not any(isinstance(m, (wire.StartShard, wire.StopShard, wire.DrainShard)) for m in await a.closed())
            # ...and takes no new session (the route answers 503 not_leader before; this is the last guard).
            late.dial(plane, connections)
            await late.channel.send(dataclasses.replace(late.register, token=JOIN_TOKEN))
            assert await late.closed() == []
            assert plane.inventory.nodes["a"].session is None
