"""Warnings that a peer can provoke at will, logged at most once per interval and kind, the rest counted.

A thousand refused connections in a second are one line (the first), and the next line of that kind, once the
interval is over, says how many were left out meanwhile. The metrics count every one.
"""

from __future__ import annotations

import logging
import time


class ThrottledLog:
    """``warning(kind, message)``: logged when ``kind`` was not logged in the last ``interval`` seconds."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0, clock=time.monotonic):
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}  # kind -> when it was last logged
        self._skipped: dict[str, int] = {}  # kind -> lines left out since

    def warning(self, kind: str, message: str) -> None:
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        skipped = self._skipped.pop(kind, 0)
        self._last[kind] = now
        if skipped and last is not None:
            message += f" ({skipped} more like it in the last {now - last:.0f}s were not logged)"
        self.logger.warning("%s", message)
