"""The busy load of one deployment over the last window, and what it will be one engine start ahead.

The scaler feeds every reading of ``busy`` (the ready replicas' busy seats, in replicas) into a
:class:`LoadTrend`; it keeps :data:`BUCKETS` means over the last two ``lookahead`` (bounded whatever the decision
rate), and :meth:`LoadTrend.forecast` fits a line through them. A rise counts only where the samples prove it: the
slope's lower bound (:data:`CONFIDENCE` standard errors under it), so that the noise of a constant load (a few
requests a second, each taking a seat for a second) does not read as a ramp, and only over a full window; a fall
is proven the same way, from the slope's upper bound.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

BUCKETS = 20  # means over the window: few enough to be bounded, enough for a slope and its error
MIN_BUCKETS = 5  # buckets before a forecast (its level) is made at all
# A rise is read only from a full window: traffic that starts (a fresh fleet, a model called after a quiet spell)
# fills a partial window with a step from nothing, which a line through it reads as a steep ramp.
CONFIDENCE = 2.0  # standard errors a slope must clear to count as a rise (or a fall)


@dataclass(frozen=True, slots=True)
class Forecast:
    """The busy load now, at ``now + ahead``, and whether the window proves it is falling."""

    level: float  # the window's mean, moved to now by the proven rise
    ahead: float  # ``level`` plus the proven rise over ``ahead`` seconds
    rise_per_s: float  # the proven rise (0 when the window does not prove one)
    falling: bool  # the slope's upper bound is under 0

    def describe(self, lookahead: float) -> str:
        if self.rise_per_s > 0:
            return (f"busy {self.level:.2f} replicas rising {self.rise_per_s * 60:.2f}/min, "
                    f"{self.ahead:.2f} in {lookahead:g} s")
        return f"busy {self.level:.2f} replicas" + (", falling" if self.falling else "")


class LoadTrend:
    """Bucketed readings of one deployment's busy load over ``2 x lookahead`` seconds."""

    def __init__(self) -> None:
        self._buckets: deque[list[float]] = deque(maxlen=BUCKETS + 1)  # [start, sum, count]

    def add(self, at: float, busy: float, lookahead: float) -> None:
        width = 2 * lookahead / BUCKETS
        if self._buckets and at < self._buckets[-1][0]:
            self._buckets.clear()  # the clock went back (a new leader's): start over
        if not self._buckets or at >= self._buckets[-1][0] + width:
            self._buckets.append([at, 0.0, 0])
        bucket = self._buckets[-1]
        bucket[1] += busy
        bucket[2] += 1

    def clear(self) -> None:
        self._buckets.clear()

    def forecast(self, now: float, lookahead: float) -> Forecast | None:
        """The load ``lookahead`` ahead; None until :data:`MIN_BUCKETS` buckets of the window are filled."""
        width = 2 * lookahead / BUCKETS
        points = [(start + width / 2, total / count) for start, total, count in self._buckets
                  if count and start >= now - 2 * lookahead - width]
        if len(points) < MIN_BUCKETS:
            return None
        n = len(points)
        mean_t = sum(t for t, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        sxx = sum((t - mean_t) ** 2 for t, _ in points)
        if sxx <= 0:
            return Forecast(mean_y, mean_y, 0.0, False)
        slope = sum((t - mean_t) * (y - mean_y) for t, y in points) / sxx
        residual = sum((y - mean_y - slope * (t - mean_t)) ** 2 for t, y in points)
        error = math.sqrt(residual / (n - 2) / sxx) if n > 2 else math.inf
        rise = max(0.0, slope - CONFIDENCE * error) if n >= BUCKETS else 0.0
        level = mean_y + rise * max(0.0, now - mean_t)
        return Forecast(level, level + rise * lookahead, rise, slope + CONFIDENCE * error < 0)
