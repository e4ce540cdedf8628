"""Control-port containment: Hypercorn's own serve versus llmgw's ControlServer, under the half-closed short body.

In one process, on 127.0.0.1, a small Quart-Trio app (``/health`` and an
echo websocket standing in for an agent session) is served (a) by
``hypercorn.trio.serve`` and (b) by :class:`llmgw.http.control_server.ControlServer`.
Each gets the request that ended ``llmgw serve`` (``POST`` with a body one
byte short of its ``Content-Length``, then a half-close) until the server
dies or ``--requests`` were sent. Reported: requests until the server died,
whether the websocket survived, contained failures, ``/health`` latency
afterwards, and what a whole-server restart costs (time to the first answer
with one failed start-up before it, minus the time without).

    python -m llmgw.bench.control_containment --requests 300 --json results/control_containment.json
"""

from __future__ import annotations

import logging
import statistics
import time

import httpx
import trio
import trio_websocket
from hypercorn.trio import serve as hypercorn_serve
from prometheus_client import CollectorRegistry
from quart import websocket
from quart_trio import QuartTrio

from llmgw.bench.common import bench_parser, write_json
from llmgw.http.control_server import ControlServer, ControlServerMetrics, hypercorn_config

MALFORMED = b"POST /admin/whatever HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"x" * 4999


def make_app(failing_starts: list[int] | None = None) -> QuartTrio:
    app = QuartTrio("bench")

    @app.before_serving
    async def start():
        if failing_starts:
            failing_starts.pop()
            raise RuntimeError("a failed start-up")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.websocket("/ws")
    async def echo():
        while True:
            await websocket.send(await websocket.receive())

    return app


async def malformed(port: int) -> None:
    with trio.move_on_after(5):
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            return
        async with stream:
            try:
                await stream.send_all(MALFORMED)
                await stream.send_eof()
                while await stream.receive_some(65536):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass


async def websocket_alive(ws) -> bool:
    try:
        with trio.fail_after(2):
            await ws.send_message("ping")
            return await ws.get_message() == "ping"
    except (trio_websocket.ConnectionClosed, trio.TooSlowError, trio.BrokenResourceError):
        return False


async def barrage(port: int, requests: int, died: trio.Event) -> dict:
    url = f"ws://127.0.0.1:{port}/ws"
    async with trio_websocket.open_websocket_url(url) as ws:
        assert await websocket_alive(ws)
        sent = 0
        while sent < requests and not died.is_set():
            await malformed(port)
            sent += 1
            await trio.sleep(0)
        await trio.sleep(0.2)
        return {"requests_sent": sent, "server_died": died.is_set(), "websocket_survived": await websocket_alive(ws)}


async def health_latency(port: int, count: int = 50) -> dict:
    times = []
    async with httpx.AsyncClient(timeout=5) as client:
        for _ in range(count):
            started = time.perf_counter()
            (await client.get(f"http://127.0.0.1:{port}/health")).raise_for_status()
            times.append((time.perf_counter() - started) * 1000)
    return {"health_p50_ms": round(statistics.median(times), 3), "health_max_ms": round(max(times), 3)}


async def run_hypercorn(requests: int) -> dict:
    died = trio.Event()
    config = hypercorn_config()
    config.bind = ["127.0.0.1:0"]

    async def serve(task_status=trio.TASK_STATUS_IGNORED):
        try:
            await hypercorn_serve(make_app(), config, task_status=task_status)
        except BaseException:  # noqa: BLE001 - the measured failure
            died.set()

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve)
        result = await barrage(int(binds[0].rsplit(":", 1)[1]), requests, died)
        nursery.cancel_scope.cancel()
    return result


async def run_control_server(requests: int) -> dict:
    registry = CollectorRegistry()
    server = ControlServer(make_app, ControlServerMetrics(registry))
    shutdown, died = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(lambda task_status: server.serve("127.0.0.1", 0, shutdown=shutdown,
                                                                       task_status=task_status))
        result = await barrage(port, requests, died)
        result.update(await health_latency(port))
        result["contained_failures"] = registry.get_sample_value("llmgw_control_connection_failures_total")
        result["restarts"] = registry.get_sample_value("llmgw_control_server_restarts_total")
        shutdown.set()
    return result


async def time_to_first_answer(failed_starts: int) -> float:
    server = ControlServer(lambda: make_app(pending), ControlServerMetrics(CollectorRegistry()))
    pending = [1] * failed_starts
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        started = time.perf_counter()
        _, port = await nursery.start(lambda task_status: server.serve("127.0.0.1", 0, shutdown=shutdown,
                                                                       task_status=task_status))
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                try:
                    (await client.get(f"http://127.0.0.1:{port}/health")).raise_for_status()
                    break
                except httpx.TransportError:
                    await trio.sleep(0.005)
        elapsed = time.perf_counter() - started
        shutdown.set()
    return elapsed


async def run(requests: int) -> dict:
    restart_cost = []
    for _ in range(5):
        restart_cost.append((await time_to_first_answer(1) - await time_to_first_answer(0)) * 1000)
    return {"hypercorn_serve": await run_hypercorn(requests), "control_server": await run_control_server(requests),
            "restart_port_unanswered_ms_median": round(statistics.median(restart_cost), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=300, help="malformed requests per server (default 300)")
    args = parser.parse_args(argv)
    logging.getLogger("llmgw.http.control_server").setLevel(logging.CRITICAL)  # hundreds of expected warnings
    report = trio.run(run, args.requests)
    for name, value in report.items():
        print(f"{name}: {value}")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
