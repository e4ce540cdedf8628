"""Running out of file descriptors where the process opens one: recognised, counted, logged, waited out.

Connection caps (:mod:`llmgw.fdlimit`) keep clients from taking every
descriptor, but the process can still run short: the system-wide table is full
(``ENFILE``), the limit was lowered under a running process, or a burst of
engine connections came at once. Then any ``socket()``, ``accept()``,
``open()`` or ZMQ socket fails with ``EMFILE``/``ENFILE`` (or ``ENOBUFS``/
``ENOMEM``). That says nothing about the peer (an engine, Redis, the control
plane): each site that opens one treats it as "not now", never as the peer
being down and never as a reason to end a task that serves others.

- :func:`capacity_errno`: whether an exception (an ``OSError``, a
  ``zmq.ZMQError``, or one raised from either) is such a shortage;
- :func:`note_shortage`: count it in ``llmgw_fd_exhaustion_total{where}`` and
  log one line per site and 10 s (:class:`~llmgw.lograte.RepeatLimitedLog`);
- :class:`ShortageBackoff`: the wait before the next try at one site (100 ms,
  doubling to 2 s, back to 100 ms once a try succeeds).

The count is process-wide (the embedded agent's sockets are the gateway's
process's): :data:`FD_EXHAUSTION` is a collector each ``/metrics`` registry
registers.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from .lograte import RepeatLimitedLog

log = logging.getLogger(__name__)
repeats = RepeatLimitedLog(log)

# Errors that mean "no descriptor or memory for it right now": wait and try again, blame nobody.
CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
FIRST_RETRY = 0.1
LONGEST_RETRY = 2.0
_CHAIN_DEPTH = 8  # how far __cause__/__context__ is followed (a wrapped error is one or two links down)


def capacity_errno(exc: BaseException | None, depth: int = _CHAIN_DEPTH) -> int | None:
    """The errno when ``exc`` (an exception it was raised from, or one of a group's: every address of a host
    tried) is a shortage of descriptors or memory; None otherwise."""
    while exc is not None and depth > 0:
        number = getattr(exc, "errno", None)  # OSError and zmq.ZMQError alike
        if isinstance(number, int) and number in CAPACITY_ERRNOS:
            return number
        if isinstance(exc, BaseExceptionGroup):
            for member in exc.exceptions:
                found = capacity_errno(member, depth - 1)
                if found is not None:
                    return found
        exc = exc.__cause__ or exc.__context__
        depth -= 1
    return None


class FdExhaustion(Collector):
    """How many times each site could not open a descriptor (``llmgw_fd_exhaustion_total{where}``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the gateway renders /metrics in a worker thread
        self.counts: dict[str, int] = {}

    def add(self, where: str) -> None:
        with self._lock:
            self.counts[where] = self.counts.get(where, 0) + 1

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "llmgw_fd_exhaustion", "Times the process could not open a socket or file for want of descriptors "
            "(EMFILE, ENFILE) or memory (ENOBUFS, ENOMEM), by where it tried; each is retried after a back-off, "
            "and blames no engine or peer.", labels=["where"])
        with self._lock:
            for where, count in sorted(self.counts.items()):
                family.add_metric([where], count)
        yield family


FD_EXHAUSTION = FdExhaustion()


def note_shortage(where: str, exc: BaseException, what: str = "") -> None:
    """Count a shortage at ``where`` and log it (once per 10 s per site, with a count of the others);
    ``what``: what could not be opened, for the log line."""
    FD_EXHAUSTION.add(where)
    number = capacity_errno(exc)
    reason = errno.errorcode.get(number, "") if number is not None else ""
    repeats.error("out of file descriptors (%s) at %s%s: %s; retrying with a back-off (llmgw_fd_exhaustion_total, "
                  "docs/security.md#sockets)", reason or type(exc).__name__, where, f" ({what})" if what else "",
                  exc, kind=f"fd:{where}")


class ShortageBackoff:
    """The wait before one site tries again after a shortage: ``FIRST_RETRY`` doubling to ``LONGEST_RETRY``;
    :meth:`succeeded` starts over."""

    def __init__(self, first: float = FIRST_RETRY, longest: float = LONGEST_RETRY):
        self.first = first
        self.longest = longest
        self.delay = first

    def next_delay(self) -> float:
        delay = self.delay
        self.delay = min(self.delay * 2, self.longest)
        return delay

    def succeeded(self) -> None:
        self.delay = self.first
