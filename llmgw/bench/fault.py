"""Benchmark: a steady load through the gateway while an engine, the agent and the control plane are killed in turn.

``llmgw bench fault [--duration 6] [--rate 20] [--concurrency 4] [--json bench-results/fault.json]``

With ``--gateways N`` (N >= 2) it measures a cluster of gateways sharing state through Redis instead
(a follower gateway killed, then Redis killed and started again): :mod:`llmgw.bench.fault_cluster`.

Real processes on loopback: ``llmgw serve`` (control plane and data plane in
one process, on fixed ports so a restart binds them again), one ``llmgw agent``
(CPU discovery) running ``--replicas`` simulator engines of a ``kv_index``
profile with KV events. A steady load (:mod:`llmgw.bench.fault_load`:
non-streamed and streamed completions at ``--rate``) runs throughout. Each
fault gets ``--duration`` seconds of load, half before the ``SIGKILL`` and half
after the cluster recovered:

- **engine**: one engine killed; its agent restarts it;
- **agent**: the agent killed, and started again after ``--agent-down`` seconds;
  it adopts the engines from its ledger;
- **control plane**: ``llmgw serve`` killed and started again at once; the
  agent reconnects and the engines are adopted.

Per fault the table shows the requests that ended in its window and how they
failed (by HTTP status, ``in_flight``: lost inside a killed ``llmgw serve``,
``stream_cut``: a stream broken off after its first bytes), connections refused
while nothing listened (not started, retried by the client), requests the
gateway sent again to another replica (``llmgw_retries_total``), the time from the
kill until a request is answered again (*routable*) and until every replica is
up on its engine again, engine restarts, whether the engines kept their pids,
and whether, once settled, the kv_index tier's predicted cached tokens equal
the engines' own for a repeated prefix on every replica
(:mod:`llmgw.bench.kv_truth`). Prints a Markdown table; ``--json`` writes it all.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import trio

from ..procgroup import signal_group, wait_group_gone
from ..testing.metrics import metric_value, scrape
from ..testing.processes import Child, free_port, llmgw_command, start_child
from ..testing.sims import kv_sim_profile
from . import fault_cluster
from .common import bench_parser, print_and_save, write_json
from .fault_load import LoadSettings, SteadyLoad, add_load_options
from .kv_truth import check_kv_truth

TOKEN = "bench-fault-token"
NODE = "bench"
AGENT_READY = re.compile(rb"llmgw-agent \S+ connected to (\S+)")


def cluster_config(data_port: int, control_port: int, replicas: int) -> str:
    return f"""listen: 127.0.0.1:{data_port}
control_listen: 127.0.0.1:{control_port}
log_level: warning
agents:
  token: {TOKEN}
  heartbeat_interval: 1s
  suspect_after: 3s
  disconnected_after: 6s
health:
  interval: 0.5s
  failures_to_down: 1
""" + kv_sim_profile('"--num-blocks", "2048"', replicas=replicas)


@dataclass
class FaultResult:
    fault: str
    sent: int
    failed: dict[str, int]  # "plain http_503", "stream stream_cut", ...
    not_started_retries: int
    gateway_retries: int | None  # sent again to another replica by the gateway (None: its counters restarted)
    lost_before_gone: bool  # every in_flight/stream_cut request started before the killed process was gone
    routable_s: float  # from the kill until a request sent after it was answered 200
    replicas_up_s: float  # from the kill until every replica was up on its engine again
    engine_restarts: int
    same_pids: bool  # every engine kept its pid (for the engine fault: every other engine)
    kv_exact: bool
    kv_checks: list[dict]


class FaultCluster:
    """``llmgw serve`` and one ``llmgw agent`` as children of ``nursery``, killable and restartable.

    ``async with FaultCluster.open(workdir, replicas) as cluster`` owns the nursery; at its end the
    children stop, and so do the engines (which outlive agents by design).
    """

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, workdir: Path, replicas: int):
        cluster = None
        try:
            async with trio.open_nursery() as nursery:
                cluster = cls(nursery, workdir, replicas)
                try:
                    yield cluster
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            if cluster is not None:  # its children stopped: now their engines
                with trio.CancelScope(shield=True):
                    await cluster.http.aclose()
                cluster.reap_engines()

    def __init__(self, nursery: trio.Nursery, workdir: Path, replicas: int):
        self.nursery = nursery
        self.workdir = workdir
        self.replicas_wanted = replicas
        data_port, control_port = free_port(), free_port()
        self.data_url, self.control_url = f"http://127.0.0.1:{data_port}", f"http://127.0.0.1:{control_port}"
        self.config = workdir / "llmgw.yaml"
        self.config.write_text(cluster_config(data_port, control_port, replicas))
        self.http = httpx.AsyncClient(timeout=10)
        self.serve: Child | None = None
        self.agent: Child | None = None
        self.engine_pids: set[int] = set()

    async def start_serve(self) -> None:
        argv = llmgw_command("serve", "--config", str(self.config))
        self.serve = await start_child(self.nursery, argv, name="llmgw serve")

    async def start_agent(self) -> None:
        argv = llmgw_command("agent", "--join", self.control_url, "--token", TOKEN, "--node-id", NODE,
                             "--state-dir", str(self.workdir / "agent"), "--address", "127.0.0.1",
                             "--discovery", "cpu", "--log-level", "warning")
        self.agent = await start_child(self.nursery, argv, name="llmgw agent", ready=AGENT_READY)

    @staticmethod
    async def kill(child: Child) -> None:
        os.kill(child.pid, signal.SIGKILL)
        with trio.fail_after(30):
            await child.process.wait()

    async def replicas(self) -> dict[str, dict]:
        body = (await self.http.get(self.control_url + "/admin/replicas")).json()
        self.engine_pids.update(s["pid"] for r in body for s in r.get("shards", []) if s.get("pid"))
        return {r["name"]: r for r in body}

    async def replicas_where(self, check, timeout: float = 120.0) -> dict[str, dict]:
        with trio.fail_after(timeout):
            while True:
                try:
                    replicas = await self.replicas()
                    if len(replicas) == self.replicas_wanted and all(r["state"] == "up" for r in replicas.values()) \
                            and check(replicas):
                        return replicas
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    pass
                await trio.sleep(0.05)

    async def metric(self, name: str) -> float:
        return metric_value(await scrape(self.control_url, self.http), name)

    async def routable(self, since: float, timeout: float = 120.0) -> float:
        """Seconds from ``since`` until a small request sent now or later is answered 200."""
        body = {"model": "tiny", "prompt": "are you there", "max_tokens": 1}
        with trio.fail_after(timeout):
            while True:
                try:
                    if (await self.http.post(self.data_url + "/v1/completions", json=body)).status_code == 200:
                        return time.monotonic() - since
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.05)

    def reap_engines(self) -> None:
        """Engines outlive agents by design: stop every one this run started (the ledger's and those seen)."""
        ledger = self.workdir / "agent" / "shards.json"
        if ledger.exists():
            for entry in json.loads(ledger.read_text()).get("shards", {}).values():
                self.engine_pids.add(entry.get("pgid") or entry.get("pid") or 0)
        for pid in self.engine_pids - {0}:
            try:
                signal_group(pid, signal.SIGKILL)
            except (ValueError, PermissionError):
                pass


def pids(replicas: dict[str, dict]) -> dict[str, int]:
    return {name: r["shards"][0]["pid"] for name, r in replicas.items()}


def restarts(replicas: dict[str, dict]) -> int:
    return sum(s["restarts"] for r in replicas.values() for s in r["shards"])


class EngineFault:
    """One engine killed; its agent restarts it."""

    name = "engine"

    def __init__(self, before: dict[str, dict]):
        self.victim = sorted(before)[0]
        self.pid = before[self.victim]["shards"][0]["pid"]

    async def kill(self, cluster: FaultCluster) -> None:
        os.kill(self.pid, signal.SIGKILL)
        await wait_group_gone(self.pid, timeout=30)

    async def recover(self, cluster: FaultCluster) -> dict[str, dict]:
        return await cluster.replicas_where(lambda rs: rs[self.victim]["shards"][0]["pid"] not in (0, self.pid))

    def kept(self, before: dict[str, dict], after: dict[str, dict]) -> bool:
        return all(pids(after)[name] == pid for name, pid in pids(before).items() if name != self.victim)


class AgentFault:
    """The agent killed, started again ``down`` seconds later; it adopts its engines."""

    name = "agent"

    def __init__(self, before: dict[str, dict], down: float):
        self.down = down

    async def kill(self, cluster: FaultCluster) -> None:
        assert cluster.agent is not None  # started before any fault
        await cluster.kill(cluster.agent)

    async def recover(self, cluster: FaultCluster) -> dict[str, dict]:
        await trio.sleep(self.down)
        await cluster.start_agent()
        return await cluster.replicas_where(lambda rs: all("adopted" in r["shards"][0]["reason"]
                                                           for r in rs.values()))

    @staticmethod
    def kept(before: dict[str, dict], after: dict[str, dict]) -> bool:
        """Every engine kept its pid."""
        return pids(after) == pids(before)


class ControlPlaneFault:
    """``llmgw serve`` killed and started again at once; the agent reconnects and its engines are adopted."""

    name = "control plane"
    kept = staticmethod(AgentFault.kept)

    def __init__(self, before: dict[str, dict]):
        pass

    async def kill(self, cluster: FaultCluster) -> None:
        assert cluster.serve is not None  # started before any fault
        await cluster.kill(cluster.serve)

    async def recover(self, cluster: FaultCluster) -> dict[str, dict]:
        await cluster.start_serve()
        return await cluster.replicas_where(lambda rs: {r["origin"] for r in rs.values()} == {"adopted"})


async def run_fault(make_fault, cluster: FaultCluster, load: SteadyLoad, duration: float) -> FaultResult:
    before = await cluster.replicas_where(lambda rs: True)
    fault = make_fault(before)
    retries = await cluster.metric("llmgw_retries_total")
    load.phase = fault.name
    await trio.sleep(duration / 2)
    routable: list[float] = []

    async def probe(since: float) -> None:
        routable.append(await cluster.routable(since))

    async with trio.open_nursery() as nursery:
        killed_at = time.monotonic()
        await fault.kill(cluster)
        gone_at = time.monotonic()  # a request that connected before this may have reached the dying process
        nursery.start_soon(probe, killed_at)
        after = await fault.recover(cluster)
        replicas_up_s = time.monotonic() - killed_at
    await trio.sleep(duration / 2)
    await load.pause()
    counts = load.phases[fault.name]
    restarted = isinstance(fault, ControlPlaneFault)
    gateway_retries = None if restarted else int(await cluster.metric("llmgw_retries_total") - retries)
    engines = {name: r["url"] for name, r in after.items()}
    checks = await check_kv_truth(cluster.http, cluster.data_url, cluster.control_url, engines,
                                  tag=fault.name.replace(" ", ""))
    load.resume()
    return FaultResult(
        fault=fault.name, sent=counts.sent(),
        failed={f"{kind} {outcome}": n for kind in ("plain", "stream") for outcome, n in counts.failed(kind).items()},
        not_started_retries=counts.not_started_retries, gateway_retries=gateway_retries,
        lost_before_gone=all(t <= gone_at for t in counts.lost_started_at),
        routable_s=round(routable[0], 3), replicas_up_s=round(replicas_up_s, 3),
        engine_restarts=restarts(after) - restarts(before), same_pids=fault.kept(before, after),
        kv_exact=all(c.exact for c in checks), kv_checks=[asdict(c) | {"exact": c.exact} for c in checks])


def print_table(results: list[FaultResult]) -> None:
    print("| fault | requests | failed (by kind) | lost ones in flight at the kill | not started, retried "
          "| retried by the gateway | routable again | all replicas up | engine restarts | same pids "
          "| predicted == actual |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        failed = ", ".join(f"{n} {kind}" for kind, n in sorted(r.failed.items())) or "0"
        print(f"| {r.fault} | {r.sent} | {failed} | {'yes' if r.lost_before_gone else 'no'} "
              f"| {r.not_started_retries} | {'n/a' if r.gateway_retries is None else r.gateway_retries} "
              f"| {r.routable_s:.2f} s "
              f"| {r.replicas_up_s:.2f} s | {r.engine_restarts} | {'yes' if r.same_pids else 'no'} "
              f"| {'yes' if r.kv_exact else 'no'} |")


async def run(args) -> dict:
    settings = LoadSettings.from_args(args)
    faults = [EngineFault, lambda before: AgentFault(before, args.agent_down), ControlPlaneFault]
    results: list[FaultResult] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-fault-") as workdir:
        async with FaultCluster.open(Path(workdir), args.replicas) as cluster:
            await cluster.start_serve()
            await cluster.start_agent()
            await cluster.replicas_where(lambda rs: True)
            load = SteadyLoad(cluster.data_url, settings)
            async with load.running():
                await trio.sleep(args.duration / 2)  # warm-up
                for make_fault in faults:
                    results.append(await run_fault(make_fault, cluster, load, args.duration))
                    print(f"  {results[-1].fault}: done", flush=True)
    return {"settings": asdict(settings) | {"duration_s": args.duration, "replicas": args.replicas,
                                            "agent_down_s": args.agent_down},
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_average":
                        os.getloadavg()},
            "results": [asdict(r) for r in results]}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.prog = "llmgw bench fault"
    parser.add_argument("--duration", type=float, default=6.0, help="seconds of load around each fault (default 6)")
    add_load_options(parser, rate=20.0, concurrency=4, max_tokens=16)
    parser.add_argument("--replicas", type=int, default=2, help="simulator replicas (default 2)")
    parser.add_argument("--agent-down", type=float, default=2.0, help="seconds the agent stays dead (default 2)")
    cluster = parser.add_argument_group("several gateways (--gateways N >= 2: llmgw.bench.fault_cluster)")
    cluster.add_argument("--gateways", type=int, default=1,
                         help="1 (default): one llmgw serve with an agent, faults engine, agent, control plane; "
                              "N >= 2: a control process and N-1 --role gateway processes sharing state through a "
                              "private redis-server, faults: a gateway, then redis")
    cluster.add_argument("--redis-down", type=float, default=10.0,
                         help="seconds redis-server stays dead (default 10)")
    cluster.add_argument("--redis", choices=("server", "sentinel"), default="server",
                         help="server (default): one redis-server, killed and started again; sentinel: a primary, "
                              "its replica and a sentinel (state.sentinel), the primary killed and not started "
                              "again")
    cluster.add_argument("--load-ttl", type=float, default=2.0,
                         help="state.load_ttl of the gateways, seconds (default 2)")
    args = parser.parse_args(argv)
    if not (1 <= args.gateways <= 8 and 0 < args.duration <= 120 and 0 < args.rate <= 200
            and 1 <= args.concurrency <= 64 and 0 <= args.redis_down <= 120 and 0.1 <= args.load_ttl <= 60):
        parser.error("bounds: 1 <= --gateways <= 8, 0 < --duration <= 120, 0 < --rate <= 200, "
                     "1 <= --concurrency <= 64, 0 <= --redis-down <= 120, 0.1 <= --load-ttl <= 60")
    if args.gateways > 1:
        report = trio.run(fault_cluster.run, args)
        results = [fault_cluster.result_from_dict(r) for r in report["results"]]
        return print_and_save(report, fault_cluster.markdown(results), args.json)
    report = trio.run(run, args)
    print_table([FaultResult(**r) for r in report["results"]])
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
