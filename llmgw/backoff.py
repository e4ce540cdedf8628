"""The wait before a supervisor starts a process again: short after a one-off crash, growing while it keeps crashing.

Shared by the private redis-server's supervisor (:mod:`llmgw.redis_server`) and the workers of
``llmgw serve --workers`` (:mod:`llmgw.workers.supervisor`).
"""

from __future__ import annotations


class RestartBackoff:
    """``first`` seconds, doubled after each restart up to ``longest``; ``first`` again once a run lasted
    ``stable_after`` seconds (it had recovered: its next crash is a new story)."""

    def __init__(self, first: float, longest: float, stable_after: float = 60.0):
        self.first = first
        self.longest = longest
        self.stable_after = stable_after
        self.delay = first

    def next_delay(self, ran_for: float | None) -> float:
        """The wait before the next start, after a run of ``ran_for`` seconds (None: the start itself failed)."""
        if ran_for is not None and ran_for >= self.stable_after:
            self.delay = self.first
        delay = self.delay
        self.delay = min(self.delay * 2, self.longest)
        return delay
