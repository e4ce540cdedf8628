"""The OpenAI data plane: authenticate, parse just enough JSON to route, relay the engine's bytes.

Per request: find the API key's tenant (llmgw.tenancy.directory), read ``model`` from the JSON
body, admit it against its key's limits (:mod:`.tenant_gate`: a 429 or a reservation), ask the
router for a replica, forward the original body bytes, and relay the response as it arrives; once
it ended, however, the reservation is settled with what it used. Every response, relayed or made
here, carries ``x-request-id``; every error made here is in OpenAI's JSON shape. A known key's
stream is the one body re-encoded: its engine is asked for the usage chunk, which the client
does not see unless it asked (:mod:`.stream_usage`).

An attempt is retried on another replica only when nothing of the request
reached the replica (no connection; the first write failed) or the replica
answered 502/503/504, and never after the first byte was relayed. A failure
the request itself may have caused (an engine 500 or other 5xx, the
connection closed after the request was sent, a malformed answer) is
answered at once with the upstream's own status and body, or a 502 naming
the replica, and is never counted against the replica's health
(``docs/routing.md``, "Retries and passive health"). An event stream the
upstream breaks off after its head ends with an OpenAI-shaped error event and
``data: [DONE]``, as vLLM ends a stream that fails (:func:`stream_error_event`).

Every answer but the probes' (``/health``, ``/ready``) is counted by API key name
and, with ``access_log``, written as one access line by :meth:`DataPlane._answered`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

from ..engines import probe
from ..flow.model import FlowSettings
from ..http.client import UpstreamError, UpstreamResponse
from ..http.jsonbody import BodyError, JsonLimits, read_json_body
from ..http.messages import Request, Response, error_body, error_response
from ..http.multipart import FormError, form_field
from ..http.server import AbortConnection
from ..logfields import FieldValue, fields_extra, logfmt
from ..metrics import ANSWERED, STREAM_ERROR, TOKEN_LATENCY_BOUNDS, add_observations
from ..router.canonical import estimated_prompt_tokens
from ..router.replica import Replica
from ..router.router import Router, replica_of
from ..router.tier import Decision, RouteRequest
from ..tenancy.directory import Directory
from ..tenancy.interfaces import KeyDirectory
from ..tenancy.model import Estimate, Tenant
from ..tenancy.usage import MODEL_NOT_ALLOWED
from .decisions import DecisionLog
from .engine_priority import PRIORITY_PATHS, engine_priority, prioritized_body
from .flow_gate import OPEN, FlowGate, FlowTrace, Pass
from .hops import HopGuard
from .latency import StreamWatch, events_after_last_token
from .readiness import Readiness
from .replica_back import wait_for_replica_back
from .request_ids import RequestIds, accepted_client_id
from .stream_usage import UsageChunkFilter, usage_forced_body
from .tenant_gate import Charge, TenancyGate
from .usage import STREAM_TAIL_PIECES, usage_counts, usage_of_body, usage_of_stream_tail

log = logging.getLogger(__name__)
_Answer = TypeVar("_Answer", Response, None)  # what DataPlane._count passes through
access_log = logging.getLogger("llmgw.access")

# What vLLM's OpenAI server answers with a POST naming a model: relayed to a replica of that model.
PROXIED_POST_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/score", "/v1/rerank",
    "/v1/audio/transcriptions", "/v1/audio/translations",
    "/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank", "/v2/rerank",
})
# Paths whose body may omit "model" (vLLM's tokenizer endpoints): the gateway's only model serves them then.
MODEL_OPTIONAL_PATHS = frozenset({"/tokenize", "/detokenize"})
# Response headers that describe the upstream connection, not the body.
_DROP_RESPONSE_HEADERS = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"trailer", b"upgrade",
                                    b"server", b"date"})
_DROP_REQUEST_HEADERS = frozenset({b"authorization", b"x-request-id", b"expect"})
INLINE_BODY_LIMIT = 1 << 20  # bodies with a known length up to this are relayed in one write
# What says a replica is unwell (counted by passive health); anything else the request may have caused.
UNWELL_KINDS = frozenset({"connect", "tls", "closed_before_request", "timeout"})
UNWELL_STATUSES = frozenset({502, 503, 504})
# Failures after which the request is sent to another replica: none of it reached this one. "capacity" (no socket
# for want of descriptors: llmgw.fdpressure) is one, and says nothing about the replica's health.
RETRY_KINDS = frozenset({"connect", "tls", "closed_before_request", "capacity"})
_now = time.perf_counter  # durations for the metrics; real time, not Trio's clock
ENGINE_GONE_TIMEOUT = 1.0  # seconds a replica that broke off a request has to answer /health to count as alive
NO_KEY = "none"  # the key name of a request without a valid API key (or of any request without api_keys)
API_MADE_KEYS = "api"  # the metric label of every key the admin API made: their number is the store's
PROBE_PATHS = frozenset({"/health", "/ready"})  # answered without an access line: load balancers poll them
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")


class Exchange:
    """One request as the access log and the per-key count see it, filled in as the data plane learns it. A plain
    class: a dataclass's ``__init__`` is written at run time and stays interpreted in the compiled build."""

    __slots__ = ("started", "key", "tenant", "model", "relayed", "charge", "flow", "engine_priority")

    def __init__(self, started: float, key: str = NO_KEY, tenant: Tenant | None = None, model: str | None = None):
        self.started = started
        self.key = key  # the name of the API key it carried
        self.tenant = tenant  # who carried it (None: no valid key, or no keys at all)
        self.model = model
        self.relayed = False  # an upstream's answer: its access line is written when its body has been relayed
        self.charge: Charge | None = None  # its reservation and usage record, once admitted (tenant_gate.py)
        self.flow: FlowTrace | None = None  # what overload control did with it (None: it did not go through the queue)
        self.engine_priority: int | None = None  # the priority sent to an engine in priority scheduling (None: none)


@dataclass(frozen=True)
class DataPlaneSettings:
    connect_timeout: float = 3.0
    first_byte_timeout: float = 600.0
    idle_timeout: float = 300.0
    retries: int = 2
    retry_after_seconds: int = 1
    access_log: bool = False  # one INFO line per answer on the "llmgw.access" logger
    json_limits: JsonLimits = JsonLimits()


class DataPlane:
    def __init__(self, router: Router, health, metrics, settings: DataPlaneSettings,
                 directory: KeyDirectory | None = None, hops: HopGuard | None = None):
        """``directory``: who each API key is (None: no keys, /v1 is open)."""
        self.router = router
        self.health = health
        self.metrics = metrics
        self.settings = settings
        self.directory: KeyDirectory = directory or Directory()
        self.tenancy: TenancyGate | None = None  # limits and usage (set by the gateway; None: neither)
        # Overload control (set by the gateway): a request waits here for its model's room; off until it is set.
        self.flow = FlowGate(FlowSettings(enabled=False), None, None)
        self.readiness: Readiness | None = None  # answers /ready (set by the gateway); None: /ready is a 404
        self._created = int(time.time())
        self._ids = RequestIds()
        self._replica_names: dict[str, bytes] = {}
        self.decisions = DecisionLog()  # the last answered attempts, for /admin/decisions and the status page
        self.hops = hops or HopGuard()
        # ``await wait_for_replica(model)``: True once a request that found no routable replica may look again
        # (the control plane's adoption window after a start); None: answer 503 at once.
        self.wait_for_replica: Callable[[str], Awaitable[bool]] | None = None
        # ``await wait_for_models()``: a gateway that follows the cluster's state knows no model before its first
        # snapshot; None when nothing is pending, else whether the models came in time (no: 503, not 404).
        self.wait_for_models: Callable[[], Awaitable[bool | None]] | None = None
        # ``holds(model)``: a request for ``model`` waits in the flow queue even with no routable replica (an
        # autoscaled model: its first replica starts for the requests waiting, llmgw/autoscale).
        self.holds: Callable[[str], bool] = lambda model: False

    def apply(self, settings: DataPlaneSettings) -> None:
        """A reload's settings, from the next request on (its API keys reach the directory: Gateway.reload)."""
        self.settings = settings

    # -- entry point -------------------------------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        if request.path in PROBE_PATHS and request.method == "GET":
            response = self._probe(request)
            response.headers += self.error_headers(request)
            return response
        exchange = Exchange(_now())
        try:
            response = await self._route(request, exchange)
        except BaseException:  # the client went away (or the server stops) before an answer
            if not exchange.relayed:
                self._answered(exchange, 499, None)
            raise
        request_id = None
        for name, value in response.headers:  # relayed answers have it already; answers made here get it now
            if name == b"x-request-id":
                request_id = value
                break
        else:
            added = self.error_headers(request)
            response.headers += added
            request_id = added[0][1]
        if not exchange.relayed:
            self._answered(exchange, response.status, request_id.decode("ascii"))
        return response

    def refused(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """A request the HTTP server answered itself (malformed, too large, too slow): counted, and logged with
        the ``x-request-id`` of its answer (``headers``)."""
        self.metrics.refused_requests.labels(str(status)).inc()
        request_id = next((value.decode("ascii") for name, value in headers if name == b"x-request-id"), None)
        self._answered(Exchange(_now()), status, request_id)

    def _probe(self, request: Request) -> Response:
        """``/health`` (liveness: the process answers) and ``/ready`` (readiness: :mod:`.readiness`). With
        ``api_keys``, ``/ready?model=X`` needs a key as ``/v1`` does (it tells whether a model exists), and a
        bare ``/ready`` without one stays open for load balancers but names no model. Its cluster reasons never
        name Redis's address (the control port's do)."""
        if request.path == "/health":
            return Response(200, [], b"")
        if self.readiness is None:
            return error_response(404, "no route for GET /ready", code="not_found")
        directory = self.directory
        keyed = not directory.required or directory.lookup(request.header("authorization")) is not None
        if not keyed and request.query:
            return _key_required()
        status, body = self.readiness.answer(request.query, names=keyed, detailed=False)
        return Response.json(body, status)

    def error_headers(self, request: Request | None) -> list[tuple[bytes, bytes]]:
        """``x-request-id`` for an answer made without an upstream: the client's, or a new one."""
        given = None
        if request is not None:
            for name, value in request.headers:
                if name == b"x-request-id":
                    given = self._client_id(value)
                    break
        return [(b"x-request-id", (given or self._ids.next()).encode("ascii"))]

    def _client_id(self, value: bytes) -> str | None:
        """The client's ``x-request-id`` when it may be kept (:mod:`.request_ids`); a refused one is counted."""
        accepted = accepted_client_id(value)
        if accepted is None:
            self.metrics.replaced_request_ids.inc()
        return accepted

    async def _route(self, request: Request, exchange: Exchange) -> Response:
        path = request.path
        if not path.startswith("/v1/") and path not in PROXIED_POST_PATHS:
            return error_response(404, f"no route for {request.method} {path}", code="not_found")
        directory = self.directory
        if directory.required:
            tenant = directory.lookup(request.header("authorization"))
            if tenant is None:
                return _key_required()
            exchange.tenant, exchange.key = tenant, tenant.name
        if request.method == "GET" and path == "/v1/models":
            return self._list_models(exchange.tenant)
        if request.method == "GET" and path.startswith("/v1/models/"):
            return self._get_model(path[len("/v1/models/"):], exchange.tenant)
        if path not in PROXIED_POST_PATHS:
            return error_response(404, f"no route for {request.method} {path}", code="not_found")
        if request.method != "POST":
            return error_response(405, f"{path} only accepts POST", code="method_not_allowed")
        return await self._proxy(request, exchange)

    # -- small endpoints ---------------------------------------------------------------------------------------------

    def _model_card(self, name: str, parent: str | None = None) -> dict:
        card = {"id": name, "object": "model", "created": self._created, "owned_by": "llmgw"}
        if parent is not None:
            card["parent"] = parent  # a LoRA adapter, served by its base model's replicas (as vLLM lists them)
        return card

    def _list_models(self, tenant: Tenant | None) -> Response:
        """The models (and LoRA adapters) there are, as far as ``tenant`` may use them."""
        cards = [self._model_card(n) for n in sorted(self.router.models)]
        cards += [self._model_card(a, m) for a, m in sorted(self.router.adapters.items()) if m in self.router.models]
        if tenant is not None:
            cards = [card for card in cards if tenant.may_use(card["id"])]
        return Response.json({"object": "list", "data": cards})

    def _get_model(self, name: str, tenant: Tenant | None) -> Response:
        if tenant is not None and not tenant.may_use(name):
            return _model_not_allowed(tenant, name)
        resolved = self.router.resolve(name)
        if resolved is None:
            return error_response(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return Response.json(self._model_card(name, resolved[0] if resolved[1] else None))

    # -- the proxy ---------------------------------------------------------------------------------------------------

    async def _proxy(self, request: Request, exchange: Exchange) -> Response:
        if self.hops.looped(request.headers):
            self.metrics.loops_detected.inc()
            return self._count(None, self.hops.refusal())
        body = await self._routing_body(request)
        if isinstance(body, Response):
            return self._count(None, body)
        model = body.get("model")
        if model is None and request.path in MODEL_OPTIONAL_PATHS and len(self.router.models) == 1:
            model = next(iter(self.router.models))
        if not isinstance(model, str) or not model:
            return self._count(None, error_response(400, "the request needs a 'model' string", param="model",
                                                    code="missing_model"))
        tenant = exchange.tenant
        if tenant is not None and not tenant.may_use(model):
            exchange.model = model
            if self.tenancy is not None:
                self.tenancy.tenancy.usage.refused(tenant, model, MODEL_NOT_ALLOWED)
            return self._count(None, _model_not_allowed(tenant, model))
        resolved = self.router.resolve(model)
        if resolved is None and self.wait_for_models is not None:
            loaded = await self.wait_for_models()
            if loaded is False:
                return self._count(None, error_response(
                    503, "this gateway has not loaded the cluster's models from the shared state yet; "
                    "try again or another gateway", code="state_not_loaded",
                    headers=[(b"retry-after", str(self.settings.retry_after_seconds).encode())]))
            if loaded:
                resolved = self.router.resolve(model)
        exchange.model = model
        if resolved is None:
            return self._count(None, error_response(404, f"the model {model!r} does not exist", param="model",
                                                    code="model_not_found"))
        upstream_body = request.body
        strip_usage = False
        charge = None
        gate = self.tenancy  # read once: a reload swaps it whole
        if gate is not None and tenant is not None:
            charge = gate.open(tenant, model, request.path, body, len(request.body))
            if tenant.limited:  # a key without limits waits on nothing here
                refused = await gate.admit(charge)
                if refused is not None:
                    return self._count(model, refused)
            exchange.charge = charge
            forced = usage_forced_body(request.path, body)
            if forced is not None:
                upstream_body, strip_usage = forced, True
        try:
            response = await self._dispatch(request, exchange, model, resolved, body, upstream_body, strip_usage)
        except BaseException:
            if charge is not None and not exchange.relayed:
                charge.unanswered()
            raise
        if charge is not None:
            if not exchange.relayed:
                charge.unanswered()
            response.headers += charge.headers
        return response

    async def _dispatch(self, request: Request, exchange: Exchange, model: str, resolved: tuple[str, str | None],
                        body: dict, upstream_body: bytes, strip_usage: bool) -> Response:
        """Route the request and send ``upstream_body`` to a replica, another on a failure that allows it; the
        answer relayed (``strip_usage``: less the stream's usage chunk the gateway asked for), or made here."""
        started = exchange.started
        request_id = None
        seen_id = False
        forwarded = []
        for header in request.headers:  # one pass: find the request id, drop what is not forwarded
            name = header[0]
            if name in _DROP_REQUEST_HEADERS:
                if name == b"x-request-id" and not seen_id:
                    seen_id = True
                    request_id = self._client_id(header[1])
            else:
                forwarded.append(header)
        if request_id is None:
            request_id = self._ids.next()
        route_request = RouteRequest(resolved[0], request.path, body, request.headers, request_id,
                                     adapter=resolved[1])
        id_header = (b"x-request-id", request_id.encode("ascii"))
        forwarded.append(id_header)
        forwarded.append(self.hops.header)
        flow = self.flow  # read once: a reload swaps it whole
        entered = OPEN
        # A model without a routable replica has no room to wait for: routed now, it is answered 503 at once (or
        # waits for a replica being adopted), as without flow control; but an autoscaled one's requests wait for
        # the replica they make the autoscaler start, up to their class's deadline.
        if flow.control is not None and (self.router.has_routable_replica(resolved[0]) or self.holds(resolved[0])):
            trace = exchange.flow = FlowTrace()
            estimate = self._cost(flow, exchange, request, body)
            turn = await flow.enter(request, exchange.tenant, resolved[0], estimate.tokens, request_id, trace,
                                    output=estimate.max_output_tokens, prompt=estimated_prompt_tokens(route_request))
            if exchange.charge is not None:  # a configured class (priority_of never yields a client's string)
                exchange.charge.priority = trace.priority
            if isinstance(turn, Response):  # shed (429), or a priority header or deadline it cannot read (400)
                if trace.shed is not None and exchange.charge is not None:
                    exchange.charge.shed()
                turn.headers.append(id_header)
                return self._count(model, turn, started)
            entered = turn
        try:
            return await self._attempts(request, model, route_request, upstream_body, forwarded, id_header, exchange,
                                        strip_usage, entered)
        finally:
            entered.release()  # abandoned before it was routed (else already released)

    async def _attempts(self, request: Request, model: str, route_request: RouteRequest, upstream_body: bytes,
                        forwarded: list[tuple[bytes, bytes]], id_header: tuple[bytes, bytes], exchange: Exchange,
                        strip_usage: bool, entered: Pass) -> Response:
        """Send the request to a replica, to another after a failure that allows it; ``entered`` (its place in the
        model's room) released as soon as it is routed."""
        started = exchange.started
        request_id = route_request.request_id
        tried: list[Replica] = []
        failures: list[str] = []  # "<replica>: <why>", one per failed attempt
        last_error: UpstreamError | None = None
        kept: tuple[Replica, int, list[tuple[bytes, bytes]], bytes] | None = None  # an unwell replica's answer
        resent = False  # sent on once after its engine went away with it
        prioritized: bytes | None = None  # the body with its engine priority, made for the first replica that wants it
        waited = False  # waited once for a held model's replica to come back
        retries = self.settings.retries  # read once: a reload may replace the settings meanwhile
        for attempt in range(1 + retries):
            decision = None
            try:
                decision = await self.router.pick(route_request, exclude=tried)
                if decision is None and not tried and self.wait_for_replica is not None \
                        and await self.wait_for_replica(model):
                    decision = await self.router.pick(route_request, exclude=tried)
                if decision is None and not waited and self.holds(route_request.model):
                    # An autoscaled model's requests wait for a replica: its only one failed (engine killed,
                    # restarting) in a way that lets the request be sent on, so it waits for it to come back.
                    waited = True
                    decision = await self._wait_for_replica_back(request, model, route_request, exchange, tried)
                if decision is None:
                    break
                replica = replica_of(decision)
                tried.append(replica)
                if attempt:
                    self.metrics.for_model(model).retries.inc()
                # Routed as it is handed to the replica, before any answer: from now on it counts in the
                # replica's local_inflight and local_inflight_tokens (so in what tiers read), streamed or not.
                self._load(replica, +1)
                entered.release()  # its place in the room is now its replica's in-flight count
                self.router.routed(route_request, decision)
                sent = upstream_body
                if replica.priority_scheduling and request.path in PRIORITY_PATHS:
                    if prioritized is None:
                        prioritized = self._prioritized(request, route_request.body, exchange, strip_usage)
                    sent = prioritized
                outcome = await self._attempt(replica, request, sent, forwarded, is_last=attempt == retries)
            except BaseException:  # cancelled before any answer: the client went away (or the server stops)
                if decision is not None:
                    self.router.finished(route_request, decision, None)
                self._count(model, None, started, 499)
                self.metrics.for_model(model).client_disconnects.inc()
                raise
            if isinstance(outcome, UpstreamResponse):
                exchange.relayed = True
                return await self._relay(outcome, replica, decision, route_request, exchange, id_header,
                                         strip_usage)
            # This attempt failed before any answer was relayed: its decision ends here, before anything is awaited.
            reason = outcome.kind if isinstance(outcome, UpstreamError) else f"status_{outcome[0]}"
            self.router.attempt_failed(route_request, decision, reason)
            self.router.finished(route_request, decision, None)
            if isinstance(outcome, tuple):  # an unwell replica's answer (502/503/504), retried elsewhere
                kept = (replica, *outcome)
                failures.append(f"{replica.name}: HTTP {outcome[0]}")
                continue
            last_error = outcome
            failures.append(f"{replica.name}: {outcome}")
            if outcome.kind in RETRY_KINDS:
                continue
            if outcome.kind in ("closed_after_request", "closed") and not resent \
                    and await self._engine_gone(replica):
                # Its engine died with the request in it (killed, out of memory): sent on once, so a request
                # that kills its engine can take at most one more with it.
                resent = True
                self._failed(replica, "connect", "its engine went away (no answer to /health)")
                log.warning("replica %s went away with request %s before answering; sending it to another "
                            "replica once", replica.name, request_id)
                continue
            log.info("request %s: replica %s failed after taking it (%s); answered as it is, not sent on",
                     request_id, replica.name, outcome)
            break  # it reached the engine: sending it again could repeat its work, or its harm
        if kept is not None and (last_error is None or last_error.kind in RETRY_KINDS):
            return self._count(model, self._kept_answer(*kept, id_header), started)
        return self._count(model, self._no_replica_error(model, last_error, tried, failures, id_header), started)

    def _prioritized(self, request: Request, body: dict, exchange: Exchange, force_usage: bool) -> bytes:
        """The body for an engine in priority scheduling: its ``priority`` from the request's class (counted by
        model and class, and kept for the access line)."""
        assert exchange.model is not None
        chosen = self.flow.engine_class(exchange.tenant, request, exchange.flow)
        exchange.engine_priority = engine_priority(chosen, exchange.tenant, body)
        self.metrics.engine_priority_requests.labels(exchange.model, chosen.name).inc()
        return prioritized_body(request.path, body, exchange.engine_priority, force_usage)

    async def _wait_for_replica_back(self, request: Request, model: str, route_request: RouteRequest,
                                     exchange: Exchange, tried: list[Replica]) -> Decision | None:
        """Up to the request's class deadline (``max_wait`` from now, shortened by the client's own), a replica
        of a held model that may take it (:mod:`.replica_back`); None: none came (answered as before)."""
        flow = self.flow
        priority = flow.priority_of(exchange.tenant, request)
        until = flow.deadline(priority, request) if not isinstance(priority, Response) else None
        if until is None or isinstance(until, Response) or flow.control is None:
            return None
        decision = await wait_for_replica_back(self.router, route_request, tried, until)
        self.metrics.waited_for_replica.labels(model, "none" if decision is None else "routed").inc()
        if decision is None:
            log.info("request %s: no replica of %s came back within its class's max_wait (tried: %s); answered "
                     "as without the wait", route_request.request_id, model,
                     ", ".join(r.name for r in tried) or "none")
        return decision

    @staticmethod
    def _cost(flow: FlowGate, exchange: Exchange, request: Request, body: dict) -> Estimate:
        """A request's estimated tokens (prompt and most output, apart), what fair shares count and the room
        holds: its charge's estimate (a known key), else the same estimator's (the flow gate's, of the same
        config)."""
        charge = exchange.charge
        if charge is not None:
            return charge.estimate
        assert exchange.model is not None
        return flow.estimator.estimate(exchange.model, request.path, body, len(request.body))

    async def _engine_gone(self, replica: Replica) -> bool:
        """Whether the replica's engine is gone: its ``/health`` gets no answer within ``ENGINE_GONE_TIMEOUT``
        (refused, reset, or silent). A bare connection would not tell: a killed server's listening socket can
        outlive it for a moment, or for good in a child process that inherited it (vLLM's engine core)."""
        if replica.pool is None:
            return False
        health = await probe.check_health(replica.pool, replica.base_path + "/health", ENGINE_GONE_TIMEOUT,
                                          [(b"host", b"llmgw")])
        return not health.answered and not health.inconclusive

    async def _routing_body(self, request: Request) -> dict | Response:
        """What the router looks at: the JSON object of the body (parsed within ``json_limits``), or a form's
        ``model`` field (audio uploads); the body itself is relayed unchanged either way. An error response when
        it is neither."""
        content_type = request.header("content-type") or ""
        if content_type[:19].lower() == "multipart/form-data":
            try:
                model = form_field(request.body, content_type, "model")
            except FormError as bad_form:
                return error_response(400, f"the request body is not a valid form: {bad_form}", code="invalid_form")
            return {} if model is None else {"model": model}
        try:
            body = await read_json_body(request.body, self.settings.json_limits)
        except BodyError as exc:
            self.metrics.rejected_bodies.labels(exc.reason).inc()
            return error_response(exc.status, str(exc), code=exc.code)
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object", code="invalid_json")
        return body

    async def _attempt(self, replica: Replica, request: Request, body: bytes, headers: list[tuple[bytes, bytes]],
                       is_last: bool) -> UpstreamResponse | UpstreamError | tuple[int, list, bytes]:
        """Send the request, with ``body``, to one replica (already counted in its load). An error comes back as an
        UpstreamError, the load given back; a 502/503/504 answer (unless this is the last attempt) as ``(status,
        headers, body)``, its connection closed."""
        if replica.auth_header is not None:
            headers = headers + [replica.auth_header]
        pool = replica.pool
        assert pool is not None, "a replica in routing has its pool (opened when it entered the replica set)"
        upstream = await self._step(replica, lambda: pool.request(
            request.method, replica.base_path + request.target, headers, body,
            first_byte_timeout=self.settings.first_byte_timeout, idle_timeout=self.settings.idle_timeout))
        if isinstance(upstream, UpstreamError):
            return upstream
        if upstream.status in UNWELL_STATUSES and not is_last:
            self._load(replica, -1)
            self._failed(replica, "status_5xx", f"HTTP {upstream.status}")
            # Its body is kept for the client only if it came with the head: no waiting on an unwell replica.
            body = await upstream.read() if upstream.complete else b""
            await upstream.aclose()
            return upstream.status, upstream.headers, body
        if not upstream.complete and _inline_length(upstream.headers) is not None:
            # A small answer whose body did not come with its head: read here, so that an engine dying before it
            # ends fails this attempt, while nothing was relayed yet, rather than the client's answer.
            failed = await self._step(replica, upstream.read_ahead)
            if isinstance(failed, UpstreamError):
                return failed
        return upstream

    async def _step(self, replica: Replica, step):
        """``await step()`` of an attempt; its ``UpstreamError`` is returned, counted, and the replica's load given
        back (also when cancelled)."""
        try:
            return await step()
        except UpstreamError as exc:
            self._load(replica, -1)
            self._upstream_error(replica, exc)
            return exc
        except BaseException:
            self._load(replica, -1)
            raise

    async def _relay(self, upstream: UpstreamResponse, replica: Replica, decision: Decision,
                     route_request: RouteRequest, exchange: Exchange, id_header: tuple[bytes, bytes],
                     strip_usage: bool = False) -> Response:
        ttfb = _now() - exchange.started
        headers = [h for h in upstream.headers if h[0] not in _DROP_RESPONSE_HEADERS]
        headers.append(id_header)
        name = self._replica_names.get(replica.name)
        if name is None:
            name = self._replica_names[replica.name] = replica.name.encode()
        headers.append((b"x-llmgw-replica", name))
        if strip_usage and upstream.status == 200:  # shorter by the usage chunk: relayed piece by piece, unsized
            headers = [h for h in headers if h[0] != b"content-length"]
        if upstream.status in UNWELL_STATUSES:
            self._failed(replica, "status_5xx", f"HTTP {upstream.status}")
        elif upstream.status >= 500:
            self._request_caused(replica, f"status_{upstream.status}")
        else:
            self.health.request_succeeded(replica)
        if _inline_length(headers) is not None:
            try:
                data = await upstream.read()
            except UpstreamError as exc:
                self._observe_ttfb(route_request, ttfb)
                self._upstream_error(replica, exc)
                self._finish(replica, decision, route_request, exchange, 502)
                return error_response(502, f"replica {replica.name} failed while sending its answer: {exc}",
                                      headers=[id_header])
            except BaseException:
                self._observe_ttfb(route_request, ttfb)
                self._finish(replica, decision, route_request, exchange, 499)
                raise
            body_at = _now()
            status = upstream.status

            def account() -> None:  # once the answer is on its way: the accounting need not delay it
                self._observe_ttfb(route_request, ttfb)
                usage = usage_of_body(data) if status == 200 else None
                self._finish(replica, decision, route_request, exchange, status, usage, body_at=body_at,
                             sent_tokens=len(data))

            return Response(status, headers, data, account)
        self._observe_ttfb(route_request, ttfb)
        return Response(upstream.status, headers,
                        RelayedStream(self, upstream, replica, decision, route_request, exchange, strip_usage))

    # -- bookkeeping -------------------------------------------------------------------------------------------------

    def _observe_ttfb(self, route_request: RouteRequest, ttfb: float) -> None:
        self.metrics.for_model(route_request.served_name).ttfb.observe(ttfb)

    def _load(self, replica: Replica, delta: int) -> None:
        replica.local_inflight += delta  # this process's own count; peers' requests are not ours to count
        if delta < 0:
            self.flow.ended(replica.model)
        bound = self.metrics.for_replica(replica)
        if bound.inflight_of is not replica:
            bound.track_inflight(replica)

    def _failed(self, replica: Replica, kind: str, reason: str) -> None:
        self.metrics.upstream_errors.labels(replica.model, replica.name, kind).inc()
        self.health.request_failed(replica, reason)

    def _finish(self, replica: Replica, decision: Decision, route_request: RouteRequest, exchange: Exchange,
                status: int, usage: dict | None = None, *, body_at: float | None = None,
                watch: StreamWatch | None = None, tail: list[bytes] | None = None, outcome: str = ANSWERED,
                sent_tokens: int | None = None) -> None:
        """Account a response that ended: ``body_at`` is when a non-streamed body arrived, ``watch`` a stream's
        token timings and ``tail`` its last pieces; ``outcome``: :data:`STREAM_ERROR` for a stream broken off;
        ``sent_tokens``: at most how many output tokens a body without usage held (its length)."""
        started = exchange.started
        self._load(replica, -1)
        replica.served += 1
        ended = _now()
        self._count(route_request.served_name, None, started, status, outcome)
        first_token_at = watch.first_token_at if watch is not None else _first_token_of_body(body_at, usage)
        tokens = record_latency(self.metrics.for_replica(replica), started, ended, first_token_at, usage, watch,
                                tail) if status == 200 else _NO_TOKENS
        if status == 200 and watch is None and first_token_at is not None:
            self.router.first_token(route_request, decision, first_token_at - started)
        self.router.finished(route_request, decision, usage)
        charge = exchange.charge
        if charge is not None:
            charge.answered(status, usage, watch.tokens_seen if watch is not None else sent_tokens)
        self.decisions.record(route_request, decision, status, started, ended, first_token_at)
        self._answered(exchange, status, route_request.request_id, replica, decision, ended, first_token_at, tokens,
                       outcome)

    def _answered(self, exchange: Exchange, status: int, request_id: str | None, replica: Replica | None = None,
                  decision: Decision | None = None, ended: float | None = None, first_token_at: float | None = None,
                  tokens: tuple[int | None, int | None, int | None] = (None, None, None),
                  outcome: str = ANSWERED) -> None:
        """The one place every answer of the data plane (but the probes') is counted by key and, with
        ``access_log``, written as an access line; ``replica`` and ``decision`` when an upstream answered."""
        tenant = exchange.tenant
        label = exchange.key if tenant is None or tenant.source == "config" else API_MADE_KEYS
        self.metrics.requests_by_key.labels(label, str(status)).inc()
        if not self.settings.access_log:
            return
        started = exchange.started
        ended = _now() if ended is None else ended
        prompt_tokens, cached_tokens, completion_tokens = tokens
        fields: dict[str, FieldValue] = {
            "request_id": request_id, "key": exchange.key,
            "team": tenant.team.name if (tenant := exchange.tenant) is not None and tenant.team is not None else None,
            "model": exchange.model,
            "replica": replica.name if replica is not None else None,
            "tier": (decision.tier or None) if decision is not None else None,
            "outcome": decision.outcome if decision is not None else None,
            "status": status, "stream_error": 1 if outcome == STREAM_ERROR else None,
            "ttft_ms": None if first_token_at is None else round((first_token_at - started) * 1000, 1),
            "latency_ms": round((ended - started) * 1000, 1), "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens, "completion_tokens": completion_tokens,
            "predicted_cached_tokens": decision.detail.get("predicted_cached_tokens") if decision is not None
            else None}
        trace = exchange.flow
        fields["class"] = trace.priority if trace is not None else None
        fields["queue_wait_ms"] = round(trace.waited * 1000, 1) if trace is not None and trace.waited is not None \
            else None
        fields["shed"] = trace.shed if trace is not None else None
        fields["engine_priority"] = exchange.engine_priority
        access_log.info("%s", logfmt(fields), extra=fields_extra(fields))

    def _count(self, model: str | None, response: _Answer, started: float | None = None,
               status: int | None = None, outcome: str = ANSWERED) -> _Answer:
        """Count a request of ``model`` answered with ``status``, or ``response``'s; ``response`` is returned."""
        if status is None:
            assert response is not None  # without a response, the caller says the status
            status = response.status
        bound = self.metrics.for_model(model or "unknown")
        bound.requests(status, outcome).inc()
        if started is not None:
            bound.request_duration.observe(_now() - started)
        return response

    def _upstream_error(self, replica: Replica, exc: UpstreamError) -> None:
        if exc.kind == "capacity":  # this process's shortage, counted in llmgw_fd_exhaustion_total: nobody's fault
            return
        if exc.kind in UNWELL_KINDS:
            self._failed(replica, exc.kind, str(exc))
        else:
            self._request_caused(replica, exc.kind)

    def _request_caused(self, replica: Replica, reason: str) -> None:
        """A failure the request itself may have caused: counted apart, never against the replica's health."""
        self.metrics.request_caused_failures.labels(replica.model, replica.name, reason).inc()

    def _kept_answer(self, replica: Replica, status: int, headers: list[tuple[bytes, bytes]], body: bytes,
                     id_header: tuple[bytes, bytes]) -> Response:
        """The last unwell replica's own answer, when no other replica could serve."""
        headers = [h for h in headers if h[0] not in _DROP_RESPONSE_HEADERS and h[0] != b"content-length"]
        headers += [id_header, (b"x-llmgw-replica", replica.name.encode())]
        return Response(status, headers, body)

    def _no_replica_error(self, model: str, last_error: UpstreamError | None, tried: list[Replica],
                          failures: list[str], id_header: tuple[bytes, bytes]) -> Response:
        if last_error is not None and last_error.kind == "timeout":
            return error_response(504, f"replica {tried[-1].name} did not answer in time: {last_error}",
                                  code="upstream_timeout", headers=[id_header])
        if last_error is not None and last_error.kind not in RETRY_KINDS:
            return error_response(502, f"replica {tried[-1].name} failed after it took the request: {last_error}; "
                                       "not sent to another replica, as the request itself may have caused this",
                                  code="upstream_error", headers=[id_header])
        retry_after = [id_header, (b"retry-after", str(self.settings.retry_after_seconds).encode())]
        if failures:
            return error_response(503, f"no replica of {model!r} could take the request; tried "
                                       f"{'; '.join(failures)}", code="no_healthy_replica", headers=retry_after)
        return error_response(503, f"no healthy replica of {model!r} is available", code="no_healthy_replica",
                              headers=retry_after)


class RelayedStream:
    """The body of a relayed answer that is not whole at its head (a stream), piece by piece as it arrives.

    An async iterator rather than an async generator (which mypyc cannot compile; docs/benchmarks.md): the
    server iterates it and calls :meth:`aclose` when it stops early. Every way it ends (the upstream's end,
    an upstream failure, the client going away, cancellation) gives the connection back or closes it and
    accounts the answer once (:meth:`DataPlane._finish`). An event stream the upstream breaks off at an
    event's end gets an error event (:func:`stream_error_event`); elsewhere the connection is cut. With
    ``strip_usage``, the usage chunk the gateway asked the engine for is not relayed
    (:class:`~.stream_usage.UsageChunkFilter`); it is still read from the upstream's pieces.
    """

    __slots__ = ("_plane", "_upstream", "_replica", "_decision", "_route_request", "_exchange", "_status",
                 "_outcome", "_recent", "_watch", "_filter", "_started", "_last_sent", "_done")

    def __init__(self, plane: DataPlane, upstream: UpstreamResponse, replica: Replica, decision: Decision,
                 route_request: RouteRequest, exchange: Exchange, strip_usage: bool = False):
        self._plane = plane
        self._upstream = upstream
        self._replica = replica
        self._decision = decision
        self._route_request = route_request
        self._exchange = exchange
        status = upstream.status
        self._status = status
        self._outcome = ANSWERED
        self._recent: list[bytes] | None = [] if status == 200 else None  # the last pieces, for the usage chunk
        self._watch: StreamWatch | None = StreamWatch(TOKEN_LATENCY_BOUNDS) \
            if status == 200 and _is_event_stream(upstream.headers) else None
        decision.stream = self._watch  # the tier may learn decode speed from its token timings
        self._filter: UsageChunkFilter | None = UsageChunkFilter() if strip_usage and status == 200 else None
        self._started = False
        self._last_sent = False  # the answer's last piece went out (an error event, the filter's held bytes)
        self._done = False

    def __aiter__(self) -> RelayedStream:
        return self

    async def __anext__(self) -> bytes:
        """The next piece to send the client (one coroutine per piece, as an async generator's)."""
        if self._done:
            raise StopAsyncIteration
        if self._last_sent:
            await self._end()
            raise StopAsyncIteration
        upstream = self._upstream
        try:
            if not self._started:
                self._started = True
                if not upstream.piece_ready:
                    return b""  # the head goes out now, as the engine sent it; its first token may be long in coming
            piece = await upstream.receive_piece()
        except UpstreamError as exc:
            return await self._broken_off(exc)
        except BaseException:
            await self._abandoned()
            raise
        if not piece:
            held = self._filter.flush() if self._filter is not None else b""
            if held:
                self._last_sent = True
                return held
            await self._end()
            raise StopAsyncIteration
        recent = self._recent
        if recent is not None:  # the last pieces (references), for the final usage chunk
            recent.append(piece)
            if len(recent) > STREAM_TAIL_PIECES:
                del recent[0]
        watch = self._watch
        if watch is not None:
            watch.feed(piece, _now())
            decision = self._decision
            if watch.first_token_at is not None and decision.ttft is None:
                self._plane.router.first_token(self._route_request, decision,
                                               watch.first_token_at - self._exchange.started)
        usage_filter = self._filter
        return usage_filter.feed(piece) if usage_filter is not None else piece

    async def _broken_off(self, exc: UpstreamError) -> bytes:
        """The upstream failed mid-answer: an error event to send, or AbortConnection (the answer accounted)."""
        replica = self._replica
        self._plane._upstream_error(replica, exc)
        watch = self._watch
        recent = self._recent
        # An event stream told so at an event's end: the client read a 200 head and then this error event.
        told = watch is not None and recent is not None and _at_event_end(recent)
        log.warning("replica %s broke off a streamed answer (request %s): %s; %s", replica.name,
                    self._route_request.request_id, exc, "the client gets an error event" if told else
                    "the connection is closed" + (" (in the middle of an event)" if watch is not None else ""))
        if self._status == 200:
            self._outcome = STREAM_ERROR  # counted under the 200 the client saw
        else:
            self._status = 502
        if not told:
            await self._end()
            raise AbortConnection(str(exc)) from None
        self._last_sent = True
        return stream_error_event(f"replica {replica.name} broke off this answer: {exc}",
                                  504 if exc.kind == "timeout" else 502)

    async def aclose(self) -> None:
        """The client will take no more (it went away, or the server stops): accounted as it stands."""
        if self._done:
            return
        if not self._last_sent:
            await self._abandoned()
        else:
            await self._end()

    async def _abandoned(self) -> None:
        """Cancelled, or the client stopped reading, before the end."""
        recent = self._recent
        if not (recent and _relayed_stream_end(recent)):  # a client may hang up once it has read [DONE]
            self._status = 499
            self._plane.metrics.for_model(self._route_request.served_name).client_disconnects.inc()
        await self._end()

    async def _end(self) -> None:
        """Once: the connection back to the pool (or closed), the answer accounted."""
        if self._done:
            return
        self._done = True
        try:
            await self._upstream.aclose()
        finally:
            recent = self._recent
            status = self._status
            usage = usage_of_stream_tail(recent) if recent and status == 200 and self._outcome == ANSWERED else None
            self._plane._finish(self._replica, self._decision, self._route_request, self._exchange, status, usage,
                                watch=self._watch, tail=recent, outcome=self._outcome)


_NO_TOKENS = (None, None, None)


def _key_required() -> Response:
    return error_response(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                          code="invalid_api_key")


def _model_not_allowed(tenant: Tenant, model: str) -> Response:
    team = tenant.team
    whose = f"its team {team.name!r}" if team is not None and team.models is not None and model not in team.models \
        else "it"
    return error_response(403, f"the API key {tenant.name!r} may not use the model {model!r} (not among the "
                               f"models {whose} may use)", param="model", code="model_not_allowed")


def _inline_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The body's length when the answer announces one up to :data:`INLINE_BODY_LIMIT` (relayed in one write)."""
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() and int(value) <= INLINE_BODY_LIMIT else None
    return None


def _relayed_stream_end(recent: list[bytes]) -> bool:
    """The last relayed pieces end with the SSE stream's ``data: [DONE]``: the client has the whole answer (an
    OpenAI SDK closes there, before the upstream's chunked terminator reaches the gateway)."""
    return b"".join(recent[-2:]).rstrip().endswith(b"data: [DONE]")


def _at_event_end(recent: list[bytes]) -> bool:
    """The relayed pieces (the last ones, or none yet) end where an SSE event ends: an event written now stands
    alone, rather than completing one the client has half read."""
    return not recent or b"".join(recent[-2:]).endswith(_EVENT_ENDS)


def stream_error_event(message: str, status: int) -> bytes:
    """The end of an event stream that failed, as vLLM ends one: ``data: {"error": {...}}`` (OpenAI's error
    object, its ``code`` the status the answer would have had) and ``data: [DONE]``."""
    return b"data: " + error_body(status, message, code=status) + b"\n\ndata: [DONE]\n\n"


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-type":
            return value.startswith(b"text/event-stream")
    return False


def _first_token_of_body(body_at: float | None, usage: dict | None) -> float | None:
    """When a non-streamed answer's first token arrived: its body's arrival when it holds one output token (usage
    says so), else unknown, as decoding the others is in that time too."""
    if body_at is not None and usage is not None and usage_counts(usage)[2] == 1:
        return body_at
    return None


def record_latency(bound, started: float, ended: float, first_token_at: float | None, usage: dict | None,
                   watch: StreamWatch | None, tail: list[bytes] | None) -> tuple[int | None, int | None, int | None]:
    """Observe a served response's end-to-end latency, time to first token (the same the router learns from:
    a stream's first token, a one-token body), the gaps before a stream's later tokens (``tail``: its last
    pieces) and usage token counts on its replica's series; the token counts (None where unknown) for the
    access log."""
    bound.e2e.observe(ended - started)
    if first_token_at is not None:
        bound.ttft.observe(first_token_at - started)
    prompt = cached = completion = None
    if usage is not None:
        prompt, cached, completion = usage_counts(usage)
        for counter, value in ((bound.prompt_tokens, prompt), (bound.cached_tokens, cached),
                               (bound.completion_tokens, completion)):
            if value:
                counter.inc(value)
    if watch is not None and watch.first_token_at is not None:
        watch.close(events_after_last_token(tail or []))
        assert watch.last_token_at is not None  # set with the first token
        add_observations(bound.inter_token, watch.counts, watch.last_token_at - watch.first_token_at)
    return prompt, cached, completion
