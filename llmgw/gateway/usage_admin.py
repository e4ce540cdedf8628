"""``GET /admin/usage``: usage per key, team, model, priority class and hour from the usage store, as JSON or
CSV.

Parameters (all optional; :mod:`llmgw.tenancy.usage_query`): ``key`` (an id or a name), ``team`` (empty: keys of
no team), ``model``, ``class`` (a priority class; empty: requests that did not go through the gateway's queue),
``since`` and ``until`` (epoch seconds, ISO 8601, or a duration ago such as ``24h``; the last
day by default), ``group_by`` (a comma-separated list of key, team, model, class, hour; default ``key,model``) and
``format`` (``json`` or ``csv``). A wrong one is a 400 naming it; a store that does not answer a 503.

``GET /admin/usage/budgets``: every budget of a key or a team with what it spent in its current period (from the
usage store: settled usage, not the reservations in flight), for the status page. Registered by
:func:`llmgw.gateway.admin.create_control_app`, behind the admin tokens like every ``/admin`` path.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable

import trio
from quart import Response, jsonify, request
from quart_trio import QuartTrio

from ..http.messages import error_body
from ..tenancy.model import Limits, nano_to_usd
from ..tenancy.usage_query import QueryError, parse_query
from ..tenancy.usage_store import StoreUnavailable

if TYPE_CHECKING:
    from .app import Gateway

QUERY_SECONDS = 30.0  # the longest a usage query may take (a long range read from Redis)


def _error(status: int, message: str, code: str, param: str | None = None) -> Response:
    return Response(error_body(status, message, param=param, code=code), status=status,
                    content_type="application/json")


def budgets_json(budgeted: Iterable[tuple[str, str, str, Limits]], spent: dict[tuple[str, str, str], tuple[int, int]]
                 ) -> list[dict[str, Any]]:
    """One entry per budget of ``budgeted`` (kind, id, name, limits): its limit and what was spent against it."""
    answer = []
    for kind, ident, name, limits in budgeted:
        for budget in limits.budgets:
            tokens, nano = spent.get((kind, ident, budget.period), (0, 0))
            answer.append({"kind": kind, "id": ident, "name": name, "period": budget.period,
                           "tokens": budget.tokens, "tokens_spent": tokens,
                           "usd": None if budget.nano_usd is None else nano_to_usd(budget.nano_usd),
                           "usd_spent": nano_to_usd(nano)})
    return answer


def register_usage_routes(app: QuartTrio, gateway: Gateway) -> None:
    @app.get("/admin/usage")
    async def usage_report():
        """Usage summed per group over the range asked (:mod:`llmgw.gateway.usage_admin`)."""
        try:
            query = parse_query({name: request.args.get(name, "") for name in request.args})
        except QueryError as exc:
            return _error(400, str(exc), "invalid_usage_query", exc.param)
        try:
            with trio.fail_after(QUERY_SECONDS):
                kind, body = await gateway.tenancy.usage_service.answer(query)
        except StoreUnavailable as exc:
            return _error(503, f"the usage store does not answer: {exc}", "usage_store_unavailable")
        except trio.TooSlowError:
            return _error(503, f"the usage store did not answer within {QUERY_SECONDS:g}s; ask a shorter range",
                          "usage_store_unavailable")
        if kind == "csv":
            return Response(body, content_type="text/csv; charset=utf-8",
                            headers={"Content-Disposition": 'attachment; filename="llmgw-usage.csv"'})
        return jsonify(body)

    @app.get("/admin/usage/budgets")
    async def usage_budgets():
        """Every key's and team's budgets with their spend in the current period."""
        gateway_tenancy, directory = gateway.tenancy, gateway.directory
        budgeted = [("team", team.name, team.name, team.limits) for team in directory.teams() if team.limits.budgets]
        budgeted += [("key", key.key_id, key.name, key.limits) for key in directory.keys() if key.limits.budgets]
        if not budgeted:
            return jsonify({"budgets": []})
        settings = gateway_tenancy.gate.tenancy.settings
        try:
            with trio.fail_after(QUERY_SECONDS):
                rows = await gateway_tenancy.usage_service.budget_spent(settings, time.time())
        except StoreUnavailable as exc:
            return _error(503, f"the usage store does not answer: {exc}", "usage_store_unavailable")
        except trio.TooSlowError:
            return _error(503, f"the usage store did not answer within {QUERY_SECONDS:g}s", "usage_store_unavailable")
        spent = {(row.kind, row.name, row.period): (row.tokens, row.nano_usd) for row in rows}
        return jsonify({"budgets": budgets_json(budgeted, spent)})
