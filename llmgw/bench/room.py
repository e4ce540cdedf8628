"""The learnt room on one simulated GPU under a standing backlog: engine KV usage, queue and preemptions, throughput.

Run: ``python -m llmgw.bench.room [--profile h100-llama-3.1-8b] [--users 100] [--gateways 1] [--seconds 30]
[--runs 3] [--num-blocks 6000] [--time-scale 2] [--json FILE]``.

One ``llmgw sim`` on a GPU profile; ``--users`` clients each send one non-streamed chat request after another
(long prompts, long answers: the KV cache, not ``max_num_seqs``, is what fills). Two arms, alternated run by run:

- ``room``: a request is sent only while the :class:`~llmgw.flow.room.EngineRoom` (with the router's scraper,
  as a gateway runs them) has room for it; the others wait at the "gateway" (their count is the room's demand);
- ``none``: every request goes to the engine at once (llmgw without admission: the engine queues and preempts).

Also measured: what one ``room.free()`` costs (the queue calls it for every request it admits).

With ``--gateways N`` the users are spread over N gateways in this process, each with its own router, scraper
and room, which see each other's requests in flight and held as llmgw's load reports carry them: every 50 ms.

Sampled every scrape while requests wait at the gateway or the engine: the engine's KV usage and waiting
requests, every gateway's requests in flight over the (first gateway's) learnt capacity; per run the
preemptions, completed requests and output tokens per second, the learnt capacity and its cuts and raises.
Printed: medians over the runs, with min..max.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from random import Random

import httpx
import trio

from ..engines.probe import EngineLoad
from ..flow.model import DEFAULT_CLASSES
from ..flow.room import EngineRoom
from ..metrics import Metrics
from ..plugins_manager import build_registry, make_plugin_manager
from ..router.load_scraper import scrape_engine_load
from ..router.replica import Replica
from ..router.router import Router
from ..testing.metrics import metric_value
from ..testing.processes import llmgw_command, start_child
from ..testing.sims import MODEL
from .chat_workloads import words
from .common import cell, print_and_save, rounds_us

STANDARD = DEFAULT_CLASSES[1]
ARMS = ("room", "none")


class Gateway:
    """One gateway in this process: its own router, replica of the engine, scraper, learnt room and held requests."""

    def __init__(self, url: str, reports: Reports | None) -> None:
        self.router = Router(build_registry(make_plugin_manager(())), Metrics())
        self.router.configure_model(MODEL, "round_robin")
        self.replica = Replica(name="sim-0", model=MODEL, url=url)
        self.replica.pool = self.replica.open_pool(5.0)
        self.router.add_replica(self.replica)
        self.waiting = 0  # requests held here
        self.peer_held: list[int] = []  # the other gateways' held requests, as their last report said
        self.room = EngineRoom(self.router, PeerView(self) if reports is not None else None)
        self.room.count_queued(lambda model: self.waiting)


class PeerView:
    """The room's view of the other gateways (what llmgw.cluster.load.LoadSharing gives a gateway)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def count_queued(self, source, max_queued: int) -> None: ...

    def peer_queued(self, model: str) -> list[int]:
        return self.gateway.peer_held

    def peer_output(self, model: str) -> int | None:
        return None  # not modelled: the room counts the others' output at its own mean

    def watch(self, listener) -> None: ...


class Reports:
    """Load reports between the gateways of this process every ``interval`` (LoadSharing's 50 ms): each one's
    requests in flight and held reach the others as they were when sent."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.gateways: list[Gateway] = []

    async def run(self) -> None:
        while True:
            await trio.sleep(self.interval)
            sent = [(g.replica.local_inflight, g.waiting) for g in self.gateways]
            for index, gateway in enumerate(self.gateways):
                others = [figures for other, figures in enumerate(sent) if other != index]
                gateway.replica.peer_inflight = sum(inflight for inflight, _ in others)
                gateway.peer_held = [held for _, held in others if held > 0]
                gateway.room.wake_all()


async def one_run(arm: str, args: argparse.Namespace, seed: int) -> dict:
    users, seconds, prompt_words = args.users, args.seconds, args.prompt_words
    blocks = ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
    async with trio.open_nursery() as nursery:
        sim = await start_child(nursery, llmgw_command(
            "sim", "--port", "0", "--served-model-name", MODEL, "--profile", args.profile, *blocks,
            "--output-tokens", args.output_tokens, "--time-scale", str(args.time_scale), "--no-enable-prefix-caching",
            "--seed", str(seed), "--log-level", "WARNING"), name="sim", keep_lines=10)
        reports = Reports() if args.gateways > 1 else None
        gateways = [Gateway(sim.url, reports) for _ in range(args.gateways)]
        if reports is not None:
            reports.gateways = gateways
            nursery.start_soon(reports.run)
        for gateway in gateways:
            nursery.start_soon(scrape_engine_load, gateway.router)
        first = gateways[0]
        done = {"requests": 0, "tokens": 0}
        samples: list[tuple[float, float]] = []  # (kv usage, engine waiting) while requests wait somewhere
        over: list[float] = []  # every gateway's requests in flight over the first one's learnt capacity
        trace: list[list[float | int | None]] = []  # every scrape: [s, kv, running, waiting, capacity, inflight]
        measuring = False
        rng = Random(seed)

        async def user(http: httpx.AsyncClient, index: int) -> None:
            gateway = gateways[index % len(gateways)]
            room, replica = gateway.room, gateway.replica
            while True:
                body = {"model": MODEL, "max_tokens": 1024,
                        "messages": [{"role": "user", "content": f"{index} " + words(rng, prompt_words)}]}
                if arm == "room":
                    gateway.waiting += 1
                    while room.free(MODEL, STANDARD) <= 0:
                        await room.changed(MODEL)
                    gateway.waiting -= 1
                replica.local_inflight += 1
                try:
                    response = await http.post(sim.url + "/v1/chat/completions", json=body)
                finally:
                    replica.local_inflight -= 1
                    room.wake(MODEL)
                if measuring and response.status_code == 200:
                    done["requests"] += 1
                    done["tokens"] += response.json()["usage"]["completion_tokens"]

        async def sample() -> None:
            begun = trio.current_time()
            while True:
                await trio.sleep(first.room.scrape_interval)
                load = first.replica.engine_load
                inflight = sum(g.replica.local_inflight for g in gateways)
                capacity = first.room.capacity(first.replica)
                if load is not None:
                    trace.append([round(trio.current_time() - begun, 2), load.kv_usage, load.running, load.waiting,
                                  capacity, inflight])
                held = sum(g.waiting for g in gateways)
                if measuring and load is not None and load.kv_usage is not None and (held or load.waiting):
                    samples.append((load.kv_usage, load.waiting))
                    if capacity:
                        over.append(inflight / capacity)

        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(
                max_connections=users + 4, max_keepalive_connections=users + 4)) as http:
            async with trio.open_nursery() as load:
                for index in range(users):
                    load.start_soon(user, http, index)
                load.start_soon(sample)
                await trio.sleep(seconds / 3)  # the engine fills and the room learns
                before = metric_value((await http.get(sim.url + "/metrics")).text, "vllm:num_preemptions_total")
                measuring = True
                started = trio.current_time()
                await trio.sleep(seconds)
                measuring = False
                elapsed = trio.current_time() - started
                after = metric_value((await http.get(sim.url + "/metrics")).text, "vllm:num_preemptions_total")
                load.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    learnt = first.room._learnt.get(first.replica)
    kv = [s[0] for s in samples]
    return {
        "arm": arm, "requests_per_s": done["requests"] / elapsed, "output_tokens_per_s": done["tokens"] / elapsed,
        "kv_usage_mean": statistics.fmean(kv) if kv else None, "kv_usage_p10": _p10(kv),
        "engine_waiting_mean": statistics.fmean(s[1] for s in samples) if samples else None,
        "preemptions_per_s": (after - before) / elapsed,
        "inflight_over_capacity_mean": statistics.fmean(over) if over else None,
        "inflight_over_capacity_max": max(over) if over else None,
        "capacity": first.room.capacity(first.replica), "cuts": learnt.cuts if learnt else 0,
        "raises": learnt.raises if learnt else 0, "trace": trace,
    }


def _p10(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 10] if values else None


def free_cost_us(replicas: int = 4, peers: int = 3, rounds: int = 7) -> dict:
    """µs per :meth:`EngineRoom.free` (what the queue calls for every request it admits), capacities learnt,
    ``peers`` other gateways holding requests: median of ``rounds`` rounds of 20,000 calls, and their spread."""
    router = Router(build_registry(make_plugin_manager(())), Metrics())
    router.configure_model(MODEL, "round_robin")
    held = {f"gw-{i}": 5 for i in range(peers)}

    class Peers:
        def count_queued(self, source, max_queued) -> None: ...

        def peer_queued(self, model: str) -> list[int]:
            return list(held.values())

        def peer_output(self, model: str) -> int | None:
            return None

        def watch(self, listener) -> None: ...

    room = EngineRoom(router, Peers())
    room.count_queued(lambda model: 3)
    for index in range(replicas):
        replica = Replica(name=f"r{index}", model=MODEL, url=f"http://127.0.0.1:{9000 + index}")
        router.add_replica(replica)
        for at in (1.0, 2.0):
            replica.engine_load = EngineLoad(running=40, waiting=5, at=at, kv_usage=0.5)
            room.scraped(replica)
    times = rounds_us({"free": lambda: room.free(MODEL, STANDARD)}, 20_000, rounds)["free"]
    return {"replicas": replicas, "peers": peers, "median_us": statistics.median(times), "min_us": min(times),
            "max_us": max(times)}


MEASURES = ("requests_per_s", "output_tokens_per_s", "kv_usage_mean", "kv_usage_p10", "engine_waiting_mean",
            "preemptions_per_s", "inflight_over_capacity_mean", "inflight_over_capacity_max", "capacity", "cuts",
            "raises")


def summarize(runs: list[dict]) -> dict:
    """Per arm and measure: the median over the runs, its min and max."""
    summary: dict = {}
    for arm in ARMS:
        rows = [run for run in runs if run["arm"] == arm]
        if not rows:
            continue
        summary[arm] = {}
        for measure in MEASURES:
            values = [row[measure] for row in rows if row[measure] is not None]
            summary[arm][measure] = None if not values else {
                "median": statistics.median(values), "min": min(values), "max": max(values)}
    return summary


def table(summary: dict) -> str:
    arms = [arm for arm in ARMS if arm in summary]
    lines = ["| measure | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for measure in MEASURES:
        cells = []
        for arm in arms:
            figure = summary[arm][measure]
            cells.append("-" if figure is None else f"{cell(figure['median'], '.2f')} "
                         f"({cell(figure['min'], '.2f')}..{cell(figure['max'], '.2f')})")
        lines.append(f"| {measure} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h100-llama-3.1-8b")
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--gateways", type=int, default=1, help="gateways in this process, the users spread over "
                        "them, sharing their load every 50 ms as llmgw's load reports do")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured per run (a third more to warm up)")
    parser.add_argument("--runs", type=int, default=3, help="runs per arm")
    parser.add_argument("--prompt-words", type=int, default=400)
    parser.add_argument("--output-tokens", default="128:256", help="the simulator's MIN:MAX")
    parser.add_argument("--num-blocks", type=int, default=6000, help="the engine's KV blocks (0: the profile's): "
                        "fewer than an H100 holds, so that a few dozen requests fill it and the clients stay few")
    parser.add_argument("--time-scale", type=float, default=2.0, help="the simulator's: its GPU this many times "
                        "slower, so that its own CPU time (on a shared machine) distorts it less")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    arms = [arm for arm in ARMS if arm in args.arms.split(",")]
    runs = []
    for index in range(args.runs):
        for arm in arms:
            run = trio.run(one_run, arm, args, index)
            print({k: v for k, v in run.items() if k != "trace"}, file=sys.stderr)
            runs.append(run)
    summary = summarize(runs)
    cost = free_cost_us()
    report = {"settings": vars(args), "runs": runs, "summary": summary, "free_cost": cost}
    return print_and_save(report, table(summary) + f"\n\nroom.free(): {cost['median_us']:.2f} µs per call "
                          f"({cost['min_us']:.2f}..{cost['max_us']:.2f}), {cost['replicas']} replicas, "
                          f"{cost['peers']} peers holding requests", args.json)


if __name__ == "__main__":
    sys.exit(main())
