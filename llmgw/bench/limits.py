"""How exact per-key limits are across N gateways (and workers), beside LiteLLM's proxy on the same upstreams.

``llmgw bench limits`` runs, one arm after the other, each on fresh processes (:mod:`.limits_rig`,
:mod:`.limits_litellm`): llmgw as N = 1, 2, 4 gateways on one Redis, N gateways of ``--workers W``, and LiteLLM's
proxy as N instances on one Redis (and ``--num_workers W``). On each, ``--repeats`` times, the scenarios of
:mod:`.limits_runs` on keys (model groups) with rpm, tpm, concurrency and budget limits: bursts of ``--burst``
requests at once spread over the gateways, steady load above the limit, the added latency, and a Redis kill.
The tables (:mod:`.limits_report`) are printed, and with ``--json`` written with every repeat's numbers.

Why a limit of 120 rpm for a minute means what 12,000 rpm would: the exact limiters count in units of the limit
(a bucket refills ``limit`` per minute, a window holds ``limit`` per minute) and the load is a multiple of it, so
admitted over expected and the usable fraction do not depend on its size; what does is the error of a limiter
that works in whole requests per process (at most one per process per refill), which is largest, relative to the
limit, at small limits: the numbers here are the harder case. A run's time is the steady minute and the Redis
fault per repeat and arm; ``--quick`` is the short form (10 s, one repeat) for a smoke test.

Run: ``llmgw bench limits [--arms llmgw,llmgw-workers,litellm,litellm-workers] [--gateways 1,2,4] [--repeats 3]
[--json bench-results/limits.json]``. Needs ``redis-server``; the LiteLLM arms install ``litellm[proxy]`` into
``~/.cache/llmgw`` on first use (never under CI: they are left out, saying so).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from ..testing.processes import ChildFailed
from .common import bench_parser, chosen_names, numbers, print_and_save, run_in_workdir, write_json
from .limits_litellm import LITELLM_VERSION, LitellmUnavailable, open_litellm
from .limits_report import markdown, summary
from .limits_rig import REDIS_KILL, Fleet, Plan, open_llmgw
from .limits_runs import Timing, run_redis_kill, run_repeat
from .limits_workloads import Client, new_http

ARMS = ("llmgw", "llmgw-workers", "litellm", "litellm-workers")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser(__doc__ or "")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ARMS))
    parser.add_argument("--gateways", default="1,2,4", help="N for each arm (the workers arms: the largest)")
    parser.add_argument("--workers", type=int, default=2, help="W of the workers arms")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--burst", type=int, default=100, help="requests sent at once per burst")
    parser.add_argument("--burst-limit", type=int, default=50, help="a burst lane's limit, in requests")
    parser.add_argument("--steady-limit", type=int, default=120, help="rpm of the steady and Redis lanes")
    parser.add_argument("--steady-seconds", type=float, default=60.0)
    parser.add_argument("--redis-before", type=float, default=5.0, help="seconds of steady load before the kill")
    parser.add_argument("--redis-away", type=float, default=10.0, help="seconds Redis is down")
    parser.add_argument("--redis-after", type=float, default=10.0, help="seconds of load after its restart")
    parser.add_argument("--latency-requests", type=int, default=200, help="per lane")
    parser.add_argument("--quick", action="store_true", help="other defaults: one repeat, N = 1, 2, 10 s of "
                                                             "steady load, Redis away 4 s")
    parser.add_argument("--workdir", help="where the processes' files go (default: a temporary folder)")
    if "--quick" in argv:
        parser.set_defaults(repeats=1, gateways="1,2", steady_seconds=10.0, latency_requests=50,
                            redis_before=3.0, redis_away=4.0, redis_after=4.0)
    args = parser.parse_args(argv)
    args.arms = chosen_names(parser, args.arms, ARMS)
    args.gateways = numbers(args.gateways)
    return args


def arm_runs(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """``(arm, gateways, workers)`` in the order they run."""
    runs = []
    for arm in args.arms:
        workers = args.workers if arm.endswith("-workers") else 1
        for n in ([max(args.gateways)] if workers > 1 else args.gateways):
            runs.append((arm, n, workers))
    return runs


def leaves(group: BaseException) -> list[BaseException]:
    """The exceptions inside ``group`` and the groups within it."""
    if isinstance(group, BaseExceptionGroup):
        return [leaf for inner in group.exceptions for leaf in leaves(inner)]
    return [group]


@contextlib.asynccontextmanager
async def open_fleet(arm: str, workdir: Path, plan: Plan, gateways: int, workers: int) -> AsyncIterator[Fleet]:
    opener = open_litellm if arm.startswith("litellm") else open_llmgw
    async with opener(workdir, plan, gateways, workers) as fleet:
        yield fleet


async def measure(arm: str, workdir: Path, plan: Plan, timing: Timing, gateways: int, workers: int) -> dict:
    entry: dict = {"arm": arm, "gateways": gateways, "workers": workers, "processes": gateways * workers,
                   "label": f"{arm} N={gateways}", "runs": []}
    try:
        async with open_fleet(arm, workdir, plan, gateways, workers) as fleet, new_http() as http:
            entry.update(label=fleet.label, kind=fleet.kind, notes=fleet.notes)
            client = Client(http, fleet.urls)
            for repeat in range(plan.repeats):
                print(f"  {fleet.label}: repeat {repeat + 1} of {plan.repeats}", file=sys.stderr, flush=True)
                entry["runs"].append(await run_repeat(fleet, client, plan, timing, repeat))
            if REDIS_KILL in fleet.measures:
                for repeat, run in enumerate(entry["runs"]):
                    print(f"  {fleet.label}: Redis kill {repeat + 1} of {plan.repeats}", file=sys.stderr, flush=True)
                    run[REDIS_KILL] = await run_redis_kill(fleet, client, plan, timing, repeat)
    except* (ChildFailed, LitellmUnavailable) as group:
        failure = "\n".join(str(leaf) for leaf in leaves(group))
        entry["error"] = failure.splitlines()[0][:200]
        entry["error_detail"] = failure[-4000:]
    entry["summary"] = summary(entry["runs"])
    return entry


async def run(args: argparse.Namespace, root: Path) -> dict:
    plan = Plan(repeats=args.repeats, burst=args.burst, burst_limit=args.burst_limit,
                steady_limit=args.steady_limit)
    timing = Timing(steady_seconds=args.steady_seconds, redis_before=args.redis_before, redis_away=args.redis_away,
                    redis_after=args.redis_after, latency_requests=args.latency_requests)
    settings = {**dataclasses.asdict(plan), **dataclasses.asdict(timing), "request_tokens": plan.request_tokens,
                "request_nano": plan.request_nano, "litellm_version": LITELLM_VERSION, "cpus": os.cpu_count()}
    arms: list[dict] = []
    for i, (arm, gateways, workers) in enumerate(arm_runs(args)):
        print(f"llmgw bench limits: {arm}, N={gateways}, workers={workers}", file=sys.stderr, flush=True)
        arms.append(await measure(arm, root / f"{i}-{arm}-{gateways}", plan, timing, gateways, workers))
        if args.json:  # what was measured so far survives a run cut short
            write_json(args.json, {"settings": settings, "arms": arms, "partial": True})
    return {"settings": settings, "arms": arms}


def main(argv: list[str]) -> int:
    args = parse(argv)
    report = run_in_workdir("limits", run, args)
    return print_and_save(report, markdown(report["arms"], report["settings"]), args.json)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
