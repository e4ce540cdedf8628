"""What ``llmgw serve --workers 2`` costs and gives against one process: CPU per request, added latency, per worker.

Small non-streamed chat completions (``wrk``, one thread, the Lua POST script of :mod:`llmgw.bench.proxy`) to two
fake upstreams (:mod:`llmgw.testing.fake_upstream`), through:

* ``direct``: one upstream called directly (the latency every target adds to);
* ``llmgw``: one ``llmgw serve`` process (round_robin over the two upstreams);
* ``llmgw-shared``: one process with the shared state on (``state.backend: redis``, a redis-server on a Unix
  socket the benchmark runs): what the shared state costs a process, apart from a second process;
* ``llmgw-workers2``: ``llmgw serve --workers 2`` with the config of ``llmgw`` (no Redis in it: the supervisor
  runs its private redis-server on a Unix socket).

As in :mod:`llmgw.bench.proxy` (whose pieces this reuses), the gateway under test runs on CPU 1 and wrk and the
upstreams on CPU 0 (``taskset``; the workers and the private redis-server inherit the supervisor's CPU), so
both gateways get the same single core: the comparison is of the cost of the arrangement (two processes, the
shared state's load reports, Redis), not of its scaling, which needs more cores than the load generator and the
upstreams leave free on a 2-core machine. Scenarios: ``c1`` (one connection: latency; it stays with one worker)
and ``c32`` (32 connections, which the kernel spreads across the workers: requests/s and CPU per request).
CPU is user+system time from /proc: of every process of the target (supervisor, workers, redis-server), and of
each worker alone together with the requests its own ``/metrics`` counted, which gives each worker's share and
its CPU per request (its efficiency, against the single process's). Before the load, each target's CPU at
rest (``--duration`` seconds without requests) is its fixed cost. Rounds interleave the targets; medians over
the rounds are reported. Runs are short (``--duration``, default 3 s). The redis-servers' CPU counts for the
targets that use them.

Run: ``python -m llmgw.bench.workers [--duration 3] [--repeat 2] [--json bench-results/workers.json]``.
Needs ``wrk`` and ``taskset``, and ``redis-server`` (Debian: ``apt-get install wrk util-linux redis-server``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio

from llmgw.bench.common import cell as fmt, write_json
from llmgw.bench.proxy import (
    LOAD_CPU,
    MODEL,
    PROXY_CPU,
    SMALL_BODY,
    UPSTREAM_READY,
    BenchError,
    RunResult,
    check_target,
    check_tools,
    llmgw_config,
    lua_script,
    machine_info,
    process_cpu_seconds,
    run_wrk,
    start,
    summarize,
    versions,
    wait_ready,
)
from llmgw.redis_server import find_redis_server, run_redis_server
from llmgw.testing.metrics import series_sum
from llmgw.testing.processes import SERVE_READY, Child
from llmgw.testing.shared_state import state_section
from llmgw.usererrors import UserError

SCENARIOS = (("c1", 1), ("c32", 32))
SINGLE, SHARED, WORKERS = "llmgw", "llmgw-shared", "llmgw-workers2"
GATEWAYS = (SINGLE, SHARED, WORKERS)
WORKER_LINE = re.compile(r"^llmgw worker (\d+) \(pid (\d+), role (\w+)\) ready: control (\S+)$", re.MULTILINE)
REDIS_LINE = re.compile(r"private redis-server \(pid (\d+)\)")


@dataclass
class Process:
    """A gateway process whose CPU and served requests are counted: a whole gateway or one worker."""

    name: str
    pid: int
    control_url: str


@dataclass
class Target:
    name: str
    url: str
    child: Child | None  # None: the upstream called directly
    workers: list[Process] = field(default_factory=list)  # each gateway process with its own /metrics
    redis_pid: int | None = None  # a redis-server of its own
    redis_is_child: bool = False  # ...that is its child (its CPU is counted with the target's already)

    def cpu_seconds(self) -> float:
        """User+system CPU of every process of the target so far (its redis-server's too)."""
        assert self.child is not None
        total = process_cpu_seconds(self.child.pid)
        if self.redis_pid is not None and not self.redis_is_child:
            total += process_cpu_seconds(self.redis_pid)
        return total


@dataclass
class Share:
    """One gateway process during one run: its CPU seconds and the requests it answered."""

    target: str
    scenario: str
    process: str
    cpu_seconds: float
    requests: float

    @property
    def cpu_us_per_request(self) -> float | None:
        return self.cpu_seconds / self.requests * 1e6 if self.requests else None


def served(process: Process) -> float:
    """The requests ``process`` answered so far (its ``llmgw_requests_total``), read with a blocking GET."""
    with urllib.request.urlopen(process.control_url + "/metrics", timeout=5) as answer:
        return series_sum(answer.read().decode(), "llmgw_requests_total")


def measure(target: Target, script: Path, scenario: str, connections: int, duration: float,
            shares: list[Share]) -> RunResult:
    """One wrk run on ``target``; each of its processes' CPU and requests during it go to ``shares``."""
    before = [(process_cpu_seconds(p.pid), served(p)) for p in target.workers]
    redis_before = process_cpu_seconds(target.redis_pid) if target.redis_pid and not target.redis_is_child else 0.0
    result = run_wrk(target.url, script, connections, duration, target.child, target.name, scenario)
    for process, (cpu, requests) in zip(target.workers, before):
        shares.append(Share(target.name, scenario, process.name, process_cpu_seconds(process.pid) - cpu,
                            served(process) - requests))
    if redis_before and target.redis_pid is not None and result.proxy_cpu_share is not None and result.requests:
        redis = process_cpu_seconds(target.redis_pid) - redis_before  # not a child of the gateway: add it
        result.proxy_cpu_share += redis / result.seconds
        result.proxy_cpu_us_per_request = (result.proxy_cpu_us_per_request or 0.0) + redis / result.requests * 1e6
    return result


def at_rest(target: Target, seconds: float) -> float:
    """The share of a core ``target`` uses over ``seconds`` without requests (blocking)."""
    before = target.cpu_seconds()
    time.sleep(seconds)
    return (target.cpu_seconds() - before) / seconds


def worker_processes(child: Child) -> tuple[list[Process], int | None]:
    """The workers (``llmgw worker I (pid P, role R) ready: control URL`` lines) and the private Redis's pid."""
    text = child.output(200)
    workers = [Process(f"worker {index} ({role})", int(pid), url)
               for index, pid, role, url in WORKER_LINE.findall(text)]
    redis = REDIS_LINE.search(text)
    return workers, int(redis.group(1)) if redis else None


async def start_targets(nursery: trio.Nursery, workdir: Path, targets: list[Target], commands: dict) -> None:
    """The upstreams, then every target, checked by hand (what wrk counts must be real answers)."""
    urls = []
    for name in ("a", "b"):
        upstream = await start(nursery, workdir, f"upstream-{name}", [
            sys.executable, "-m", "llmgw.testing.fake_upstream", "--port", "0", "--name", name, "--model", MODEL,
            "--chunks", "50"], LOAD_CPU, UPSTREAM_READY, 30)
        commands[upstream.name] = upstream.argv
        urls.append(upstream.url)
    check_target("direct", urls[0])
    targets.append(Target("direct", urls[0], None))
    # The shared state's redis-server: on the gateways' core, as the private one of --workers is.
    redis = await nursery.start(partial(run_redis_server, workdir / "redis", unix_socket=workdir / "redis.sock"))
    os.sched_setaffinity(redis.pid, {PROXY_CPU})
    config, shared = workdir / "llmgw.yaml", workdir / "llmgw-shared.yaml"
    config.write_text(llmgw_config(urls))
    shared.write_text(llmgw_config(urls) + state_section(redis.url, "bench"))
    for name, path, extra in ((SINGLE, config, []), (SHARED, shared, []),
                              (WORKERS, config, ["--workers", "2", "--state-dir", str(workdir / "w")])):
        child = await start(nursery, workdir, name, [
            sys.executable, "-m", "llmgw", "serve", "--config", str(path), "--listen", "127.0.0.1:0",
            "--control-listen", "127.0.0.1:0", *extra], PROXY_CPU, SERVE_READY, 60)
        commands[name] = child.argv
        wait_ready(child.url, 30, child)
        check_target(name, child.url)
        target = Target(name, child.url, child)
        if name == WORKERS:
            target.workers, target.redis_pid = worker_processes(child)
            target.redis_is_child = True
            if len(target.workers) != 2:
                raise BenchError(f"{name}: expected 2 worker lines, found:\n{child.output(40)}")
        else:
            target.workers = [Process("single", child.pid, child.control_url)]
            target.redis_pid = redis.pid if name == SHARED else None
        targets.append(target)
        print(f"{name}: {child.url} (pid {child.pid}"
              + "".join(f", {w.name} pid {w.pid}" for w in target.workers if extra)
              + (f", redis-server pid {target.redis_pid}" if target.redis_pid else "") + ")", flush=True)


async def run(args: argparse.Namespace, workdir: Path, results: list[RunResult], shares: list[Share],
              commands: dict, rest: dict) -> None:
    """Start every target in one nursery (each process group stopped when it ends: at the end, on an error, on
    Ctrl-C), then measure them in interleaved rounds (blocking: nothing else runs here meanwhile)."""
    async with trio.open_nursery() as nursery:
        targets: list[Target] = []
        await start_targets(nursery, workdir, targets, commands)
        for target in targets[1:]:
            rest[target.name] = round(at_rest(target, args.duration), 4)
            print(f"  {target.name:15s} at rest: {rest[target.name] * 100:.1f}% of a core", flush=True)
        scripts = {scenario: lua_script(workdir, scenario, SMALL_BODY) for scenario, _ in SCENARIOS}
        for round_ in range(args.repeat):
            for scenario, connections in SCENARIOS:
                for target in targets:
                    if round_ == 0 and args.warmup:
                        run_wrk(target.url, scripts[scenario], connections, args.warmup, None, target.name,
                                scenario + "-warmup")
                    result = measure(target, scripts[scenario], scenario, connections, args.duration, shares)
                    results.append(result)
                    cpu = (f"  CPU {result.proxy_cpu_us_per_request:6.1f} µs/req"
                           if result.proxy_cpu_us_per_request is not None else "")
                    print(f"  [{round_ + 1}/{args.repeat}] {target.name:15s} {scenario:4s} {result.rps:8.0f} req/s  "
                          f"p50 {result.p50_ms:6.3f} ms{cpu}{'' if result.ok else f'  ERRORS {result.errors}'}",
                          flush=True)
        nursery.cancel_scope.cancel()


def per_process(shares: list[Share]) -> dict:
    """Per target, scenario and process: the median share of requests and CPU per request over the rounds."""
    out: dict = {}
    for share in shares:
        out.setdefault(share.target, {}).setdefault(share.scenario, {}).setdefault(share.process, []).append(share)
    table: dict = {}
    for target, scenarios in out.items():
        for scenario, processes in scenarios.items():
            rounds = len(next(iter(processes.values())))
            totals = [sum(p[i].requests for p in processes.values()) for i in range(rounds)]
            cells = {}
            for name, runs in processes.items():
                per_request = [r.cpu_us_per_request for r in runs if r.cpu_us_per_request is not None]
                cells[name] = {
                    "requests_share": round(statistics.median(
                        r.requests / total for r, total in zip(runs, totals) if total), 3) if any(totals) else None,
                    "cpu_us_per_request": round(statistics.median(per_request), 1) if per_request else None,
                }
            table.setdefault(target, {})[scenario] = cells
    return table


def conclusions(summary: dict, processes: dict, rest: dict) -> dict:
    """The numbers the report is about: each target against one process (ratios of medians)."""
    out: dict = {"at_rest_share_of_a_core": rest}
    single = summary.get(SINGLE, {})
    for scenario in ("c1", "c32"):
        base = single.get(scenario, {})
        for key, name in (("added_p50_ms", "added_p50_ms"), ("proxy_cpu_us_per_request", "cpu_us_per_request"),
                          ("rps", "rps")):
            cells = {target: summary.get(target, {}).get(scenario, {}).get(key) for target in GATEWAYS}
            if base.get(key) and key != "added_p50_ms":
                cells.update({f"{target}_ratio": round(value / base[key], 3) for target, value in list(cells.items())
                              if value and target != SINGLE})
            out[f"{scenario}_{name}"] = cells
    single_cpu = processes.get(SINGLE, {}).get("c32", {}).get("single", {}).get("cpu_us_per_request")
    if single_cpu:
        out["c32_worker_efficiency"] = {
            name: {**cell, "vs_single_process": round(single_cpu / cell["cpu_us_per_request"], 3)
                   if cell.get("cpu_us_per_request") else None}
            for name, cell in processes.get(WORKERS, {}).get("c32", {}).items()}
    return out


def print_report(summary: dict, processes: dict, found: dict, rest: dict) -> None:
    print("\nmedians over the rounds; CPU per request counts every process of the target (supervisor, workers, "
          "redis-server) on its one core")
    print("| target | c=1 p50 ms | added p50 ms | c=32 req/s | c=32 p50 ms | CPU µs/req c=32 | CPU µs/req c=1 | "
          "others on the core |")
    print("|---|---|---|---|---|---|---|---|")
    for target in ("direct", *GATEWAYS):
        row = summary.get(target, {})
        c1, c32 = row.get("c1", {}), row.get("c32", {})
        others = max(c1.get("others_on_proxy_core_max") or 0.0, c32.get("others_on_proxy_core_max") or 0.0)
        print(f"| {target} | {fmt(c1.get('p50_ms'), '.3f')} | {fmt(c1.get('added_p50_ms'), '+.3f')} | "
              f"{fmt(c32.get('rps'), '.0f')} | {fmt(c32.get('p50_ms'), '.3f')} | "
              f"{fmt(c32.get('proxy_cpu_us_per_request'), '.1f')} | {fmt(c1.get('proxy_cpu_us_per_request'), '.1f')} | "
              f"{'-' if target == 'direct' else f'up to {others * 100:.0f}%'} |")
    print("\nat rest (no requests): " + ", ".join(f"{name} {share * 100:.1f}%" for name, share in rest.items())
          + " of a core")
    print("\nper gateway process at c=32 (share of the requests it answered, its own CPU per request):")
    for target in GATEWAYS:
        for name, cell in processes.get(target, {}).get("c32", {}).items():
            print(f"  {target:15s} {name:20s} {fmt(cell['requests_share'], '.0%'):>5s} of requests, "
                  f"{fmt(cell['cpu_us_per_request'], '.1f')} µs/request")
    efficiency = found.get("c32_worker_efficiency", {})
    if efficiency:
        print("  per-worker efficiency (single process's µs/request over the worker's): "
              + ", ".join(f"{name} {fmt(cell['vs_single_process'], '.2f')}x" for name, cell in efficiency.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=3, help="seconds per measured wrk run (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="seconds of unmeasured load first (default 1)")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds over the targets (default 2)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if not 0 < args.duration <= 60 or not 0 <= args.warmup <= 10 or not 1 <= args.repeat <= 10:
        parser.error("bounds: 0 < --duration <= 60, 0 <= --warmup <= 10, 1 <= --repeat <= 10")
    repo = Path(__file__).resolve().parents[2]
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    results: list[RunResult] = []
    shares: list[Share] = []
    commands: dict = {}
    rest: dict = {}
    code = 0
    try:
        check_tools()
        find_redis_server()
        trio.run(partial(run, args, workdir, results, shares, commands, rest))
    except* (BenchError, UserError) as group:
        print(f"llmgw.bench.workers: {group.exceptions[0]}", file=sys.stderr)
        code = 2
    except* KeyboardInterrupt:
        print("\ninterrupted: every process stopped", file=sys.stderr)
        code = 130
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if code:
        return code
    summary = summarize(results, ["direct", *GATEWAYS])
    processes = per_process(shares)
    found = conclusions(summary, processes, rest)
    print_report(summary, processes, found, rest)
    if args.json:
        write_json(args.json, {
            "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": [sys.executable, "-m", "llmgw.bench.workers"] + (argv if argv is not None else sys.argv[1:]),
            "settings": {"duration_s": args.duration, "warmup_s": args.warmup, "repeat": args.repeat,
                         "gateway_cpu": PROXY_CPU, "load_and_upstream_cpu": LOAD_CPU, "body": SMALL_BODY,
                         "scenarios": dict(SCENARIOS)},
            "machine": machine_info(), "versions": versions(repo), "commands": {k: " ".join(v) for k, v in
                                                                               commands.items()},
            "summary": summary, "per_process": processes, "conclusions": found,
            "runs": [vars(r) | {"ok": r.ok, "command": " ".join(r.command)} for r in results],
        })
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
