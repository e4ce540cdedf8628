"""Repeated log lines collapsed: one line per message per interval, with a count of the ones held back.

A failure that repeats many times a second (``accept()`` out of file
descriptors, every connection of a flood failing alike) would otherwise write
one line each and bury everything else. :class:`RepeatLimitedLog` wraps a
logger: the first line of a message is written at once; the same message again
within ``interval`` seconds is only counted; the first one after the interval is
written with ``(and N more like it in the last Xs)`` appended. "The same
message" is the formatted text at the same level, so lines that name different
addresses or errors stay apart. At most ``max_messages`` messages are tracked;
the oldest is forgotten first (its held-back count is written then, so no
count is lost).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Seen:
    written_at: float  # when the message was last written
    text: str  # what was written then
    held_back: int = 0  # repeats since then that were not written


class RepeatLimitedLog:
    """``logger``'s lines, each distinct message written at most once per ``interval`` seconds."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0, *, max_messages: int = 256,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.interval = interval
        self.max_messages = max_messages
        self.clock = clock
        self._seen: OrderedDict[tuple[int, str], _Seen] = OrderedDict()

    def log(self, level: int, msg: str, *args: object, exc_info: BaseException | None = None,
            kind: str | None = None) -> bool:
        """Write ``msg % args`` at ``level`` unless it was written less than ``interval`` ago; True if written.
        ``kind``: lines of one kind count as the same message whatever their text (e.g. refusals that name the
        peer: one line per kind and interval, not per peer)."""
        if not self.logger.isEnabledFor(level):
            return False
        text = msg % args if args else msg
        key = (level, text if kind is None else "\0" + kind)
        now = self.clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen.written_at < self.interval:
            seen.held_back += 1
            return False
        if seen is not None:
            self._seen.move_to_end(key)
            text += self._summary(seen, now)
            seen.written_at, seen.text, seen.held_back = now, text, 0
        else:
            self._seen[key] = _Seen(now, text)
            self._forget_oldest(now)
        self.logger.log(level, "%s", text, exc_info=exc_info)
        return True

    def error(self, msg: str, *args: object, exc_info: BaseException | None = None, kind: str | None = None) -> bool:
        return self.log(logging.ERROR, msg, *args, exc_info=exc_info, kind=kind)

    def warning(self, msg: str, *args: object, exc_info: BaseException | None = None,
                kind: str | None = None) -> bool:
        return self.log(logging.WARNING, msg, *args, exc_info=exc_info, kind=kind)

    def _forget_oldest(self, now: float) -> None:
        while len(self._seen) > self.max_messages:
            (level, _), seen = self._seen.popitem(last=False)
            if seen.held_back:
                self.logger.log(level, "%s", seen.text + self._summary(seen, now))

    @staticmethod
    def _summary(seen: _Seen, now: float) -> str:
        if not seen.held_back:
            return ""
        return f" (and {seen.held_back} more like it in the last {now - seen.written_at:.0f}s)"
