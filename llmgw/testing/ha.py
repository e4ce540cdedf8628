"""The production topology of a highly available cluster, as real processes on loopback, for fault tests.

:func:`start_ha_cluster` starts, in the caller's nursery: two candidates A and B (``llmgw serve`` without ``--role``,
each with its own identity store, as on hosts of their own), one ``--role gateway`` F, a remote ``llmgw agent
--join A,B`` on a fixture node deploying simulator replicas (``replicas``), all sharing state through a
:class:`~.redis.PrivateRedis` the test may freeze, kill and restart, with ``state.secret_env`` set and
``agents.heartbeat_interval`` 0.5 s. It returns once A leads and every gateway routes every replica.

:class:`HaCluster` reads it as a client would: who leads (:meth:`HaCluster.wait_leader`), whether every gateway
routes every replica (:meth:`HaCluster.routable`), and the engines' pids from the agent's ledger (what restarts an
engine changes; ``Child.pid`` of a simulator the test started itself cannot). :class:`RoutabilityWatch` samples
every gateway's replica listing through a fault, so a replica that left routing for a moment is seen even when
it came back by the end. Steady traffic: :class:`~.traffic.TrafficRecorder`, one per gateway.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

import httpx
import trio

from .cluster import TOKEN, Cluster, EngineReaper
from .processes import Child
from .redis import PrivateRedis
from .shared_state import state_section
from .sims import kv_sim_profile

if TYPE_CHECKING:
    from ..bench.fault_load import SteadyLoad

FIXTURE = "tiny-2gpu-a"  # the agent's node: two fixture GPUs
HEARTBEAT = 0.5
LEASE_TTL = 2.0
LEASE_RENEW = 0.5


def candidate_config(control_state_dir: Path, redis_url: str, cluster: str, replicas: int = 1,
                     num_blocks: int = 256) -> str:
    """A process of the cluster with its own identity store (as on a host of its own), ``replicas`` deployed
    simulator engines, signed with the cluster secret every child of :mod:`.processes` has (the placement key
    every candidate derives)."""
    return f"""
agents:
  token: {TOKEN}
  heartbeat_interval: {HEARTBEAT}s
  suspect_after: 1.5s
  disconnected_after: 3s
  control_state_dir: {control_state_dir}
health:
  interval: 0.2s
  failures_to_down: 1
""" + kv_sim_profile(f'"--num-blocks", "{num_blocks}"', replicas=replicas) + state_section(
        redis_url, cluster, snapshot_interval="1s", lease_ttl=f"{LEASE_TTL}s",
        lease_renew=f"{LEASE_RENEW}s")


def recovery_limit() -> float:
    """The issue's target: every replica routable again within ``lease_ttl + lease_renew + 1 s`` of Redis
    answering or of a new leader's election."""
    return LEASE_TTL + LEASE_RENEW + 1.0


@dataclass(eq=False)
class HaCluster:
    redis: PrivateRedis
    candidates: list[Cluster]  # A (elected first), B
    gateway: Cluster  # F: --role gateway
    agent: Child
    agent_state: Path
    replicas: int
    http: httpx.AsyncClient

    @property
    def gateways(self) -> list[Cluster]:
        """A, B and F: every process that routes."""
        return [*self.candidates, self.gateway]

    async def health(self, process: Cluster) -> dict:
        return (await self.http.get(process.control_url + "/health", timeout=2)).json()

    async def leading(self, process: Cluster) -> bool:
        return bool((await self.health(process))["state"]["leader"]["leading"])

    async def wait_leader(self, among: list[Cluster] | None = None, timeout: float = 15.0) -> Cluster:
        """The first of ``among`` (the candidates) seen leading; polled every 50 ms (an unanswering one is
        skipped: it may be the frozen one)."""
        with trio.fail_after(timeout):
            while True:
                for candidate in among or self.candidates:
                    try:
                        if await self.leading(candidate):
                            return candidate
                    except (httpx.HTTPError, KeyError, ValueError):
                        pass
                await trio.sleep(0.05)

    async def wait_ready(self, process: Cluster, timeout: float = 30.0) -> None:
        """Until ``process``'s control port answers ``/ready`` 200: what a load balancer's health check waits for."""
        with trio.fail_after(timeout):
            while True:
                try:
                    if (await self.http.get(process.control_url + "/ready", timeout=2)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.1)

    async def restart(self, process: Cluster, load: SteadyLoad, *extra: str,
                      while_down: Callable[[], Awaitable[object]] | None = None) -> None:
        """One step of a rolling restart under ``load``: SIGTERM ``process`` (it drains), out of the load's rotation
        once it exited, ``while_down`` awaited (e.g. until the other candidate leads: a leader started again at once
        can win the election back before the other's next look at the lease), started again with ``extra``
        (``--role gateway``), back in the rotation once it is ready."""
        assert process.serve is not None
        process.serve.kill(signal.SIGTERM)
        code = await process.serve.wait_exit(timeout=40)
        assert code == 0, f"{process.serve.name} exited with {code}:\n{process.serve.output()}"
        load.data_urls = [url for url in load.data_urls if url != process.data_url]
        if while_down is not None:
            await while_down()
        await process.start_serve(*extra)
        await self.wait_ready(process)
        load.data_urls = [p.data_url for p in self.gateways]

    async def listing(self, process: Cluster) -> dict[str, dict]:
        """``/admin/replicas`` of one gateway, by name."""
        response = await self.http.get(process.control_url + "/admin/replicas", timeout=2)
        response.raise_for_status()
        return {r["name"]: r for r in response.json()}

    async def routable_on(self, process: Cluster) -> set[str]:
        """The replicas ``process`` routes to now: listed with an address and up."""
        return {name for name, r in (await self.listing(process)).items() if r.get("url") and r["state"] == "up"}

    async def routable(self, among: list[Cluster] | None = None) -> bool:
        """Every gateway of ``among`` (all) routes ``replicas`` replicas."""
        for process in among or self.gateways:
            try:
                if len(await self.routable_on(process)) < self.replicas:
                    return False
            except (httpx.HTTPError, ValueError):
                return False
        return True

    async def wait_routable(self, among: list[Cluster] | None = None, timeout: float = 30.0) -> float:
        """Until every gateway of ``among`` routes every replica; the seconds it took."""
        start = trio.current_time()
        with trio.fail_after(timeout):
            while not await self.routable(among):
                await trio.sleep(0.05)
        return trio.current_time() - start

    async def converged(self) -> list[str]:
        """What keeps the cluster from being whole again (empty when it is): one leader, its agent's node connected
        to it with the ledger's engines adopted, and every other process following the leader's log."""
        problems: list[str] = []
        leaders = [c for c in self.candidates if await self.leading(c)]
        if len(leaders) != 1:
            return [f"{len(leaders)} leaders"]
        (leader,) = leaders
        writer = (await self.http.get(leader.control_url + "/admin/cluster", timeout=2)).json()["log"]["writer"]
        for name, process in zip("ABF", self.gateways):
            if process is not leader:
                log = (await self.http.get(process.control_url + "/admin/cluster", timeout=2)).json()["log"]
                if log["writer"] != writer or not log["loaded"]:
                    problems.append(f"{name} follows {log['writer']} (loaded: {log['loaded']}), not {writer}")
        nodes = (await self.http.get(leader.control_url + "/admin/nodes", timeout=2)).json()
        if [n["state"] for n in nodes if n["node_id"] == "a"] != ["connected"]:
            problems.append(f"the agent's node at the leader: {[n for n in nodes if n['node_id'] == 'a']}")
        shards = {name: [s.get("pid") for s in r.get("shards", [])] for name, r in (await self.listing(leader)).items()}
        ledger = {name: [pid] for name, (pid, _) in self.engine_pids().items()}
        if shards != ledger:
            problems.append(f"the leader's engines {shards}, the agent's ledger {ledger}")
        return problems

    async def wait_converged(self, timeout: float = 15.0) -> float:
        """Until :meth:`converged`; the seconds it took (AssertionError with what was left, on timeout)."""
        start = trio.current_time()
        problems: list[str] = []
        with trio.move_on_after(timeout):
            while problems := await self.converged():
                await trio.sleep(0.1)
            return trio.current_time() - start
        raise AssertionError(f"the cluster is not whole {timeout:g} s on: {problems}")

    def load_outcome(self, load: SteadyLoad) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
        """After a test's load ended: every process's output written beside the agent's state (``logs/``), each
        phase's counts printed, and the phases where a request failed (:meth:`SteadyLoad.failed_phases`)."""
        self.write_logs(self.agent_state.parent / "logs")
        for phase, counts in load.phases.items():
            print(f"{phase}: {counts.as_dict()}")
        return load.failed_phases()

    def write_logs(self, directory: Path) -> None:
        """Every process's output so far to ``directory/NAME.log`` (A, B, F, agent): what a failed test left."""
        directory.mkdir(parents=True, exist_ok=True)
        for name, child in (*zip("ABF", (p.serve for p in self.gateways)), ("agent", self.agent)):
            if child is not None:
                (directory / f"{name}.log").write_text("\n".join(child.lines) + "\n")

    def node_secret(self) -> str:
        """The agent's node secret (a new one: it joined anew, the leader did not know its node)."""
        return (self.agent_state / "node-secret").read_text()

    def engine_pids(self) -> dict[str, tuple[int, int]]:
        """``{replica: (pid, restarts)}`` of the engines in the agent's ledger (what it runs and reports)."""
        pids: dict[str, tuple[int, int]] = {}
        for ledger in self.agent_state.rglob("shards.json"):
            for entry in json.loads(ledger.read_text()).get("shards", {}).values():
                pids[entry["replica_id"]] = (entry["pid"], entry.get("restarts", 0))
        return pids


async def start_ha_cluster(nursery: trio.Nursery, root: Path, engines: EngineReaper, redis: PrivateRedis,
                           cluster_name: str, http: httpx.AsyncClient, *, fixtures: Path, cwd: Path | None = None,
                           replicas: int = 2) -> HaCluster:
    """Start the topology (the module's docstring) under ``root``; once A leads, the agent's ``replicas`` engines
    are up, and every gateway routes them. ``fixtures``: the folder of the agent's fixture node
    (``tests/fixtures/nodes``); ``cwd``: a source checkout the children import llmgw from."""
    processes = {}
    for name in ("A", "B", "F"):
        (root / name).mkdir(parents=True, exist_ok=True)
        process = processes[name] = Cluster(nursery, root / name, engines, fixtures=fixtures, cwd=cwd)
        process.write_config(candidate_config(root / name / "control", redis.url, cluster_name, replicas))
    a, b, f = processes["A"], processes["B"], processes["F"]
    await a.start_serve()
    cluster = HaCluster(redis, [a, b], f, None, root / "agent", replicas, http)  # type: ignore[arg-type]
    await cluster.wait_leader([a])

    async def start_agent() -> None:
        cluster.agent = await a.start_agent("a", FIXTURE, join=f"{a.control_url},{b.control_url}",
                                            state_dir=cluster.agent_state)

    async with trio.open_nursery() as starting:  # the children run in `nursery`: this one only starts them
        starting.start_soon(b.start_serve)
        starting.start_soon(f.start_serve, "--role", "gateway")
        starting.start_soon(start_agent)
    await a.settled(replicas)
    await cluster.wait_routable()
    return cluster


@dataclass(eq=False)
class RoutabilityWatch:
    """Every gateway's routable replicas and ``/ready`` (what a load balancer's health check asks), sampled every
    ``every`` seconds until cancelled: ``samples`` of ``(time, gateway index, routable count)`` (-1: the gateway
    did not answer), ``readiness`` of ``(time, gateway index, /ready's status, its reasons)`` (status 0: no
    answer)."""

    cluster: HaCluster
    every: float = 0.2
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    readiness: list[tuple[float, int, int, list]] = field(default_factory=list)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            for i, process in enumerate(self.cluster.gateways):
                try:
                    count = len(await self.cluster.routable_on(process))
                except (httpx.HTTPError, ValueError):
                    count = -1
                self.samples.append((trio.current_time(), i, count))
                try:
                    ready = await self.cluster.http.get(process.control_url + "/ready", timeout=2)
                    status, reasons = ready.status_code, ready.json().get("reasons", [])
                except (httpx.HTTPError, ValueError):
                    status, reasons = 0, []
                self.readiness.append((trio.current_time(), i, status, reasons))
            await trio.sleep(self.every)

    def not_ready(self, gateway: int, since: float = float("-inf")) -> list[tuple[float, int, list]]:
        """The samples since ``since`` where ``gateway`` answered ``/ready`` with anything but 200:
        ``(time, status, reasons)``."""
        return [(t, status, reasons) for t, i, status, reasons in self.readiness
                if i == gateway and t >= since and status not in (0, 200)]

    def short(self, gateway: int, since: float = float("-inf")) -> list[tuple[float, int]]:
        """The samples since ``since`` where ``gateway`` (an index of :attr:`HaCluster.gateways`) answered and
        routed fewer than every replica: ``(time, count)``."""
        return [(t, count) for t, i, count in self.samples
                if i == gateway and t >= since and 0 <= count < self.cluster.replicas]
