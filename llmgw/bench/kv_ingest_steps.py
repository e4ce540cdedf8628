"""How long a KV-event subscription holds the gateway's Trio loop while it ingests a replay or a live backlog.

An :class:`~llmgw.kv.subscriber.EngineSubscription` feeds an
:class:`~llmgw.kv.mirror.EngineMirror` (content keys, as a static replica's
subscription does) whose ``flush_loop`` writes a :class:`~llmgw.kv.index.KvIndex`,
in one Trio run with a task ticking every millisecond (standing for the tasks
that relay streamed tokens). A fake engine (a PUB connected to the
subscription and a replay ROUTER, on loopback) then either holds
``--batches`` batches (one ``BlockStored`` of ``--blocks`` 16-token blocks
each, what a decode step of that many sequences completes) for a replay that
the next live batch asks for, or sends them live while the loop is kept busy
(a blocking sleep), so they queue on the SUB socket. Printed and written per
run: the ingestion's duration, the subscription task's longest step (an
instrument on the run) and the ticker's longest gap.

Run: ``python -m llmgw.bench.kv_ingest_steps [--batches 1000] [--blocks 16] [--repeats 2]
[--json bench-results/kv_ingest_steps.json]``.
"""

from __future__ import annotations

import random
import time

import trio
import zmq

from ..kv import zmq_trio
from ..kv.codec import END_SEQ_BYTES, encode_batch
from ..kv.events import BlockStored, EventBatch
from ..kv.index import KvIndex
from ..kv.mirror import EngineMirror, flush_loop
from ..kv.subscriber import EngineSubscription
from .common import bench_parser, finish

BLOCK_SIZE = 16
MODES = ("replay", "backlog")


class LongestSteps(trio.abc.Instrument):
    """The longest step of every task (by name) while installed."""

    def __init__(self) -> None:
        self.started = 0.0
        self.longest: dict[str, float] = {}

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        took = time.perf_counter() - self.started
        if took > self.longest.get(task.name, 0.0):
            self.longest[task.name] = took


def payloads(batches: int, blocks: int, seed: int = 0) -> list[bytes]:
    """``batches + 1`` encoded batches (the last one is the live batch that reveals a replay's gap)."""
    rng = random.Random(seed)
    out = []
    for seq in range(batches + 1):
        tokens = [rng.randrange(128_000) for _ in range(blocks * BLOCK_SIZE)]
        event = BlockStored([rng.getrandbits(64) for _ in range(blocks)], None, tokens, BLOCK_SIZE, medium="GPU")
        out.append(encode_batch(EventBatch(float(seq), [event], 0)))
    return out


async def _tick(marks: list[float]) -> None:
    while True:
        await trio.sleep(0.001)
        marks.append(time.perf_counter())


async def _serve_replay(router: zmq.Socket[bytes], data: list[bytes], upto: int) -> None:
    identity, _, start = await zmq_trio.recv_multipart(router)
    for seq in range(int.from_bytes(start, "big"), upto):
        await zmq_trio.send_multipart(router, [identity, b"", b"", seq.to_bytes(8, "big"), data[seq]])
    await zmq_trio.send_multipart(router, [identity, b"", b"", END_SEQ_BYTES, b""])


async def measure(mode: str, data: list[bytes]) -> dict:
    """One ingestion of ``len(data) - 1`` batches in ``mode``: its duration and the loop's longest holds."""
    batches = len(data) - 1
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
    for sock in (pub, router):
        sock.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    mirror, index = EngineMirror(key_mode="content"), KvIndex()
    sub = EngineSubscription("tcp://127.0.0.1:0", on_batch=mirror.apply, on_reset=mirror.reset,
                             replay_endpoint=router.getsockopt_string(zmq.LAST_ENDPOINT), idle_probe=None)
    steps, marks = LongestSteps(), list[float]()
    try:
        async with trio.open_nursery() as nursery:
            pub.connect(await nursery.start(sub.run))
            with trio.fail_after(10):
                await zmq_trio.recv_multipart(pub)  # the subscription arrived
            nursery.start_soon(_serve_replay, router, data, batches)
            nursery.start_soon(flush_loop, mirror, lambda changes: index.apply("replica", changes))
            nursery.start_soon(_tick, marks)
            await trio.sleep(0.05)
            trio.lowlevel.add_instrument(steps)
            if mode == "replay":
                last = batches
                pub.send_multipart([b"", batches.to_bytes(8, "big"), data[batches]])
            else:
                last = batches - 1
                for seq in range(batches):
                    pub.send_multipart([b"", seq.to_bytes(8, "big"), data[seq]])
                time.sleep(0.2 + batches * 0.0002)  # the loop kept busy: the batches queue on the SUB socket
            started = time.perf_counter()
            with trio.fail_after(120):
                await sub.wait_for(lambda s: s.last_seq == last)
            took = time.perf_counter() - started
            await trio.sleep(0.05)
            trio.lowlevel.remove_instrument(steps)
            nursery.cancel_scope.cancel()
    finally:
        zmq_trio.close(pub)
        zmq_trio.close(router)
        ctx.term()
    ticks = [mark for mark in marks if mark > started]
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    held = max(took for name, took in steps.longest.items() if "EngineSubscription" in name)
    return {"mode": mode, "batches": batches, "ingest_ms": took * 1000, "longest_subscription_step_ms": held * 1000,
            "longest_tick_gap_ms": max(gaps, default=0.0) * 1000, "mirrored_blocks": len(mirror)}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=16, help="16-token blocks stored by each batch")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    data = payloads(args.batches, args.blocks)
    runs = []
    for mode in MODES:
        for _ in range(args.repeats):
            run = trio.run(measure, mode, data)
            runs.append(run)
            print(f"{mode:7s} {run['batches']} batches of {args.blocks} blocks: ingested in {run['ingest_ms']:.1f} ms, "
                  f"longest subscription step {run['longest_subscription_step_ms']:.2f} ms, longest gap of a "
                  f"1 ms ticker {run['longest_tick_gap_ms']:.2f} ms")
    return finish(args, {"batches": args.batches, "blocks": args.blocks, "runs": runs})


if __name__ == "__main__":
    raise SystemExit(main())
