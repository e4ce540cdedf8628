"""Coarse deadlines for the data plane's hot path, swept by one task per Trio run.

A ``trio.CancelScope`` with a deadline costs about 10 µs to enter and leave on
the machines we measure on (2 vCPU VMs), and the thin HTTP layer would need
two or three per proxied request (client read, upstream head, every streamed
piece). Instead, a :class:`Watch` belongs to one socket and is *armed* just
before a task parks on that socket (``wait_readable``/``wait_writable``) and
*disarmed* right after, which sets a float. One system task per run sleeps
until the earliest deadline; for each watch whose deadline passed it sets
``expired`` and calls ``trio.lowlevel.notify_closing`` on the socket, so whoever
waits on it wakes with ``trio.ClosedResourceError``; the owner then sees
``watch.expired``, reports its timeout and closes the socket (an expired
socket is never reused). An :class:`Alarm` calls a function instead.

Bookkeeping is lazy: a watch has at most one entry in the sweeper's heap, and
re-arming it to a *later* time (the usual case: the same timeout, one request
later) touches nothing but the float; when the entry comes due, the sweeper
re-files it at the watch's current deadline, or drops it if disarmed. So a
request costs a few attribute writes, not a heap operation.

Deadlines fire up to one tick late: an eighth of the shortest timeout armed so
far in this run, between 2 ms and 500 ms (a 10 s header timeout fires within
10.0-10.5 s, a test's 0.2 s timeout within 25 ms).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from typing import TYPE_CHECKING, Callable

import trio

if TYPE_CHECKING:
    from .tls_socket import Stream

log = logging.getLogger(__name__)

MIN_TICK = 0.002
MAX_TICK = 0.5
_INF = math.inf


class _Sweeper:
    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Watch]] = []
        self._seq = itertools.count()
        self.tick = MAX_TICK
        self.wake_at = _INF
        self.last_sweep = -_INF
        self._sleep: trio.CancelScope | None = None

    def file(self, watch: "Watch", timeout: float) -> None:
        if timeout < self.tick * 8:
            self.tick = min(MAX_TICK, max(MIN_TICK, timeout / 8))
        when = watch.when
        if watch.heap_when <= when:
            return  # an entry due no later is filed already; it is re-filed when it comes due
        watch.heap_when = when
        heapq.heappush(self.heap, (when, next(self._seq), watch))
        if when < self.wake_at and self._sleep is not None:
            self.wake_at = max(when, self.last_sweep + self.tick)
            self._sleep.deadline = self.wake_at

    def sweep(self, now: float) -> None:
        heap = self.heap
        while heap and heap[0][0] <= now:
            when, _, watch = heapq.heappop(heap)
            if when != watch.heap_when:
                continue  # superseded by an earlier entry of the same watch
            watch.heap_when = _INF
            if watch.when <= now:
                watch.when = _INF
                watch.expired = True
                try:
                    watch.fire()
                except Exception:  # a system task must never crash the run
                    log.exception("a deadline's action failed")
            elif watch.when != _INF:
                watch.heap_when = watch.when
                heapq.heappush(heap, (watch.when, next(self._seq), watch))

    async def run(self) -> None:
        while True:
            now = trio.current_time()
            self.sweep(now)
            self.last_sweep = now
            self.wake_at = max(self.heap[0][0], now + self.tick) if self.heap else _INF
            with trio.CancelScope(deadline=self.wake_at) as self._sleep:
                await trio.sleep_forever()
            self._sleep = None


_SWEEPER: trio.lowlevel.RunVar[_Sweeper] = trio.lowlevel.RunVar("llmgw_deadline_sweeper")


def sweeper() -> _Sweeper:
    """This Trio run's sweeper, started on first use."""
    try:
        return _SWEEPER.get()
    except LookupError:
        sweeper = _Sweeper()
        _SWEEPER.set(sweeper)
        trio.lowlevel.spawn_system_task(sweeper.run, name="llmgw.http.deadlines.sweeper")
        return sweeper


class Watch:
    """One socket's deadline. ``kind`` says what it guards (e.g. ``"header"``, ``"write"``)."""

    __slots__ = ("sock", "kind", "when", "expired", "heap_when", "_sweeper")

    def __init__(self, sock: Stream | None, kind: str = "") -> None:
        self.sock = sock
        self.kind = kind
        self.when = _INF
        self.heap_when = _INF
        self.expired = False
        self._sweeper: _Sweeper | None = None

    def arm(self, timeout: float, kind: str | None = None) -> None:
        """Expire ``timeout`` seconds from now unless disarmed first."""
        self.arm_at(trio.current_time() + timeout, timeout, kind)

    def arm_at(self, when: float, timeout: float, kind: str | None = None) -> None:
        """Expire at ``when`` (Trio clock); ``timeout`` (the span it stands for) sets the sweeper's resolution."""
        s = self._sweeper
        if s is None:
            s = self._sweeper = sweeper()
        if kind is not None:
            self.kind = kind
        self.expired = False
        self.when = when
        s.file(self, timeout)

    def disarm(self) -> None:
        self.when = _INF

    @property
    def armed(self) -> bool:
        return self.when != _INF

    def fire(self) -> None:
        sock = self.sock
        if sock is not None and sock.fileno() >= 0:
            trio.lowlevel.notify_closing(sock)


class Alarm(Watch):
    """A deadline that calls ``action()`` (from the sweeper task) instead of waking a socket's waiters."""

    __slots__ = ("action",)

    def __init__(self, action: Callable[[], None], kind: str = "alarm") -> None:
        super().__init__(None, kind)
        self.action = action

    def fire(self) -> None:
        self.action()
