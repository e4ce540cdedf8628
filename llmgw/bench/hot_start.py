"""A model at zero called again: its replica woken from sleep (``sleep_mode`` with ``keep_warm``) against started
cold (no ``keep_warm``), the time from the call to its first token.

``llmgw bench hot-start`` opens two fleets of the autoscale bench's rig (:mod:`.autoscale_rig`: one remote agent on
a fixture H100, ``llmgw sim --profile h100-llama-3.1-8b`` replicas with ``--cold-start`` and ``--hot-start`` fleet
seconds, divided by ``--time-factor``), one deployment ``replicas: {min: 0, max: 1}`` each, going to zero after
``--idle`` wall seconds: ``cold`` (the default: a replica scaled to zero is stopped) and ``sleep`` (its profile has
``sleep_mode: true`` and the deployment ``keep_warm``: it is put to sleep, and woken by the next call). Then,
``--repeats`` times, alternating the fleets (cold, sleep, cold, sleep...): wait until the fleet is at zero (and,
for ``sleep``, its engine reported sleeping), send one streamed chat completion, record the seconds to its first
token. Each fleet's first call (a cold start on both) is not counted. Printed: per fleet the median, min and max,
and the ratio of the medians; with ``--json`` every call.

Run: ``llmgw bench hot-start [--repeats 5] [--json bench-results/hot-start.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from ..sim.profiles import DEFAULT_PROFILE
from .autoscale import engine_of, measure_boot, tenant_of
from .autoscale_rig import AutoscaleRig
from .autoscale_traces import MODEL_A
from .chat_workloads import new_client
from .common import bench_parser, print_and_save, run_in_workdir
from .overload_workload import OK, sender

COLD, SLEEP = "cold", "sleep"
WAIT = 120.0  # wall seconds a fleet may take to reach zero (or sleep): only a hung run waits this long


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser(__doc__ or "")
    parser.add_argument("--repeats", type=int, default=5, help="calls from zero per fleet (after a first one)")
    parser.add_argument("--time-factor", type=float, default=10.0, help="fleet seconds per wall second")
    parser.add_argument("--cold-start", type=float, default=60.0, help="an engine's cold start, fleet seconds")
    parser.add_argument("--hot-start", type=float, default=5.0, help="an engine's wake-up, fleet seconds")
    parser.add_argument("--idle", type=float, default=1.0, help="idle_to_zero, wall seconds")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="the simulators' GPU profile")
    parser.add_argument("--max-num-seqs", type=int, default=2)
    parser.add_argument("--prompt-words", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--workdir", help="where the processes' files go (default: a temporary folder)")
    return parser.parse_args(argv)


def deployment(fleet: str, idle: float) -> str:
    keep = ", keep_warm: 1h" if fleet == SLEEP else ""
    return f"replicas: {{min: 0, max: 1}}\n    autoscale: {{idle_to_zero: {idle:g}s{keep}}}"


@contextlib.asynccontextmanager
async def open_fleet(args: argparse.Namespace, fleet: str, root: Path, boot: float) -> AsyncIterator[AutoscaleRig]:
    async with AutoscaleRig.open(root / fleet, engine_of(args, boot), {MODEL_A: deployment(fleet, args.idle)},
                                 {MODEL_A: 0}, nodes=1, gpus=1, extra_config="autoscale:\n  interval: 0.2s\n",
                                 profile_extra="    sleep_mode: true\n" if fleet == SLEEP else "") as rig:
        yield rig


async def engine_states(rig: AutoscaleRig) -> list[str]:
    """The states of the engines the fleet's node reports (parked ones included)."""
    nodes = (await rig.http.get(rig.control.control_url + "/admin/nodes")).json()
    return [shard["state"] for node in nodes for shard in node.get("shards") or ()]


async def wait_at_zero(rig: AutoscaleRig, fleet: str) -> None:
    """Until no replica is routed and the engine is gone (``cold``) or reported sleeping (``sleep``)."""
    with trio.fail_after(WAIT):
        while True:
            ready = (await rig.sample())[MODEL_A]["ready"]
            states = [s for s in await engine_states(rig) if s not in ("stopped", "failed")]
            if not ready and states == ([] if fleet == COLD else ["sleeping"]):
                return
            await trio.sleep(0.1)


async def call(args: argparse.Namespace, send, rng: random.Random) -> float:
    outcome = await send(tenant_of(args, MODEL_A), rng)
    if outcome.kind != OK:
        raise RuntimeError(f"a call from zero failed: {outcome.kind} (HTTP {outcome.status})")
    return outcome.ttft


def summary(values: list[float]) -> dict:
    return {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values), "n": len(values)}


async def run(args: argparse.Namespace, root: Path) -> dict:
    boot = statistics.median(await measure_boot(args))
    engine = engine_of(args, boot)
    report: dict = {"settings": {
        "repeats": args.repeats, "time_factor": args.time_factor, "cold_start_s": args.cold_start,
        "hot_start_s": args.hot_start, "sim_startup_seconds": engine.cold_start,
        "sim_hot_startup_seconds": engine.hot_start, "boot_s": boot, "idle_to_zero_s": args.idle,
        "profile": args.profile, "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()},
        "calls": {COLD: [], SLEEP: []}}
    rng = random.Random(1)
    async with new_client(4) as http, open_fleet(args, COLD, root, boot) as cold, \
            open_fleet(args, SLEEP, root, boot) as asleep:
        fleets = {COLD: cold, SLEEP: asleep}
        sends = {fleet: sender(http, [rig.url], args.request_timeout, MODEL_A) for fleet, rig in fleets.items()}
        for fleet in fleets:  # the first call of each: a cold start on both, not counted
            await call(args, sends[fleet], rng)
        for repeat in range(args.repeats):
            for fleet, rig in fleets.items():
                await wait_at_zero(rig, fleet)
                ttft = await call(args, sends[fleet], rng)
                report["calls"][fleet].append(ttft)
                print(f"  {fleet} {repeat + 1}/{args.repeats}: first token after {ttft:.2f} s", file=sys.stderr,
                      flush=True)
    report["settings"]["load_average_at_end"] = os.getloadavg()
    report["summary"] = {fleet: summary(values) for fleet, values in report["calls"].items()}
    report["summary"]["speedup"] = report["summary"][COLD]["median_s"] / report["summary"][SLEEP]["median_s"]
    return report


def markdown(report: dict) -> str:
    s, summ = report["settings"], report["summary"]
    lines = [f"A call to a model at zero, first token (wall s; modelled starts {s['cold_start_s']:g} s cold, "
             f"{s['hot_start_s']:g} s hot, {s['time_factor']:g}x faster than the wall; {s['repeats']} calls each, "
             f"alternated; load average {s['load_average_at_start'][0]:.1f} -> {s['load_average_at_end'][0]:.1f})",
             "", "| fleet | median | min | max |", "|---|---|---|---|"]
    for fleet, label in ((COLD, "cold start (stopped at zero)"), (SLEEP, "woken (sleep_mode, keep_warm)")):
        f = summ[fleet]
        lines.append(f"| {label} | {f['median_s']:.2f} | {f['min_s']:.2f} | {f['max_s']:.2f} |")
    lines.append(f"\nmedian cold / median woken: {summ['speedup']:.1f}x")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse(argv)
    report = run_in_workdir("hot-start", run, args)
    return print_and_save(report, markdown(report), args.json)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
