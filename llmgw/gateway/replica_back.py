"""Waiting for a replica to come back: a held model's request whose replica failed with none left to try.

An autoscaled model's requests wait for a replica (docs/autoscaling.md): at zero they wait in the flow queue for
the first one. The same holds when its only replica goes away under them: its engine killed with requests inside
(which the data plane sends on once), or refusing connections while it restarts. Rather than answering 502 or 503
while the agent restarts the engine, such a request waits, up to its class's ``max_wait``, for a replica it may
be sent to: another one, or the one that failed once it has been seen down and routable again (its restarted
engine). Nothing here waits on the network: it polls the router's own view.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ..router.replica import Replica
from ..router.router import Router
from ..router.tier import Decision, RouteRequest

POLL = 0.05  # seconds between looks at the router's replicas (a local read)


async def wait_for_replica_back(router: Router, request: RouteRequest, tried: Sequence[Replica], until: float,
                                poll: float = POLL) -> Decision | None:
    """A decision for ``request`` once a replica may take it, at most until ``until`` (Trio's clock); None then.
    A replica in ``tried`` is a candidate again once it has been seen unroutable (it went down, so a routable one
    later is a new engine); until then it is not, as it may not have been marked down yet."""
    seen_down: set[str] = set()
    with trio.move_on_at(until):
        while True:
            seen_down.update(replica.name for replica in tried if not replica.routable)
            decision = await router.pick(request, exclude=[r for r in tried if r.name not in seen_down])
            if decision is not None:
                return decision
            await trio.sleep(poll)
    return None
