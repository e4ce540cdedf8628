"""A local process floods a KV-event subscription: how much memory the subscriber's process takes.

An :class:`~llmgw.kv.subscriber.EngineSubscription` binds a loopback SUB as the
agent's does; a PUB in a process of its own connects to it and sends
``--messages`` messages of ``--size`` bytes as fast as it can (a valid msgpack
``bin``, so each one is received, decoded and refused as a batch). Printed and
written: the peak resident memory of the process, the subscription's counters
and how many peers were cut off. Sizes over the subscription's
``--max-message-size`` show the bound at work (the peer is disconnected before
anything is buffered); sizes under it show what the bound does not cover: up to
``RCVHWM`` messages queue per connection while the subscription decodes.

Run: ``python -m llmgw.bench.kv_flood [--messages 200] [--size 31457280] [--json bench-results/kv_flood.json]``.
"""

from __future__ import annotations

import argparse
import sys
import time

import trio
import zmq

from ..kv.subscriber import DEFAULT_MAX_MESSAGE_BYTES, EngineSubscription
from .common import bench_parser, finish


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024


def flood(endpoint: str, messages: int, size: int) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    try:
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.connect(endpoint)
        time.sleep(0.3)  # the subscription reaches the PUB
        payload = b"\xc6" + (size - 5).to_bytes(4, "big") + bytes(size - 5)  # msgpack bin32 of size bytes
        for seq in range(messages):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload], copy=False)
        time.sleep(2.0)  # what was queued is received
    finally:
        pub.close(linger=0)
        ctx.term()


async def measure(messages: int, size: int, max_message_bytes: int) -> dict:
    sub = EngineSubscription("tcp://127.0.0.1:0", on_batch=lambda batch: None, on_reset=lambda reason: None,
                             idle_probe=None, max_message_bytes=max_message_bytes)
    before = rss_mb()
    peak = before
    async with trio.open_nursery() as nursery:
        endpoint = await nursery.start(sub.run)

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, rss_mb())
                await trio.sleep(0.01)

        nursery.start_soon(watch)
        started = time.perf_counter()
        await trio.run_process([sys.executable, "-m", "llmgw.bench.kv_flood", "--send", endpoint,
                                "--messages", str(messages), "--size", str(size)])
        seconds = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return {"messages_sent": messages, "message_bytes": size, "max_message_bytes": max_message_bytes,
            "seconds": seconds, "rss_before_mb": before, "rss_peak_mb": peak, "received": sub.batches,
            "decode_errors": sub.decode_errors, "peer_disconnects": sub.disconnects}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--size", type=int, default=30 * 1024 * 1024, help="bytes of each message's payload")
    parser.add_argument("--max-message-size", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    parser.add_argument("--send", metavar="ENDPOINT", help=argparse.SUPPRESS)  # the flooding process
    args = parser.parse_args(argv)
    if args.send:
        flood(args.send, args.messages, args.size)
        return 0
    report = trio.run(measure, args.messages, args.size, args.max_message_size)
    print(f"{report['messages_sent']} messages of {report['message_bytes']} bytes (bound "
          f"{report['max_message_bytes']}) in {report['seconds']:.1f} s: received {report['received']}, "
          f"peers cut off {report['peer_disconnects']}, RSS {report['rss_before_mb']:.0f} MB before, "
          f"{report['rss_peak_mb']:.0f} MB at peak")
    return finish(args, report)


if __name__ == "__main__":
    raise SystemExit(main())
