"""A model's drain rate: the tokens per second its requests are dispatched at while some wait, an EWMA.

Only time during which requests were waiting counts: with an empty queue the dispatches follow the arrivals, not
what the replicas can take, and would make the queue look slower than it is. The tokens dispatched during a
backlog are summed until ``window`` seconds of backlog have passed and something was dispatched; each such window
is one sample of the EWMA. A stall (a backlog and nothing dispatched) adds no sample until its first dispatch, which
then counts the whole stall: a queue that is merely waiting for a long stream to end is not taken for one that
never drains. Until the first sample the rate is unknown (``None``, cold): a caller must not guess from it.

:attr:`DrainRate.trusted` is what to shed by: nothing until ``TRUSTED`` samples were taken (the first window of a
cold queue often holds the stall of engines working through the burst that taught the room their capacity, and
alone it would shed what is about to be served: an early shed that was wrong costs a request that would have
been served, a late one only the wait to its deadline), then the EWMA.
"""

from __future__ import annotations

WINDOW = 0.5  # seconds of backlog per sample
ALPHA = 0.3  # the EWMA's weight of a new sample
TRUSTED = 2  # samples before the rate is shed by


class DrainRate:
    __slots__ = ("window", "alpha", "rate", "last", "samples", "_tokens", "_busy", "_since")

    def __init__(self, window: float = WINDOW, alpha: float = ALPHA):
        self.window, self.alpha = window, alpha
        self.rate: float | None = None  # tokens/s; None until one window of backlog was seen
        self.last = 0.0  # the last sample
        self.samples = 0
        self._tokens = 0  # dispatched during the current window's backlog
        self._busy = 0.0  # seconds of backlog in the current window, up to _since
        self._since: float | None = None  # when the backlog in progress started being counted (None: no backlog)

    def backlog(self, waiting: bool, now: float) -> None:
        """Requests are (``waiting``) or are no longer waiting, from ``now``."""
        if waiting and self._since is None:
            self._since = now
        elif not waiting and self._since is not None:
            self._busy += now - self._since
            self._since = None
            self._sample()

    def dispatched(self, tokens: int, now: float) -> None:
        """``tokens`` were dispatched at ``now``: counted when a backlog is in progress."""
        if self._since is None:
            return
        self._tokens += tokens
        self._busy += now - self._since
        self._since = now
        self._sample()

    def current(self, now: float) -> float | None:
        """The rate, with the backlog in progress counted up to ``now`` (a stalled queue's rate falls)."""
        if self._since is not None:
            self._busy += now - self._since
            self._since = now
            self._sample()
        return self.rate

    @property
    def trusted(self) -> float | None:
        """The rate to shed by (see the module's docstring); None until it is trusted."""
        if self.rate is None or self.samples < TRUSTED:
            return None
        return self.rate

    def _sample(self) -> None:
        if self._busy < self.window or not self._tokens:
            return
        sample = self._tokens / self._busy
        self.rate = sample if self.rate is None else self.rate + self.alpha * (sample - self.rate)
        self.last = sample
        self.samples += 1
        self._tokens, self._busy = 0, 0.0
