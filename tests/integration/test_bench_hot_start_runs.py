"""``llmgw bench hot-start`` as a real command on its two fleets (a control process and a remote agent on a fixture
H100 each, simulator engines): every call counted, alternated, and the table holds them.

No claim about the speed of a wake-up is asserted (the benchmark measures it): what is checked is that the benchmark
counts what it says it counts, and that the sleep fleet's calls were served by woken engines (a cold start of the
simulator takes its modelled start, a wake-up its modelled hot start: the calls must fall on each side of it)."""

from __future__ import annotations

import pytest

from llmgw.testing.processes import run_bench

pytestmark = pytest.mark.slow


async def test_hot_start_calls_each_fleet_from_zero_in_turn(tmp_path):
    # 40 s cold and 2 s hot at 10x: 4 s against 0.2 s of modelled start on the wall
    done, report = await run_bench(tmp_path, "hot-start", "--repeats", "2", "--cold-start", "40", "--hot-start",
                                   "2", "--workdir", str(tmp_path / "work"), timeout=300)
    assert report["markdown"] in done.stdout.decode()
    calls = report["calls"]
    assert len(calls["cold"]) == len(calls["sleep"]) == 2
    order = [line.split()[0] for line in done.stderr.decode().splitlines() if "first token after" in line]
    assert order == ["cold", "sleep", "cold", "sleep"]
    modelled_cold = report["settings"]["sim_startup_seconds"] + report["settings"]["boot_s"]
    assert min(calls["cold"]) >= report["settings"]["sim_startup_seconds"]  # each a start of a new engine
    assert max(calls["sleep"]) < modelled_cold  # each a wake-up, never a start
    summary = report["summary"]
    assert summary["speedup"] == pytest.approx(summary["cold"]["median_s"] / summary["sleep"]["median_s"])
