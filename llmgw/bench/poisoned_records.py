"""What poisoned records in the cluster's Redis cost each gateway: loop stalls, RSS growth, CPU, and how long a
forged load report steers routing (issue 29).

``python -m llmgw.bench.poisoned_records [--followers 2] [--baseline DIR [--baseline-secret without,with]]
[--json PATH]``

A cluster of a control ``llmgw serve`` and ``--followers`` ``--role gateway`` processes over two simulators and a
private ``redis-server`` (:class:`~.cluster_rig.ClusterRig`). One after the other, each record of issue 29 is
written to Redis with a plain client, as anyone who can reach Redis would:

- ``learn-5M-unsigned``: one ``learn`` entry of 5,000,000 block keys (23 MiB) without a signature;
- ``learn-500k-signed``: one of 500,000 keys with a 600 s life, signed with the cluster secret (a buggy or
  compromised peer);
- ``load-100k-signed``: one signed ``load`` report of 99,998 replicas nobody knows, a real one at 2**40 in flight,
  ``x=600000``; ``load-2^40-signed``: the same without the unknown replicas;
- ``asks-3000-signed``: 3,000 signed resync asks for one replica.

For each, per gateway: the slowest ``/health`` while it is applied (polled every 20 ms for ``--window`` seconds),
the RSS growth over the window, the CPU seconds it used, and for the load report how long the replica stayed
loaded (``peer_inflight`` above 0; capped at the window). ``--baseline DIR`` runs the same against the llmgw of
another checkout (``git worktree add /tmp/base main``) first: without a cluster secret (as docs/scaling.md's "Try
it" ran before a Redis backend needed one) and with one. Before each record every gateway must answer
``/health`` within 0.1 s again (a baseline can stay frozen past the window). Prints a Markdown table; ``--json``
writes it with every figure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import coredis
import httpx
import trio

from ..cluster import records
from ..cluster.records import Keys
from ..testing.processes import CLUSTER_SECRET, CLUSTER_SECRET_ENV
from .agent_socket import rss_bytes
from .cluster_rig import CLUSTER, ClusterRig, GatewayProcess
from .common import print_and_save
from .proxy import process_cpu_seconds

SCENARIOS = ("learn-5M-unsigned", "learn-500k-signed", "load-100k-signed", "load-2^40-signed", "asks-3000-signed")
HEALTH_POLL = 0.02


def poison(scenario: str, signer: records.Signer) -> list[tuple[str, dict[bytes, bytes]]]:
    """The stream entries of ``scenario``: ``[(stream, fields), ...]``."""
    keys = Keys(CLUSTER)
    now_ms = int(time.time() * 1000)
    if scenario.startswith("learn"):
        count, signed = (5_000_000, False) if scenario == "learn-5M-unsigned" else (500_000, True)
        batch = records.pack([records.learn_item("sim-0", now_ms, 600_000, list(range(1 << 40, (1 << 40) + count)))])
        origin = b"poisoner"
        return [(keys.learn, {b"o": origin, b"e": batch, b"s": signer.sign(origin, batch) if signed else b""})]
    if scenario.startswith("load"):
        load: list[Any] = [[f"ghost-{i}", 5, 5, 5, 5, 5] for i in range(99_998 if "100k" in scenario else 0)]
        load += [["sim-0", 1 << 40, 1 << 40, 1 << 40, 1 << 40, 1 << 40], ["sim-1", 0, 0, 0, 0, 0]]
        fields = {b"o": b"poisoner", b"x": b"600000", b"l": records.pack(load)}
        fields[b"s"] = signer.sign(fields[b"o"], fields[b"x"], fields[b"l"])
        return [(keys.load, fields)]
    entries = []
    for i in range(3000):
        ask = records.pack(["resync", "sim-0", "full", f"drift {i}"])
        entries.append((keys.requests, {b"o": b"poisoner", b"a": ask, b"s": signer.sign(b"poisoner", ask)}))
    return entries


class Watch:
    """One gateway through one scenario: its slowest /health, RSS and CPU before and after, how long sim-0 was
    loaded by others."""

    def __init__(self, gateway: GatewayProcess):
        self.gateway = gateway
        self.slowest = 0.0
        self.asked_at: float | None = None  # the /health request in flight (one still unanswered counts too)
        self.errors = 0
        self.loaded_until = 0.0
        self.rss_before = rss_bytes(gateway.pid)
        self.cpu_before = process_cpu_seconds(gateway.pid)

    async def health(self, http: httpx.AsyncClient) -> None:
        while True:
            self.asked_at = started = time.monotonic()
            try:
                answer = await http.get(self.gateway.control_url + "/health")
                ok = answer.status_code == 200
            except httpx.HTTPError:
                ok = False
            self.asked_at = None
            self.slowest = max(self.slowest, time.monotonic() - started)
            self.errors += not ok
            await trio.sleep(HEALTH_POLL)

    async def load(self, http: httpx.AsyncClient, started: float) -> None:
        while True:
            try:
                listed = (await http.get(self.gateway.control_url + "/admin/replicas")).json()
                if any(r["peer_inflight"] for r in listed if r["name"] == "sim-0"):
                    self.loaded_until = time.monotonic() - started
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await trio.sleep(0.1)

    def result(self) -> dict[str, Any]:
        if self.asked_at is not None:
            self.slowest = max(self.slowest, time.monotonic() - self.asked_at)
        return {"health_max_s": round(self.slowest, 3), "health_errors": self.errors,
                "rss_growth_mb": round((rss_bytes(self.gateway.pid) - self.rss_before) / 2**20, 1),
                "cpu_s": round(process_cpu_seconds(self.gateway.pid) - self.cpu_before, 2),
                "sim0_loaded_s": round(self.loaded_until, 1)}


async def recovered(rig: ClusterRig, limit: float = 0.1, timeout: float = 180.0) -> float:
    """Until every gateway answers ``/health`` within ``limit`` seconds again (a baseline may still be busy with
    the previous record): how long that took."""
    started = time.monotonic()
    with trio.move_on_after(timeout):
        while True:
            asked = time.monotonic()
            try:
                for gateway in rig.gateways:
                    await rig.http.get(gateway.control_url + "/health", timeout=timeout)
            except httpx.HTTPError:
                pass
            else:
                if time.monotonic() - asked < limit * len(rig.gateways):
                    break
            await trio.sleep(0.5)
    return round(time.monotonic() - started, 1)


async def run_scenario(rig: ClusterRig, redis: coredis.Redis, scenario: str, signer: records.Signer,
                       window: float) -> dict[str, dict[str, Any]]:
    entries = poison(scenario, signer)
    await recovered(rig)
    watches = [Watch(g) for g in rig.gateways]
    async with trio.open_nursery() as nursery:
        for watch in watches:
            nursery.start_soon(watch.health, rig.http)
        await trio.sleep(0.3)
        started = time.monotonic()
        if scenario.startswith("load"):
            for watch in watches:
                nursery.start_soon(watch.load, rig.http, started)
        for stream, fields in entries:
            await redis.xadd(stream, fields)
        await trio.sleep(window)
        nursery.cancel_scope.cancel()
    return {w.gateway.name: w.result() for w in watches}


async def run_cluster(args: argparse.Namespace, source: Path | None, signed: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="llmgw-poison-") as workdir:
        async with ClusterRig.open(Path(workdir), followers=args.followers, source=source,
                                   secret_env=CLUSTER_SECRET_ENV if signed else "") as rig:
            host, port = rig.redis.url.removeprefix("redis://").split("/")[0].split(":")
            signer = records.Signer(CLUSTER_SECRET.encode())
            results = {}
            async with coredis.Redis(host=host, port=int(port), decode_responses=False) as redis:
                for scenario in args.scenarios:
                    results[scenario] = await run_scenario(rig, redis, scenario, signer, args.window)
                    print(f"{scenario}: {results[scenario]}", flush=True)
            return results


async def run(args: argparse.Namespace) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    if args.baseline is not None:
        for secret in args.baseline_secret:
            arms[f"baseline, {secret} secret"] = await run_cluster(args, args.baseline.resolve(),
                                                                   signed=secret == "with")
    arms["this checkout"] = await run_cluster(args, None, signed=True)
    summary = []
    for arm, results in arms.items():
        for scenario, per_gateway in results.items():
            worst = {key: max(g[key] for g in per_gateway.values())
                     for key in ("health_max_s", "rss_growth_mb", "cpu_s", "sim0_loaded_s", "health_errors")}
            summary.append({"arm": arm, "scenario": scenario, **worst})
    return {"settings": {k: str(v) for k, v in vars(args).items() if k != "json"}, "arms": arms,
            "summary": summary}


def markdown(summary: list[dict[str, Any]]) -> str:
    lines = ["| arm | record | slowest /health (s) | RSS growth (MB) | CPU (s) | sim-0 loaded (s) | /health errors |",
             "|---|---|---|---|---|---|---|"]
    for row in summary:
        loaded = f"{row['sim0_loaded_s']:g}" if row["scenario"].startswith("load") else "-"
        lines.append(f"| {row['arm']} | {row['scenario']} | {row['health_max_s']:.3f} | {row['rss_growth_mb']:.1f} "
                     f"| {row['cpu_s']:.2f} | {loaded} | {row['health_errors']} |")
    return "\n".join(lines) + "\n\nEach figure is the worst gateway's over the scenario's window."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.bench.poisoned_records", description=__doc__.split("\n")[0])
    parser.add_argument("--followers", type=int, default=2, help="--role gateway processes (default 2)")
    parser.add_argument("--window", type=float, default=8.0, help="seconds watched per record (default 8)")
    parser.add_argument("--scenarios", type=lambda text: text.split(","), default=list(SCENARIOS),
                        help="comma-separated, of: " + ",".join(SCENARIOS))
    parser.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                        help="first run the gateways of the llmgw checkout in DIR")
    parser.add_argument("--baseline-secret", type=lambda text: text.split(","), default=["without", "with"],
                        help="the baseline's runs: without a cluster secret (docs/scaling.md's old 'Try it'), "
                             "with one, or both (default: without,with)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if not (0 <= args.followers <= 4 and 1 <= args.window <= 120 and set(args.scenarios) <= set(SCENARIOS)
            and set(args.baseline_secret) <= {"with", "without"}):
        parser.error(f"bounds: 0 <= --followers <= 4, 1 <= --window <= 120; scenarios of {', '.join(SCENARIOS)}")
    report = trio.run(run, args)
    return print_and_save(report, markdown(report["summary"]), args.json)


if __name__ == "__main__":
    sys.exit(main())
