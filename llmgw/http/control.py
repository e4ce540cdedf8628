"""The control-side app (Quart-Trio on Hypercorn): ``/health``, ``/metrics``, the admin JSON API and ``/agent``.

It serves operators (``/admin/*``) and agents (the ``/agent`` websocket, one
session per agent, see :mod:`llmgw.control.agent_service`); it is not on the
request hot path (that is :mod:`llmgw.http.dataplane` on the thin server).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from quart import Response, jsonify, request, websocket
from quart_trio import QuartTrio

from ..agent.channel import quart_channel
from ..metrics import render
from ..router.tier import RouteRequest

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
        deployed = {id(routed.replica) for routed in gateway.control.routing.routed.values()}
        static = [r.as_json() for r in gateway.router.all_replicas() if id(r) not in deployed]
        return jsonify(static + gateway.control.replicas_json())

    @app.get("/admin/kv")
    async def kv():
        """The router's KV index per replica (state, blocks, block size, resets), and the embedded agent's
        subscriptions (ports, mirrored blocks, last sequence number, resets, hash parity)."""
        index = gateway.router.kv_index
        names = sorted(set(index.replicas()) | {r.name for r in gateway.router.all_replicas()})
        agent = gateway.embedded_agent
        shards = [shard.describe() for shard in agent.kv.shards.values()] if agent is not None else []
        return jsonify({"replicas": [{"name": name, **index.describe(name)} for name in names],
                        "predicted_keys": index.predicted_keys, "agent_subscriptions": shards})

    @app.get("/admin/nodes")
    async def nodes():
        return jsonify(gateway.control.nodes_json())

    @app.post("/admin/nodes/<node_id>/forget")
    async def forget_node(node_id: str):
        """Drop a node's identity: its id can join again with a join token (a rebuilt or replaced machine)."""
        if not gateway.control.agents.forget(node_id):
            return _error(404, f"no node {node_id!r} is known", "node_not_found")
        return jsonify({"forgotten": node_id})

    @app.post("/admin/reload")
    async def reload():
        errors = await gateway.reload()
        if errors:
            return jsonify({"reloaded": False, "errors": errors}), 400
        return jsonify({"reloaded": True, "errors": []})

    @app.websocket("/agent")
    async def agent():
        peer = f"{websocket.remote_addr or '?'}"
        await gateway.control.agents.serve(quart_channel(websocket._get_current_object(), f"agent at {peer}"))

    @app.get("/admin/models")
    async def models():
        return jsonify([
            {"name": route.name, "routing": route.tier_name, "replicas": [r.name for r in route.replicas],
             "routable": sum(1 for r in route.replicas if r.routable)}
            for route in gateway.router.models.values()
        ])

    @app.post("/admin/explain")
    async def explain():
        """For an OpenAI request body: each replica's scores and the pick, without sending or learning it."""
        body = await request.get_json(force=True, silent=True)
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object: an OpenAI request with 'model'", "invalid_json")
        model = body.get("model")
        resolved = gateway.router.resolve(model) if isinstance(model, str) else None
        if resolved is None:
            return _error(404, f"the model {model!r} does not exist", "model_not_found", param="model")
        path = request.args.get("path") or ("/v1/chat/completions" if "messages" in body else "/v1/completions")
        return jsonify(await gateway.router.explain(RouteRequest(resolved[0], path, body, adapter=resolved[1])))

    @app.errorhandler(404)
    async def not_found(_):
        return jsonify({"error": {"message": "no such control endpoint", "type": "not_found_error",
                                  "param": None, "code": "not_found"}}), 404

    return app


def _error(status: int, message: str, code: str, param: str | None = None):
    return jsonify({"error": {"message": message, "type": "invalid_request_error", "param": param,
                              "code": code}}), status


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
