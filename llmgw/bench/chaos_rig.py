"""The cluster ``llmgw bench chaos`` hurts: the production topology on loopback, every part a real process.

:meth:`ChaosRig.open` starts, in one nursery: a private ``redis-server``
(:class:`~llmgw.testing.redis.PrivateRedis`, restartable on its port), two candidates
(``llmgw serve``, each with an identity store of its own, as on hosts of their own),
``gateways`` ``llmgw serve --role gateway`` processes (the last one reaches Redis
through a :class:`~.cut_proxy.CutProxy`, so a partition can be made), and one remote
``llmgw agent --join A,B`` on a recorded node (fixture discovery) to which the leader
deploys ``replicas`` simulators of a ``sim`` profile with KV events (the fixed
deployment, model :data:`MODEL`) and, beside it, an autoscaled deployment of the same
engine (model :data:`AUTO_MODEL`, ``replicas: {min: 1, max: 3}``, the scaler's defaults)
with GPUs free for its ``max``. Every process has ``state.secret_env`` set,
``agents.heartbeat_interval: 0.5s`` and overload control on (``flow.enabled``, the
default, written out). It returns once every gateway routes to every replica of both. Leaving the block stops every
process, and the engines (which outlive agents by design) are killed from the
agent's ledger.

What the benchmark reads is what an operator sees: ``/health``'s ``state.leader``,
``/admin/models`` (how many replicas each gateway can route to), the leader's
``/admin/replicas`` (each shard's pid and restarts, as the agent reported them), ``/metrics``, and
``/proc`` for each process's memory and descriptors.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
import yaml

from ..testing.cluster import TOKEN, EngineReaper
from ..testing.ha import candidate_config
from ..testing.processes import Child, llmgw_command, start_child
from ..testing.redis import PrivateRedis, start_private_redis
from ..testing.sims import MODEL
from .cluster_rig import CONTROL, GATEWAY, GatewayProcess
from .cut_proxy import CutProxy

CLUSTER = "chaos"
AUTO_MODEL = "tiny-auto"  # the autoscaled deployment's model, beside the fixed one (MODEL)
AUTO_PROFILE = "tiny-auto-sim"
AUTO_MIN, AUTO_MAX = 1, 3
NODE = "gpu-node"
AGENT_READY = " connected to "
POLL_TIMEOUT = 1.0  # an admin read of a frozen process gives up after this


L4 = ("L4", 24152899584, (8, 9))  # a GPU of a fixture: its NVML name, memory in bytes, compute capability
H100 = ("NVIDIA H100 80GB HBM3", 85520809984, (9, 0))


def node_fixture(gpus: int, gpu: tuple[str, int, tuple[int, int]] = L4, hostname: str = NODE,
                 node: int = 0) -> dict:
    """A recorded node (``fixture:`` discovery, docs/placement.md): ``gpus`` of ``gpu`` on one NUMA node; ``node``
    numbers the GPUs' UUIDs apart from other nodes'."""
    name, memory, capability = gpu
    devices = [{"uuid": f"GPU-00000000-0000-4000-{0x8000 + node:04x}-{i:012d}", "name": name,
                "pci_bus_id": f"00000000:{i + 1:02x}:00.0", "memory": {"total": memory, "used": 0},
                "cuda_compute_capability": list(capability), "numa_node": 0, "utilization": {"gpu": 0, "memory": 0}}
               for i in range(gpus)]
    return {"format": "llmgw-node-fixture/1", "address": "127.0.0.1",
            "host": {"hostname": hostname, "os": "Linux", "arch": "x86_64", "cpu_count": 4,
                     "memory_bytes": 17179869184},
            "nvml": {"driver_version": "550.90.07", "cuda_driver_version": 12040, "devices": devices}}


def process_config(redis_url: str, control_state_dir: Path, replicas: int,
                   routing_options: Mapping[str, Any] | None = None) -> str:
    """One process's config: the agents' settings, the deployed ``sim`` profile and the shared state (the HA tests'
    candidate, :func:`llmgw.testing.ha.candidate_config`), quieter, with overload control on and the autoscaled
    deployment of the same engine beside the fixed one; ``routing_options`` added to the profiles' (the soak sets
    its caches' bounds small, so that they are full within minutes)."""
    text = "log_level: warning\n" + candidate_config(control_state_dir, redis_url, CLUSTER, replicas, num_blocks=512)
    config = yaml.safe_load(text)
    config["flow"] = {"enabled": True}
    fixed = config["profiles"][0]
    config["profiles"].append({**fixed, "name": AUTO_PROFILE, "served_model_name": AUTO_MODEL})
    config["deployments"].append({"profile": AUTO_PROFILE, "replicas": {"min": AUTO_MIN, "max": AUTO_MAX}})
    for profile in config["profiles"]:
        profile["routing_options"] = {**profile.get("routing_options", {}), **(routing_options or {})}
    return yaml.safe_dump(config, sort_keys=False)


@dataclass(eq=False)
class ChaosRig:
    nursery: trio.Nursery
    workdir: Path
    redis: PrivateRedis
    proxy: CutProxy
    candidates: list[GatewayProcess]
    gateways_only: list[GatewayProcess]  # --role gateway; the last one reaches Redis through the proxy
    replicas: int
    http: httpx.AsyncClient
    reaper: EngineReaper
    agent: Child | None = None
    agent_argv: list[str] = field(default_factory=list)

    @property
    def gateways(self) -> list[GatewayProcess]:
        return [*self.candidates, *self.gateways_only]

    @property
    def partitioned(self) -> GatewayProcess:
        return self.gateways_only[-1]

    @property
    def ledger(self) -> Path:
        return self.workdir / "agent" / "shards.json"

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, workdir: Path, *, gateways: int = 1, replicas: int = 2,
                   routing_options: Mapping[str, Any] | None = None) -> AsyncIterator["ChaosRig"]:
        reaper = EngineReaper(workdir)
        try:
            async with httpx.AsyncClient(timeout=POLL_TIMEOUT) as http, trio.open_nursery() as nursery:
                redis = await start_private_redis(nursery, workdir / "redis")
                proxy = await nursery.start(CutProxy(redis.port).run)
                processes = []
                for i in range(2 + gateways):
                    role = CONTROL if i < 2 else GATEWAY
                    name = "ABCDEFGH"[i] if i < 2 else f"F{i - 1}"
                    url = f"redis://127.0.0.1:{proxy.port}" if i == 1 + gateways and gateways else redis.url
                    config = workdir / f"llmgw-{name}.yaml"
                    config.write_text(process_config(url, workdir / f"control-{name}", replicas, routing_options))
                    processes.append(GatewayProcess(name, role, config))
                rig = cls(nursery, workdir, redis, proxy, processes[:2], processes[2:], replicas, http, reaper)
                await processes[0].start(nursery)
                await rig.wait_leader([processes[0]], timeout=60)
                for process in processes[1:]:
                    await process.start(nursery)
                fixture = workdir / "node.json"
                fixture.write_text(json.dumps(node_fixture(replicas + AUTO_MAX)))
                rig.agent_argv = llmgw_command(
                    "agent", "--join", ",".join(c.control_url for c in rig.candidates), "--token", TOKEN,
                    "--node-id", NODE, "--state-dir", str(workdir / "agent"), "--address", "127.0.0.1",
                    "--discovery", f"fixture:{fixture}", "--log-level", "warning")
                await rig.start_agent()
                await rig.wait_all_routable(timeout=120)
                try:
                    yield rig
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            reaper.reap()

    # -- processes -------------------------------------------------------------------------------------------

    async def start_agent(self) -> Child:
        self.agent = await start_child(self.nursery, self.agent_argv, name="llmgw agent", ready=AGENT_READY,
                                       startup_timeout=60, stop_grace=2)
        return self.agent

    async def kill_agent(self) -> None:
        assert self.agent is not None, "started by open()"
        os.kill(self.agent.pid, signal.SIGKILL)
        with trio.fail_after(30):
            await self.agent.process.wait()

    def pids(self) -> dict[str, int]:
        """The pid of each process of the cluster (gateways, the agent, Redis) that runs now."""
        pids = {g.name: g.pid for g in self.gateways if g.child is not None and g.child.returncode is None}
        if self.agent is not None and self.agent.returncode is None:
            pids["agent"] = self.agent.pid
        if self.redis.server is not None and self.redis.server.returncode is None:
            pids["redis"] = self.redis.pid
        return pids

    # -- what the cluster says -------------------------------------------------------------------------------

    async def leader_of(self, gateway: GatewayProcess) -> tuple[bool, int | None]:
        """``(leading, term)`` from ``gateway``'s ``/health``."""
        state = (await self.http.get(gateway.control_url + "/health")).json().get("state") or {}
        leader = state.get("leader") or {}
        return bool(leader.get("leading")), leader.get("term")

    async def leader(self) -> tuple[GatewayProcess, int | None] | None:
        """The candidate that says it leads, with its term; None when none does (or none answers)."""
        for candidate in self.candidates:
            with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
                leading, term = await self.leader_of(candidate)
                if leading:
                    return candidate, term
        return None

    async def wait_leader(self, among: list[GatewayProcess] | None = None,
                          timeout: float = 60.0) -> tuple[GatewayProcess, int | None]:
        with trio.fail_after(timeout):
            while True:
                found = await self.leader()
                if found is not None and (among is None or found[0] in among):
                    return found
                await trio.sleep(0.05)

    async def degraded(self, gateway: GatewayProcess) -> bool:
        """Whether ``gateway``'s ``/health`` says its shared state is degraded (False when it does not answer)."""
        try:
            state = (await self.http.get(gateway.control_url + "/health")).json().get("state") or {}
        except (httpx.HTTPError, ValueError, AttributeError):
            return False
        return bool(state.get("degraded"))

    async def routable(self, gateway: GatewayProcess) -> dict[str, int] | None:
        """How many replicas of each model ``gateway`` can route to now; None when it does not answer."""
        try:
            models = (await self.http.get(gateway.control_url + "/admin/models")).json()
            return {name: next((m.get("routable", 0) for m in models if m.get("name") == name), 0)
                    for name in (MODEL, AUTO_MODEL)}
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    async def routes_all(self, gateway: GatewayProcess) -> bool:
        """Whether ``gateway`` routes to every replica of the fixed deployment and to at least the autoscaled
        one's ``min`` (how many more it runs is the scaler's, watched apart: :meth:`autoscaled`)."""
        routable = await self.routable(gateway)
        return routable is not None and routable[MODEL] == self.replicas and routable[AUTO_MODEL] >= AUTO_MIN

    async def all_routable(self) -> bool:
        return all([await self.routes_all(g) for g in self.gateways])

    async def autoscaled(self) -> dict | None:
        """The autoscaled deployment as the leader's ``/admin/autoscale`` shows it (desired, ready, starting,
        ``started_from``, decisions); None when no candidate answers as the leader."""
        for candidate in self.candidates:
            with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
                answer = (await self.http.get(candidate.control_url + "/admin/autoscale")).json()
                if answer.get("leading"):
                    return answer.get("deployments", {}).get(AUTO_PROFILE)
        return None

    async def wait_all_routable(self, timeout: float) -> None:
        with trio.fail_after(timeout):
            while not await self.all_routable():
                await trio.sleep(0.1)

    async def engine_pids(self) -> dict[str, int]:
        """Each deployed replica's engine pid as the agent reported it to the leader (its ``/admin/replicas``),
        or, where the leader knows none, from the agent's ledger."""
        pids: dict[str, int] = {}
        found = await self.leader()
        if found is not None:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                listed = (await self.http.get(found[0].control_url + "/admin/replicas")).json()
                for replica in listed:
                    shards = replica.get("shards") or []
                    if shards and shards[0].get("pid"):
                        pids[replica["name"]] = shards[0]["pid"]
        if len(pids) < self.replicas + AUTO_MIN and self.ledger.exists():
            with contextlib.suppress(OSError, ValueError):
                for key, entry in json.loads(self.ledger.read_text()).get("shards", {}).items():
                    name = entry.get("replica_id") or key
                    pids.setdefault(name, entry.get("pid") or 0)
        self.reaper.update(pids.values())
        return pids

    async def trio_tasks(self, gateway: GatewayProcess) -> int | None:
        """``llmgw_trio_tasks`` of ``gateway`` (its ``/metrics``); None when it does not answer."""
        return await self.gauge(gateway, "llmgw_trio_tasks")

    async def gauge(self, gateway: GatewayProcess, name: str) -> int | None:
        """The unlabelled sample ``name`` of ``gateway``'s ``/metrics``; None when it does not answer."""
        try:
            text = (await self.http.get(gateway.control_url + "/metrics")).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith(name + " "):
                return int(float(line.split()[1]))
        return None


def rss_and_fds(pid: int) -> tuple[int, int] | None:
    """``(resident bytes, open descriptors)`` of ``pid`` from ``/proc``; None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return rss, fds
