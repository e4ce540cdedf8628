"""The simulated engine's startup (llmgw.sim.startup): the cold start's and the hot wake-up's modelled time, on
trio's virtual clock."""

from __future__ import annotations

import pytest
import trio

from llmgw.sim.config import SimArgumentError, SimConfig
from llmgw.sim.startup import Startup


async def test_a_cold_start_takes_its_seconds_times_the_time_scale(autojump_clock):
    before = trio.current_time()
    await Startup(cold_seconds=60, hot_seconds=5, time_scale=0.5).cold_start()
    assert trio.current_time() - before == pytest.approx(30)


async def test_a_wake_up_takes_the_hot_start_once_for_every_waiter(autojump_clock):
    startup = Startup(cold_seconds=60, hot_seconds=5)
    before = trio.current_time()
    await startup.wake_up()  # awake already: nothing to wait for
    assert trio.current_time() == before
    startup.sleep(1)
    woke: list[float] = []

    async def wake() -> None:
        await startup.wake_up()
        woke.append(trio.current_time() - before)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(wake)
    assert woke == [pytest.approx(5)] * 3 and startup.sleeping == 0


def test_negative_startup_times_are_refused():
    with pytest.raises(SimArgumentError, match="--startup-seconds"):
        SimConfig(startup_seconds=-1).resolve()
    with pytest.raises(SimArgumentError, match="--hot-startup-seconds"):
        SimConfig(hot_startup_seconds=-1).resolve()
