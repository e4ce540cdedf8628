"""The simulated engine's time to ready: a cold start (loading the weights) before it listens, and vLLM's sleep
mode (``--enable-sleep-mode``: ``POST /sleep`` frees the GPU, ``POST /wake_up`` takes the hot start's time).

Both times are modelled seconds, multiplied by ``--time-scale`` like every other simulated duration.
"""

from __future__ import annotations

import logging

import trio

log = logging.getLogger(__name__)


class Startup:
    def __init__(self, cold_seconds: float = 0.0, hot_seconds: float = 0.0, time_scale: float = 1.0):
        self.cold_seconds = cold_seconds
        self.hot_seconds = hot_seconds
        self.time_scale = time_scale
        self.sleeping = 0  # the sleep level (0: awake)
        self._waking: trio.Event | None = None

    async def cold_start(self) -> None:
        """Before the server listens: what loading the weights onto the GPUs takes."""
        if self.cold_seconds > 0:
            log.info("loading the model: ready in %.3gs (cold start, --startup-seconds %g x --time-scale %g)",
                     self.cold_seconds * self.time_scale, self.cold_seconds, self.time_scale)
            await trio.sleep(self.cold_seconds * self.time_scale)

    def sleep(self, level: int) -> None:
        """vLLM's ``POST /sleep?level=N``: the weights offloaded (1) or dropped (2); requests wait for a wake-up."""
        self.sleeping = level
        log.info("sleeping at level %d: a wake-up takes %.3gs (--hot-startup-seconds)", level,
                 self.hot_seconds * self.time_scale)

    async def wake_up(self) -> None:
        """vLLM's ``POST /wake_up``: back on the GPUs after the hot start's time (one wake-up at a time)."""
        if not self.sleeping:
            return
        if self._waking is None:
            self._waking = trio.Event()
            try:
                await trio.sleep(self.hot_seconds * self.time_scale)
                self.sleeping = 0
                log.info("awake (hot start)")
            finally:
                self._waking.set()
                self._waking = None
        else:
            await self._waking.wait()
