"""How long each side of an agent's session waits, all derived from the heartbeat interval in this one place.

The control plane heartbeats every ``heartbeat_interval`` (it tells the agent
in ``Registered``). From that interval:

- a control plane that just started waits :func:`adoption_window` for agents
  to report their running engines before it places new ones;
- an agent gives a session up after :func:`silence_limit` without a message
  (a frozen or cut-off control plane), and dials again;
- it dials again after a backoff that starts at :data:`BACKOFF_FIRST` after a
  session it was registered on, doubling up to :func:`backoff_cap`, and gives
  a dial that gets no answer up after :func:`dial_timeout` (a frozen process
  takes the TCP connection and never answers the upgrade: the next address is
  dialled);
- a cluster's new leader holds the replicas it followed from the previous one
  for :func:`hold_window`, long enough for every agent of the old leader to
  come over before anything held is dropped. The old leader may keep its
  term (and its sessions) up to ``lease_ttl`` into the new one (its lease was
  deleted, forged, or lost with Redis's data: it learns so at its next
  renewal, then closes its sessions); a frozen old leader closes nothing, and
  its agents notice only after their silence limit. So: the silence limit,
  plus the lease, plus one reconnect backoff, plus a round trip's margin.
"""

from __future__ import annotations

BACKOFF_FIRST = 0.05  # the first reconnect delay (and the one after a session that was registered)
BACKOFF_CAP = 5.0  # the most an agent ever waits between two dials
HOLD_MARGIN = 1.0  # the close of the silent connection (0.5 s), a dial, a Register's round trip, a reconcile
DIAL_MARGIN = 2.0  # what a live but loaded control plane may take to answer a dial beyond a heartbeat interval
DEFAULT_HEARTBEAT = 5.0  # agents.heartbeat_interval's default: what an agent assumes before a Registered says


def dial_timeout(heartbeat_interval: float) -> float:
    """How long an agent waits for a dial (TCP, TLS, the websocket upgrade) to be answered: a heartbeat interval
    plus :data:`DIAL_MARGIN`, no more than :func:`silence_limit` (a control plane that answers nothing for that
    long is given up in a session too)."""
    return min(heartbeat_interval + DIAL_MARGIN, silence_limit(heartbeat_interval))


def silence_limit(heartbeat_interval: float) -> float:
    """How long an agent waits for any message before it gives the session up: three heartbeats, and at least
    five seconds more than one (a loaded control plane may be late)."""
    return max(3 * heartbeat_interval, heartbeat_interval + 5.0)


def backoff_cap(heartbeat_interval: float) -> float:
    """The longest reconnect delay: a heartbeat interval (at least the first step, at most :data:`BACKOFF_CAP`)."""
    return min(BACKOFF_CAP, max(heartbeat_interval, BACKOFF_FIRST))


def next_backoff(delay: float, heartbeat_interval: float) -> float:
    """The reconnect delay after ``delay`` failed again."""
    return min(delay * 2, backoff_cap(heartbeat_interval))


def adoption_window(heartbeat_interval: float) -> float:
    """How long a control plane that just started waits for agents to re-register (and report the engines it may
    adopt) before it places anything new: every agent heartbeats within one interval, plus a second."""
    return heartbeat_interval + 1.0


def hold_window(heartbeat_interval: float, lease_ttl: float) -> float:
    """How long a new leader keeps the replicas it followed in routing, waiting for their agents to re-register:
    the agents' silence limit, the lease (that much of the silence may fall after this term's start), one dial of
    the old leader that gets no answer (an agent tries its addresses in turn), and one reconnect backoff, plus
    :data:`HOLD_MARGIN`."""
    return (silence_limit(heartbeat_interval) + lease_ttl + dial_timeout(heartbeat_interval)
            + backoff_cap(heartbeat_interval) + HOLD_MARGIN)
