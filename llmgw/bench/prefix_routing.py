"""Benchmark: prefix-tree routing against round-robin on simulator replicas, and the tier's decision cost.

``python -m llmgw.bench.prefix_routing --json bench-results/prefix.json``

For each workload (a multi-turn chat, and independent questions under one
shared system prompt) and each arm (``round_robin``; ``prefix_tree`` with
its defaults, the cost model; ``prefix_tree`` with the weighted scores and
the count guard ``max_imbalance: 4``, the defaults before the cost model;
``prefix_tree`` without the load guard, i.e. prefix affinity alone), fresh
simulator replicas and a fresh gateway are started, the same seeded workload
is run through the gateway, and the engines' reported cache hit rate, TTFT
p50/p90 and per-replica request counts are recorded. The decision cost is
measured in-process: ``Router.pick`` on realistic chat bodies, against a small
tree and a tree filled to its default size limits.
Prints a Markdown table; ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ..metrics import Metrics
from ..plugins_manager import default_registry
from ..router.replica import Replica
from ..router.router import Router
from ..router.tier import RouteRequest
from ..testing.sims import MODEL, gateway_config, start_gateway, start_sims
from .chat_workloads import percentile, run_multi_turn, run_shared_prefix, summarize, words
from .common import print_and_save

REPLICAS = 4
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "round_robin": ("round_robin", {}),
    "prefix_tree": ("prefix_tree", {"seed": 1}),  # rule cost, no count guard: the defaults
    "prefix_tree, scores + max_imbalance 4": ("prefix_tree", {"seed": 1, "rule": "scores", "max_imbalance": 4}),
    "prefix_tree, no load guard": ("prefix_tree", {"seed": 1, "max_imbalance": None, "scorers": {"prefix": 1.0}}),
}


@dataclass
class Settings:
    conversations: int = 24
    turns: int = 5
    chat_system_words: int = 400
    chat_user_words: int = 40
    chat_concurrency: int = 8
    shared_requests: int = 96
    shared_system_words: int = 600
    shared_user_words: int = 30
    shared_concurrency: int = 16
    max_tokens: int = 32
    num_blocks: int = 2048
    max_num_seqs: int = 8
    time_scale: float = 1.0
    decisions: int = 5000
    seed: int = 1

    @classmethod
    def quick(cls) -> "Settings":
        return cls(conversations=12, turns=3, shared_requests=32, decisions=1000, time_scale=0.25)


async def run_arm(workload: str, routing: str, options: dict, s: Settings) -> dict:
    async with trio.open_nursery() as nursery:
        sims = await start_sims(nursery, REPLICAS, num_blocks=s.num_blocks, time_scale=s.time_scale, seed=0,
                                extra=("--max-num-seqs", str(s.max_num_seqs)))
        gateway = await start_gateway(nursery, gateway_config([c.url for c in sims], routing=routing,
                                                              routing_options=options))
        started = time.perf_counter()
        if workload == "multi_turn":
            results = await run_multi_turn(gateway.url, MODEL, conversations=s.conversations, turns=s.turns,
                                           system_words=s.chat_system_words, user_words=s.chat_user_words,
                                           max_tokens=s.max_tokens, concurrency=s.chat_concurrency, seed=s.seed)
        else:
            results = await run_shared_prefix(gateway.url, MODEL, requests=s.shared_requests,
                                              system_words=s.shared_system_words, user_words=s.shared_user_words,
                                              max_tokens=s.max_tokens, concurrency=s.shared_concurrency,
                                              seed=s.seed)
        summary = summarize(results)
        summary["wall_s"] = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return summary


# -- decision cost ---------------------------------------------------------------------------------------------------

def _router(tier: str) -> Router:
    router = Router(default_registry(), Metrics())
    router.configure_model(MODEL, tier, {"seed": 1} if tier == "prefix_tree" else {})
    for i in range(REPLICAS):
        router.add_replica(Replica(name=f"sim-{i}", model=MODEL, url=f"http://127.0.0.1:{9000 + i}"))
    return router


class ChatBodies:
    """Realistic chat bodies: a few dozen system prompts, conversations of 1-12 turns of 20-80 words."""

    def __init__(self, seed: int, conversations: int):
        self.rng = random.Random(seed)
        systems = [words(self.rng, self.rng.randint(100, 500)) for _ in range(32)]
        self.histories = [[{"role": "system", "content": self.rng.choice(systems)}] for _ in range(conversations)]

    def next(self) -> dict:
        history = self.rng.choice(self.histories)
        if len(history) > 24:
            del history[1:]
        history.append({"role": "user", "content": words(self.rng, self.rng.randint(20, 80))})
        body = {"model": MODEL, "messages": list(history), "max_tokens": 128}
        history.append({"role": "assistant", "content": words(self.rng, self.rng.randint(20, 80))})
        return body


async def decision_cost(tier: str, conversations: int, fill_chars: int, decisions: int, seed: int) -> dict:
    """Microseconds per ``Router.pick`` once the tree holds ``fill_chars`` characters (or the bodies run out)."""
    router = _router(tier)
    bodies = ChatBodies(seed, conversations)
    route = router.models[MODEL]
    tree = getattr(route.tier, "tree", None)
    for _ in range(200_000):  # fill, untimed
        if tree is None or tree.char_count >= fill_chars:
            break
        await router.pick(RouteRequest(MODEL, "/v1/chat/completions", bodies.next()))
    wall, cpu = [], []
    gc.collect()
    for _ in range(decisions):
        request = RouteRequest(MODEL, "/v1/chat/completions", bodies.next())
        started, started_cpu = time.perf_counter(), time.thread_time()
        await router.pick(request)
        wall.append(time.perf_counter() - started)
        cpu.append(time.thread_time() - started_cpu)
    result: dict[str, float] = {"decisions": decisions}
    for name, timings in (("", wall), ("cpu_", cpu)):  # CPU time leaves out time the OS ran something else
        for q in (50, 90, 99):
            result[f"{name}p{q}_us"] = 1e6 * percentile(timings, q / 100)
    if tree is not None:
        result.update(tree_nodes=tree.node_count, tree_chars=tree.char_count)
    return result


# -- the run ---------------------------------------------------------------------------------------------------------

async def run(s: Settings) -> dict:
    report: dict = {"settings": s.__dict__, "workloads": {}, "decision_cost": {}}
    for workload in ("multi_turn", "shared_prefix"):
        report["workloads"][workload] = {}
        for arm, (routing, options) in ARMS.items():
            print(f"  {workload} / {arm} ...", file=sys.stderr, flush=True)
            report["workloads"][workload][arm] = await run_arm(workload, routing, options, s)
    cost = report["decision_cost"]
    cost["prefix_tree, small tree"] = await decision_cost("prefix_tree", 64, 0, s.decisions, s.seed)
    cost["prefix_tree, full tree"] = await decision_cost("prefix_tree", 4000, REPLICAS * 2_000_000 - 50_000,
                                                         s.decisions, s.seed)
    cost["round_robin"] = await decision_cost("round_robin", 64, 0, s.decisions, s.seed)
    return report


def markdown(report: dict) -> str:
    lines = ["| workload | routing | cache hit rate | TTFT p50 (ms) | TTFT p90 (ms) | requests per replica |",
             "|---|---|---|---|---|---|"]
    for workload, arms in report["workloads"].items():
        for arm, r in arms.items():
            counts = "/".join(str(n) for n in r["per_replica"].values())
            errors = f" ({r['errors']} errors)" if r["errors"] else ""
            lines.append(f"| {workload} | {arm} | {r['hit_rate']:.1%} | {r['ttft_p50_ms']:.0f} | "
                         f"{r['ttft_p90_ms']:.0f} | {counts}{errors} |")
    lines += ["", "| decision (`Router.pick`, in-process) | tree nodes | tree characters | p50 (µs) | p90 (µs) | "
                  "p99 (µs) | CPU p50 (µs) | CPU p99 (µs) |", "|---|---|---|---|---|---|---|---|"]
    for name, c in report["decision_cost"].items():
        lines.append(f"| {name} | {c.get('tree_nodes', '-')} | {c.get('tree_chars', '-')} | {c['p50_us']:.0f} | "
                     f"{c['p90_us']:.0f} | {c['p99_us']:.0f} | {c['cpu_p50_us']:.0f} | {c['cpu_p99_us']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.bench.prefix_routing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the full results here")
    parser.add_argument("--quick", action="store_true", help="a smaller, faster run (for a smoke test)")
    args = parser.parse_args(argv)
    settings = Settings.quick() if args.quick else Settings()
    report = trio.run(run, settings)
    report["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                         "load_average": os.getloadavg(), "platform": platform.platform()}
    return print_and_save(report, markdown(report), args.json)


if __name__ == "__main__":
    sys.exit(main())
