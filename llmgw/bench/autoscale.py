"""Replicas that follow demand (issue 32): llmgw's autoscaler beside a fixed ``max`` fleet (cost) and a fixed
``min`` fleet (SLO), on traces an offline oracle knows in advance.

``llmgw bench autoscale`` runs on simulated nodes (:mod:`.autoscale_rig`: ``--nodes`` remote agents of ``--gpus``
fixture H100s each, deploying ``llmgw sim --profile h100-llama-3.1-8b`` replicas of ``--max-num-seqs`` sequences
that take ``--cold-start`` seconds to become ready, ``--hot-start`` when started hot). Fleet time runs
``--time-factor`` times faster than the wall: the startup times, the scaler's windows and the traces are divided by
it, a request itself runs at the engine's speed.

First one replica's capacity: a closed loop of ``--max-num-seqs`` clients on a fleet of one replica for
``--capacity-seconds`` (``--capacity`` gives it instead); one replica's worth of demand is ``--utilisation`` of it.
Then, for each trace (:mod:`.autoscale_traces`: ``step``, ``diurnal``, ``swap``, ``idle``) and each arm
(``autoscaled``: ``replicas: {min, max}`` and an ``autoscale:`` section with the windows, and the decisions'
interval, divided by the factor; ``fixed-max``; ``fixed-min``; opt-in, ``autoscaled-sleep``: the autoscaled arm
with ``sleep_mode`` on the profiles and a ``keep_warm`` longer than the trace, whose fleet first serves a busy spell
and is left idle until the replicas above ``min`` sleep, so that its steps up wake them: hot starts beside the
autoscaled arm's cold ones), ``--repeats`` times on a fresh fleet: open-loop
arrivals following the trace (streamed chat completions of ``--prompt-words`` words and ``--max-tokens`` tokens
through the gateway), sampled every ``--sample`` seconds (:meth:`~.autoscale_rig.AutoscaleRig.sample`). Per
trace, arm and model (:mod:`.autoscale_report`): the step to the extra replica serving, dropped requests,
reversals, TTFT p95 SLO attainment, replica-seconds against the oracle (:mod:`.autoscale_oracle`); a text chart of
replicas against demand; where the seconds of the step's scale-up and of the start from zero went, phase by phase,
from the processes' logs (:mod:`.autoscale_timeline`); with ``--json`` everything, series included (partial results
as they come).

Run: ``llmgw bench autoscale [--traces step,diurnal,swap,idle] [--arms autoscaled,fixed-max,fixed-min,...]
[--repeats 3] [--json bench-results/autoscale.json]``; ``--quick`` is a short form (the traces over a quarter of
their length, one repeat). An arm this llmgw cannot run (no ``autoscale:`` config yet) says so and is not run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import trio

from ..config.schema import Deployment
from ..flow.model import DEFAULT_CLASSES
from ..sim.profiles import DEFAULT_PROFILE
from ..testing.processes import ChildFailed
from ..testing.sims import start_sims
from .autoscale_oracle import plan
from .autoscale_report import charts, markdown, model_stats, run_summary, series, targets, targets_markdown
from .autoscale_rig import AutoscaleRig, EngineShape, profile_name, sim_models_startup
from .autoscale_timeline import engine_logs, log_events, scale_up_timeline, timelines_markdown
from .autoscale_traces import MODEL_A, TRACES, Trace, arrival_times, shortened
from .chat_workloads import new_client
from .cluster_events import percentile
from .common import bench_parser, chosen_names, print_and_save, run_in_workdir, write_json
from .limits import leaves
from .overload_arms import ArmUnavailable
from .overload_workload import INTERACTIVE, OK, Tenant, closed_loop, send_at, sender

AUTOSCALED, FIXED_MAX, FIXED_MIN = "autoscaled", "fixed-max", "fixed-min"
AUTOSCALED_SLEEP = "autoscaled-sleep"  # the autoscaled arm with sleep_mode and keep_warm: hot starts (opt-in)
ARMS = (AUTOSCALED, FIXED_MAX, FIXED_MIN)
ALL_ARMS = (*ARMS, AUTOSCALED_SLEEP)
SCALED_ARMS = (AUTOSCALED, AUTOSCALED_SLEEP)
# The autoscaled arms' windows, fleet s; lookahead: the forecast of the busy load looks one cold start ahead (the
# issue's 60 s, the key's default)
WINDOWS = {"scale_up_after": 5.0, "scale_down_after": 300.0, "idle_to_zero": 600.0, "lookahead": 60.0}
KEEP_WARM = 3600.0  # fleet seconds a scaled-down replica of the sleep arm sleeps: longer than any trace
SLEEP_MODE = "    sleep_mode: true\n"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser(__doc__ or "")
    parser.add_argument("--traces", default=",".join(TRACES), help="comma-separated, of: " + ", ".join(TRACES))
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ALL_ARMS)
                        + f" (default: {','.join(ARMS)}; {AUTOSCALED_SLEEP} first drives each model to its max "
                          "and leaves it idle until the replicas above its min sleep)")
    parser.add_argument("--warm-up", type=float, default=240.0,
                        help=f"{AUTOSCALED_SLEEP}: fleet seconds of load at max replicas' worth before the wait "
                             "for its replicas to sleep")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-factor", type=float, default=10.0, help="fleet seconds per wall second")
    parser.add_argument("--cold-start", type=float, default=60.0, help="an engine's cold start, fleet seconds")
    parser.add_argument("--hot-start", type=float, default=5.0, help="an engine's hot start, fleet seconds")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=4, help="fixture H100s per node")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="the simulators' GPU profile")
    parser.add_argument("--max-num-seqs", type=int, default=2, help="each simulator's running sequences")
    parser.add_argument("--prompt-words", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--capacity-seconds", type=float, default=15.0, help="the capacity loop's length")
    parser.add_argument("--capacity", type=float, default=None, help="one replica's req/s, instead of measuring")
    parser.add_argument("--utilisation", type=float, default=0.7,
                        help="one replica's worth of demand, as a share of its measured capacity")
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--window", type=float, default=30.0, help="SLO attainment's window, fleet seconds")
    parser.add_argument("--sample", type=float, default=0.25, help="wall seconds between samples of the fleet")
    parser.add_argument("--cap", type=int, default=500, help="requests in flight at most (arrivals beyond: counted)")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="the client's, per request")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="the traces over a quarter of their length, one "
                                                             "repeat, a 6 s capacity loop")
    parser.add_argument("--workdir", help="where the processes' files go (default: a temporary folder)")
    if "--quick" in argv:
        parser.set_defaults(repeats=1, capacity_seconds=6.0)
    args = parser.parse_args(argv)
    args.traces = chosen_names(parser, args.traces, list(TRACES), "traces")
    args.arms = chosen_names(parser, args.arms, ALL_ARMS)
    return args


def engine_of(args: argparse.Namespace, boot: float = 0.0) -> EngineShape:
    """Each replica; its modelled cold start less ``boot``, the seconds this machine takes to start the
    simulator's process at all (which the time factor does not shrink)."""
    return EngineShape(args.profile, args.max_num_seqs, max(0.0, args.cold_start / args.time_factor - boot),
                       args.hot_start / args.time_factor)


async def measure_boot(args: argparse.Namespace, times: int = 3) -> list[float]:
    """Wall seconds from starting a simulator (no modelled startup) to its listening, ``times`` times."""
    boots = []
    for _ in range(times):
        async with trio.open_nursery() as nursery:
            started = trio.current_time()
            await start_sims(nursery, 1, num_blocks=None, extra=("--profile", args.profile))
            boots.append(trio.current_time() - started)
            nursery.cancel_scope.cancel()
    return boots


def tenant_of(args: argparse.Namespace, model: str) -> Tenant:
    return Tenant(model, "sk-bench-autoscale", INTERACTIVE, 1.0, args.prompt_words, args.max_tokens)


def autoscale_available() -> bool:
    """Whether this llmgw's deployments take ``replicas: {min, max}`` and an ``autoscale:`` section (issue 32)."""
    return "autoscale" in {f.name for f in dataclasses.fields(Deployment)}


def seconds(fleet_seconds: float, factor: float) -> str:
    return f"{fleet_seconds / factor:g}s"


def deployment_lines(arm: str, trace: Trace, factor: float) -> str:
    """A model's deployment in ``arm`` (the YAML after ``profile:``)."""
    if arm == FIXED_MAX:
        return f"replicas: {trace.max_replicas}"
    if arm == FIXED_MIN:
        return f"replicas: {trace.min_replicas}"
    if not autoscale_available():
        raise ArmUnavailable("not available: this llmgw has no autoscaling (the deployments' `autoscale:` keys)")
    windows = dict(WINDOWS)
    if arm == AUTOSCALED_SLEEP:
        windows["keep_warm"] = KEEP_WARM
    scaled = ", ".join(f"{key}: {seconds(value, factor)}" for key, value in windows.items())
    return (f"replicas: {{min: {trace.min_replicas}, max: {trace.max_replicas}}}\n"
            f"    autoscale: {{{scaled}}}")


REFERENCE_FACTOR = 10.0  # the compression at which the flow classes' default ``max_wait`` are kept as they are


def flow_classes(factor: float) -> str:
    """The flow queue's classes with their default ``max_wait`` held in fleet seconds as at the default compression
    (the ``standard`` class's 10 s is 100 fleet seconds): a request held for a model at zero waits out an engine's
    cold start at any ``--time-factor`` (docs/autoscaling.md: a ``max_wait`` longer than the start)."""
    scaled = "".join(f"    - {{name: {c.name}, rank: {c.rank}, max_fill: {c.max_fill:g}, "
                     f"max_wait: {seconds(c.max_wait * REFERENCE_FACTOR, factor)}}}\n" for c in DEFAULT_CLASSES)
    return f"flow:\n  classes:\n{scaled}"


def config_extra(arm: str, factor: float) -> str:
    """The arm's top-level config: the flow classes (:func:`flow_classes`) and, autoscaled, the autoscaler deciding
    every second of fleet time."""
    classes = "" if factor == REFERENCE_FACTOR else flow_classes(factor)
    return classes + (f"autoscale:\n  interval: {seconds(1.0, factor)}\n" if arm in SCALED_ARMS else "")


def profile_extra(arm: str) -> str:
    """The arm's profile keys: the sleep arm's engines can be put to sleep (vLLM's sleep mode; the simulator's)."""
    return SLEEP_MODE if arm == AUTOSCALED_SLEEP else ""


def starting_count(arm: str, trace: Trace) -> int:
    return trace.max_replicas if arm == FIXED_MAX else trace.min_replicas


async def measure_capacity(args: argparse.Namespace, http: httpx.AsyncClient, root: Path) -> dict:
    """One replica's req/s under a closed loop of ``--max-num-seqs`` clients (see the module's docstring)."""
    if args.capacity is not None:
        return {"rps": args.capacity, "given": True}
    async with AutoscaleRig.open(root / "capacity", engine_of(args), {MODEL_A: "replicas: 1"}, {MODEL_A: 1},
                                 nodes=1, gpus=1) as rig:
        send = sender(http, [rig.url], args.request_timeout, MODEL_A)
        loop = await closed_loop(send, [tenant_of(args, MODEL_A)], args.max_num_seqs, args.capacity_seconds,
                                 args.seed)
    ok = [o for o in loop.outcomes if o.kind == OK]
    p95 = percentile([o.ttft for o in ok], 0.95)
    return {"rps": len(ok) / loop.seconds, "given": False, "clients": args.max_num_seqs, "completed": len(ok),
            "failed": len(loop.outcomes) - len(ok), "seconds": loop.seconds,
            "ttft_p95_ms": None if p95 is None else p95 * 1000}


async def sample_fleet(rig: AutoscaleRig, every: float, into: list[dict]) -> None:
    """Until cancelled, the fleet's counts every ``every`` seconds, timed from the call (a failed read skipped)."""
    start = trio.current_time()
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            counts = await rig.sample()
            into.append({"t": trio.current_time() - start, "models": counts})
        await trio.sleep_until(start + (len(into) + 1) * every)


ASLEEP_WAIT = 60.0  # wall seconds beyond the scale-downs' windows the sleep arm's replicas may take to sleep


async def asleep_counts(rig: AutoscaleRig) -> dict[str, dict[str, int]]:
    """Per model: its replicas ready (``/admin/replicas``) and asleep (``/admin/autoscale``'s ``sleeping``)."""
    counts = await rig.sample()
    scaled = (await rig.http.get(rig.control.control_url + "/admin/autoscale")).json()["deployments"]
    return {model: {"ready": counts[model]["ready"], "sleeping": scaled[profile_name(model)]["sleeping"]}
            for model in rig.models}


async def put_to_sleep(args: argparse.Namespace, http: httpx.AsyncClient, rig: AutoscaleRig, trace: Trace,
                       replica_rps: float, rng: random.Random) -> dict[str, int]:
    """The sleep arm's fleet before its trace, as if it had served a busy spell before: each model driven at
    ``max`` replicas' worth for ``--warm-up`` fleet seconds, then left idle until its autoscaler took it back to
    ``min`` (a step down every ``scale_down_after``, or all at once after ``idle_to_zero``) and the replicas it had
    above that sleep. Per model, the replicas asleep when the trace starts (fewer than it had above ``min`` if they
    did not all sleep within those windows and :data:`ASLEEP_WAIT`)."""
    factor = args.time_factor
    wall = args.warm_up / factor
    warm = Trace("warm-up", "max replicas' worth", args.warm_up, trace.models,
                 lambda _model, _t: float(trace.max_replicas), float(trace.max_replicas))
    most = dict.fromkeys(trace.models, 0)

    async def drive(model: str) -> None:
        arrivals = [(at, tenant_of(args, model), random.Random(rng.random()))
                    for at in arrival_times(warm, model, replica_rps, factor, rng)]
        await send_at(sender(http, [rig.url], args.request_timeout, model), arrivals, wall, args.cap)

    async def watch() -> None:
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                for model, found in (await rig.sample()).items():
                    most[model] = max(most[model], found["ready"])
            await trio.sleep(args.sample)

    async with trio.open_nursery() as warming:
        warming.start_soon(watch)
        async with trio.open_nursery() as driving:
            for model in trace.models:
                driving.start_soon(drive, model)
        warming.cancel_scope.cancel()
    counts: dict[str, dict[str, int]] = {}
    steps_down = WINDOWS["idle_to_zero"] + trace.max_replicas * WINDOWS["scale_down_after"]
    with trio.move_on_after(steps_down / factor + ASLEEP_WAIT):
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                counts = await asleep_counts(rig)
                if all(counts[m]["ready"] <= trace.min_replicas
                       and counts[m]["sleeping"] >= most[m] - trace.min_replicas for m in trace.models):
                    break
            await trio.sleep(0.5)
    asleep = {model: counts.get(model, {}).get("sleeping", 0) for model in trace.models}
    print(f"    warmed up to {most} replicas ready; asleep when the trace starts: {asleep}", file=sys.stderr,
          flush=True)
    return asleep


async def run_trace(args: argparse.Namespace, http: httpx.AsyncClient, trace: Trace, arm: str, repeat: int,
                    workdir: Path, replica_rps: float, boot: float) -> tuple[dict, dict]:
    """One repeat of ``trace`` on a fresh fleet of ``arm``: per model its stats and its series."""
    factor = args.time_factor
    deployments = {model: deployment_lines(arm, trace, factor) for model in trace.models}
    ready = dict.fromkeys(trace.models, starting_count(arm, trace))
    wall = trace.seconds / factor
    rng = random.Random(args.seed * 1000 + repeat)
    arrivals = {model: [(at, tenant_of(args, model), random.Random(rng.random()))
                        for at in arrival_times(trace, model, replica_rps, factor, rng)] for model in trace.models}
    fleet: list[dict] = []
    loops = {}
    began: dict[str, float] = {}  # epoch seconds at which each model's arrivals are timed from
    asleep: dict[str, int] = {}
    async with AutoscaleRig.open(workdir, engine_of(args, boot), deployments, ready, nodes=args.nodes,
                                 gpus=args.gpus, extra_config=config_extra(arm, factor),
                                 profile_extra=profile_extra(arm)) as rig:
        if arm == AUTOSCALED_SLEEP:
            asleep = await put_to_sleep(args, http, rig, trace, replica_rps, random.Random(rng.random()))

        async def drive(model: str) -> None:
            began[model] = time.time()
            loops[model] = await send_at(sender(http, [rig.url], args.request_timeout, model), arrivals[model],
                                         wall, args.cap)

        async with trio.open_nursery() as sampling:
            sampling.start_soon(sample_fleet, rig, args.sample, fleet)
            async with trio.open_nursery() as driving:
                for model in trace.models:
                    driving.start_soon(drive, model)
            sampling.cancel_scope.cancel()
        control_log, agent_log = rig.log_lines()
    for name, log_lines in (("control.log", control_log), ("agents.log", agent_log)):  # kept with --workdir
        (workdir / name).write_text("\n".join(log_lines) + "\n")
    control_events, agent_events = log_events(control_log), log_events(agent_log)
    engines = engine_logs(workdir)
    within = [s for s in fleet if s["t"] <= wall]
    stats, lines = {}, {}
    for model in trace.models:
        oracle = plan(trace, model, factor, args.cold_start, args.sample)
        stats[model] = model_stats(trace, model, factor, within, loops[model].outcomes, oracle,
                                   args.ttft_slo_ms / 1000, args.window)
        stats[model]["over_cap"] = loops[model].over_cap
        if model in asleep:
            stats[model]["asleep_at_start"] = asleep[model]
        lines[model] = series(trace, model, factor, within, oracle)
        moment = trace.called_at if trace.called_at is not None else trace.step_at
        if moment is not None:
            since = began[model] + moment / factor
            stats[model]["timeline"] = scale_up_timeline(control_events, agent_events, profile_name(model), model,
                                                         since, engines, trace.called_at is not None)
    return stats, lines


async def run_arm(args: argparse.Namespace, http: httpx.AsyncClient, trace: Trace, arm: str, root: Path,
                  replica_rps: float, boot: float) -> dict:
    entry: dict = {"trace": trace.name, "description": trace.description, "arm": arm, "runs": []}
    try:
        for repeat in range(args.repeats):
            print(f"  {trace.name} on {arm}: repeat {repeat + 1} of {args.repeats} "
                  f"({trace.seconds / args.time_factor:g} s)", file=sys.stderr, flush=True)
            stats, lines = await run_trace(args, http, trace, arm, repeat, root / f"{trace.name}-{arm}-{repeat}",
                                           replica_rps, boot)
            entry["runs"].append(stats)
            entry.setdefault("series", lines)  # the first repeat's: the chart
            entry.setdefault("series_by_repeat", []).append(lines)
        entry["summary"] = run_summary(entry["runs"])
    except* ArmUnavailable as group:
        entry["error"] = str(leaves(group)[0])
    except* (ChildFailed, RuntimeError) as group:
        failure = "\n".join(str(leaf) for leaf in leaves(group))
        entry["error"] = failure.splitlines()[0][:200]
        entry["error_detail"] = failure[-4000:]
    return entry


def traces_of(args: argparse.Namespace) -> list[Trace]:
    traces = [TRACES[name]() for name in args.traces]
    return [shortened(t, 0.25) for t in traces] if args.quick else traces


async def run(args: argparse.Namespace, root: Path) -> dict:
    settings = {key: getattr(args, key) for key in (
        "traces", "arms", "repeats", "time_factor", "nodes", "profile", "max_num_seqs", "prompt_words",
        "max_tokens", "utilisation", "ttft_slo_ms", "sample", "seed", "quick", "warm_up")}
    settings.update(gpus_per_node=args.gpus, gpu="H100 80GB", cold_start_s=args.cold_start,
                    hot_start_s=args.hot_start, window_s=args.window, startup_modelled=sim_models_startup(),
                    sim_note=f"--max-num-seqs {args.max_num_seqs}, {args.prompt_words}-word prompts, "
                             f"{args.max_tokens} tokens out, streamed",
                    cpus=os.cpu_count(), load_average_at_start=os.getloadavg())
    if not settings["startup_modelled"]:
        settings["sim_note"] += "; this simulator models no startup time (a replica is ready once its process is)"
    report: dict = {"settings": settings, "runs": []}
    async with new_client(args.cap) as http:
        boots = await measure_boot(args)
        boot = statistics.median(boots)
        engine = engine_of(args, boot)
        settings.update(boot_s=boots, sim_startup_seconds=engine.cold_start, sim_hot_startup_seconds=engine.hot_start)
        print(f"llmgw bench autoscale: a simulator's process starts in {boot:.2f} s (median of {boots}): its "
              f"modelled cold start is {engine.cold_start:.2f} s", file=sys.stderr, flush=True)
        print("llmgw bench autoscale: one replica's capacity", file=sys.stderr, flush=True)
        report["capacity"] = capacity = await measure_capacity(args, http, root)
        replica_rps = capacity["replica_worth_rps"] = capacity["rps"] * args.utilisation
        print(f"  {capacity['rps']:.2f} req/s; one replica's worth: {replica_rps:.2f} req/s", file=sys.stderr,
              flush=True)
        for trace in traces_of(args):
            for arm in args.arms:
                print(f"llmgw bench autoscale: {trace.name} ({trace.description}) on {arm}", file=sys.stderr,
                      flush=True)
                report["runs"].append(await run_arm(args, http, trace, arm, root, replica_rps, boot))
                if args.json:  # what was measured so far survives a run cut short
                    write_json(args.json, {**report, "partial": True})
    settings["load_average_at_end"] = os.getloadavg()
    return report


def main(argv: list[str]) -> int:
    args = parse(argv)
    report = run_in_workdir("autoscale", run, args)
    print(charts(report), "\n")
    for arm in (a for a in SCALED_ARMS if a in args.arms):
        if timelines := timelines_markdown(report, arm):
            print(f"Where the seconds of a scale-up go, {arm} (the logs' timestamps):\n\n" + timelines, "\n")
    report["targets"] = targets(report, AUTOSCALED)
    text = markdown(report) + "\n\n" + targets_markdown(report, AUTOSCALED)
    if AUTOSCALED_SLEEP in args.arms:
        report["targets_sleep"] = targets(report, AUTOSCALED_SLEEP)
        text += "\n\n" + targets_markdown(report, AUTOSCALED_SLEEP)
    return print_and_save(report, text, args.json)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
