"""ControlServer over real sockets: a server that fails as a whole is started again on the same port."""

from __future__ import annotations

import httpx
import trio
from prometheus_client import CollectorRegistry
from quart_trio import QuartTrio

from llmgw.http.control_server import ControlServer, ControlServerMetrics


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
