"""The OpenAI data plane: authenticate, parse just enough JSON to route, relay the engine's bytes.

Per request: check the API key (constant time), read ``model`` from the JSON
body, ask the router for a replica, forward the original body bytes, and
relay the response as it arrives. Connect failures and 5xx answers are
retried on another replica *before* the first response byte is relayed,
never after. Every error is answered in OpenAI's JSON error shape.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import AsyncIterator

from ..router.replica import Replica
from ..router.router import Router
from ..router.tier import Decision, RouteRequest
from .bearer import BearerTokens
from .client import UpstreamError, UpstreamResponse
from .messages import Request, Response, error_response
from .usage import STREAM_TAIL_PIECES, usage_of_body, usage_of_stream_tail
from .server import AbortConnection

log = logging.getLogger(__name__)

PROXIED_POST_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
# Response headers that describe the upstream connection, not the body.
_DROP_RESPONSE_HEADERS = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"trailer", b"upgrade",
                                    b"server", b"date"})
_DROP_REQUEST_HEADERS = frozenset({b"authorization", b"x-request-id", b"expect"})
INLINE_BODY_LIMIT = 1 << 20  # bodies with a known length up to this are relayed in one write
_now = time.perf_counter  # durations for the metrics; real time, not Trio's clock


class _RequestIds:
    """32 hex digits like a UUID4's: a random per-process prefix and a counter (uuid4() costs microseconds)."""

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count(int.from_bytes(os.urandom(4), "big"))

    def next(self) -> str:
        return "%s%016x" % (self._prefix, next(self._count))


@dataclass(frozen=True)
class DataPlaneSettings:
    connect_timeout: float = 3.0
    first_byte_timeout: float = 600.0
    idle_timeout: float = 300.0
    retries: int = 2
    retry_after_seconds: int = 1


class DataPlane:
    def __init__(self, router: Router, health, metrics, settings: DataPlaneSettings,
                 api_keys: list[str] | None = None):
        self.router = router
        self.health = health
        self.metrics = metrics
        self.settings = settings
        self._api_keys = BearerTokens(api_keys or [])
        self._created = int(time.time())
        self._ids = _RequestIds()
        self._replica_names: dict[str, bytes] = {}

    # -- entry point -------------------------------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        path = request.path
        if not path.startswith("/v1/"):
            if path == "/health" and request.method == "GET":
                return Response(200, [], b"")
            return error_response(404, f"no route for {request.method} {path}", code="not_found")
        if self._api_keys and not self._authorized(request):
            return error_response(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
        if request.method == "GET" and path == "/v1/models":
            return self._list_models()
        if request.method == "GET" and path.startswith("/v1/models/"):
            return self._get_model(path[len("/v1/models/"):])
        if request.method != "POST":
            if path in PROXIED_POST_PATHS:
                return error_response(405, f"{path} only accepts POST", code="method_not_allowed")
            return error_response(404, f"no route for {request.method} {path}", code="not_found")
        return await self._proxy(request)

    # -- small endpoints ---------------------------------------------------------------------------------------------

    def _authorized(self, request: Request) -> bool:
        return self._api_keys.accepts(request.header("authorization"))

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self._created, "owned_by": "llmgw"}

    def _list_models(self) -> Response:
        return Response.json({"object": "list", "data": [self._model_card(n) for n in sorted(self.router.models)]})

    def _get_model(self, name: str) -> Response:
        if name not in self.router.models:
            return error_response(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return Response.json(self._model_card(name))

    # -- the proxy ---------------------------------------------------------------------------------------------------

    async def _proxy(self, request: Request) -> Response:
        started = _now()
        try:
            body = json.loads(request.body)
        except (ValueError, UnicodeDecodeError) as exc:
            return self._count(None, error_response(400, f"the request body is not valid JSON: {exc}",
                                                    code="invalid_json"))
        if not isinstance(body, dict):
            return self._count(None, error_response(400, "the request body must be a JSON object",
                                                    code="invalid_json"))
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return self._count(None, error_response(400, "the request needs a 'model' string", param="model",
                                                    code="missing_model"))
        if model not in self.router.models:
            return self._count(None, error_response(404, f"the model {model!r} does not exist", param="model",
                                                    code="model_not_found"))
        request_id = None
        forwarded = []
        for header in request.headers:  # one pass: find the request id, drop what is not forwarded
            name = header[0]
            if name in _DROP_REQUEST_HEADERS:
                if name == b"x-request-id" and request_id is None:
                    request_id = header[1].decode("latin-1")
            else:
                forwarded.append(header)
        if not request_id:
            request_id = self._ids.next()
        route_request = RouteRequest(model, request.path, body, request.headers, request_id)
        id_header = (b"x-request-id", request_id.encode("latin-1"))
        forwarded.append(id_header)

        tried: list[Replica] = []
        last_error: UpstreamError | None = None
        for attempt in range(1 + self.settings.retries):
            try:
                decision = await self.router.pick(route_request, exclude=tried)
                if decision is None:
                    break
                replica = decision.replica
                tried.append(replica)
                if attempt:
                    self.metrics.for_model(model).retries.inc()
                outcome = await self._attempt(replica, request, forwarded, is_last=attempt == self.settings.retries)
            except BaseException:  # cancelled before any answer: the client went away (or the server stops)
                self._count(model, None, started, 499)
                self.metrics.for_model(model).client_disconnects.inc()
                raise
            if isinstance(outcome, UpstreamError):
                last_error = outcome
                if outcome.kind == "timeout":
                    break  # the engine may still be working on it: sending it again would double the work
                continue
            self.router.routed(route_request, decision)
            return await self._relay(outcome, replica, decision, route_request, started, id_header)
        return self._count(model, self._no_replica_error(model, last_error, tried), started)

    async def _attempt(self, replica: Replica, request: Request, headers: list[tuple[bytes, bytes]],
                       is_last: bool) -> UpstreamResponse | UpstreamError:
        """Send the request to one replica; an error or a retryable 5xx comes back as an UpstreamError."""
        if replica.auth_header is not None:
            headers = headers + [replica.auth_header]
        self._load(replica, +1)
        try:
            upstream = await replica.pool.request(
                request.method, replica.base_path + request.target, headers, request.body,
                first_byte_timeout=self.settings.first_byte_timeout, idle_timeout=self.settings.idle_timeout)
        except UpstreamError as exc:
            self._load(replica, -1)
            self._failed(replica, exc.kind, str(exc))
            return exc
        except BaseException:
            self._load(replica, -1)
            raise
        if upstream.status >= 500 and not is_last:
            self._load(replica, -1)
            await upstream.aclose()
            self._failed(replica, "status_5xx", f"HTTP {upstream.status}")
            return UpstreamError("status_5xx", f"replica {replica.name} answered HTTP {upstream.status}")
        return upstream

    async def _relay(self, upstream: UpstreamResponse, replica: Replica, decision: Decision,
                     route_request: RouteRequest, started: float, id_header: tuple[bytes, bytes]) -> Response:
        self.metrics.for_model(route_request.model).ttfb.observe(_now() - started)
        headers = [h for h in upstream.headers if h[0] not in _DROP_RESPONSE_HEADERS]
        headers.append(id_header)
        name = self._replica_names.get(replica.name)
        if name is None:
            name = self._replica_names[replica.name] = replica.name.encode()
        headers.append((b"x-llmgw-replica", name))
        if upstream.status >= 500:
            self._failed(replica, "status_5xx", f"HTTP {upstream.status}")
        else:
            self.health.request_succeeded(replica)
        length = None
        for header in headers:
            if header[0] == b"content-length":
                length = header[1]
                break
        if length is not None and length.isdigit() and int(length) <= INLINE_BODY_LIMIT:
            try:
                data = await upstream.read()
            except UpstreamError as exc:
                self._failed(replica, exc.kind, str(exc))
                self._finish(replica, decision, route_request, started, 502)
                return error_response(502, f"replica {replica.name} failed while sending its answer: {exc}",
                                      headers=[id_header])
            except BaseException:
                self._finish(replica, decision, route_request, started, 499)
                raise
            usage = usage_of_body(data) if upstream.status == 200 and self.router.wants_usage(
                route_request.model) else None  # only for tiers that ask (kv_index): no parse otherwise
            self._finish(replica, decision, route_request, started, upstream.status, usage)
            return Response(upstream.status, headers, data)
        return Response(upstream.status, headers,
                        self._stream(upstream, replica, decision, route_request, started))

    async def _stream(self, upstream: UpstreamResponse, replica: Replica, decision: Decision,
                      route_request: RouteRequest, started: float) -> AsyncIterator[bytes]:
        status = upstream.status
        recent: list[bytes] | None = [] if status == 200 and self.router.wants_usage(route_request.model) else None
        try:
            while piece := await upstream.receive_piece():
                if recent is not None:  # the last pieces (references), for the final usage chunk
                    recent.append(piece)
                    if len(recent) > STREAM_TAIL_PIECES:
                        del recent[0]
                yield piece
        except UpstreamError as exc:
            self._failed(replica, exc.kind, str(exc))
            log.warning("replica %s broke off a streamed answer (request %s): %s", replica.name,
                        route_request.request_id, exc)
            status = 502
            raise AbortConnection(str(exc)) from None
        except BaseException:
            status = 499
            self.metrics.for_model(route_request.model).client_disconnects.inc()
            raise
        finally:
            await upstream.aclose()
            usage = usage_of_stream_tail(recent) if recent and status == 200 else None
            self._finish(replica, decision, route_request, started, status, usage)

    # -- bookkeeping -------------------------------------------------------------------------------------------------

    def _load(self, replica: Replica, delta: int) -> None:
        replica.inflight += delta
        bound = self.metrics.for_replica(replica.name)
        if bound.inflight_of is not replica:
            bound.track_inflight(replica)

    def _failed(self, replica: Replica, kind: str, reason: str) -> None:
        self.metrics.upstream_errors.labels(replica.name, kind).inc()
        self.health.request_failed(replica, reason)

    def _finish(self, replica: Replica, decision: Decision, route_request: RouteRequest, started: float,
                status: int, usage: dict | None = None) -> None:
        self._load(replica, -1)
        replica.served += 1
        self._count(route_request.model, None, started, status)
        self.router.finished(route_request, decision, usage)

    def _count(self, model: str | None, response: Response | None, started: float | None = None,
               status: int | None = None) -> Response | None:
        bound = self.metrics.for_model(model or "unknown")
        bound.requests(status if status is not None else response.status).inc()
        if started is not None:
            bound.request_duration.observe(_now() - started)
        return response

    def _no_replica_error(self, model: str, last_error: UpstreamError | None, tried: list[Replica]) -> Response:
        if last_error is not None and last_error.kind == "timeout":
            return error_response(504, f"replica {tried[-1].name} did not answer in time: {last_error}",
                                  code="upstream_timeout")
        retry_after = [(b"retry-after", str(self.settings.retry_after_seconds).encode())]
        if last_error is not None:
            names = ", ".join(r.name for r in tried)
            return error_response(503, f"no replica of {model!r} could take the request (tried {names}; "
                                       f"last error: {last_error})", code="no_healthy_replica", headers=retry_after)
        return error_response(503, f"no healthy replica of {model!r} is available", code="no_healthy_replica",
                              headers=retry_after)
