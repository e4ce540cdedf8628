"""The value types of overload control: priority classes, the settings, one request's flow, and what became of it.

A *class* is a band: bands are served strictly in order of ``rank`` (0 first); within a band, *flows* (a
tenant: its team, else its key; ``anonymous`` without keys) share the room fairly by tokens, in proportion to
their ``weight``. A request waits at most its class's ``max_wait`` (a client deadline may shorten it) and is
then answered 429 with ``Retry-After``.

Every type here is immutable but :class:`FlowRequest`, which the queue fills in as the request waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ANONYMOUS = "anonymous"  # the flow of a request without an API key


@dataclass(frozen=True, slots=True)
class PriorityClass:
    name: str
    rank: int  # bands are served strictly by rank, 0 first
    max_wait: float  # seconds a request of this class may wait at the gateway before it is shed (429)
    # The share of a model's room this class may fill (1.0: all of it). Below 1.0 the rest is kept for the classes
    # ranked above it, so that their arrivals find room at once instead of waiting for a long stream to end.
    max_fill: float = 1.0
    # The ``priority`` its requests carry to an engine that runs vLLM's priority scheduling (lower is served first);
    # None: its rank.
    engine_priority: int | None = None

    @property
    def engine_rank(self) -> int:
        """The ``priority`` an engine in priority scheduling is given for this class's requests."""
        return self.rank if self.engine_priority is None else self.engine_priority


DEFAULT_CLASSES = (
    PriorityClass("interactive", 0, max_wait=2.0),
    PriorityClass("standard", 1, max_wait=10.0, max_fill=0.95),
    PriorityClass("batch", 2, max_wait=60.0, max_fill=0.85),
    PriorityClass("best-effort", 3, max_wait=30.0, max_fill=0.75),
)
DEFAULT_CLASS = "standard"


@dataclass(frozen=True, slots=True)
class FlowSettings:
    """The ``flow`` section of the config (llmgw/config/schema.py maps it here)."""

    enabled: bool = True
    classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES
    default_class: str = DEFAULT_CLASS  # the class of a request whose key, team and header name none
    priority_header: str = "x-llmgw-priority"  # a request may lower its class with it; raise it only if its key may
    max_queued: int = 10_000  # requests waiting per model, all classes; beyond it the lowest class waiting is shed
    max_queued_tokens: int = 50_000_000  # their estimated tokens, likewise
    retry_after_min: int = 1  # seconds, the bounds of a shed request's Retry-After
    retry_after_max: int = 60

    def by_name(self) -> dict[str, PriorityClass]:
        return {c.name: c for c in self.classes}


@dataclass(slots=True, eq=False)
class FlowRequest:
    """One request as the queue sees it."""

    model: str
    flow: str  # the fairness id: the tenant's team, else its key name; ANONYMOUS without keys
    priority: PriorityClass
    cost: int  # estimated tokens (prompt + output): what fair shares are counted in
    deadline: float  # trio.current_time() after which it is shed rather than dispatched
    weight: float = 1.0  # the flow's share within its band
    # Of ``cost``, the output allowance (``max_tokens``): the room scales the prompt part alone by the engines'
    # prompt-token ratio. 0: all of it is taken as prompt (scaled whole, the safe side).
    output: int = 0
    enqueued: float | None = None  # trio.current_time() when it started waiting (None: dispatched at once)
    # Its prompt in the router's estimate (characters / 4), the one the requests in flight are counted in and the
    # engines' prompt-token ratio is learnt against: the room counts it so, with ``output``. None: the prompt part
    # of ``cost`` (the tenancy's estimate, one token per body byte: about 4 times the router's, docs/overload.md).
    prompt: int | None = None


@dataclass(frozen=True, slots=True)
class Admitted:
    """Dispatch it now. ``waited``: seconds it spent in the queue (0.0 when there was room at once). ``release``
    must be called exactly once when the request is routed (the replica's in-flight count then holds its place)
    or abandoned; until then its place in the room is held for it."""

    waited: float
    ticket: object = field(default=None, repr=False)
    # Why it waited, for /admin/explain (all 0 / "" when it was dispatched at once), as it arrived: the requests
    # waiting in its band and the bands above, the tokens to be dispatched before it (those of the bands above,
    # and of its own band those the fair order puts first: its flow's, and the other flows' shares meanwhile), and
    # the highest class waiting ahead ("": none, it waited for room alone).
    position: int = 0
    tokens_ahead: int = 0
    ahead_class: str = ""


# Why a request was shed: its deadline passed waiting, the queue was full, or nothing can serve it soon enough.
EXPIRED, OVERFLOW, UNSERVABLE = "expired", "overflow", "unservable"


@dataclass(frozen=True, slots=True)
class Shed:
    """Answer 429 with ``Retry-After: retry_after`` (seconds, from the measured drain rate)."""

    reason: str  # EXPIRED, OVERFLOW or UNSERVABLE
    retry_after: int
    waited: float
    detail: str = ""  # for the error message and /admin/explain
    position: int = 0  # as Admitted's: what was waiting ahead of it when it arrived
    tokens_ahead: int = 0
    ahead_class: str = ""
