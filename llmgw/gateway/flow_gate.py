"""The data plane's side of overload control: a request's class, flow, cost and deadline; its turn from the queue;
a shed request's 429.

:class:`FlowGate` is built from the ``flow`` section (swapped whole on reload, over the same queue and room) and
read once per request. :meth:`FlowGate.enter` returns a :class:`Pass` (route it, then :meth:`Pass.release` once,
which later calls ignore) or the answer to give instead: a 400 for a priority header or a deadline it cannot read,
a 429 with ``Retry-After`` when the queue shed it. Each request that waited or was shed is kept, for
``/admin/explain?request_id=`` (:class:`FlowOutcomes`). docs/overload.md says how a request gets its class.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from ..flow.interfaces import FlowControl, Room
from ..flow.model import ANONYMOUS, EXPIRED, OVERFLOW, Admitted, FlowRequest, FlowSettings, PriorityClass, Shed
from ..http.messages import Request, Response, error_response
from ..tenancy.estimate import Estimator
from ..tenancy.model import PriceList, TenancySettings, Tenant
from ..tenancy.ratelimit_headers import retry_after_header

DEADLINE_HEADER = "x-request-deadline"  # absolute: Unix epoch seconds (a decimal number) the client gives up at
CLIENT_TIMEOUT_HEADER = "x-stainless-timeout"  # relative: the OpenAI SDKs' request timeout, in seconds
_DEADLINE_NAME, _CLIENT_TIMEOUT_NAME = DEADLINE_HEADER.encode(), CLIENT_TIMEOUT_HEADER.encode()
MAX_NUMBER_TEXT = 32  # characters of a deadline header read (a number needs far fewer)
RECENT_OUTCOMES = 1000  # requests that waited or were shed, kept for /admin/explain
# A shed request's error code, by the queue's reason: it waited its class's max_wait (or its own deadline), or
# would have (UNSERVABLE: the queue ahead of it drains too slowly); or the model's queue is full.
SHED_CODES = {EXPIRED: "queue_timeout", OVERFLOW: "queue_full"}
UNSERVABLE_CODE = "queue_timeout"


@dataclass(frozen=True, slots=True)
class FlowOutcome:
    """What overload control did with one request that waited or was shed (``/admin/explain?request_id=``)."""

    request_id: str
    request: FlowRequest
    outcome: Admitted | Shed
    at: float  # time.time()

    def to_json(self) -> dict[str, Any]:
        request, outcome = self.request, self.outcome
        shed = outcome if isinstance(outcome, Shed) else None
        return {"request_id": self.request_id, "model": request.model, "class": request.priority.name,
                "flow": request.flow, "cost_tokens": request.cost, "waited_ms": round(outcome.waited * 1000, 1),
                "outcome": "waited" if shed is None else "shed", "reason": shed and shed.reason,
                "retry_after": shed and shed.retry_after, "detail": (shed and shed.detail) or None,
                "position": outcome.position, "tokens_ahead": outcome.tokens_ahead,
                "ahead_class": outcome.ahead_class or None, "at": round(self.at, 3)}


class FlowTrace:
    """What overload control did with one request, for its access line: its class, its wait at the gateway
    (seconds; 0.0 when routed at once) and, when shed, the reason (``expired``, ``overflow``, ``unservable``). A
    plain class (one per request): a dataclass's ``__init__`` stays interpreted in the compiled build."""

    __slots__ = ("priority", "waited", "shed")

    def __init__(self) -> None:
        self.priority: str | None = None
        self.waited: float | None = None
        self.shed: str | None = None


class FlowOutcomes:
    """The last :data:`RECENT_OUTCOMES` requests that waited or were shed, by request id (a request routed at
    once is not kept: nothing happened to it)."""

    __slots__ = ("_by_id", "_size", "shared")

    def __init__(self, size: int = RECENT_OUTCOMES) -> None:
        self._by_id: OrderedDict[str, FlowOutcome] = OrderedDict()
        self._size = size
        self.shared: Callable[[FlowOutcome], None] | None = None  # each outcome handed on, for the other gateways

    def add(self, outcome: FlowOutcome) -> None:
        if self.shared is not None:
            self.shared(outcome)
        self._by_id[outcome.request_id] = outcome
        self._by_id.move_to_end(outcome.request_id)
        if len(self._by_id) > self._size:
            self._by_id.popitem(last=False)

    def get(self, request_id: str) -> FlowOutcome | None:
        return self._by_id.get(request_id)

    def recent(self, limit: int = 100) -> list[FlowOutcome]:
        """The newest first."""
        return list(reversed(self._by_id.values()))[:limit]


class Pass:
    """An admitted request's place in its model's room: :meth:`release` it once it is routed (its replica's
    in-flight count holds it then) or abandoned; later calls do nothing."""

    __slots__ = ("_control", "_admitted")

    def __init__(self, control: FlowControl | None, admitted: Admitted | None) -> None:
        self._control = control
        self._admitted = admitted

    def release(self) -> None:
        admitted = self._admitted
        if admitted is not None:
            self._admitted = None
            assert self._control is not None
            self._control.release(admitted)


OPEN = Pass(None, None)  # the pass of every request while flow control is off


class FlowGate:
    """One config's overload control as the data plane uses it (``flow.enabled: false``: :data:`OPEN` for all)."""

    __slots__ = ("settings", "control", "room", "outcomes", "estimator", "_classes", "_default", "_priority_header")

    def __init__(self, settings: FlowSettings, control: FlowControl | None, room: Room | None,
                 outcomes: FlowOutcomes | None = None, estimator: Estimator | None = None) -> None:
        """``control`` and ``room``: the queue and the room, which outlive a reload (None: flow control is off).
        ``estimator``: a request's tokens (prompt and most output) when no key's charge estimated them already,
        the tenancy's estimate of the same config (default: its defaults)."""
        self.settings = settings
        self.control = control if settings.enabled else None
        self.room = room
        self.outcomes = outcomes if outcomes is not None else FlowOutcomes()
        self.estimator = estimator if estimator is not None else Estimator(TenancySettings(), PriceList())
        self._classes = settings.by_name()
        self._default = self._classes[settings.default_class]
        self._priority_header = settings.priority_header.lower().encode("latin-1")  # as the server stores names

    def priority_of(self, tenant: Tenant | None, request: Request) -> PriorityClass | Response:
        """The request's class: its key's, else its team's, else ``default_class``; the priority header may
        lower it, and raise it only when the key (or its team) allows it. A 400 for a header naming no class."""
        return self._priority(tenant, request.header(self.settings.priority_header))

    def _priority(self, tenant: Tenant | None, asked: str | None) -> PriorityClass | Response:
        """:meth:`priority_of` with the priority header's value (``asked``; None: absent)."""
        own = self.own_class(tenant)
        if asked is None:
            return own
        wanted = self._classes.get(asked.strip())
        if wanted is None:
            return error_response(400, f"the header {self.settings.priority_header} names no priority class: "
                                       f"{asked[:64]!r} (the classes: {', '.join(self._classes)})",
                                  param=self.settings.priority_header, code="unknown_priority_class")
        if wanted.rank >= own.rank or (tenant is not None and tenant.may_raise_priority):
            return wanted
        return own  # a raise the key may not make: its own class, as if the header were absent

    def own_class(self, tenant: Tenant | None) -> PriorityClass:
        """The class of the request's key, else its team's, else ``default_class`` (no priority header read)."""
        named = tenant.class_name if tenant is not None else None
        # A key or team of the admin API may name a class a reload since removed: it gets the default then.
        return self._classes.get(named, self._default) if named is not None else self._default

    def engine_class(self, tenant: Tenant | None, request: Request, trace: FlowTrace | None) -> PriorityClass:
        """The class whose engine priority a request carries (:mod:`.engine_priority`): the one the queue gave it,
        else (flow control off, or a model it did not queue for) the one it would have had, its key's when its
        priority header names no class."""
        if trace is not None and trace.priority is not None:
            queued = self._classes.get(trace.priority)
            if queued is not None:
                return queued
        chosen = self.priority_of(tenant, request)
        return self.own_class(tenant) if isinstance(chosen, Response) else chosen

    def deadline(self, priority: PriorityClass, request: Request) -> float | Response:
        """When the request stops waiting, on Trio's clock: its class's ``max_wait`` from now, shortened by the
        client's own deadline (``x-request-deadline``: Unix epoch seconds; ``x-stainless-timeout``: seconds from
        now, as the OpenAI SDKs send it); never lengthened. A 400 for an ``x-request-deadline`` that is not a
        number."""
        return _deadline(priority, request.header(DEADLINE_HEADER), request.header(CLIENT_TIMEOUT_HEADER))

    async def enter(self, request: Request, tenant: Tenant | None, model: str, cost: int,
                    request_id: str, trace: FlowTrace | None = None, output: int = 0,
                    prompt: int | None = None) -> Pass | Response:
        """Wait for ``model``'s room in the request's class and flow: its :class:`Pass`, or the answer to give
        (400: a header it cannot read; 429: shed). Cancelled (the client left), it leaves the queue. ``trace``
        is filled in with its class, its wait and why it was shed. ``cost``: its estimated tokens, ``output`` of
        them its output allowance (:attr:`FlowRequest.output`); ``prompt``: its prompt in the router's estimate,
        what the room counts (:attr:`FlowRequest.prompt`)."""
        control = self.control
        if control is None:
            return OPEN
        # The three headers read in one pass over the request's (most requests carry none of them).
        asked: str | None = None
        absolute: str | None = None
        relative: str | None = None
        wanted = self._priority_header
        for name, value in request.headers:
            if name == wanted:
                if asked is None:
                    asked = value.decode("latin-1")
            elif name == _DEADLINE_NAME:
                if absolute is None:
                    absolute = value.decode("latin-1")
            elif name == _CLIENT_TIMEOUT_NAME and relative is None:
                relative = value.decode("latin-1")
        priority = self._priority(tenant, asked)
        if isinstance(priority, Response):
            return priority
        deadline = _deadline(priority, absolute, relative)
        if isinstance(deadline, Response):
            return deadline
        flow_request = FlowRequest(model, _flow_of(tenant), priority, cost, deadline, output=output, prompt=prompt)
        if trace is not None:
            trace.priority = priority.name
        outcome = await control.enter(flow_request)
        if trace is not None:
            trace.waited = outcome.waited
            if isinstance(outcome, Shed):
                trace.shed = outcome.reason
        if isinstance(outcome, Shed) or outcome.waited > 0:
            self.outcomes.add(FlowOutcome(request_id, flow_request, outcome, time.time()))
        if isinstance(outcome, Admitted):
            return Pass(control, outcome)
        return shed_response(outcome, model, priority)

    def ended(self, model: str) -> None:
        """A request to ``model`` ended (its replica's in-flight count fell): the room may have grown."""
        room = self.room
        if room is not None:
            room.wake(model)


def shed_response(shed: Shed, model: str, priority: PriorityClass) -> Response:
    """The 429 of a shed request, in OpenAI's shape as a tenant's limit refuses one (``type``
    ``rate_limit_exceeded``, SDKs retry it), its ``code`` saying why, with ``Retry-After``."""
    code = SHED_CODES.get(shed.reason, UNSERVABLE_CODE)
    if shed.reason == OVERFLOW:
        why = f"the queue of model {model!r} is full"
    elif shed.reason == EXPIRED:
        why = f"it waited {shed.waited:.1f}s for room on model {model!r}, its deadline (class {priority.name!r})"
    else:
        why = f"model {model!r} would not have room for it within its deadline (class {priority.name!r})" + \
            (f", found after it waited {shed.waited:.1f}s" if shed.waited > 0 else "")
    message = f"the gateway is overloaded: {why}" + (f"; {shed.detail}" if shed.detail else "") + \
        f"; retry after {shed.retry_after}s"
    return error_response(429, message, code=code, type_="rate_limit_exceeded",
                          headers=[retry_after_header(shed.retry_after)])


def _deadline(priority: PriorityClass, absolute: str | None, relative: str | None) -> float | Response:
    """:meth:`FlowGate.deadline` with the two headers' values (None: absent)."""
    wait = priority.max_wait
    if absolute is not None:
        at = _number(absolute)
        if at is None:
            return error_response(400, f"the header {DEADLINE_HEADER} must be a Unix time in seconds (a decimal "
                                       "number), the time the client stops waiting", param=DEADLINE_HEADER,
                                  code="invalid_deadline")
        wait = min(wait, at - time.time())
    if relative is not None:
        seconds = _number(relative)
        if seconds is not None and seconds > 0:  # not ours to refuse: the SDK's own header, read if it is sane
            wait = min(wait, seconds)
    return trio.current_time() + max(wait, 0.0)


def _flow_of(tenant: Tenant | None) -> str:
    """The fairness id: the tenant's team, else its key's name; :data:`ANONYMOUS` without a key."""
    if tenant is None:
        return ANONYMOUS
    team = tenant.team
    return team.name if team is not None else tenant.name


def _number(text: str) -> float | None:
    """A finite decimal number of at most :data:`MAX_NUMBER_TEXT` characters, else None."""
    if len(text) > MAX_NUMBER_TEXT:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
