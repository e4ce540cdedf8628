"""Micro-benchmark of the room's share of the queue's fast path: µs of CPU per ``EngineRoom.admits()`` (one pass
over a model's replicas: requests, seats and KV tokens), the call the queue makes for every request it admits.

Run: ``python -m llmgw.bench.room_admits [--rounds 7] [--calls 20000] [--replicas 4] [--json PATH]``. In-process,
no socket: a router with ``--replicas`` replicas whose engines' capacity, seats and KV cache were learnt from
scrapes, each with requests in flight, the output allowance learnt. CPU time (``time.process_time``), so the
machine's other work weighs less than in wall time; printed the median µs per call of ``--rounds`` rounds with
the fastest and slowest. Written with absolute imports, so that it also runs against another checkout
(``PYTHONPATH=../other python path/to/room_admits.py``) for a before/after.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from llmgw.bench.common import bench_parser, finish
from llmgw.engines.probe import EngineLoad
from llmgw.flow.model import DEFAULT_CLASSES
from llmgw.flow.room import EngineRoom
from llmgw.metrics import Metrics
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.replica import Replica
from llmgw.router.router import Router
from llmgw.router.tier import Decision, RouteRequest


def room_of(replicas: int) -> EngineRoom:
    router = Router(build_registry(make_plugin_manager(())), Metrics())
    router.configure_model("m", "round_robin")
    room = EngineRoom(router, clock=time.monotonic)
    room.count_queued(lambda model: 1)  # requests wait: the raise rule's demand
    body = {"model": "m", "max_tokens": 256, "messages": [{"role": "user", "content": "word " * 400}]}
    for i in range(replicas):
        replica = Replica(name=f"r{i}", model="m", url=f"http://127.0.0.1:{9000 + i}")
        router.add_replica(replica)
        for at, waiting in ((1.0, 0.0), (2.0, 5.0), (3.0, 5.0)):  # full at 6 running: capacity and seats learnt
            replica.engine_load = EngineLoad(running=6, waiting=waiting, at=at, kv_usage=0.5, num_blocks=512,
                                             block_size=16)
            room.scraped(replica)
        replica.engine_load = EngineLoad(running=3, waiting=0, at=time.monotonic() + 3600, kv_usage=0.4,
                                         num_blocks=512, block_size=16)  # fresh for the whole run
        for _ in range(3):
            router.routed(RouteRequest("m", "/v1/chat/completions", body), Decision(replica))
            replica.local_inflight += 1
    allowance = getattr(router.models["m"], "output_allowance", None)  # None: a checkout from before it
    if allowance is not None:
        for _ in range(64):
            allowance.observe(256, {"completion_tokens": 128})
    return room


def run(rounds: int, calls: int, replicas: int) -> dict[str, Any]:
    room = room_of(replicas)
    batch = DEFAULT_CLASSES[2]
    per_call = []
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(calls):
            room.admits("m", batch, 0, 700, 256)
        per_call.append((time.process_time() - started) / calls * 1e6)
    return {"rounds": rounds, "calls": calls, "replicas": replicas,
            "us": {"median": statistics.median(per_call), "min": min(per_call), "max": max(per_call)}}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__ or "")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--replicas", type=int, default=4)
    args = parser.parse_args(argv)
    result = run(args.rounds, args.calls, args.replicas)
    us = result["us"]
    print(f"room.admits(), {args.replicas} replicas: {us['median']:.2f} µs CPU per call "
          f"[{us['min']:.2f} - {us['max']:.2f}] ({args.rounds} rounds of {args.calls})")
    return finish(args, result)


if __name__ == "__main__":
    raise SystemExit(main())
