"""Does a busy Redis writer delay the load reports? Load reports beside an /admin/explain-style writer, one Redis.

A real ``redis-server``; one Trio process, as a gateway, sends a load report (``XADD`` to a stream, as
:mod:`llmgw.cluster.load` does) every 50 ms and reads the stream back (:func:`~llmgw.cluster.streams.follow_stream`,
as a peer gateway reads it), while a writer sets 256 explain records a call (the script of
:mod:`llmgw.gateway.explain_shared`) back to back: about a hundred times what gateways write at 2x overload.
Arms, alternated in each round: ``none`` (no writer), ``shared-link`` (the writer on the reports' own link, as in
the product) and ``own-link`` (the writer on a link, so a connection pool, of its own). Per arm: the interval
between consecutive reports by Redis' own clock (the stream ids) and the delay from a report's send to its read.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from ..cluster.link import RedisLink
from ..cluster.metrics import ClusterMetrics
from ..cluster.records import entry_id
from ..cluster.streams import follow_stream
from ..config import parse_config
from ..gateway.explain_shared import _SET_ALL, BATCH, TTL
from ..testing.processes import CLUSTER_SECRET, CLUSTER_SECRET_ENV
from ..testing.redis import start_private_redis
from ..testing.shared_state import state_section
from .common import bench_parser, finish

ARMS = ("none", "shared-link", "own-link")
REPORT_EVERY = 0.05  # state.load_interval's default
RECORD = b"x" * 450  # one explain record's size, signed


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(len(ordered) * 0.99) - 1)]


async def one_arm(url: str, arm: str, seconds: float) -> dict[str, float]:
    """One arm's run: report intervals (ms, Redis' clock) and send-to-read delays (ms), p50, p99 and max."""
    os.environ.setdefault(CLUSTER_SECRET_ENV, CLUSTER_SECRET)  # what the config's state section names
    settings = parse_config(state_section(url, "bench-writers")).state
    stream = f"bench:load:{arm}:{time.monotonic_ns()}"
    delays: list[float] = []

    def take(entries: list[dict[str, Any]]) -> None:
        now = time.time()
        delays.extend(now - float(entry["t"]) for entry in entries if "t" in entry)

    async with trio.open_nursery() as nursery:
        link = RedisLink(settings, ClusterMetrics(None, "control", "bench", "reports"))
        await nursery.start(link.run)
        writer_link = link
        if arm == "own-link":
            writer_link = RedisLink(settings, ClusterMetrics(None, "control", "bench", "writer"))
            await nursery.start(writer_link.run)
        nursery.start_soon(lambda: follow_stream(link, "load_read", stream, take, stream="load",
                                                 max_bytes=lambda: 10_000))
        await trio.sleep(0.3)  # the reader's doorbell armed
        stop = trio.current_time() + seconds

        async def reports() -> None:
            while trio.current_time() < stop:
                await link.add_to_stream("load_report", stream, {b"l": b"y" * 200, b"t": repr(time.time()).encode()},
                                         1000)
                await trio.sleep(REPORT_EVERY)

        async def explain_writes() -> None:
            written = 0
            while trio.current_time() < stop:
                keys = [f"bench:explain:{written}:{index}" for index in range(BATCH)]
                written += 1
                await writer_link.call("flow_explain_put", lambda client: client.eval(
                    _SET_ALL, keys=keys, args=[TTL, *[RECORD] * BATCH]))
                await trio.sleep(0)

        async with trio.open_nursery() as load:
            load.start_soon(reports)
            if arm != "none":
                load.start_soon(explain_writes)
        await trio.sleep(0.2)  # the last report read
        entries = await link.call("bench", lambda client: client.xrange(stream))
        await link.call("bench", lambda client: client.delete([stream]))
        nursery.cancel_scope.cancel()
    ids = [int(entry_id(entry.identifier).split(b"-")[0]) for entry in entries]
    gaps = [float(later - earlier) for earlier, later in zip(ids, ids[1:])]
    seen = [delay * 1000 for delay in delays]
    return {"reports": len(ids), "interval_ms_p50": statistics.median(gaps), "interval_ms_p99": _p99(gaps),
            "interval_ms_max": max(gaps), "seen_ms_p50": statistics.median(seen), "seen_ms_p99": _p99(seen),
            "seen_ms_max": max(seen)}


async def run(rounds: int, seconds: float) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as folder:
        async with trio.open_nursery() as nursery:
            redis = await start_private_redis(nursery, Path(folder))
            for _ in range(rounds):
                for arm in ARMS:  # alternated, so that the other processes on the cores disturb them all alike
                    runs[arm].append(await one_arm(redis.url, arm, seconds))
            nursery.cancel_scope.cancel()
    summary = {arm: {figure: {"median": statistics.median(run[figure] for run in arm_runs),
                              "min": min(run[figure] for run in arm_runs),
                              "max": max(run[figure] for run in arm_runs)}
                     for figure in arm_runs[0]} for arm, arm_runs in runs.items()}
    return {"rounds": rounds, "seconds": seconds, "report_every_ms": REPORT_EVERY * 1000, "runs": runs,
            "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the arms, alternated (default 3)")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of one arm's run (default 4)")
    args = parser.parse_args(argv)
    report = trio.run(run, args.rounds, args.seconds)
    print(f"load reports every {REPORT_EVERY * 1000:g} ms beside a busy explain writer: median of {args.rounds} "
          "rounds [lowest - highest round], ms")
    figures = list(next(iter(report["summary"].values())))
    for arm, summary in report["summary"].items():
        print(f"  {arm}")
        for figure in figures:
            value = summary[figure]
            print(f"    {figure:16s} {value['median']:8.2f}  [{value['min']:.2f} - {value['max']:.2f}]")
    return finish(args, report)


if __name__ == "__main__":
    raise SystemExit(main())
