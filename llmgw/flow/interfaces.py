"""The seams of overload control, as Protocols: the room (how much more each model's replicas can take now) and
the flow control the data plane calls.

The data plane, for a request of model M::

    outcome = await flow.enter(request)          # FlowRequest; waits while M has no room for its class
    if isinstance(outcome, Shed): answer 429 with Retry-After
    else: route it; flow.release(outcome) as soon as it is routed (or abandoned)

The queue never waits on Redis: the room reads local figures (the engines' scraped state, this gateway's and
the other gateways' in-flight counts, shared through the load stream) and wakes the queue when they change.
"""

from __future__ import annotations

from typing import Protocol

from .model import Admitted, FlowRequest, PriorityClass, Shed


class Room(Protocol):
    def free(self, model: str, priority: PriorityClass) -> int:
        """How many more requests of ``priority`` this gateway may dispatch to ``model``'s replicas now (0: hold
        them): the replicas' learnt room less what is in flight on them (this gateway's routed requests and the
        other gateways'), and this gateway's share of it when other gateways have requests waiting too. The queue's
        own admitted requests not yet released (not yet routed) are not in it: the queue subtracts those itself."""

    def fits(self, model: str, priority: PriorityClass, tokens: int, output: int = 0) -> bool:
        """Whether ``tokens`` more KV tokens (a request's prompt and most output, with those admitted and not yet
        routed) of ``priority`` fit on ``model``'s replicas now: the tokens in flight there stay within the class's
        share of their KV capacity. ``output``: the part of ``tokens`` that is output allowance, counted as it is;
        the rest is prompt estimate, counted in the engines' tokens. True while that capacity is unknown."""

    def admits(self, model: str, priority: PriorityClass, pending: int, tokens: int, output: int = 0) -> bool:
        """``free(model, priority) - pending > 0 and fits(model, priority, tokens, output)``: what the queue asks for
        every request (``pending``: its admitted requests not yet released; ``tokens``: theirs and the request's,
        ``output`` of which is output allowance). A room may answer it in one pass over the replicas; this default
        asks both."""
        return self.free(model, priority) - pending > 0 and self.fits(model, priority, tokens, output)

    async def changed(self, model: str) -> None:
        """Return when ``model``'s room may have changed (a request finished, an engine was scraped, a replica
        came or went, a peer's report arrived); at the latest after a short poll interval."""

    def wake(self, model: str) -> None:
        """Something changed ``model``'s room (the data plane calls it when a request there ended): wake
        :meth:`changed`'s waiters. Never blocks."""

    def saturation(self, model: str) -> float:
        """0.0 idle .. 1.0 full and beyond, for the metrics and /admin/explain."""

    def ramping(self, model: str) -> bool:
        """Whether a replica of ``model`` is taking the requests held for it in a ramp (llmgw/flow/ramp.py): their
        dispatch is paced, so a drain rate measured meanwhile says nothing of how fast they will go. This default:
        never."""
        return False


class FlowControl(Protocol):
    async def enter(self, request: FlowRequest) -> Admitted | Shed:
        """Admit ``request`` when its model has room for it and it is next in band and flow order; shed it
        (429) when its deadline passes or the queue overflows. Cancellation (the client left) removes it."""

    def release(self, admitted: Admitted) -> None:
        """The admitted request was routed (its replica's in-flight count holds it now) or abandoned."""
