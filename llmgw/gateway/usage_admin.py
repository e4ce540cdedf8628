"""``GET /admin/usage``: usage per key, team, model and hour from the usage store, as JSON or CSV.

Parameters (all optional; :mod:`llmgw.tenancy.usage_query`): ``key`` (an id or a name), ``team`` (empty: keys of
no team), ``model``, ``since`` and ``until`` (epoch seconds, ISO 8601, or a duration ago such as ``24h``; the last
day by default), ``group_by`` (a comma-separated list of key, team, model, hour; default ``key,model``) and
``format`` (``json`` or ``csv``). A wrong one is a 400 naming it; a store that does not answer a 503. Registered
by :func:`llmgw.gateway.admin.create_control_app`, behind the admin tokens like every ``/admin`` path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import trio
from quart import Response, jsonify, request
from quart_trio import QuartTrio

from ..http.messages import error_body
from ..tenancy.usage_query import QueryError, parse_query
from ..tenancy.usage_store import StoreUnavailable

if TYPE_CHECKING:
    from ..tenancy.usage_service import UsageService

QUERY_SECONDS = 30.0  # the longest a usage query may take (a long range read from Redis)


def _error(status: int, message: str, code: str, param: str | None = None) -> Response:
    return Response(error_body(status, message, param=param, code=code), status=status,
                    content_type="application/json")


def register_usage_routes(app: QuartTrio, usage: Callable[[], UsageService]) -> None:
    @app.get("/admin/usage")
    async def usage_report():
        """Usage summed per group over the range asked (:mod:`llmgw.gateway.usage_admin`)."""
        try:
            query = parse_query({name: request.args.get(name, "") for name in request.args})
        except QueryError as exc:
            return _error(400, str(exc), "invalid_usage_query", exc.param)
        try:
            with trio.fail_after(QUERY_SECONDS):
                kind, body = await usage().answer(query)
        except StoreUnavailable as exc:
            return _error(503, f"the usage store does not answer: {exc}", "usage_store_unavailable")
        except trio.TooSlowError:
            return _error(503, f"the usage store did not answer within {QUERY_SECONDS:g}s; ask a shorter range",
                          "usage_store_unavailable")
        if kind == "csv":
            return Response(body, content_type="text/csv; charset=utf-8",
                            headers={"Content-Disposition": 'attachment; filename="llmgw-usage.csv"'})
        return jsonify(body)
