"""Early shedding's arithmetic: how long a request would wait in its model's queue, and whether an early shed was
right.

The predicted wait of a request of band *b* is the time to dispatch, at each band's own drain rate, what the
bands above *b* hold now, then what of *b* the fair order puts before it, then half of its own cost (it arrives,
on average, halfway between two dispatches). Each band's rate is measured while that band is the highest one
waiting (:class:`BandDrain`): the rate it is served at when it is served, in its own requests' tokens. One rate for
the whole model would mix the bands' request sizes: a few interactive requests of 150 tokens behind a batch
band's dispatches of 3,000 tokens each would look ten times faster to drain than they are. Until a band's rate is
measured, the model's rate in requests (dispatched per second while any waited) times the band's mean request
size stands in for it (requests take a seat each, whatever their size); until that is measured there is no
estimate, and nothing is shed early. A rate is predicted with once it is
trusted (:attr:`~.drain.DrainRate.trusted`: after two samples, a second of backlog): a cold queue's first window
often holds the stall of engines working through a burst, and a wrong early shed costs more than a late one.

An early shed cannot be undone to see whether it was right, so each leaves a *mark* (:class:`Verdicts`): its
virtual start in its band's fair order (:meth:`~.fair.FairBand.start_of`) and its deadline. The band emptying by
dispatches before the deadline means it would have been served without taking anyone's place: a wrong shed, the
kind that starves a class (IDLE_IN_TIME). Otherwise, the band dispatching a request that starts at or after it
before the deadline means its turn came: it would have been served, in the place of one served instead
(TURN_IN_TIME: near the shedding line, most are, as requests are shed a little before their predicted wait
reaches the deadline); the turn not coming, a right shed (WOULD_EXPIRE).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable

from .drain import DrainRate

# An early shed's verdict: its class's queue emptied (by dispatches) before its deadline, so it would have been
# served without taking anyone's place (a wrong shed: what starves a class); its turn came before its deadline
# but the queue stayed busy, so it would have been served in another's place (the price of answering at once);
# its turn would not have come in time (a right shed); or it was dropped unjudged beyond the bound.
IDLE_IN_TIME, TURN_IN_TIME, WOULD_EXPIRE, UNKNOWN = "idle_in_time", "turn_in_time", "would_expire", "unknown"
VERDICTS = (IDLE_IN_TIME, TURN_IN_TIME, WOULD_EXPIRE, UNKNOWN)
MAX_MARKS = 1024  # early sheds awaiting their verdict per band; beyond it the one due first is judged early

# The predicted wait is noisy: dispatches come in steps as requests end, the drain rate is an average, the room
# is held by long streams and shared with other gateways' arrivals. Measured through three gateways at 4x, those
# predicted 0.5 s or more were 3 times in 4 not served within their 2 s (docs/benchmarks/overload.md). So a request
# is shed on arrival when its predicted wait times a factor passes its deadline (unservable_on_arrival): until its
# band has seen ERRORS_LEARNT outcomes of its waiters, FACTOR_LEAST; then the FACTOR_QUANTILE of its latest
# ERRORS_KEPT waits over their predictions, within FACTOR_LEAST and FACTOR_MAX. (A prior of 2 before learning,
# measured, shed 5 batch requests a run that would have been served: a class's own misses are the evidence.)
FACTOR_LEAST = 1 / 0.9  # those admitted near the line keep some slack however right the predictions were
FACTOR_MAX = 4.0  # the queue always takes the waits predicted within a quarter of the deadline: it keeps the room fed
ERRORS_KEPT = 128
ERRORS_LEARNT = 8
FACTOR_QUANTILE = 0.9
SHORTEST = 0.05  # seconds: a prediction counted at least this long (a wait predicted 0 would make any factor)
MISSED_BY = 0.1  # seconds a waiter shed or expired is counted late by: the queue's look at the waiters' interval


class _Mark:
    __slots__ = ("start", "after", "deadline", "turn", "judged")

    def __init__(self, start: float, after: int, deadline: float):
        self.start, self.after, self.deadline = start, after, deadline
        self.turn = self.judged = False


class Verdicts:
    """The early sheds of one band awaiting a verdict (at most :data:`MAX_MARKS`): each is judged at its deadline,
    or when the band empties before it."""

    __slots__ = ("_by_start", "_by_deadline", "_seq", "pending")

    def __init__(self) -> None:
        self._by_start: list[tuple[float, int, _Mark]] = []
        self._by_deadline: list[tuple[float, int, _Mark]] = []
        self._seq = 0
        self.pending = 0

    def mark(self, start: float, served: int, deadline: float, now: float) -> list[str]:
        """A request was shed early whose virtual start in its band's fair order was ``start`` (its turn: the
        first request dispatched after now whose start is ``start`` or later), when the band had served
        ``served`` tokens. The verdicts this settles (the one due first, beyond the bound)."""
        mark = _Mark(start, served, deadline)
        self._seq += 1
        heapq.heappush(self._by_start, (start, self._seq, mark))
        heapq.heappush(self._by_deadline, (deadline, self._seq, mark))
        self.pending += 1
        if self.pending <= MAX_MARKS:
            return []
        while self._by_deadline:
            _, _, oldest = heapq.heappop(self._by_deadline)
            if not oldest.judged:
                return [self._judge(oldest, self._at_deadline(oldest) if oldest.deadline < now else UNKNOWN)]
        return []

    def judge(self, vnow: float, served: int, now: float) -> list[str]:
        """Note the turns that came (the band's virtual time is ``vnow``, it has served ``served`` tokens); the
        verdicts of the marks whose deadline has passed."""
        while self._by_start and self._by_start[0][0] <= vnow:
            mark = self._by_start[0][2]
            if not mark.judged:
                if mark.after >= served:  # nothing dispatched since it was shed: its turn is the next one
                    break
                if now <= mark.deadline:
                    mark.turn = True
            heapq.heappop(self._by_start)
        verdicts = []
        while self._by_deadline and self._by_deadline[0][0] < now:
            _, _, mark = heapq.heappop(self._by_deadline)
            if not mark.judged:
                verdicts.append(self._judge(mark, self._at_deadline(mark)))
        if not self.pending:
            self._by_start.clear()
            self._by_deadline.clear()
        return verdicts

    def emptied(self, now: float) -> list[str]:
        """The band's last waiter was dispatched: every mark whose deadline is still ahead would have been served
        without taking anyone's place."""
        verdicts = [self._judge(mark, IDLE_IN_TIME if now <= mark.deadline else self._at_deadline(mark))
                    for _, _, mark in self._by_deadline if not mark.judged]
        self._by_start.clear()
        self._by_deadline.clear()
        return verdicts

    @staticmethod
    def _at_deadline(mark: _Mark) -> str:
        return TURN_IN_TIME if mark.turn else WOULD_EXPIRE

    def _judge(self, mark: _Mark, verdict: str) -> str:
        mark.judged = True
        self.pending -= 1
        return verdict


class WaitErrors:
    """How wrong a band's predictions on arrival were: the latest :data:`ERRORS_KEPT` of its requests admitted to
    wait, each as the seconds waited over the seconds predicted, and the factor learnt from them
    (:meth:`factor`)."""

    __slots__ = ("_ratios", "_factor", "_missed")

    def __init__(self) -> None:
        self._ratios: deque[tuple[float, bool]] = deque(maxlen=ERRORS_KEPT)  # (waited / predicted, missed)
        self._factor: float | None = None  # the quantile, kept until the next outcome
        self._missed = 0  # of those kept, the waiters shed or expired

    def served(self, predicted: float, waited: float) -> None:
        """A request predicted to wait ``predicted`` seconds was dispatched after ``waited``."""
        self._add(waited / max(predicted, SHORTEST), False)

    def missed(self, predicted: float, left: float) -> None:
        """A request predicted to wait ``predicted`` seconds of the ``left`` its deadline left on arrival was shed
        while it waited, or expired: its wait would have been over ``left``, by how much is not known; counted as
        over by the time between two looks at the waiters (:data:`MISSED_BY`)."""
        self._add((left + MISSED_BY) / max(predicted, SHORTEST), True)

    def _add(self, ratio: float, missed: bool) -> None:
        if len(self._ratios) == ERRORS_KEPT and self._ratios[0][1]:
            self._missed -= 1
        self._ratios.append((ratio, missed))
        self._missed += missed
        self._factor = None

    def factor(self) -> float | None:
        """The :data:`FACTOR_QUANTILE` of the waits over their predictions (None until :data:`ERRORS_LEARNT`
        outcomes were seen); :data:`FACTOR_LEAST` while none of them missed its deadline: waits longer than
        predicted but served in time (a batch class's, behind the interactive arrivals that no prediction counts)
        are no reason to shed."""
        if len(self._ratios) < ERRORS_LEARNT:
            return None
        if not self._missed:
            return FACTOR_LEAST
        if self._factor is None:
            ordered = sorted(ratio for ratio, _ in self._ratios)
            self._factor = ordered[min(len(ordered) - 1, int(FACTOR_QUANTILE * len(ordered)))]
        return self._factor


def unservable_on_arrival(expected: float, left: float, factor: float | None) -> bool:
    """Whether a request predicted to wait ``expected`` seconds, with ``left`` before its deadline, is shed on
    arrival: when the prediction times the factor its band's predictions were wrong by (:class:`WaitErrors`;
    None: not learnt yet) passes its deadline; the factor within :data:`FACTOR_LEAST` and :data:`FACTOR_MAX`."""
    used = FACTOR_LEAST if factor is None else min(max(factor, FACTOR_LEAST), FACTOR_MAX)
    return expected * used > left


class BandDrain:
    """One band's drain: its rate while it is the highest band waiting, the tokens it has dispatched (its
    waiters' and its early sheds' marks count against it), the verdicts awaited and its predictions' errors."""

    __slots__ = ("drain", "served", "verdicts", "head", "errors")

    def __init__(self) -> None:
        self.drain = DrainRate()
        self.served = 0
        self.verdicts = Verdicts()
        self.head = False  # the highest band with requests waiting
        self.errors = WaitErrors()


def drain_time(waiting: Iterable[tuple[int, float | None]]) -> float | None:
    """Seconds to dispatch each ``(tokens, rate)`` in turn; None when a part with tokens has no rate known."""
    total = 0.0
    for tokens, rate in waiting:
        if tokens <= 0:
            continue
        if rate is None:
            return None
        total += tokens / rate if rate > 0 else float("inf")
    return total
