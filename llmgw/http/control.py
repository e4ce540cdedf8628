"""The control-side app (Quart-Trio on Hypercorn): ``/health``, ``/metrics`` and the admin JSON API.

It serves operators and, later, agents; it is not on the request hot path
(that is :mod:`llmgw.http.dataplane` on the thin server).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, jsonify
from quart_trio import QuartTrio

from ..metrics import render

if TYPE_CHECKING:
    from ..app import Gateway


def create_control_app(gateway: "Gateway") -> QuartTrio:
    app = QuartTrio("llmgw.control")
    app.config["RESPONSE_TIMEOUT"] = None

    @app.get("/health")
    async def health():
        return jsonify({"status": "ok", "draining": gateway.draining})

    @app.get("/metrics")
    async def metrics():
        body, content_type = await render(gateway.metrics.registry)
        return Response(body, content_type=content_type)

    @app.get("/admin/replicas")
    async def replicas():
        return jsonify([r.as_json() for r in gateway.router.all_replicas()])

    @app.get("/admin/models")
    async def models():
        return jsonify([
            {"name": route.name, "routing": route.tier_name, "replicas": [r.name for r in route.replicas],
             "routable": sum(1 for r in route.replicas if r.routable)}
            for route in gateway.router.models.values()
        ])

    @app.errorhandler(404)
    async def not_found(_):
        return jsonify({"error": {"message": "no such control endpoint", "type": "not_found_error",
                                  "param": None, "code": "not_found"}}), 404

    return app


async def serve_control(app: QuartTrio, host: str, port: int, *, shutdown: trio.Event,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the control app on Hypercorn; ``task_status.started((host, port))`` with the bound port."""
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 1.0
    config.websocket_ping_interval = 5.0

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        await hypercorn_serve(app, config, shutdown_trigger=shutdown.wait, task_status=task_status)

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(run)
        task_status.started((host, int(binds[0].rsplit(":", 1)[1])))
