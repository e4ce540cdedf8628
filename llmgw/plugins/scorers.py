"""The built-in replica scorers, ``prefix`` and ``load``, for scoring tiers such as ``prefix_tree``.

Each rates every candidate in [0, 1], higher is better; a tier adds them up
with the weights of ``routing_options.scorers``. Registered through the
``register_scorers`` hook, like a third party's (this module's hook is
registered by the ``prefix_tree`` plugin's entry point).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..plugin import Replica, RouteRequest, ScoreContext, hookimpl

DEFAULT_MAX_IMBALANCE = 4
DEFAULT_LOAD_TOKEN_SCALE = 8192


class PrefixScorer:
    """The share of the request's canonical text the replica is believed to hold: matched / length."""

    name = "prefix"

    def __init__(self, options: Mapping[str, Any] | None = None):
        pass

    def score(self, request: RouteRequest, candidates: Sequence[Replica], context: ScoreContext) -> list[float]:
        length = context.prompt_chars
        if not length:
            return [0.0] * len(candidates)
        return [matched / length for matched in context.matched_chars]


class LoadScorer:
    """1 for the least loaded candidates, falling linearly to 0 at ``max_imbalance`` requests more.

    The mean of two terms, each relative to the least loaded candidate:
    in-flight requests (``context.loads``) over ``max_imbalance``, and
    in-flight prompt tokens over ``load_token_scale``; each capped at 1.
    """

    name = "load"
    option_keys = ("max_imbalance", "load_token_scale")

    def __init__(self, options: Mapping[str, Any] | None = None):
        options = options or {}
        self.request_scale = float(options.get("max_imbalance") or DEFAULT_MAX_IMBALANCE)
        self.token_scale = float(options.get("load_token_scale") or DEFAULT_LOAD_TOKEN_SCALE)

    def score(self, request: RouteRequest, candidates: Sequence[Replica], context: ScoreContext) -> list[float]:
        loads, tokens = context.loads, context.inflight_tokens
        least_load, least_tokens = min(loads), min(tokens)
        request_scale, token_scale = self.request_scale, self.token_scale
        return [1.0 - 0.5 * min(1.0, (load - least_load) / request_scale)
                - 0.5 * min(1.0, (token - least_tokens) / token_scale)
                for load, token in zip(loads, tokens)]


@hookimpl
def register_scorers():
    return {"prefix": PrefixScorer, "load": LoadScorer}
