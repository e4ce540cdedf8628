"""Benchmark: a schedule of faults under steady load over the production topology; what each one cost.

``llmgw bench chaos [--faults all] [--repeats 1] [--quick] [--soak MINUTES] [--json bench-results/chaos.json]``

The cluster (:mod:`.chaos_rig`): a real ``redis-server``, two candidates, ``--gateways``
``--role gateway`` processes (the last behind a TCP proxy to Redis that the bench can cut),
and a remote ``llmgw agent --join A,B`` to which the leader deploys simulators with KV
events; ``state.secret_env`` set, ``agents.heartbeat_interval: 0.5s``. A steady load
(:mod:`.fault_load`, ``--rate`` requests per second per gateway, round robin) runs on
every gateway throughout. The faults (:mod:`.chaos_schedule`), one after the other, each
with ``--before`` seconds of load, the fault, then at least ``--observe`` seconds and until
every gateway has routed to every replica for ``--stable`` seconds (at most ``--settle``):
Redis SIGSTOP; Redis kill -9 and an empty restart; the leader SIGSTOP; the leader kill -9
(restarted as a candidate); a forged lease written to Redis with no secret; the lease
deleted three times (``DEL``, 1 s apart); a partition
between the last gateway and Redis; the agent kill -9 and restart; an engine kill -9.

Per fault: the requests that ended in its window and, per gateway, the failed ones by
outcome (``http_503``, ``in_flight``, ...), those lost inside a killed or frozen process
(its own ``in_flight``, ``stream_cut`` and ``timeout``) apart; from the fault's end (the
SIGCONT, Redis answering, the restart, the lease's expiry or last deletion) until every replica is routable
again on every gateway (``/admin/models``), and how long each gateway could not route to
all; whether the engines kept their pids (as the agent reported them, before and after);
the leaders and terms seen. A cluster that has not recovered after ``--settle`` seconds is
healed by restarting the agent, and the row says so. It prints a Markdown table and, with
``--json``, writes it all. The exit status never depends on a result: it is a measurement.

``--soak MINUTES``: the same cluster with 3 gateways, one fault from the schedule every
``--soak-every`` seconds (120), each process's RSS, open descriptors and Trio tasks
(``llmgw_trio_tasks``) sampled every ``--sample-every`` seconds; it reports each one's
slope per hour and the failed requests outside a killed process's own in-flight ones.
``--routing-options YAML`` adds to the deployed profile's routing options (the soak's
``{tokenize_cache_tokens: 20000, tree_ttl: 60s}`` fills those caches within minutes).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import platform
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import coredis
import trio
import yaml

from ..procgroup import wait_group_gone
from .chaos_rig import AUTO_MODEL, AUTO_PROFILE, CLUSTER, ChaosRig, rss_and_fds
from .chaos_scaler import ScalerLog, ScalerWindow
from .chaos_schedule import QUICK, Fault, median_and_range, parse_faults, slope_per_hour, soak_plan
from .cluster_rig import GatewayProcess
from .common import bench_parser, cell, print_and_save
from .fault_load import MODEL, LoadSettings, SteadyLoad, add_load_options

LOST_INSIDE = ("in_flight", "stream_cut", "timeout")  # how a request inside a killed or frozen process ends
POLL = 0.1
DEGRADED_EVERY = 2  # /health read every second poll


@dataclass
class GatewayRow:
    gateway: str
    requests: int
    failed: dict[str, int]  # outcome -> count, the victim's own lost requests left out
    lost_inside: int = 0  # the victim's own requests in flight while it was killed or frozen
    unroutable_s: float = 0.0  # time it could not route to every replica (or did not answer), in the window
    degraded_s: float = 0.0  # time its /health said the shared state was degraded, in the window
    back_s: float | None = None  # fault's end -> its last moment without every replica; None: not back


@dataclass
class ChaosResult:
    fault: str
    what: str
    run: int
    victim: str | None
    requests: int
    gateways: list[GatewayRow]
    routable_again_s: float | None  # fault's end (a leader fault: the new leader's election) -> every replica
    # routable on every gateway again (None: not by itself)
    new_leader_s: float | None  # the fault's start -> another leader seen
    healed_by: str | None  # what the bench did because it had not recovered by itself
    engines_before: dict[str, int]
    engines_after: dict[str, int]
    engines_restarted: list[str]  # replicas whose engine pid changed (the engine fault's victim included)
    expected_restarts: list[str]  # the engine fault's victim
    leaders: list[str]  # "A term 3" in the order seen, the one before the fault first
    fault_s: float  # how long the fault lasted (0 for an instant one)
    scaler: dict | None = None  # the autoscaled deployment's count and decisions (ScalerWindow), None: unread

    @property
    def failed_elsewhere(self) -> int:
        return sum(sum(row.failed.values()) for row in self.gateways)

    @property
    def lost_inside(self) -> int:
        return sum(row.lost_inside for row in self.gateways)


@dataclass
class Condition:
    """One gateway's yes/no condition (it cannot route to every replica; its /health says degraded), polled:
    each poll's finding stands until the next poll."""

    held_s: float = 0.0
    holds: bool = False
    polled_at: float | None = None
    clear_since: float | None = None  # the poll that found it over, or the first poll; None while it holds

    def record(self, at: float, holds: bool) -> None:
        if self.holds and self.polled_at is not None:
            self.held_s += at - self.polled_at
        if holds:
            self.clear_since = None
        elif self.clear_since is None:
            self.clear_since = at
        self.holds, self.polled_at = holds, at

    def back_after(self, ended: float) -> float | None:
        """Seconds from ``ended`` until it last stopped holding (0: not after ``ended``); None: it holds now."""
        return None if self.clear_since is None else round(max(0.0, self.clear_since - ended), 2)


@dataclass
class Watch:
    """What the watchers saw during one fault: per gateway its routing and its health, and the leaders."""

    unroutable: dict[str, Condition] = field(default_factory=lambda: collections.defaultdict(Condition))
    degraded: dict[str, Condition] = field(default_factory=lambda: collections.defaultdict(Condition))
    leaders: list[str] = field(default_factory=list)
    new_leader_at: float | None = None  # when a leader other than the first one seen was first seen

    def all_routable_since(self) -> float | None:
        """Since when every gateway watched routes to every replica; None while one does not."""
        since = [c.clear_since for c in self.unroutable.values()]
        return None if not since or None in since else max(s for s in since if s is not None)


async def watch_gateway(rig: ChaosRig, gateway: GatewayProcess, watch: Watch) -> None:
    """Poll ``gateway`` (a task per gateway: a frozen one delays only its own polls; a poll is timed from its
    start, when the gateway was or was not answering)."""
    turn = 0
    while True:
        at = time.monotonic()
        watch.unroutable[gateway.name].record(at, not await rig.routes_all(gateway))
        if turn % DEGRADED_EVERY == 0:
            at = time.monotonic()
            watch.degraded[gateway.name].record(at, await rig.degraded(gateway))
        turn += 1
        await trio.sleep(POLL)


async def watch_leaders(rig: ChaosRig, watch: Watch) -> None:
    while True:
        found = await rig.leader()
        if found is not None:
            seen = f"{found[0].name} term {found[1]}"
            if not watch.leaders or watch.leaders[-1] != seen:
                watch.leaders.append(seen)
                if len(watch.leaders) > 1 and watch.new_leader_at is None:
                    watch.new_leader_at = time.monotonic()
        await trio.sleep(2 * POLL)


@dataclass
class Settings:
    before: float = 3.0
    observe: float = 15.0
    stable: float = 2.0
    settle: float = 60.0
    redis_stop: float = 8.0
    redis_down: float = 8.0
    leader_stop: float = 7.0
    forged_ms: int = 6000
    lease_deletes: int = 3
    partition: float = 8.0
    agent_down: float = 2.0

    def describe(self, fault: Fault) -> str:
        return fault.what.format(**asdict(self))


class Injector:
    """Does each fault to the rig; returns when the fault is over (the moment the recovery is timed from)."""

    def __init__(self, rig: ChaosRig, settings: Settings):
        self.rig = rig
        self.s = settings
        self.victim: GatewayProcess | None = None
        self.expected_restarts: list[str] = []

    async def do(self, fault: Fault, engines: dict[str, int]) -> float:
        """The fault; when it ended (``time.monotonic()``)."""
        self.victim, self.expected_restarts = None, []
        if fault.victim == "leader":
            found = await self.rig.leader()
            self.victim = found[0] if found is not None else self.rig.candidates[0]
        ended = await getattr(self, fault.name.replace("-", "_"))(engines)
        return ended if ended is not None else time.monotonic()

    async def redis_stop(self, engines) -> None:
        await self._frozen(self.rig.redis.pid, self.s.redis_stop)

    async def redis_restart(self, engines) -> None:
        port = self.rig.redis.port
        await self.rig.redis.kill()
        await trio.sleep(self.s.redis_down)
        await self.rig.redis.start(port)  # empty: the servers the rig runs keep nothing on disk

    async def leader_stop(self, engines) -> None:
        assert self.victim is not None
        await self._frozen(self.victim.pid, self.s.leader_stop)

    async def leader_kill(self, engines) -> float:
        """Over at the kill (the other candidate's election is part of the recovery); the victim is started
        again meanwhile, as a candidate."""
        assert self.victim is not None
        await self.victim.kill()
        killed = time.monotonic()
        self.rig.nursery.start_soon(self.victim.start, self.rig.nursery)
        return killed

    async def forged_lease(self, engines) -> None:
        async with self._intruder() as client:
            await client.set(f"llmgw:{CLUSTER}:leader", "999 evil http://127.0.0.1:1", px=self.s.forged_ms)
        await trio.sleep(self.s.forged_ms / 1000)

    async def lease_delete(self, engines) -> None:
        async with self._intruder() as client:
            for i in range(self.s.lease_deletes):
                if i:
                    await trio.sleep(1.0)
                await client.delete([f"llmgw:{CLUSTER}:leader"])

    async def partition(self, engines) -> None:
        self.rig.proxy.cut()
        try:
            await trio.sleep(self.s.partition)
        finally:
            self.rig.proxy.restore()

    async def agent_kill(self, engines) -> None:
        await self.rig.kill_agent()
        await trio.sleep(self.s.agent_down)
        await self.rig.start_agent()

    async def engine_kill(self, engines) -> None:
        await self._kill_engine(engines, sorted(n for n in engines if not n.startswith(AUTO_PROFILE))[0])

    async def autoscaled_engine_kill(self, engines) -> None:
        await self._kill_engine(engines, sorted(n for n in engines if n.startswith(AUTO_PROFILE))[0])

    async def _kill_engine(self, engines: dict[str, int], name: str) -> None:
        self.expected_restarts = [name]
        os.kill(engines[name], signal.SIGKILL)
        await wait_group_gone(engines[name], timeout=30)

    def _intruder(self) -> "coredis.Redis[bytes]":
        """A client of the rig's Redis as anyone who can write to it would have (no cluster secret)."""
        return coredis.Redis("127.0.0.1", self.rig.redis.port, connect_timeout=2, stream_timeout=5)

    @staticmethod
    async def _frozen(pid: int, seconds: float) -> None:
        os.kill(pid, signal.SIGSTOP)
        try:
            await trio.sleep(seconds)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def wait_recovered(rig: ChaosRig, watch: Watch, s: Settings, ended: float) -> bool:
    """At least ``observe`` seconds after the fault's end, then until every gateway has routed to every
    replica for ``stable`` seconds; False when that did not happen within ``settle`` seconds of the end."""
    await trio.sleep(max(0.0, ended + s.observe - time.monotonic()))
    while time.monotonic() < ended + s.settle:
        since = watch.all_routable_since()
        if since is not None and time.monotonic() - since >= s.stable:
            return True
        await trio.sleep(POLL)
    return False


async def run_fault(rig: ChaosRig, load: SteadyLoad, scaler: ScalerLog, fault: Fault, s: Settings,
                    run: int) -> ChaosResult:
    phase = f"{fault.name}#{run}"
    load.phase = phase
    await trio.sleep(s.before)
    injector = Injector(rig, s)
    engines_before = await rig.engine_pids()
    watch = Watch()
    healed_by = None
    async with trio.open_nursery() as watchers:
        watchers.start_soon(watch_leaders, rig, watch)
        for gateway in rig.gateways:
            watchers.start_soon(watch_gateway, rig, gateway, watch)
        await trio.sleep(2 * POLL)  # the leader before the fault first in the list; every gateway polled once
        started = time.monotonic()
        ended = await injector.do(fault, engines_before)
        recovered = await wait_recovered(rig, watch, s, ended)
        if not recovered:
            healed_by = "agent restarted"  # what heals the known failure (issue 29); the row says it was needed
            print(f"  {fault.name}: not recovered {s.settle:g} s after the fault; restarting the agent", flush=True)
            await rig.kill_agent()
            await rig.start_agent()
            healed = await wait_recovered(rig, watch, Settings(observe=0, stable=s.stable, settle=s.settle),
                                          time.monotonic())
            if not healed:
                healed_by = "nothing healed it"
        watchers.cancel_scope.cancel()
    scaled = scaler.window(started, time.monotonic())
    for why in scaled.reasons:
        print(f"  {fault.name}: autoscale {why}", flush=True)
    await load.pause()
    counts = load.phases[phase]
    load.resume()
    engines_after = await rig.engine_pids()
    victim = injector.victim
    # A leader fault's recovery is timed from the election it causes (the issue's target: every replica routable
    # within lease_ttl + lease_renew + 1 s of it), when one was seen; every other fault's from its end.
    since = watch.new_leader_at if fault.victim == "leader" and watch.new_leader_at is not None else ended
    rows = []
    for gateway in rig.gateways:
        outcomes = counts.by_target.get(gateway.url) or collections.Counter()
        failed = {k: n for k, n in outcomes.items() if k != "ok"}
        lost = sum(failed.pop(k, 0) for k in LOST_INSIDE) if gateway is victim else 0
        unroutable, degraded = watch.unroutable[gateway.name], watch.degraded[gateway.name]
        rows.append(GatewayRow(gateway.name, sum(outcomes.values()), failed, lost, round(unroutable.held_s, 1),
                               round(degraded.held_s, 1), None if healed_by else unroutable.back_after(since)))
    backs = [row.back_s for row in rows if row.gateway != (victim.name if victim else None)]
    return ChaosResult(
        fault=fault.name, what=s.describe(fault), run=run, victim=victim.name if victim else None,
        requests=counts.sent(), gateways=rows,
        routable_again_s=None if healed_by or None in backs else max(b for b in backs if b is not None),
        new_leader_s=None if watch.new_leader_at is None else round(watch.new_leader_at - started, 2),
        healed_by=healed_by, engines_before=engines_before, engines_after=engines_after,
        engines_restarted=sorted(n for n, pid in engines_before.items() if engines_after.get(n) != pid),
        expected_restarts=injector.expected_restarts, leaders=watch.leaders,
        fault_s=round(ended - started, 2), scaler=asdict(scaled))


# -- the report ---------------------------------------------------------------------------------------------------

def failed_cell(row: GatewayRow) -> str:
    failed = ", ".join(f"{n} {kind}" for kind, n in sorted(row.failed.items())) or "0"
    return f"{row.gateway}: {failed}" + (f" (+{row.lost_inside} in flight inside it)" if row.lost_inside else "")


def engines_cell(result: ChaosResult) -> str:
    unexpected = [n for n in result.engines_restarted if n not in result.expected_restarts]
    if len(result.engines_after) < len(result.engines_before) or not result.engines_before:
        return "pids unknown"
    if unexpected:
        return f"{len(unexpected)} restarted"
    return "killed one restarted, others same pids" if result.expected_restarts else "same pids"


def routable_cell(result: ChaosResult) -> str:
    if result.healed_by:
        return f"not by itself ({result.healed_by})"
    if not any(row.unroutable_s for row in result.gateways):
        return "always"
    victim = next((row for row in result.gateways if row.gateway == result.victim), None)
    own = f" ({victim.gateway} itself: {cell(victim.back_s, '.1f')} s)" if victim and victim.unroutable_s else ""
    return f"{cell(result.routable_again_s, '.1f')} s{own}"


def scaler_cell(result: ChaosResult) -> str:
    """The autoscaled deployment's desired count: before -> after [lowest-highest in between]; its decisions."""
    if result.scaler is None:
        return "-"
    w = ScalerWindow(**result.scaler)
    count = f"{cell(w.before, 'd')} -> {cell(w.after, 'd')}"
    if (w.lowest, w.highest) != (w.before, w.before):
        count += f" [{cell(w.lowest, 'd')}-{cell(w.highest, 'd')}]"
    return count + (f"; {', '.join(w.decisions)}" if w.decisions else "")


def leaders_cell(result: ChaosResult) -> str:
    seen = " -> ".join(result.leaders) or "-"
    return seen if result.new_leader_s is None else f"{seen} (after {result.new_leader_s:.1f} s)"


def markdown(results: list[ChaosResult]) -> str:
    lines = ["| fault | requests | failed per gateway (by outcome) | could not route to all (per gateway) "
             "| every replica routable again after the fault's end (leader faults: the election) | engines "
             "| leaders (terms) | /health degraded | autoscaled: desired before -> after [range]; decisions |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        unroutable = ", ".join(f"{row.gateway} {row.unroutable_s:.1f} s" for row in r.gateways)
        degraded = ", ".join(f"{row.gateway} {row.degraded_s:.1f} s" for row in r.gateways)
        lines.append(f"| {r.what} | {r.requests} | {'; '.join(failed_cell(row) for row in r.gateways)} "
                     f"| {unroutable} | {routable_cell(r)} | {engines_cell(r)} | {leaders_cell(r)} "
                     f"| {degraded} | {scaler_cell(r)} |")
    if len({r.run for r in results}) > 1:
        lines += ["", "| fault | runs | failed outside the victim: median [min-max] "
                      "| routable again: median [min-max] | recovered by itself | autoscaled count moved |",
                  "|---|---|---|---|---|---|"]
        for name in dict.fromkeys(r.fault for r in results):
            runs = [r for r in results if r.fault == name]
            failed = median_and_range([r.failed_elsewhere for r in runs])
            back = median_and_range([r.routable_again_s for r in runs if r.routable_again_s is not None])
            moved = sum(r.scaler is not None and ScalerWindow(**r.scaler).stepped for r in runs)
            lines.append(f"| {runs[0].what} | {len(runs)} | {spread(failed, '.0f')} | {spread(back, '.1f', ' s')} "
                         f"| {sum(r.healed_by is None for r in runs)} of {len(runs)} | {moved} of {len(runs)} |")
    return "\n".join(lines)


def spread(values: tuple[float, float, float] | None, spec: str, unit: str = "") -> str:
    if values is None:
        return "-"
    median, low, high = (format(v, spec) for v in values)
    return f"{median}{unit} [{low}-{high}]"


# -- the runs ------------------------------------------------------------------------------------------------------

def load_settings(args, gateways: int) -> LoadSettings:
    """``--rate`` per gateway, half of it for the fixed deployment's model and half for the autoscaled one's."""
    return LoadSettings.from_args(args, rate_scale=gateways, request_timeout=args.request_timeout,
                                  models=(MODEL, AUTO_MODEL))


def machine(load_before) -> dict:
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "load_average_before": load_before,
            "load_average_after": os.getloadavg()}


async def run(args) -> dict:
    faults = [parse_faults(",".join(QUICK))[0]] if args.quick else parse_faults(args.faults)
    settings = chaos_settings(args)
    load_before = os.getloadavg()
    results: list[ChaosResult] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-chaos-") as workdir:
        async with ChaosRig.open(Path(workdir), gateways=args.gateways, replicas=args.replicas) as rig:
            load = SteadyLoad([g.url for g in rig.gateways], load_settings(args, len(rig.gateways)))
            scaler = ScalerLog()
            async with load.running(), trio.open_nursery() as nursery:
                nursery.start_soon(scaler.run, rig)
                await trio.sleep(settings.before)  # warm-up
                for run_number in range(1, args.repeats + 1):
                    for fault in faults:
                        results.append(await run_fault(rig, load, scaler, fault, settings, run_number))
                        print(f"  {fault.name} (run {run_number}): done", flush=True)
                nursery.cancel_scope.cancel()
    return {"mode": "chaos", "settings": asdict(settings) | {"gateways": args.gateways, "replicas": args.replicas,
                                                             "rate_per_gateway": args.rate,
                                                             "concurrency": args.concurrency,
                                                             "repeats": args.repeats},
            "machine": machine(load_before), "results": [result_dict(r) for r in results]}


def result_dict(result: ChaosResult) -> dict:
    return asdict(result) | {"failed_elsewhere": result.failed_elsewhere, "lost_inside": result.lost_inside}


def result_from_dict(data: dict) -> ChaosResult:
    fields = {k: v for k, v in data.items() if k not in ("failed_elsewhere", "lost_inside")}
    return ChaosResult(**{**fields, "gateways": [GatewayRow(**g) for g in data["gateways"]]})


# -- the soak ------------------------------------------------------------------------------------------------------

async def sample(rig: ChaosRig, series: dict[str, list], started: float) -> None:
    """One sample of every process: ``series[name]`` gets ``(seconds, pid, rss, fds, tasks)``."""
    at = round(time.monotonic() - started, 1)
    by_name = {g.name: g for g in rig.gateways}
    for name, pid in rig.pids().items():
        found = rss_and_fds(pid)
        if found is None:
            continue
        tasks = await rig.trio_tasks(by_name[name]) if name in by_name else None
        series.setdefault(name, []).append((at, pid, *found, tasks))


def slopes(points: list[tuple]) -> dict:
    """Per hour, over the longest-lived pid of a process (a killed one starts a new series): rss, fds, tasks."""
    by_pid: dict[int, list[tuple]] = collections.defaultdict(list)
    for point in points:
        by_pid[point[1]].append(point)
    longest = max(by_pid.values(), key=lambda p: p[-1][0] - p[0][0])
    out: dict = {"pid": longest[0][1], "from_s": longest[0][0], "to_s": longest[-1][0], "samples": len(longest)}
    middle = (longest[0][0] + longest[-1][0]) / 2
    for index, key in ((2, "rss_bytes"), (3, "fds"), (4, "trio_tasks")):
        values = [(p[0], p[index]) for p in longest if p[index] is not None]
        # the second half's slope apart: a process warming up (caches, the KV index filling) grows early and
        # levels off, which the whole run's slope alone cannot tell from a leak
        late = [(t, v) for t, v in values if t >= middle]
        out[key] = {"first": values[0][1] if values else None, "last": values[-1][1] if values else None,
                    "per_hour": rounded(slope_per_hour(values)),
                    "second_half_per_hour": rounded(slope_per_hour(late))}
    return out


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


async def soak(args) -> dict:
    faults = parse_faults(args.faults)
    settings = chaos_settings(args)
    plan = soak_plan(args.soak, args.soak_every, faults)
    load_before = os.getloadavg()
    results: list[ChaosResult] = []
    series: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-soak-") as workdir:
        async with ChaosRig.open(Path(workdir), gateways=1, replicas=args.replicas,
                                 routing_options=args.routing_options) as rig:
            load = SteadyLoad([g.url for g in rig.gateways], load_settings(args, len(rig.gateways)))
            started = time.monotonic()

            async def sampler() -> None:
                while True:
                    await sample(rig, series, started)
                    await trio.sleep(args.sample_every)

            scaler = ScalerLog()
            async with load.running(), trio.open_nursery() as nursery:
                nursery.start_soon(sampler)
                nursery.start_soon(scaler.run, rig)
                load.phase = "quiet"
                for number, (at, fault) in enumerate(plan, 1):
                    await trio.sleep_until(trio.current_time() + max(0.0, started + at - time.monotonic()))
                    results.append(await run_fault(rig, load, scaler, fault, settings, number))
                    load.phase = "quiet"
                    print(f"  soak {time.monotonic() - started:.0f} s: {fault.name} done", flush=True)
                await trio.sleep(max(0.0, started + args.soak * 60 - time.monotonic()))
                await load.pause()
                nursery.cancel_scope.cancel()
            # new Redis clients each gateway opened (its pool had lost half its slots), over its current pid's life
            recycles = {g.name: await rig.gauge(g, "llmgw_cluster_redis_pool_recycles_total") for g in rig.gateways}
    quiet = load.phases.get("quiet")
    quiet_failed = sum(n for k, n in (quiet.outcomes["plain"] + quiet.outcomes["stream"]).items()
                       if k != "ok") if quiet else 0
    return {"mode": "soak", "settings": asdict(settings) | {"minutes": args.soak, "every_s": args.soak_every,
                                                            "sample_every_s": args.sample_every,
                                                            "rate_per_gateway": args.rate},
            "machine": machine(load_before),
            "routing_options": args.routing_options, "redis_pool_recycles": recycles,
            "failed_outside_victims": quiet_failed + sum(r.failed_elsewhere for r in results),
            "lost_inside_victims": sum(r.lost_inside for r in results),
            "requests": sum(p.sent() for p in load.phases.values()),
            "processes": {name: slopes(points) for name, points in series.items() if points},
            "series": series, "results": [result_dict(r) for r in results]}


def soak_markdown(report: dict) -> str:
    def drift(entry: dict, scale: float = 1.0, spec: str = ".0f") -> str:
        if entry["first"] is None:
            return "-"
        def per_hour(key: str) -> str:
            return "-" if entry.get(key) is None else format(entry[key] / scale, "+" + spec)
        return (f"{entry['first'] / scale:{spec}} -> {entry['last'] / scale:{spec}} ({per_hour('per_hour')}/h; "
                f"second half {per_hour('second_half_per_hour')}/h)")

    lines = [f"Soak: {report['settings']['minutes']:g} min, {report['requests']} requests, "
             f"{len(report['results'])} faults; failed outside a killed or frozen process's own in-flight ones: "
             f"{report['failed_outside_victims']} (lost inside one: {report['lost_inside_victims']}); new Redis "
             f"clients (a pool that lost half its slots) per gateway: {report.get('redis_pool_recycles', {})}", "",
             "| process | sampled | RSS MiB: first -> last (slope per hour; over the second half) | open fds "
             "| Trio tasks |", "|---|---|---|---|---|"]
    for name, entry in report["processes"].items():
        lines.append(f"| {name} | {entry['from_s']:.0f}-{entry['to_s']:.0f} s ({entry['samples']}) "
                     f"| {drift(entry['rss_bytes'], 2 ** 20, '.1f')} | {drift(entry['fds'])} "
                     f"| {drift(entry['trio_tasks'])} |")
    return "\n".join(lines + ["", markdown([result_from_dict(r) for r in report["results"]])])


# -- the command ---------------------------------------------------------------------------------------------------

def chaos_settings(args) -> Settings:
    if args.quick:
        return Settings(before=1.0, observe=2.0, stable=1.0, settle=30.0, partition=4.0)
    return Settings(before=args.before, observe=args.observe, stable=args.stable, settle=args.settle,
                    redis_stop=args.redis_stop, redis_down=args.redis_down, leader_stop=args.leader_stop,
                    partition=args.partition, agent_down=args.agent_down)


def parser() -> argparse.ArgumentParser:
    p = bench_parser(__doc__)
    p.prog = "llmgw bench chaos"
    p.add_argument("--faults", default="all", help="comma-separated faults in the order to run them, or all "
                                                   "(redis-stop, redis-restart, leader-stop, leader-kill, "
                                                   "forged-lease, lease-delete, partition, agent-kill, "
                                                   "engine-kill, autoscaled-engine-kill)")
    p.add_argument("--quick", action="store_true",
                   help="one short fault (a 4 s partition, longer than state.timeout): a smoke run")
    p.add_argument("--repeats", type=int, default=1, help="run the schedule this many times (default 1)")
    p.add_argument("--gateways", type=int, default=1, help="--role gateway processes beside the 2 candidates "
                                                           "(1 or 2; default 1)")
    p.add_argument("--replicas", type=int, default=2, help="simulators deployed through the agent (default 2)")
    add_load_options(p, rate=10.0, concurrency=12, max_tokens=8, rate_help="requests per second per gateway")
    p.add_argument("--request-timeout", type=float, default=30.0, help="a request's deadline, s (default 30)")
    p.add_argument("--before", type=float, default=3.0, help="seconds of load before each fault (default 3)")
    p.add_argument("--observe", type=float, default=15.0, help="seconds watched after each fault (default 15)")
    p.add_argument("--stable", type=float, default=2.0, help="seconds every gateway must route to every replica "
                                                             "to count as recovered (default 2)")
    p.add_argument("--settle", type=float, default=60.0, help="seconds after a fault before the bench heals "
                                                              "the cluster itself (default 60)")
    p.add_argument("--redis-stop", type=float, default=8.0, help="seconds Redis stays SIGSTOPped (default 8)")
    p.add_argument("--redis-down", type=float, default=8.0, help="seconds Redis stays dead (default 8)")
    p.add_argument("--leader-stop", type=float, default=7.0, help="seconds the leader stays SIGSTOPped (default 7)")
    p.add_argument("--partition", type=float, default=8.0, help="seconds the last gateway is cut from Redis "
                                                                "(default 8)")
    p.add_argument("--agent-down", type=float, default=2.0, help="seconds the agent stays dead (default 2)")
    soak_group = p.add_argument_group("soak")
    soak_group.add_argument("--soak", type=float, metavar="MINUTES", help="a soak of MINUTES through 3 gateways")
    soak_group.add_argument("--soak-every", type=float, default=120.0, help="seconds between faults (default 120)")
    soak_group.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples (default 5)")
    soak_group.add_argument("--routing-options", type=routing_options, default={}, metavar="YAML",
                            help="a YAML mapping added to the deployed profile's routing_options, e.g. "
                                 "'{tokenize_cache_tokens: 20000, tree_ttl: 60s}': caches bounded small are full "
                                 "within minutes, so what grows after that is not a warm-up")
    return p


def routing_options(text: str) -> dict:
    """``--routing-options``: a YAML mapping (checked by each gateway's config, which names a wrong key)."""
    value = yaml.safe_load(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a YAML mapping, e.g. '{tokenize_cache_tokens: 20000}'")
    return value


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        parse_faults(args.faults)
    except ValueError as exc:
        p.error(str(exc))
    if not (1 <= args.gateways <= 2 and 1 <= args.repeats <= 20 and 0 < args.rate <= 100
            and 1 <= args.concurrency <= 64 and 1 <= args.replicas <= 4 and args.settle >= args.observe >= 0
            and (args.soak is None or 0.25 <= args.soak <= 24 * 60) and args.soak_every >= 10
            and args.sample_every >= 0.5):
        p.error("bounds: 1 <= --gateways <= 2, 1 <= --repeats <= 20, 0 < --rate <= 100, 1 <= --concurrency <= 64, "
                "1 <= --replicas <= 4, --settle >= --observe >= 0, 0.25 <= --soak <= 1440, --soak-every >= 10, "
                "--sample-every >= 0.5")
    if args.soak is not None:
        report = trio.run(soak, args)
        return print_and_save(report, soak_markdown(report), args.json)
    report = trio.run(run, args)
    return print_and_save(report, markdown([result_from_dict(r) for r in report["results"]]), args.json)


if __name__ == "__main__":
    sys.exit(main())
