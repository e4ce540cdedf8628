"""The agent socket under hostile first frames: the data plane's ``/health`` latency while they arrive.

Starts ``llmgw serve`` (a join token, no models) on 127.0.0.1 and measures
``GET /health`` on its data port, first alone, then while a client keeps
opening ``/agent`` websockets and sending, as its first frame, a Register of
``--size`` bytes whose ``gpus`` list holds empty maps (the frame that cost
~575 bytes of memory per byte to decode). Two kinds of sender, each for
``--frames`` frames: one with a wrong join token (refused at the upgrade since
issue 18: the frame is never sent) and one with the right token (the frame
passes the upgrade and is refused by the first-frame limit unread). Reported:
``/health`` p50, p99 and max in each phase, the gateway's peak RSS growth, and
what became of the frames.

    python -m llmgw.bench.agent_socket --frames 10 --size 2MiB --json results/agent_socket.json

The client side uses only modules that predate the fix, so ``PYTHONPATH`` of an older checkout measures the
gateway before it.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import httpx
import msgpack
import trio
import trio_websocket

from llmgw.bench.common import bench_parser, finish
from llmgw.testing.processes import start_serve
from llmgw.units import parse_size

TOKEN = "bench-join-token"
CONFIG = f"models: []\nagents:\n  token: {TOKEN}\n"
ANSWER_TIMEOUT = 120.0  # a frame the gateway decodes can take that long to be answered (issue 18: 11.75 s for 2 MiB)


def hostile_register(size: int, token: str = "wrong") -> bytes:
    """A Register frame of about ``size`` bytes whose ``gpus`` list is all empty maps (one byte each)."""
    head = msgpack.packb({"v": 1, "t": "Register", "node_id": "hostile", "token": token, "address": "127.0.0.1"})
    count = max(size - len(head) - 10, 1)
    return (bytes([head[0] + 1]) + head[1:] + msgpack.packb("gpus") + b"\xdd" + count.to_bytes(4, "big")
            + b"\x80" * count)


def agent_url(control_url: str) -> str:
    return control_url.replace("http://", "ws://") + "/agent"


def rss_bytes(pid: int) -> int:
    """The resident memory of process ``pid`` (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def send_hostile(url: str, frame: bytes, headers: list[tuple[bytes, bytes]]) -> str:
    """Open ``/agent`` and send ``frame`` first; what happened: ``refused <status>`` at the upgrade, or the
    answer to the frame (``registered``, ``refused: <reason>``, ``closed``). The socket is dropped, not closed
    (trio-websocket's close fails on a ping that crosses it, which a gateway busy decoding sends)."""
    outcome = f"no answer in {ANSWER_TIMEOUT:g}s"
    try:
        async with trio.open_nursery() as nursery:
            ws = await trio_websocket.connect_websocket_url(nursery, url, extra_headers=headers,
                                                            max_message_size=1 << 20)
            await ws.send_message(frame)
            with trio.move_on_after(ANSWER_TIMEOUT):
                answer = msgpack.unpackb(await ws.get_message())
                outcome = "registered" if answer.get("accepted") else f"refused: {str(answer.get('reason'))[:60]}"
            nursery.cancel_scope.cancel()
    except* trio_websocket.ConnectionRejected as group:
        outcome = f"refused {getattr(group.exceptions[0], 'status_code', '?')} at the upgrade"
    except* (trio_websocket.ConnectionClosed, trio_websocket.HandshakeError):
        outcome = "closed"
    return outcome


async def health_latencies(url: str, until: trio.Event, pause: float = 0.01) -> list[float]:
    """``GET url`` again and again until ``until`` is set; each answer's latency in ms."""
    times: list[float] = []
    async with httpx.AsyncClient(timeout=60) as client:
        while not until.is_set():
            started = time.perf_counter()
            (await client.get(url)).raise_for_status()
            times.append((time.perf_counter() - started) * 1000)
            await trio.sleep(pause)
    return times


def summary(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"requests": len(ordered), "p50_ms": round(statistics.median(ordered), 2),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 2),
            "max_ms": round(ordered[-1], 2)}


async def phase(gw, frames: int, frame: bytes | None, headers: list[tuple[bytes, bytes]]) -> dict:
    """``/health`` latencies while ``frames`` hostile frames are sent one after another (none: a quiet second)."""
    done = trio.Event()
    outcomes: dict[str, int] = {}
    baseline = rss_bytes(gw.process.pid)
    peak = [baseline]
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        result: dict = {}

        async def measure() -> None:
            result["health"] = summary(await health_latencies(gw.url + "/health", done))

        async def sample_rss() -> None:  # /proc answers while the gateway's loop is held
            while not done.is_set():
                peak[0] = max(peak[0], rss_bytes(gw.process.pid))
                await trio.sleep(0.01)

        nursery.start_soon(measure)
        nursery.start_soon(sample_rss)
        if frame is None:
            await trio.sleep(1.0)
        for _ in range(frames):
            outcome = await send_hostile(agent_url(gw.control_url), frame or b"", headers)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        await trio.sleep(0.2)
        done.set()
    return {**result, "outcomes": outcomes, "rss_growth_mb": round((peak[0] - baseline) / 2**20, 1),
            "seconds": round(time.perf_counter() - started, 2)}


async def run(frames: int, size: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "llmgw.yaml"
        config.write_text(CONFIG)
        async with trio.open_nursery() as nursery:
            gw = await start_serve(nursery, config)
            report = {"frame_bytes": size, "frames": frames, "quiet": await phase(gw, 0, None, [])}
            wrong = [(b"authorization", b"Bearer wrong")]
            report["wrong_token"] = await phase(gw, frames, hostile_register(size), wrong)
            right = [(b"authorization", f"Bearer {TOKEN}".encode())]
            report["right_token"] = await phase(gw, frames, hostile_register(size, TOKEN), right)
            nursery.cancel_scope.cancel()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--frames", type=int, default=10, help="hostile frames per sender (default 10)")
    parser.add_argument("--size", default="2MiB", help="bytes of each frame (default 2MiB)")
    args = parser.parse_args(argv)
    report = trio.run(run, args.frames, parse_size(args.size))
    print("\n".join(f"{name}: {value}" for name, value in report.items()))
    return finish(args, report)


if __name__ == "__main__":
    raise SystemExit(main())
