"""ControlServer over real sockets: a server that fails as a whole is started again on the same port; every
connection has read deadlines (but a websocket), the port has a connection cap, and versions but HTTP/1.0 and 1.1
get 505."""

from __future__ import annotations

import httpx
import pytest
import trio
import trio_websocket
from prometheus_client import CollectorRegistry
from quart import request, websocket
from quart_trio import QuartTrio

from helpers import read_to_eof
from llmgw.http.connslots import ConnectionMetrics
from llmgw.http.control_server import ControlServer, ControlServerMetrics
from llmgw.http.server import ServerLimits


def flaky_app(failures: int, starts: list) -> QuartTrio:
    """An app whose start-up (Hypercorn's lifespan) fails until it was tried ``failures`` times, then serves."""
    app = QuartTrio("flaky")

    @app.before_serving
    async def start():
        starts.append(1)
        if len(starts) <= failures:
            raise RuntimeError(f"start-up failure {len(starts)}")

    @app.get("/health")
    async def health():
        return {"status": "ok", "starts": len(starts)}

    return app


async def test_a_failed_server_is_restarted_on_the_same_port_and_counted(nursery):
    registry = CollectorRegistry()
    metrics = ControlServerMetrics(registry)
    shutdown = trio.Event()
    starts: list = []
    server = ControlServer(lambda: flaky_app(2, starts), metrics, backoff=(0.05, 0.2))
    host, port = await nursery.start(lambda task_status: server.serve("127.0.0.1", 0, shutdown=shutdown,
                                                                      task_status=task_status))
    async with httpx.AsyncClient(timeout=10) as client:
        with trio.fail_after(20):
            while True:
                try:  # a connection accepted by a life that then fails is closed: the client tries again
                    answer = (await client.get(f"http://{host}:{port}/health")).json()
                    break
                except httpx.TransportError:
                    await trio.sleep(0.05)
    assert answer == {"status": "ok", "starts": 3}
    assert registry.get_sample_value("llmgw_control_server_restarts_total") == 2
    shutdown.set()


# -- deadlines, the connection cap and the HTTP version ----------------------------------------------------------------

def plain_app() -> QuartTrio:
    """``/health``, a ``POST /admin/reload`` that reads its body, and a websocket that echoes."""
    app = QuartTrio("plain")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/admin/reload")
    async def reload():
        return {"read": len(await request.get_data())}

    @app.websocket("/agent")
    async def agent():
        while True:
            await websocket.send(await websocket.receive())

    return app


@pytest.fixture
async def control(nursery):
    """``await control(**limits)`` -> (server, port): a ControlServer on 127.0.0.1 with those ServerLimits."""
    servers = []

    async def start(**limits):
        server = ControlServer(plain_app, ControlServerMetrics(CollectorRegistry()), limits=ServerLimits(**limits),
                               connection_metrics=ConnectionMetrics(registry := CollectorRegistry()))
        server.registry = registry  # type: ignore[attr-defined]
        shutdown = trio.Event()
        servers.append(shutdown)
        _, port = await nursery.start(lambda task_status: server.serve("127.0.0.1", 0, shutdown=shutdown,
                                                                       task_status=task_status))
        return server, port

    yield start
    for shutdown in servers:
        shutdown.set()


async def test_a_control_head_whose_body_never_comes_gets_408_after_the_body_timeout(control):
    server, port = await control(body_timeout=0.5, header_timeout=5, keepalive_timeout=60)
    with trio.fail_after(10):  # held forever without a body deadline
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"POST /admin/reload HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        raw = await read_to_eof(stream)
        while server.slots.open:
            await trio.sleep(0.01)
    assert raw.startswith(b"HTTP/1.1 408 "), raw[:80]
    assert server.registry.get_sample_value(  # type: ignore[attr-defined]
        "llmgw_connection_timeouts_total", {"port": "control", "phase": "body"}) == 1


async def test_a_control_connection_that_sends_nothing_is_closed_after_the_header_timeout(control):
    server, port = await control(header_timeout=0.5, keepalive_timeout=60)
    with trio.fail_after(10):  # held for Hypercorn's keep-alive timeout (60 s) without a header deadline
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        assert await read_to_eof(stream) == b""
    with trio.fail_after(10):  # a head begun and never ended: 408
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert (await read_to_eof(stream)).startswith(b"HTTP/1.1 408 ")


async def test_the_deadlines_of_a_kept_alive_connection_count_from_each_request_not_an_earlier_one(control):
    """Hypercorn reads on while it answers, so the next request can arrive on a read begun for the previous one:
    its head and body deadlines count from its own bytes, never from an earlier request's (a body that came in two
    pieces once must not make every later one late)."""
    _, port = await control(header_timeout=0.5, body_timeout=0.5, keepalive_timeout=60)

    async def answer(stream: trio.SocketStream, end: bytes) -> bytes:
        received = b""
        while end not in received:
            piece = await stream.receive_some()
            assert piece, received
            received += piece
        return received

    async def post_in_two_pieces(stream: trio.SocketStream) -> bytes:
        await stream.send_all(b"POST /admin/reload HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nabc")
        await trio.sleep(0.2)
        await stream.send_all(b"def")
        return await answer(stream, b'"read":6}')

    with trio.fail_after(15):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        assert (await post_in_two_pieces(stream)).startswith(b"HTTP/1.1 200 ")
        for _ in range(12):  # 1.2 s of requests on the same connection: more than both timeouts
            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await answer(stream, b'"ok"}')).startswith(b"HTTP/1.1 200 ")
            await trio.sleep(0.1)
        assert (await post_in_two_pieces(stream)).startswith(b"HTTP/1.1 200 ")
        await stream.send_all(b"GET /health HTTP/1.1\r\n")  # and a head in two pieces
        await trio.sleep(0.2)
        await stream.send_all(b"Host: x\r\n\r\n")
        assert (await answer(stream, b'"ok"}')).startswith(b"HTTP/1.1 200 ")


async def test_a_websocket_is_not_cut_by_the_read_deadlines(control):
    _, port = await control(header_timeout=0.3, body_timeout=0.3, keepalive_timeout=0.3)
    with trio.fail_after(10):
        async with trio_websocket.open_websocket_url(f"ws://127.0.0.1:{port}/agent") as ws:
            await trio.sleep(1.5)  # silent for five times every read deadline
            await ws.send_message("still here")
            assert await ws.get_message() == "still here"


async def test_a_control_port_at_its_cap_answers_503_and_serves_again_once_a_slot_is_free(control):
    server, port = await control(max_connections=2, header_timeout=30, keepalive_timeout=60)
    with trio.fail_after(10):
        held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
        while server.slots.open < 2:
            await trio.sleep(0.01)
        third = await trio.open_tcp_stream("127.0.0.1", port)
        raw = await read_to_eof(third)
        assert raw.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in raw
        await held[0].aclose()
        while server.slots.open > 1:
            await trio.sleep(0.01)
        async with httpx.AsyncClient(timeout=5) as client:
            assert (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200
    assert server.registry.get_sample_value(  # type: ignore[attr-defined]
        "llmgw_connections_refused_total", {"port": "control"}) == 1


@pytest.mark.parametrize("version", ["9.9", "2.0", "1.2"])
async def test_the_control_port_answers_505_to_http_versions_other_than_1_0_and_1_1(control, version):
    _, port = await control()
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(f"GET /health HTTP/{version}\r\nHost: x\r\n\r\n".encode())
        raw = await read_to_eof(stream)
    assert raw.startswith(b"HTTP/1.1 505 "), raw[:80]
    assert b"is not supported" in raw
