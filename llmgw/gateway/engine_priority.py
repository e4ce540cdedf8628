"""A request's ``priority`` for an engine that runs vLLM's priority scheduling, and the body that carries it.

The gateway's bands order only what waits at the gateway; an engine started with ``--scheduling-policy priority``
(a profile's or replica's ``scheduling_policy: priority``) orders its own waiting requests by the ``priority``
field of each body, lower first. Sent to such a replica, a request carries its class's ``engine_priority`` (by
default the class's rank). A client's own ``priority`` is kept only when its key may raise its class (the priority
header's rule, docs/overload.md), and never more urgent than its class's; any other client value is replaced.
To an engine in ``fcfs`` the body goes as the client sent it (vLLM answers a priority other than 0 with a 400).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..flow.model import PriorityClass
from ..tenancy.model import Tenant
from .stream_usage import encode_body, usage_forced_body

FIELD = "priority"
# The paths whose bodies vLLM reads a priority from and the simulator serves (its generation endpoints).
PRIORITY_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
BOUND = 1 << 63  # vLLM carries it to its engine core as a signed 64-bit integer


def engine_priority(priority: PriorityClass, tenant: Tenant | None, body: Mapping[str, object]) -> int:
    """The ``priority`` to send: the class's, or the client's own integer when its key may raise its class and
    the value is no more urgent than the class's (a more urgent one is taken as the class's)."""
    own = priority.engine_rank
    asked = body.get(FIELD)
    if tenant is not None and tenant.may_raise_priority and type(asked) is int and -BOUND <= asked < BOUND:
        return max(asked, own)
    return own


def prioritized_body(path: str, body: Mapping[str, object], value: int, force_usage: bool) -> bytes:
    """The client's body with ``priority`` set to ``value``; with ``force_usage``, also asking a stream's usage
    (:func:`llmgw.gateway.stream_usage.usage_forced_body`), as the body it replaces did."""
    sent = {**body, FIELD: value}
    if force_usage:
        forced = usage_forced_body(path, sent)
        if forced is not None:
            return forced
    return encode_body(sent)
