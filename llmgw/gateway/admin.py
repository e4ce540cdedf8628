"""The control-side app (Quart-Trio on Hypercorn): ``/health``, ``/metrics``, the admin JSON API, the status page
(``/ui``) and ``/agent``.

It serves operators (``/admin/*``, behind admin tokens: :mod:`llmgw.http.control_guard`)
and agents (the ``/agent`` websocket, one session per agent, see
:mod:`llmgw.control.agent_service`); it is not on the request hot path (that is
:mod:`llmgw.gateway.dataplane` on the thin server). Every error, including a
failure inside a handler, is answered in OpenAI's JSON error shape. It runs on
:class:`llmgw.http.control_server.ControlServer`, which contains failures per
connection.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from quart import Response, has_websocket_context, jsonify, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from ..cluster.link import Unavailable
from ..http.control_server import ControlServerMetrics
from ..http.jsonbody import BodyError, parse_json_body, read_json_body
from ..http.messages import error_body
from ..metrics import render, trio_task_count
from ..router.replicas import STATIC
from ..router.tier import RouteRequest
from ..wire.channel import LEADER_HEADER, AgentCredentials, quart_channel
from .admin_autoscale import register_autoscale_routes
from .admin_guard import AdminGuard
from .admin_tenants import register_tenant_routes
from .flow_gate import RECENT_OUTCOMES
from .replica_stats import replica_stats
from .ui import status_page
from .usage_admin import register_usage_routes

if TYPE_CHECKING:
    from .app import Gateway


log = logging.getLogger(__name__)



def create_control_app(gateway: "Gateway", server_metrics: ControlServerMetrics) -> QuartTrio:
    app = QuartTrio("llmgw.control")
    app.config["RESPONSE_TIMEOUT"] = None
    guard = AdminGuard(lambda: gateway.config, lambda reason: server_metrics.auth_failures.labels(reason).inc())

    @app.before_request
    async def authenticate():
        refused = guard.refusal(request.path, request.headers.get("authorization"))
        if refused is not None:
            return _error(401, refused, "invalid_admin_token",
                          headers={"WWW-Authenticate": 'Bearer realm="llmgw admin"'})
        return None

    @app.get("/health")
    async def health():
        """Liveness, always 200 (a fail-static gateway must not be restarted by its probe), with ``status``
        ``degraded`` and the reasons while its cluster's shared state cannot be trusted (:mod:`.health_report`)."""
        answer: dict[str, Any] = {**gateway.health_report.to_json(), "draining": gateway.draining}
        if gateway.shared is not None:
            answer["state"] = {key: value for key, value in gateway.shared.describe().items() if key != "peers"}
        overloaded = gateway.flow.overloaded()
        if overloaded:  # told, not a reason to be unhealthy or unready: the engines are serving all they can
            answer["overloaded"] = overloaded
        return jsonify(answer)

    @app.get("/ready")
    async def ready():
        """Readiness for load balancers and orchestrators (:mod:`.readiness`): 200, or 503 with the reasons."""
        status, body = gateway.readiness.answer(request.query_string.decode("latin-1"))
        return jsonify(body), status

    def without_control_plane():
        return _error(404, "this gateway runs with --role gateway: the control plane (nodes, agents) is in its "
                      "cluster's control process", "no_control_plane")

    def not_leading():
        """An agent's upgrade at a process without a control plane: a follower of a cluster (a candidate, or a
        --role gateway process) names the leader it knows (the agent goes there if it is one of its --join URLs)."""
        shared = gateway.shared
        if shared is None:
            return without_control_plane()
        holder = shared.leader_holder or {}
        leader = str(holder.get("control_url") or "")
        headers = {"Retry-After": "1", **({LEADER_HEADER: leader} if leader else {})}
        if shared.leading:  # elected a moment ago: its term's control plane is not up yet (the agent stays here)
            return _error(503, "this process leads its cluster since a moment: its control plane is starting; retry",
                          "control_plane_starting", headers=headers)
        return _error(503, f"this process does not lead its cluster now: the leader is at {leader}" if leader else
                      "this process does not lead its cluster now, and no leader is known (an election is under "
                      "way, or Redis is unreachable)", "not_leader", headers=headers)

    @app.get("/metrics")
    async def metrics():
        gateway.metrics.trio_tasks.set(trio_task_count())  # here, in the loop: render runs in a thread
        body, content_type = await render(gateway.metrics.registry)
        return Response(body, content_type=content_type)

    @app.get("/admin/replicas")
    async def replicas():
        """Every replica with its ``source``: the config's (static) ones, then the deployed ones (placed, with
        their shards, or waiting for a placement)."""
        replicas = gateway.replicas
        if gateway.control is None:  # a follower: the replicas the cluster's control process published
            return jsonify([replicas.describe(replica) for replica in replicas])
        static = [replicas.describe(replica) for replica in replicas.of_source(STATIC)]
        listed = static + gateway.control.replicas_json()
        return jsonify(gateway.shared.followed.held_json(listed) if gateway.shared is not None else listed)

    @app.get("/admin/cluster")
    async def cluster():
        """The shared state: role, Redis, degraded or not, the log position and the other gateways' load."""
        if gateway.shared is None:
            return jsonify({"backend": "local", "role": gateway.role})
        return jsonify(gateway.shared.describe())

    @app.get("/admin/kv")
    async def kv():
        """The router's KV index per replica (state, blocks, block size, resets), and the embedded agent's
        subscriptions (ports, mirrored blocks, last sequence number, resets, hash parity)."""
        index = gateway.kv_index
        names = sorted(set(index.replicas()) | {r.name for r in gateway.replicas})
        agent = gateway.embedded_agent
        shards: list[dict[str, Any]] = [s.describe() for s in agent.kv.shards.values()] if agent is not None else []
        return jsonify({"replicas": [{"name": name, **index.describe(name)} for name in names],
                        "predicted_keys": index.predicted_keys, "agent_subscriptions": shards})

    @app.get("/admin/stats")
    async def stats():
        """Per replica: requests, TTFT and latency quantiles and the prefix-cache hit rate of this process."""
        return jsonify({"replicas": replica_stats(gateway.metrics)})

    @app.get("/admin/decisions")
    async def decisions():
        """The last routing decisions this process's data plane finished, newest first, with the tier's detail."""
        log_ = gateway.dataplane.decisions
        return jsonify({"capacity": log_.capacity, "decisions": log_.to_json()})

    @app.get("/ui")
    async def ui():
        """The status page: no data in it, only code that reads the endpoints above with the admin token."""
        page = status_page()
        return Response(page.body, content_type="text/html; charset=utf-8", headers=page.headers)

    @app.get("/admin/nodes")
    async def nodes():
        if gateway.control is None:
            return without_control_plane()
        return jsonify(gateway.control.nodes_json())

    @app.post("/admin/nodes/<node_id>/forget")
    async def forget_node(node_id: str):
        """Drop a node's identity: its id can join again with a join token (a rebuilt or replaced machine)."""
        if gateway.control is None:
            return without_control_plane()
        if not gateway.control.forget_node(node_id):
            return _error(404, f"no node {node_id!r} is known", "node_not_found")
        return jsonify({"forgotten": node_id})

    @app.post("/admin/reload")
    async def reload():
        """Re-read the config file; ``?allow_empty=true`` confirms a file with no YAML document or one that
        removes every model and deployment (docs/cluster.md#reload). A refusal is an OpenAI error (409, or 422
        for an invalid file) with the outcome."""
        allow_empty = request.args.get("allow_empty", "false").lower()
        if allow_empty not in ("true", "false"):
            return _error(400, "allow_empty must be true or false", "invalid_parameter", param="allow_empty")
        outcome = await gateway.reload(allow_empty=allow_empty == "true")
        if outcome.refusal is None:
            return jsonify(outcome.to_json())
        error = json.loads(error_body(outcome.refusal.status, outcome.refusal.message, code=outcome.refusal.code,
                                      type_="invalid_request_error"))
        return jsonify(error | outcome.to_json()), outcome.refusal.status

    @app.websocket("/agent")
    async def agent():
        """An agent's session. Its upgrade request is judged before it is accepted, so a refused one (no or a
        wrong credential, too many sessions) gets an HTTP answer and no frame of it is ever read."""
        peer = f"{websocket.remote_addr or '?'}"
        # quart's websocket is a context-local proxy: hand the session the object behind it
        ws = websocket._get_current_object()  # type: ignore[attr-defined]
        control = gateway.agent_control()
        if control is None:
            return not_leading()
        agents = control.agents
        with agents.upgrade(AgentCredentials.from_headers(ws.headers), peer) as refusal:
            if refusal is not None:
                return _error(refusal.status, refusal.message, refusal.reason, headers=refusal.headers)
            await ws.accept()
            # The session runs in the control plane's nursery (its term's), not in this connection's task: the
            # term's end closes it, and this task only waits for it.
            await agents.serve(quart_channel(ws, f"agent at {peer}"))
        return None

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
        try:  # as the data plane reads a body: the same parser and limits (no NaN, no 1e400, bounded)
            raw = await request.get_data(cache=False)
            body = await read_json_body(raw if isinstance(raw, bytes) else raw.encode(),
                                        gateway.dataplane.settings.json_limits)
        except BodyError as exc:
            return _error(exc.status, str(exc), exc.code)
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object: an OpenAI request with 'model'",
                          "invalid_json")
        model = body.get("model")
        resolved = gateway.router.resolve(model) if isinstance(model, str) else None
        if resolved is None:
            return _error(404, f"the model {model!r} does not exist", "model_not_found", param="model")
        path = request.args.get("path") or ("/v1/chat/completions" if "messages" in body else "/v1/completions")
        explained = await gateway.router.explain(RouteRequest(resolved[0], path, body, adapter=resolved[1]))
        return jsonify({**explained, "flow": gateway.flow.explain(resolved[0])})

    @app.get("/admin/explain")
    async def explain_request():
        """What overload control did with a recent request that waited or was shed (``?request_id=``)."""
        request_id = request.args.get("request_id", "")
        if not request_id:
            return _error(400, "name the request: GET /admin/explain?request_id=ID (POST /admin/explain explains "
                               "a request body's routing)", "missing_request_id", param="request_id")
        try:
            outcome = await gateway.flow.outcome(request_id)
        except Unavailable as exc:
            return _error(503, f"request {request_id[:100]!r} is not among this process's; the shared state, where "
                               f"the other gateways' are, did not answer: {exc}", "state_unavailable")
        if outcome is None:
            elsewhere = "nor at another gateway of the cluster in the last 10 minutes" \
                if gateway.flow.explained is not None else "or went through another gateway"
            return _error(404, f"no request {request_id[:100]!r} waited or was shed among the last "
                               f"{RECENT_OUTCOMES} that did on this process: it was routed at once, is older, "
                               f"{elsewhere}", "not_found", param="request_id")
        return jsonify(outcome)

    @app.get("/admin/flow")
    async def flow():
        """Overload control now: per model its queues by class, its room and its replicas' saturation."""
        return jsonify(gateway.flow.status())

    @app.get("/admin/capacity")
    async def capacity():
        """Per autoscaled deployment, its replicas against its demand over the last minutes (the status page's
        chart)."""
        return jsonify(gateway.capacity.to_json())

    register_tenant_routes(app, gateway, _error, _json_object)
    register_usage_routes(app, gateway)
    register_autoscale_routes(app, gateway)

    @app.errorhandler(404)
    async def not_found(_):
        return _error(404, "no such control endpoint", "not_found")

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException):
        code = (exc.name or "error").lower().replace(" ", "_")
        return _error(exc.code or 500, exc.description or exc.name or "error", code)

    @app.errorhandler(Exception)
    async def failure(exc: Exception):
        # a websocket's failure lands here too, where there is no request to name
        where = f"websocket {websocket.path}" if has_websocket_context() else f"{request.method} {request.path}"
        log.exception("control API: %s failed", where)
        return _error(500, f"the control API failed on this request ({type(exc).__name__}); see the gateway's log",
                      "internal_error")

    return app


def _error(status: int, message: str, code: str, param: str | None = None, headers: dict | None = None) -> Response:
    return Response(error_body(status, message, param=param, code=code), status=status,
                    content_type="application/json", headers=headers)


def _json_object(raw: bytes | str, what: str = "an OpenAI request with 'model'") -> dict | str:
    """The body as a JSON object, or why it is not one (read as the data plane reads a body: its parser and
    default limits, no NaN or overflowing number; not an object: ``what`` it should be)."""
    try:
        value = parse_json_body(raw if isinstance(raw, bytes) else raw.encode())
    except BodyError as exc:
        return str(exc)
    if not isinstance(value, dict):
        return f"the body must be a JSON object: {what}"
    return value
