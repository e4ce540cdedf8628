"""Readiness (``GET /ready``), apart from liveness (``/health``): may a load balancer send this gateway requests?

Ready (200) when every model (or each one a ``?model=a&model=b`` query names, adapters included) has a routable
replica, the gateway is not draining, and a ``--role gateway`` process has loaded the cluster's shared state;
otherwise 503 with the reasons. One call looks at each model's replicas once and stops at the first routable
one: its work is bounded by the config, and a query names at most :data:`MAX_QUERY_MODELS` models. Answered on
the data port and the control port alike (docs/cli.md#health-and-readiness).
"""

from __future__ import annotations

from typing import Any, Callable
from urllib.parse import parse_qsl

from ..router.router import Router

MAX_QUERY_MODELS = 64  # models one /ready query may name
MAX_LISTED = 100  # model names an answer lists per reason (the counts are always whole)


class QueryError(ValueError):
    """A ``/ready`` query that cannot be read: answered 400."""


def query_models(query: str) -> list[str]:
    """The models a ``/ready`` query string names (``model=a&model=b``, URL-encoded), in order, without repeats;
    empty for no query. :class:`QueryError` for another parameter, an empty name or too many names."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query),
                          max_num_fields=MAX_QUERY_MODELS)
    except ValueError as exc:
        too_many = "Max number of fields" in str(exc)
        raise QueryError(f"name at most {MAX_QUERY_MODELS} models" if too_many
                         else "the query must be model=NAME pairs joined by '&'") from None
    names: dict[str, None] = {}
    for key, value in pairs:
        if key != "model":
            raise QueryError(f"unknown parameter {key[:64]!r}: /ready takes only model=NAME")
        if not value:
            raise QueryError("model= needs a model name")
        names[value] = None
    return list(names)


class Readiness:
    """Answers ``/ready`` from the router's models and replicas, ``draining()`` and ``state_loaded()``."""

    def __init__(self, router: Router, draining: Callable[[], bool], state_loaded: Callable[[], bool]):
        self.router = router
        self.draining = draining
        self.state_loaded = state_loaded

    def answer(self, query: str) -> tuple[int, dict[str, Any]]:
        """``(status, JSON body)``: 200 ready, 503 not ready (with the reasons), 400 for an unreadable query."""
        try:
            asked = query_models(query)
        except QueryError as exc:
            return 400, {"error": {"message": str(exc), "type": "invalid_request_error", "param": "model",
                                   "code": "invalid_parameter"}}
        draining, loaded = self.draining(), self.state_loaded()
        names = asked or list(self.router.models)
        unknown: list[str] = []
        without: list[str] = []
        for name in names:
            resolved = self.router.resolve(name)
            if resolved is None:
                unknown.append(name)
            elif not any(replica.routable for replica in self.router.models[resolved[0]].replicas):
                without.append(name)
        ready = not (draining or not loaded or unknown or without or not names)
        body: dict[str, Any] = {"ready": ready, "models": len(names), "draining": draining, "state_loaded": loaded,
                                "models_without_replica": without[:MAX_LISTED], "unknown_models": unknown[:MAX_LISTED]}
        if not names:
            body["reason"] = "no models are configured or known yet"
        return (200 if ready else 503), body
