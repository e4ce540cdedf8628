"""The process's open-files limit: raised at start, and split into connection caps that stay below it.

Every client connection, engine connection, Redis link, ZMQ socket and file
takes a file descriptor, and the soft ``RLIMIT_NOFILE`` (often 1024) caps them
all together. :func:`raise_open_files_limit` raises the soft limit to the hard
one (``llmgw serve`` and ``llmgw agent`` do at start). :func:`connection_budget`
then splits the limit so that clients run out before engines do:

- ``FIXED_RESERVE`` descriptors for the process itself (listeners, Redis, ZMQ,
  engine pipes, logs, state files);
- of the rest, half for client connections and half for the engine
  connections those clients' requests open (so a port full of clients still
  reaches its engines);
- the clients' half split between the data port (three quarters) and the
  control port (a quarter), each capped by its configured upper bound
  (``limits.max_connections``, ``limits.control_max_connections``).

A port at its cap refuses new connections (see :mod:`llmgw.http.connslots`).
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

log = logging.getLogger(__name__)

FIXED_RESERVE = 128  # listeners, Redis, ZMQ, engine pipes, logs, state files: not client or engine connections
UNLIMITED_TARGET = 1 << 20  # where the hard limit is unlimited: raise the soft one this far (Linux's nr_open)


@dataclass(frozen=True)
class OpenFilesLimit:
    before: int  # the soft limit found at start
    soft: int  # the soft limit now
    hard: int  # the hard limit (resource.RLIM_INFINITY: unlimited)

    @property
    def raised(self) -> bool:
        return self.soft > self.before

    def describe(self) -> str:
        hard = "unlimited" if self.hard == resource.RLIM_INFINITY else str(self.hard)
        if self.raised:
            return f"open files: raised the soft limit from {self.before} to {self.soft} (hard limit {hard})"
        return f"open files: soft limit {self.soft} (hard limit {hard})"


def raise_open_files_limit() -> OpenFilesLimit:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (as far as the system lets); the figures."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else UNLIMITED_TARGET
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("open files: cannot raise the soft limit %d to %d: %s", soft, target, exc)
    return OpenFilesLimit(soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)


def current_soft_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return UNLIMITED_TARGET if soft == resource.RLIM_INFINITY else soft


@dataclass(frozen=True)
class ConnectionBudget:
    """How many client connections each port may hold, out of ``soft_limit`` descriptors."""

    soft_limit: int
    data: int  # the data port's cap
    control: int  # the control port's cap
    data_bound: int  # the configured upper bounds
    control_bound: int

    @property
    def reserve(self) -> int:
        """Descriptors left for engines, Redis, ZMQ and files when both ports are full."""
        return self.soft_limit - self.data - self.control

    def describe(self) -> str:
        return (f"connection caps: data port {self.data} (limits.max_connections {self.data_bound}), control port "
                f"{self.control} (limits.control_max_connections {self.control_bound}); {self.reserve} of the "
                f"{self.soft_limit} open files kept for engine connections, Redis, ZMQ and files")

    @property
    def too_low(self) -> bool:
        """The limit is too low for the reserve: every port gets a token cap, and engines may still run short."""
        return self.soft_limit < 2 * FIXED_RESERVE


def connection_budget(soft_limit: int, data_bound: int, control_bound: int) -> ConnectionBudget:
    """The per-port caps for ``soft_limit`` descriptors (see the module docstring); each at least 1."""
    clients = max(0, soft_limit - FIXED_RESERVE) // 2
    control_share = clients // 4
    return ConnectionBudget(soft_limit, data=max(1, min(data_bound, clients - control_share)),
                            control=max(1, min(control_bound, control_share)),
                            data_bound=data_bound, control_bound=control_bound)
