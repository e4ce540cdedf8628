"""Cold waves through gateways that do and do not ingest KV events: does ingesting them delay the first tokens?

Four ``llmgw sim`` replicas (``--profile``, default ``h100-llama-3.1-8b``,
publishing KV events) and one gateway per arm over the same replicas:
``kv_index``, ``kv_index@noevents`` (no ``kv_events``: it decides by its
tree), ``prefix_tree`` and ``prefix_tree@events`` (``prefix_tree`` routing
with the replicas' ``kv_events``: a static replica's subscription runs
whatever the tier, so this arm ingests every event ``kv_index`` does, with
``prefix_tree``'s request path). For each of ``--waves`` waves, each arm in
turn sends 8 new prompts of 2,800-3,200 tokens at once (16 output tokens).
Printed and written: each arm's TTFT median and p90, the gateways' and the
simulators' CPU time per wave, and, per arm, the Trio task steps of at least
``--step-ms`` inside its own waves, summed by task (every gateway runs under
an instrument installed by this module: ``--gateway-with-steps``).

Run: ``python -m llmgw.bench.kv_ingest_wave [--waves 10] [--step-ms 0.3] [--json bench-results/kv_ingest_wave.json]``.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from ..sim.profiles import profile as gpu_profile
from ..sim.timing import GpuTiming
from ..testing.processes import SERVE_READY, start_child
from ..testing.sims import KV_SIM_ENV, KV_SIM_EXTRA, MODEL, gateway_config, kv_sources, start_sims
from .chat_workloads import send_chat, words
from .common import bench_parser, finish
from .routing_workloads import text

ARMS = ("kv_index", "kv_index@noevents", "prefix_tree", "prefix_tree@events")
WAVE = 8
REPLICAS = 4


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_with_steps(log_path: str, step_ms: float, argv: list[str]) -> int:
    """``llmgw ARGV`` with every Trio task step of at least ``step_ms`` appended to ``log_path``."""
    from .. import cli

    out = open(log_path, "a", buffering=1)

    class Steps(trio.abc.Instrument):
        started = 0.0

        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            self.started = time.perf_counter()

        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            took = time.perf_counter() - self.started
            if took * 1000 >= step_ms:
                out.write(f"{time.time():.4f} {took * 1000:.3f} {task.name}\n")

    run = trio.run

    def instrumented(*args: Any, **options: Any) -> Any:
        options["instruments"] = [*options.get("instruments", ()), Steps()]
        return run(*args, **options)

    trio.run = instrumented  # type: ignore[assignment]
    return cli.main(argv)


async def measure(waves: int, profile: str, step_ms: float, directory: Path) -> dict:
    rng = random.Random(1)
    rows: list[dict] = []
    async with trio.open_nursery() as nursery:
        sims = await start_sims(nursery, REPLICAS, env=KV_SIM_ENV, block_size=16, time_scale=1.0, seed=0,
                                per_replica=lambda i: {"num_blocks": None,
                                                       "extra": ("--profile", profile, *KV_SIM_EXTRA)})
        urls, sources = [sim.url for sim in sims], [kv_sources(sim) for sim in sims]
        rate = GpuTiming(gpu_profile(profile)).prefill_tokens_per_s  # as `llmgw bench routing` configures it
        gateways = {}
        for arm in ARMS:
            events = arm == "kv_index" or arm.endswith("@events")
            path = directory / f"{arm}.yaml"
            path.write_text(gateway_config(urls, routing=arm.partition("@")[0], kv_sources=sources if events else None,
                                           prefill_tokens_per_s=[rate] * REPLICAS))
            steps_log = str(directory / f"steps-{arm}.log")
            argv = [sys.executable, "-m", "llmgw.bench.kv_ingest_wave", "--gateway-with-steps", steps_log,
                    "--step-ms", str(step_ms), "serve", "--listen", "127.0.0.1:0", "--control-listen",
                    "127.0.0.1:0", "--config", str(path)]
            gateways[arm] = await start_child(nursery, argv, name=f"llmgw {arm}", ready=SERVE_READY)
        await trio.sleep(5)  # the subscriptions connected, the health checks passed
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=4 * WAVE)) as client:
            for wave in range(waves):
                for arm in ARMS:
                    prompts = [[{"role": "system",
                                 "content": text(rng, rng.randint(2800, 3200), f"W{wave} {arm} {i} ")},
                                {"role": "user", "content": words(rng, 8)}] for i in range(WAVE)]
                    ttfts = [0.0] * WAVE
                    gw_cpu = {a: cpu_seconds(g.pid) for a, g in gateways.items()}
                    sims_cpu = sum(cpu_seconds(sim.pid) for sim in sims)
                    started = time.time()

                    async def one(i: int, url: str = gateways[arm].url) -> None:
                        ttfts[i] = (await send_chat(client, url, MODEL, prompts[i], 16)).ttft * 1000

                    async with trio.open_nursery() as wave_nursery:
                        for i in range(WAVE):
                            wave_nursery.start_soon(one, i)
                    rows.append({"wave": wave, "arm": arm, "start": started, "end": time.time(), "ttft_ms": ttfts,
                                 "gateways_cpu_ms": {a: (cpu_seconds(g.pid) - gw_cpu[a]) * 1000
                                                     for a, g in gateways.items()},
                                 "sims_cpu_ms": (sum(cpu_seconds(sim.pid) for sim in sims) - sims_cpu) * 1000})
                    await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    return {"waves": waves, "profile": profile, "step_ms": step_ms, "rows": rows,
            "arms": {arm: summary(arm, rows, directory / f"steps-{arm}.log") for arm in ARMS}}


def summary(arm: str, rows: list[dict], steps_log: Path) -> dict:
    own = [row for row in rows if row["arm"] == arm]
    ttfts = sorted(t for row in own for t in row["ttft_ms"])
    steps: dict[str, float] = {}
    longest: dict[str, float] = {}
    for line in steps_log.read_text().splitlines() if steps_log.exists() else []:
        at, took, task = line.split(" ", 2)
        if any(row["start"] <= float(at) <= row["end"] for row in own):
            steps[task] = steps.get(task, 0.0) + float(took)
            longest[task] = max(longest.get(task, 0.0), float(took))
    return {"ttft_median_ms": statistics.median(ttfts), "ttft_p90_ms": ttfts[max(0, int(0.9 * len(ttfts)) - 1)],
            "gateway_cpu_ms_per_wave": statistics.median(row["gateways_cpu_ms"][arm] for row in own),
            "sims_cpu_ms_per_wave": statistics.median(row["sims_cpu_ms"] for row in own),
            "steps_ms_by_task": dict(sorted(steps.items(), key=lambda item: -item[1])[:6]),
            "longest_step_ms_by_task": longest}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--gateway-with-steps"]:  # one of the gateways this benchmark starts
        return serve_with_steps(argv[1], float(argv[3]), argv[4:])
    parser = bench_parser(__doc__)
    parser.add_argument("--waves", type=int, default=10)
    parser.add_argument("--profile", default="h100-llama-3.1-8b", help="the simulators' GPU profile")
    parser.add_argument("--step-ms", type=float, default=0.3, help="log the gateways' Trio steps this long or longer")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="llmgw-ingest-") as directory:
        report = trio.run(measure, args.waves, args.profile, args.step_ms, Path(directory))
    for arm, result in report["arms"].items():
        steps = ", ".join(f"{task.rsplit('.', 2)[-2]}.{task.rsplit('.', 1)[-1]} {ms:.0f} ms "
                          f"(longest {result['longest_step_ms_by_task'][task]:.1f})"
                          for task, ms in result["steps_ms_by_task"].items())
        print(f"{arm:20s} TTFT median {result['ttft_median_ms']:.1f} ms, p90 {result['ttft_p90_ms']:.1f} ms; "
              f"CPU per wave: gateway {result['gateway_cpu_ms_per_wave']:.0f} ms, simulators "
              f"{result['sims_cpu_ms_per_wave']:.0f} ms; steps >= {args.step_ms} ms: {steps}")
    print("load average at the end: " + ", ".join(f"{load:.2f}" for load in os.getloadavg()))
    return finish(args, report)


if __name__ == "__main__":
    raise SystemExit(main())
