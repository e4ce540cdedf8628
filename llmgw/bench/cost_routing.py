"""Benchmark: the cost model against the count guard, on grouped system prompts over KV-event-fed simulators.

``python -m llmgw.bench.cost_routing [--json out.json] [--quick]``

The workload of the cost model's issue: independent questions under a few
long system prompts (``groups`` of ``system_chars`` characters, about as many
tokens with the simulator's byte tokenizer), sent ``concurrency`` at a time in
a shuffled order. Per arm, fresh ``llmgw sim`` replicas (``--time-scale 1``:
real prefill and decode times; KV events published on ZMQ) and a fresh
gateway following them as static replicas with ``kv_events``, routing with
``kv_index``; the router tokenizes with the simulator's own tokenizer files
(:mod:`llmgw.sim.tokenizer_files`, as a profile's ``model_path`` would give
them) unless the arm says ``tokenizer: replica``. Recorded: the engines'
cache hit rate, TTFT p50/p90, output tokens per second, requests per
replica, and the gateway's decision outcomes (``llmgw_routing_decisions_total``)
and tokenize sources (``llmgw_kv_tokenize_source_total``).
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from ..sim.tokenizer_files import write_tokenizer_files
from ..testing.processes import llmgw_command, start_child
from ..testing.sims import MODEL, start_gateway
from .chat_workloads import _run_limited, new_client, send_chat, summarize, words
from .common import bench_parser, print_and_save

REPLICAS = 4
ARMS: dict[str, dict[str, Any]] = {
    "kv_index, cost (default)": {},
    "kv_index, scores + max_imbalance 4 (before)": {"rule": "scores", "max_imbalance": 4},
    "kv_index, scores + max_imbalance 8": {"rule": "scores", "max_imbalance": 8},
    "kv_index, cost, /tokenize": {"tokenizer": "replica"},
}


@dataclass
class Settings:
    groups: int = 6
    system_chars: int = 2000
    user_words: int = 20
    requests: int = 144
    concurrency: tuple[int, ...] = (8, 24)
    max_tokens: int = 32
    num_blocks: int = 2048
    max_num_seqs: int = 16
    seed: int = 1

    @classmethod
    def quick(cls) -> "Settings":
        return cls(requests=48, concurrency=(24,))


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _start_engines(nursery: trio.Nursery, s: Settings) -> list[tuple[str, int, int]]:
    """``(url, events port, replay port)`` of fresh simulators publishing KV events."""
    out: list = [None] * REPLICAS

    async def start(i: int) -> None:
        events, replay = _free_port(), _free_port()
        config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
                             "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"})
        argv = llmgw_command("sim", "--port", "0", "--served-model-name", MODEL, "--profile", "constant",
                             "--time-scale", "1",
                             "--num-blocks", str(s.num_blocks), "--max-num-seqs", str(s.max_num_seqs),
                             "--seed", "0", "--prefix-caching-hash-algo", "sha256_cbor", "--log-level", "WARNING",
                             "--kv-events-config", config)
        child = await start_child(nursery, argv, name=f"sim-{i}", env={"PYTHONHASHSEED": "0"})
        out[i] = (child.url, events, replay)

    async with trio.open_nursery() as starting:
        for i in range(REPLICAS):
            starting.start_soon(start, i)
    return out


def _config(engines, options: dict) -> str:
    replicas = "".join(f"      - url: {url}\n        name: sim-{i}\n        kv_events: tcp://127.0.0.1:{events}\n"
                       f"        kv_replay: tcp://127.0.0.1:{replay}\n"
                       for i, (url, events, replay) in enumerate(engines))
    return (f"models:\n  - name: {MODEL}\n    routing: kv_index\n    routing_options: {json.dumps(options)}\n"
            f"    replicas:\n{replicas}health:\n  interval: 1s\nlog_level: warning\n")


def _samples(text: str, name: str, label: str) -> dict[str, float]:
    """``{value of label: sample}`` of one metric in Prometheus text (one model)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            pairs = dict(part.split("=", 1) for part in labels.split(","))
            out[pairs[label].strip('"')] = float(value)
    return out


async def run_arm(options: dict, concurrency: int, s: Settings, tokenizer_dir: str) -> dict:
    rng = random.Random(s.seed)
    systems = [words(rng, s.system_chars // 5)[: s.system_chars] for _ in range(s.groups)]
    bodies = [[{"role": "system", "content": f"Group {i % s.groups}. " + systems[i % s.groups]},
               {"role": "user", "content": f"Question {i}: " + words(rng, s.user_words)}]
              for i in range(s.requests)]
    rng.shuffle(bodies)
    async with trio.open_nursery() as nursery:
        engines = await _start_engines(nursery, s)
        gateway = await start_gateway(nursery, _config(engines, {"seed": 1, "tokenizer_path": tokenizer_dir,
                                                                    "tokenize_timeout": "50ms", **options}))
        async with httpx.AsyncClient(timeout=10) as http:  # every replica's index healthy before the first request
            with trio.fail_after(30):
                while True:
                    kv = (await http.get(gateway.control_url + "/admin/kv")).json()["replicas"]
                    if len(kv) == REPLICAS and all(r["state"] == "healthy" for r in kv):
                        break
                    await trio.sleep(0.05)
        results = []
        started = time.perf_counter()
        async with new_client(concurrency) as client:
            def job(messages):
                async def send():
                    results.append(await send_chat(client, gateway.url, MODEL, messages, s.max_tokens))
                return send
            await _run_limited([job(m) for m in bodies], concurrency)
        wall = time.perf_counter() - started
        async with httpx.AsyncClient(timeout=10) as http:
            metrics = (await http.get(gateway.control_url + "/metrics")).text
            explained = (await http.post(gateway.control_url + "/admin/explain",
                                         json={"model": MODEL, "messages": bodies[0]})).json()
        nursery.cancel_scope.cancel()
    summary = summarize(results)
    summary.update(wall_s=round(wall, 2), output_tokens_per_s=round(s.requests * s.max_tokens / wall, 1),
                   decisions=_samples(metrics, "llmgw_routing_decisions_total", "outcome"),
                   tokenize_sources=_samples(metrics, "llmgw_kv_tokenize_source_total", "source"),
                   learnt={r["name"]: r["cost"]["learnt"] for r in explained.get("replicas", []) if "cost" in r})
    return summary


async def run(s: Settings) -> dict:
    report: dict = {"settings": {**s.__dict__, "concurrency": list(s.concurrency)}, "runs": {}}
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        write_tokenizer_files(tokenizer_dir)
        for concurrency in s.concurrency:
            for arm, options in ARMS.items():
                print(f"  C={concurrency} / {arm} ...", file=sys.stderr, flush=True)
                report["runs"][f"C={concurrency} | {arm}"] = await run_arm(options, concurrency, s, tokenizer_dir)
    return report


def markdown(report: dict) -> str:
    lines = ["| concurrency | routing | hit rate | TTFT p50 (ms) | TTFT p90 (ms) | output tok/s | per replica | "
             "outcomes | tokenize fallbacks |", "|---|---|---|---|---|---|---|---|---|"]
    for key, r in report["runs"].items():
        concurrency, arm = key.split(" | ", 1)
        decisions = r["decisions"]
        outcomes = ", ".join(f"{k} {v:g}" for k, v in sorted(decisions.items()) if v)
        fallbacks = sum(v for k, v in decisions.items() if k in ("tokenize_timeout", "tokenize_error"))
        counts = "/".join(str(n) for n in r["per_replica"].values())
        lines.append(f"| {concurrency[2:]} | {arm} | {r['hit_rate']:.3f} | {r['ttft_p50_ms']:.0f} | "
                     f"{r['ttft_p90_ms']:.0f} | {r['output_tokens_per_s']:.0f} | {counts} | {outcomes} | "
                     f"{fallbacks:g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests, C=24 only (a smoke run)")
    parser.add_argument("--concurrency", type=int, nargs="+", help="the concurrencies to run (default: 8 24)")
    args = parser.parse_args(argv)
    settings = Settings.quick() if args.quick else Settings()
    if args.concurrency:
        settings.concurrency = tuple(args.concurrency)
    report = trio.run(run, settings)
    return print_and_save(report, markdown(report), args.json)


if __name__ == "__main__":
    sys.exit(main())
