"""More demand than GPUs: llmgw with flow control, llmgw without it and vllm-router's queue at 0.5x to 4x the
fleet's capacity (issue 31).

``llmgw bench overload`` starts ``--replicas`` simulators (``--profile``, each a slice of the GPU: ``--max-num-seqs``
sequences and ``--num-blocks`` of KV cache, so that the fleet saturates at a load this machine's client can send)
and keeps them for the whole run. First the fleet's capacity, straight on the simulators (the client spreading
over them): a closed-loop ramp of the tenants' mix (:mod:`.overload_workload`) at each of ``--ramp`` client counts
for ``--capacity-seconds``; the capacity is the highest completed requests/s among the steps whose interactive
TTFT p99 met ``--slo-interactive-ms`` (the ramp's knee); the first step's TTFT p99 is the unloaded one. Then every
arm (:mod:`.overload_arms`) at each of ``--gateways`` (vllm-router: one), fresh routers in front of the same
simulators, drained between runs: for each ``--loads`` multiple of the capacity, ``--repeats`` times, open-loop
Poisson arrivals for ``--seconds`` while the engines' KV usage and the gateways' queues are sampled. Per arm, load
and class (:mod:`.overload_report`): medians with their range, a table printed and, with ``--json``, everything
written (partial results as they come).

Run: ``llmgw bench overload [--arms llmgw-flow,llmgw-off,vllm-router] [--gateways 1,3] [--loads 0.5,1,2,4]
[--repeats 3] [--json bench-results/overload.json]``; the arm ``llmgw-flow-priority`` (not in the default arms)
adds the engines' priority scheduling (``--arms llmgw-flow,llmgw-flow-priority``), the arm ``llmgw-flow-chunk`` their
per-step prefill cap (``--prefill-cap``) on simulators of its own, whose unloaded interactive TTFT p99 it measures
first (the ramp's first step on them). Every run also reads what the simulators' ``/metrics`` say of it
(:mod:`.overload_engines`): their steps' modelled lengths and the host's overrun past them. ``--quick`` is a small form
for a smoke test. Needs ``redis-server``; vllm-router is looked up as ``llmgw bench routing`` does
(``--install-vllm-router`` installs
0.1.17 into bench-results/vr-venv), else its arm says it is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Sequence
from functools import partial
from pathlib import Path

import httpx
import trio

from ..sim.profiles import DEFAULT_PROFILE
from ..testing.processes import Child, ChildFailed
from ..testing.sims import KV_SIM_ENV, KV_SIM_EXTRA, start_sims
from .chat_workloads import new_client
from .cluster_events import percentile
from .common import bench_parser, chosen_names, numbers, print_and_save, run_in_workdir, write_json
from .limits import leaves
from .overload_arms import (
    ARMS,
    DEFAULT_ARMS,
    FLOW_CHUNK,
    FLOW_PRIORITY,
    VLLM_ROUTER,
    ArmUnavailable,
    RouterTuning,
    early_shed_verdicts,
    engine_priority_requests,
    open_fleet,
    router_tuning,
    sample_kv,
    wait_idle,
)
from .overload_engines import engine_stats, read_engines
from .overload_report import level_stats, markdown, summary
from .overload_workload import BATCH, INTERACTIVE, OK, Mix, Tenant, closed_loop, open_loop, sender
from .proxy import find_vllm_router, vllm_router_version


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser(__doc__ or "")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help="comma-separated, of: " + ", ".join(ARMS) + f" (default {','.join(DEFAULT_ARMS)})")
    parser.add_argument("--gateways", default="1,3", help="llmgw gateways per arm, comma-separated (vllm-router: 1)")
    parser.add_argument("--loads", default="0.5,1,2,4", help="arrival rates as multiples of the measured capacity")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="open-loop arrivals per run")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="the simulators' GPU profile")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="each simulator's running sequences")
    parser.add_argument("--num-blocks", type=int, default=512, help="each simulator's KV cache, 16-token blocks")
    parser.add_argument("--time-scale", type=float, default=1.0, help="the simulators' (2: their GPU half as fast, "
                        "so the fleet saturates at half the arrivals and a machine shared with other work bends "
                        "the figures less; the SLOs stay as given)")
    parser.add_argument("--ramp", default="2,4,8,16,32", help="closed-loop client counts of the capacity ramp")
    parser.add_argument("--capacity-seconds", type=float, default=8.0, help="per ramp step")
    parser.add_argument("--capacity", type=float, default=None,
                        help="req/s the loads are multiples of, instead of the ramp's knee (the ramp still gives "
                             "the unloaded TTFT): two builds compared at the same arrival rates")
    parser.add_argument("--prefill-cap", type=int, default=256, metavar="N",
                        help="the llmgw-flow-chunk arm's simulators' --long-prefill-token-threshold (default 256)")
    parser.add_argument("--slo-interactive-ms", type=float, default=500.0, help="interactive TTFT SLO")
    parser.add_argument("--slo-batch-s", type=float, default=30.0, help="batch end-to-end SLO")
    parser.add_argument("--batch-share", type=float, default=0.3, help="the batch tenant's share of arrivals")
    parser.add_argument("--output-quantile", default=None, metavar="Q|off",
                        help="the llmgw-flow arm's flow.output_quantile (off: flow.learn_output false, every "
                             "request reserving its whole max_tokens; default: the gateway's default)")
    parser.add_argument("--natural-output", default=None, metavar="MIN:MAX",
                        help="answers end at their EOS after a length drawn in MIN:MAX tokens (the simulators' "
                             "--output-tokens), at most max_tokens, instead of exactly max_tokens (ignore_eos): "
                             "clients' max_tokens as a bound rather than the length")
    parser.add_argument("--cap", type=int, default=2000, help="requests in flight at most (arrivals beyond: counted)")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="the client's, per request")
    parser.add_argument("--queue-size", type=int, default=100, help="vllm-router's --queue-size")
    parser.add_argument("--queue-timeout", type=int, default=2,
                        help="vllm-router's --queue-timeout-secs (llmgw's interactive max_wait)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--vllm-router", default=None, help="the vllm-router executable (default: looked up)")
    parser.add_argument("--install-vllm-router", action="store_true", help="install vllm-router 0.1.17 if missing")
    parser.add_argument("--quick", action="store_true", help="other defaults: 2 replicas, 1 gateway, loads 0.5 "
                                                             "and 2, one repeat of 4 s, a ramp of 2 and 8")
    parser.add_argument("--workdir", help="where the processes' files go (default: a temporary folder)")
    if "--quick" in argv:
        parser.set_defaults(replicas=2, gateways="1", loads="0.5,2", repeats=1, seconds=4.0, ramp="2,8",
                            capacity_seconds=4.0)
    args = parser.parse_args(argv)
    args.arms = chosen_names(parser, args.arms, ARMS)
    if args.output_quantile not in (None, "off") and not _quantile(args.output_quantile):
        parser.error(f"--output-quantile: a number within 0 and 1, or off: {args.output_quantile!r}")
    args.gateways, args.loads, args.ramp = numbers(args.gateways), numbers(args.loads, float), numbers(args.ramp)
    return args


def _quantile(text: str) -> bool:
    try:
        return 0.0 <= float(text) <= 1.0
    except ValueError:
        return False


def slo_of(args: argparse.Namespace) -> dict[str, float]:
    return {INTERACTIVE: args.slo_interactive_ms / 1000, BATCH: args.slo_batch_s}


async def ramp_step(args: argparse.Namespace, http: httpx.AsyncClient, engines: list[Child],
                    tenants: Sequence[Tenant], concurrency: int) -> dict:
    """One closed-loop step of the capacity ramp straight on ``engines``: its throughput and interactive TTFTs."""
    send = sender(http, [e.url for e in engines], args.request_timeout, ignore_eos=args.natural_output is None)
    await wait_idle(http, [e.url for e in engines], args.request_timeout)
    loop = await closed_loop(send, tenants, concurrency, args.capacity_seconds, args.seed)
    ok = [o for o in loop.outcomes if o.kind == OK]
    ttft = [o.ttft for o in ok if o.priority == INTERACTIVE]
    p50, p99 = percentile(ttft, 0.5), percentile(ttft, 0.99)
    step = {"concurrency": concurrency, "rps": len(ok) / loop.seconds,
            "interactive_ttft_p50_ms": None if p50 is None else p50 * 1000,
            "interactive_ttft_p99_ms": None if p99 is None else p99 * 1000,
            "failed": len(loop.outcomes) - len(ok)}
    print(f"  capacity ramp: {concurrency} clients: {step['rps']:.2f} req/s, interactive TTFT p99 "
          f"{step['interactive_ttft_p99_ms'] or 0:.0f} ms", file=sys.stderr, flush=True)
    return step


async def measure_capacity(args: argparse.Namespace, http: httpx.AsyncClient, engines: list[Child],
                           tenants: Sequence[Tenant]) -> dict:
    """The closed-loop ramp straight on the engines (see the module's docstring)."""
    steps = []
    for concurrency in args.ramp:
        step = await ramp_step(args, http, engines, tenants, concurrency)
        steps.append(step)
        p99 = step["interactive_ttft_p99_ms"]
        if p99 is None or p99 > args.slo_interactive_ms:
            break
    within = [s for s in steps if s["interactive_ttft_p99_ms"] is not None
              and s["interactive_ttft_p99_ms"] <= args.slo_interactive_ms]
    knee = max(within, key=lambda s: s["rps"]) if within else steps[0]
    return {"rps": args.capacity or knee["rps"], "measured_rps": knee["rps"], "given": args.capacity is not None,
            "knee_concurrency": knee["concurrency"], "met_slo": bool(within),
            "unloaded_interactive_ttft_p99_ms": steps[0]["interactive_ttft_p99_ms"], "ramp": steps}


@contextlib.asynccontextmanager
async def arm_engines(args: argparse.Namespace, http: httpx.AsyncClient, arm: str, engines: list[Child],
                      extra: tuple[str, ...], tenants: Sequence[Tenant]) -> AsyncIterator[tuple[list[Child], dict]]:
    """The simulators ``arm`` runs on, and what to record of them: the fleet's own; for ``llmgw-flow-chunk``, as
    many of their own started with ``--long-prefill-token-threshold`` (stopped after the block), with their
    unloaded interactive TTFT (the ramp's first step on them)."""
    if arm != FLOW_CHUNK:
        yield engines, {}
        return
    async with trio.open_nursery() as nursery:
        own = await start_sims(nursery, args.replicas, env=KV_SIM_ENV, num_blocks=args.num_blocks, block_size=16,
                               seed=0, extra=(*extra, "--long-prefill-token-threshold", str(args.prefill_cap)))
        print(f"  {arm}: simulators of its own, --long-prefill-token-threshold {args.prefill_cap}", file=sys.stderr,
              flush=True)
        unloaded = await ramp_step(args, http, own, tenants, args.ramp[0])
        try:
            yield own, {"prefill_cap": args.prefill_cap, "unloaded": unloaded,
                        "unloaded_interactive_ttft_p99_ms": unloaded["interactive_ttft_p99_ms"]}
        finally:
            nursery.cancel_scope.cancel()


async def run_arm(args: argparse.Namespace, http: httpx.AsyncClient, arm: str, gateways: int, engines: list[Child],
                  tenants: Sequence[Tenant], workdir: Path, vllm_router: str | None, tuning: RouterTuning,
                  capacity: float, extra: tuple[str, ...]) -> dict:
    """Every load level of ``arm`` through ``gateways`` routers, on ``engines`` or (:func:`arm_engines`) its own,
    started with the fleet's ``extra`` simulator flags and its own."""
    entry: dict = {"arm": arm, "gateways": gateways, "label": f"{arm} x{gateways}", "levels": []}
    try:
        async with arm_engines(args, http, arm, engines, extra, tenants) as (arm_sims, record), \
                open_fleet(arm, gateways, arm_sims, tenants, workdir, vllm_router, tuning,
                           args.output_quantile) as fleet:
            entry.update(record)
            sim_urls = [e.url for e in arm_sims]
            entry["notes"] = fleet.notes
            send = sender(http, fleet.urls, args.request_timeout, ignore_eos=args.natural_output is None)
            for load in args.loads:
                runs = []
                for repeat in range(args.repeats):
                    print(f"  {fleet.label}: {load:g}x ({load * capacity:.2f} req/s), repeat {repeat + 1} of "
                          f"{args.repeats}", file=sys.stderr, flush=True)
                    await wait_idle(http, sim_urls, args.request_timeout)
                    judged = await early_shed_verdicts(http, fleet.control_urls)
                    kv: list[dict] = []
                    before = await read_engines(http, sim_urls, fleet.control_urls)
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(partial(sample_kv, seats=args.max_num_seqs), http, sim_urls,
                                           fleet.control_urls, kv)
                        loop = await open_loop(send, tenants, load * capacity, args.seconds, args.cap,
                                               args.seed * 100 + repeat)
                        nursery.cancel_scope.cancel()
                    engines_said = engine_stats(before, await read_engines(http, sim_urls, fleet.control_urls))
                    runs.append(level_stats(loop, kv, slo_of(args), capacity) | {"engines": engines_said})
                    # The early sheds judged during the run and its drain (wait_idle: their deadlines passed)
                    await wait_idle(http, sim_urls, args.request_timeout)
                    runs[-1]["early_shed_verdicts"] = _delta(judged, await early_shed_verdicts(http,
                                                                                               fleet.control_urls))
                entry["levels"].append({"load": load, "rate_rps": load * capacity, "runs": runs,
                                        "summary": summary(runs)})
            # What says the engines were given priorities at all (0 for every arm but llmgw-flow-priority)
            entry["engine_priority_requests"] = await engine_priority_requests(http, fleet.control_urls)
    except* ArmUnavailable as group:
        entry["error"] = str(leaves(group)[0])
    except* ChildFailed as group:
        failure = "\n".join(str(leaf) for leaf in leaves(group))
        entry["error"] = failure.splitlines()[0][:200]
        entry["error_detail"] = failure[-4000:]
    return entry


def _delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {key: value - before.get(key, 0.0) for key, value in sorted(after.items())}


def arm_runs(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [(arm, n) for arm in args.arms for n in ([1] if arm == VLLM_ROUTER else args.gateways)]


async def run(args: argparse.Namespace, root: Path, vllm_router: str | None, lookup: str) -> dict:
    tenants = Mix(batch_share=args.batch_share).tenants()
    settings = {key: getattr(args, key) for key in ("replicas", "profile", "max_num_seqs", "num_blocks", "time_scale",
                                                     "loads", "repeats", "seconds", "ramp", "capacity_seconds", "cap",
                                                     "slo_interactive_ms", "slo_batch_s", "seed", "gateways",
                                                     "natural_output", "output_quantile", "prefill_cap")}
    settings.update(sim_note=f"--max-num-seqs {args.max_num_seqs}, --num-blocks {args.num_blocks}"
                    + (f", --time-scale {args.time_scale:g}" if args.time_scale != 1.0 else "")
                    + (f", answers of --output-tokens {args.natural_output} at most max_tokens"
                       if args.natural_output else ""),
                    tenants=[vars(t) | {"key": "(its own)"} for t in tenants], cpus=os.cpu_count(),
                    load_average_at_start=os.getloadavg(),  # the machine's other work: read the spreads with it
                    vllm_router=vllm_router and vllm_router_version(vllm_router), vllm_router_lookup=lookup)
    report: dict = {"settings": settings, "arms": []}
    extra: tuple[str, ...] = (*KV_SIM_EXTRA, "--profile", args.profile, "--max-num-seqs", str(args.max_num_seqs),
             "--time-scale", str(args.time_scale),
             *(("--output-tokens", args.natural_output) if args.natural_output else ()))
    if FLOW_PRIORITY in args.arms:  # requests without a priority are served in fcfs's order (overload_arms.py)
        extra += ("--scheduling-policy", "priority")
        settings["sim_note"] += ", --scheduling-policy priority"
    async with new_client(args.cap) as http, trio.open_nursery() as nursery:
        engines = await start_sims(nursery, args.replicas, env=KV_SIM_ENV, num_blocks=args.num_blocks,
                                   block_size=16, seed=0, extra=extra)
        print("llmgw bench overload: the fleet's capacity", file=sys.stderr, flush=True)
        report["capacity"] = capacity = await measure_capacity(args, http, engines, tenants)
        tuning = router_tuning(capacity["knee_concurrency"], capacity["rps"], args.queue_size, args.queue_timeout)
        settings["vllm_router_options"] = " ".join(tuning.argv())
        for i, (arm, gateways) in enumerate(arm_runs(args)):
            print(f"llmgw bench overload: {arm}, {gateways} gateway(s)", file=sys.stderr, flush=True)
            report["arms"].append(await run_arm(args, http, arm, gateways, engines, tenants,
                                                root / f"{i}-{arm}-{gateways}", vllm_router, tuning,
                                                capacity["rps"], extra))
            if args.json:  # what was measured so far survives a run cut short
                write_json(args.json, {**report, "partial": True})
        nursery.cancel_scope.cancel()
    settings["load_average_at_end"] = os.getloadavg()
    return report


def main(argv: list[str]) -> int:
    args = parse(argv)
    vllm_router, lookup = None, "not wanted"
    if VLLM_ROUTER in args.arms:
        vllm_router, lookup = find_vllm_router(args.vllm_router, args.install_vllm_router, Path.cwd())
    report = run_in_workdir("overload", run, args, vllm_router, lookup)
    return print_and_save(report, markdown(report), args.json)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
