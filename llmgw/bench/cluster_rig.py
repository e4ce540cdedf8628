"""Several gateways on loopback for the cluster benchmarks: a private redis-server, simulators, a control
``llmgw serve`` (the first leader), other candidates, and ``--role gateway`` followers, all children of one
nursery.

:meth:`ClusterRig.open` starts them: ``sims`` simulators with KV events (:data:`~llmgw.testing.sims.KV_SIM_EXTRA`),
one private ``redis-server`` (:func:`~llmgw.testing.redis.start_private_redis`, which can be killed and started
again on its port), then the control process and the followers, each on fixed ports of its own (so a killed one
can be started again where the load generator sends), with the same config: the simulators as static replicas
whose events the control process follows (``kv_index``), and a ``state:`` section on the private Redis
(:func:`state_section`). It returns once every gateway routes to every replica with a healthy KV index.
Leaving the block stops everything (each child's process group).

Used by ``llmgw bench cluster-events`` (:mod:`.cluster_events`) and ``llmgw bench fault --gateways N``
(:mod:`.fault_cluster`); what they read is what an operator sees: ``/admin/kv``, ``/admin/explain``,
``/admin/cluster``, ``/health`` and ``/metrics``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from ..testing.processes import SERVE_READY, Child, checkout_env, free_port, llmgw_command, start_child
from ..testing.redis import PrivateRedis, SentinelGroup, start_private_redis, start_sentinel_group
from ..testing.shared_state import state_section as shared_state_section
from ..testing.sims import KV_SIM_ENV, KV_SIM_EXTRA, gateway_config, kv_sources, start_sims

CLUSTER = "bench"
CONTROL, GATEWAY = "control", "gateway"


def state_section(redis_url: str, *, cluster: str = CLUSTER, snapshot_interval: str = "1s",
                  load_ttl: str = "2s", **more: str) -> str:
    """The ``state:`` section of the benchmarks' gateways (:func:`llmgw.testing.shared_state.state_section`)."""
    return shared_state_section(redis_url, cluster, snapshot_interval=snapshot_interval, load_ttl=load_ttl, **more)


def cluster_config(sims: list[Child], redis_url: str, scheduling_policy: str | None = None,
                   **state_options: str) -> str:
    """One model over ``sims`` (``kv_index``, following their KV events) and the shared state on ``redis_url``;
    ``scheduling_policy``: what the simulators run with (``priority``: the gateways send each class's priority)."""
    return gateway_config([s.url for s in sims], routing="kv_index", routing_options={"tokenize_timeout": "2s"},
                          kv_sources=[kv_sources(s) for s in sims], scheduling_policy=scheduling_policy) \
        + state_section(redis_url, **state_options)


@dataclass(eq=False)
class GatewayProcess:
    """One ``llmgw serve`` of the cluster on its own fixed loopback ports; :meth:`start` may run again after a
    kill (same ports, same config, same role)."""

    name: str
    role: str
    config: Path
    data_port: int = field(default_factory=free_port)
    control_port: int = field(default_factory=free_port)
    child: Child | None = None
    source: Path | None = None  # another checkout's llmgw runs it (a baseline), else this one's
    extra_argv: tuple[str, ...] = ()  # more ``llmgw serve`` options (``--workers 2 --state-dir DIR``)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.data_port}"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    @property
    def pid(self) -> int:
        assert self.child is not None, "start() it first"
        return self.child.pid

    async def start(self, nursery: trio.Nursery) -> Child:
        argv = llmgw_command("serve", "--config", str(self.config), "--listen", f"127.0.0.1:{self.data_port}",
                             "--control-listen", f"127.0.0.1:{self.control_port}", "--role", self.role,
                             *self.extra_argv)
        self.child = await start_child(nursery, argv, name=self.name, ready=SERVE_READY, startup_timeout=60,
                                       stop_grace=2, cwd=self.source,
                                       env=None if self.source is None else checkout_env(self.source))
        return self.child

    async def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL the process itself (no goodbye to Redis or its clients); once it is gone."""
        assert self.child is not None, "start() it first"
        os.kill(self.child.pid, signal.SIGKILL)
        with trio.fail_after(timeout):
            await self.child.process.wait()


@dataclass(eq=False)
class ClusterRig:
    nursery: trio.Nursery
    workdir: Path
    redis: PrivateRedis
    sims: list[Child]
    control: GatewayProcess
    followers: list[GatewayProcess]
    http: httpx.AsyncClient
    sentinel: SentinelGroup | None = None  # with sentinel=True: ``redis`` is the primary the rig started with

    @property
    def gateways(self) -> list[GatewayProcess]:
        return [self.control, *self.followers]

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, workdir: Path, *, followers: int, sims: int = 2, num_blocks: int = 2048,
                   time_scale: float = 0.0, sim_extra: tuple[str, ...] = (), sentinel: bool = False,
                   candidates: int = 1, source: Path | None = None, extra_config: str = "", workers: int = 1,
                   engines: list[Child] | None = None, scheduling_policy: str | None = None,
                   **state_options: str) -> AsyncIterator["ClusterRig"]:
        """Everything started and ready (see the module's docstring); stopped when the block ends. ``source``: the
        gateways run the llmgw of that checkout (a baseline). ``sentinel``:
        a primary, its replica and a sentinel instead of one server, the gateways configured with
        ``state.sentinel``. ``candidates``: the control process and ``candidates - 1`` of the followers stand
        for the cluster's lease (started without ``--role gateway``); the control process, started first, is
        its first leader. ``extra_config``: YAML appended to every gateway's config (top-level keys);
        ``workers`` > 1: each gateway is ``llmgw serve --workers N`` (a state dir of its own under ``workdir``);
        ``engines``: simulators the caller started (with :data:`KV_SIM_EXTRA`) and keeps after the block, instead
        of ``sims`` new ones; ``scheduling_policy``: what they run with, as the config says it of each replica."""
        async with httpx.AsyncClient(timeout=10) as http, trio.open_nursery() as nursery:
            group = await start_sentinel_group(nursery, workdir / "redis") if sentinel else None
            redis = group.servers[0] if group else await start_private_redis(nursery, workdir / "redis")
            if engines is None:
                engines = await start_sims(nursery, sims, env=KV_SIM_ENV, num_blocks=num_blocks, block_size=16,
                                           time_scale=time_scale, seed=0, extra=KV_SIM_EXTRA + sim_extra)
            config = workdir / "llmgw.yaml"
            config.write_text(cluster_config(engines, group.url if group else redis.url, scheduling_policy,
                                             **state_options)
                              + extra_config)

            def process(name: str, role: str) -> GatewayProcess:
                argv = ("--workers", str(workers), "--state-dir", str(workdir / name.replace(" ", "-"))) \
                    if workers > 1 else ()
                return GatewayProcess(name, role, config, source=source, extra_argv=argv)

            control = process("llmgw control", CONTROL)
            await control.start(nursery)
            rig = cls(nursery, workdir, redis, engines, control,
                      [process(f"llmgw candidate-{i + 1}", CONTROL) if i < candidates - 1 else
                       process(f"llmgw gateway-{i + 1}", GATEWAY) for i in range(followers)], http, group)
            await rig.wait_leading(control)
            for follower in rig.followers:
                await follower.start(nursery)
            for gateway in rig.gateways:
                await rig.wait_kv_healthy(gateway)
            try:
                yield rig
            finally:
                nursery.cancel_scope.cancel()

    async def wait_kv_healthy(self, gateway: GatewayProcess, timeout: float = 60.0) -> None:
        """Until ``gateway`` lists every replica and its KV index of each is healthy."""
        with trio.fail_after(timeout):
            while True:
                try:
                    kv = (await self.http.get(gateway.control_url + "/admin/kv")).json()["replicas"]
                    listed = (await self.http.get(gateway.control_url + "/admin/replicas")).json()
                    if len(listed) == len(self.sims) and \
                            sum(r["state"] == "healthy" for r in kv) == len(self.sims):
                        return
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                await trio.sleep(0.1)

    async def leading(self, gateway: GatewayProcess) -> bool:
        """Whether ``gateway`` leads the cluster now (``/health`` ``state.leader.leading``)."""
        state = (await self.http.get(gateway.control_url + "/health")).json()["state"]
        return bool((state.get("leader") or {}).get("leading"))

    async def wait_leading(self, gateway: GatewayProcess, timeout: float = 30.0) -> None:
        with trio.fail_after(timeout):
            while True:
                try:
                    if await self.leading(gateway):
                        return
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                await trio.sleep(0.05)

    @property
    def redis_held_leases(self) -> bool:
        """Several candidates: who leads is worth watching through a Redis outage."""
        return sum(g.role == CONTROL for g in self.gateways) > 1

    lease_ttl = 2.0  # the gateways' state.lease_ttl (the default)

    def lead_with(self, leader: GatewayProcess) -> None:
        """``leader`` leads now: it is :attr:`control`, the others followers (the old leader among them)."""
        everyone = self.gateways
        self.control = leader
        self.followers = [g for g in everyone if g is not leader]

    async def kv_blocks(self, gateway: GatewayProcess) -> dict[str, int]:
        """Blocks per replica in ``gateway``'s KV index (``/admin/kv``)."""
        return {r["name"]: r["blocks"] for r in
                (await self.http.get(gateway.control_url + "/admin/kv")).json()["replicas"]}

    async def cluster_view(self, gateway: GatewayProcess) -> dict:
        """``gateway``'s ``/admin/cluster``: role, origin, degraded, log position, the peers' load."""
        return (await self.http.get(gateway.control_url + "/admin/cluster")).json()
