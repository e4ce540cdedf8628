"""Readiness (``GET /ready``), apart from liveness (``/health``): may a load balancer send this gateway requests?

Ready (200) when every model (or each one a ``?model=a&model=b`` query names, adapters included) has a routable
replica, the gateway is not draining, and a ``--role gateway`` process has loaded the cluster's shared state;
otherwise 503 with the reasons, each in words (``reasons``), besides the fields a script reads. One call looks at
each model's replicas once and stops at the first routable one: its work is bounded by the config, and a query names
at most :data:`MAX_QUERY_MODELS` models. Answered on the data port and the control port alike (docs/cli.md, "Health and
readiness"); on the data port, with ``api_keys``, a caller without a key learns no model's name
(:meth:`Readiness.answer`'s ``names``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence
from urllib.parse import parse_qsl

from ..router.router import Router

MAX_QUERY_MODELS = 64  # models one /ready query may name
MAX_LISTED = 100  # model names an answer lists per reason (the counts are always whole)
NO_MODELS = "no models are configured or known yet"


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


def _named(names: Sequence[str], shown: bool) -> str:
    """``'a', 'b' (and 3 more)``, or ``3 models`` when names are not ``shown``."""
    if not shown:
        return f"{len(names)} model{'s' if len(names) != 1 else ''}"
    listed = ", ".join(repr(name) for name in names[:MAX_LISTED])
    return listed + (f" (and {len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else "")


class Readiness:
    """Answers ``/ready`` from the router's models and replicas, ``draining()`` and ``state_loaded()``;
    ``cluster_reasons(detailed)``: why the shared state is not to be trusted now (:mod:`.health_report`), added
    to the reasons of an answer that is not ready."""

    def __init__(self, router: Router, draining: Callable[[], bool], state_loaded: Callable[[], bool],
                 cluster_reasons: Callable[[bool], list[str]] = lambda detailed: []):
        self.router = router
        self.draining = draining
        self.state_loaded = state_loaded
        self.cluster_reasons = cluster_reasons
        # ``holds(model)``: an autoscaled model, ready at 0 replicas (its requests wait for the first one).
        self.holds: Callable[[str], bool] = lambda model: False

    def answer(self, query: str, names: bool = True, detailed: bool = True) -> tuple[int, dict[str, Any]]:
        """``(status, JSON body)``: 200 ready, 503 not ready (with the reasons), 400 for an unreadable query.
        ``names``: the answer may name models (False: counts only, for a caller without an API key);
        ``detailed``: the cluster's reasons may name Redis's address and error (False on the data port)."""
        try:
            asked = query_models(query)
        except QueryError as exc:
            return 400, {"error": {"message": str(exc), "type": "invalid_request_error", "param": "model",
                                   "code": "invalid_parameter"}}
        draining, loaded = self.draining(), self.state_loaded()
        wanted = asked or list(self.router.models)
        unknown: list[str] = []
        without: list[str] = []
        for name in wanted:
            resolved = self.router.resolve(name)
            if resolved is None:
                unknown.append(name)
            elif not self.router.has_routable_replica(resolved[0]) and not self.holds(resolved[0]):
                without.append(name)
        reasons: list[str] = []
        if draining:
            reasons.append("the gateway is draining (it was asked to stop): it takes no new requests")
        if not loaded:
            reasons.append("this process follows the cluster's shared state and has not loaded it yet: it knows "
                           "no deployed model")
        if not wanted:
            reasons.append(NO_MODELS)
        if unknown:
            reasons.append(f"not known here: {_named(unknown, names)}")
        if without:
            reasons.append(f"no routable replica (every replica down, draining or not placed yet) for "
                           f"{_named(without, names)}")
        ready = not reasons
        if not ready:
            reasons += self.cluster_reasons(detailed)
        body: dict[str, Any] = {"ready": ready, "models": len(wanted), "draining": draining, "state_loaded": loaded,
                                "reasons": reasons}
        if names:
            body |= {"models_without_replica": without[:MAX_LISTED], "unknown_models": unknown[:MAX_LISTED]}
        else:
            body |= {"models_without_replica_count": len(without), "unknown_models_count": len(unknown)}
        if not wanted:
            body["reason"] = NO_MODELS
        return (200 if ready else 503), body
