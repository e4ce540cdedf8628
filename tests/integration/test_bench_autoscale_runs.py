"""``llmgw bench autoscale --quick`` as a real command on its rig (a control process, two remote agents on fixture
H100 nodes, simulator engines): the step trace on each arm; the JSON says what each arm's fleet was and did, and
the table and the charts hold it. The autoscaled arm, on an llmgw without autoscaling, says so.

No claim about the autoscaler is asserted (its own tests prove it; the benchmark measures it): what is checked is
that the benchmark counts what it says it counts."""

from __future__ import annotations

import pytest

from llmgw.bench.autoscale import AUTOSCALED, AUTOSCALED_SLEEP, FIXED_MAX, FIXED_MIN, autoscale_available
from llmgw.bench.autoscale_oracle import plan
from llmgw.bench.autoscale_traces import MODEL_A, shortened, step_trace
from llmgw.testing.processes import run_bench

pytestmark = pytest.mark.slow


async def test_autoscale_quick_runs_the_step_on_every_arm_and_counts_the_fleet(tmp_path):
    done, report = await run_bench(tmp_path, "autoscale", "--quick", "--traces", "step", "--capacity", "3",
                                   "--workdir", str(tmp_path / "work"), timeout=400)
    printed = done.stdout.decode()
    assert report["markdown"] in printed and report["capacity"] == {"rps": 3, "given": True,
                                                                    "replica_worth_rps": pytest.approx(2.1)}
    runs = {run["arm"]: run for run in report["runs"]}
    assert set(runs) == {AUTOSCALED, FIXED_MAX, FIXED_MIN}
    if not autoscale_available():
        assert runs[AUTOSCALED]["error"].startswith("not available")
    else:  # within its bounds (2..4: it starts at the base's need), every request counted
        run = runs[AUTOSCALED]
        assert "error" not in run, (run.get("error"), run.get("error_detail", "")[-1500:])
        (stats,) = [r[MODEL_A] for r in run["runs"]]
        series = run["series"][MODEL_A]
        assert all(2 <= r + s <= 4 for r, s in zip(series["ready"], series["starting"])), series
        assert series["ready"][0] >= 2 and stats["sent"] == stats["completed"] + stats["dropped"] > 0
    assert len(report["settings"]["boot_s"]) == 3 and report["settings"]["sim_startup_seconds"] >= 0
    assert {t["trace"] for t in report["targets"]} <= {"step"}
    trace = shortened(step_trace(), 0.25)
    oracle = plan(trace, MODEL_A, 10.0, 60.0, report["settings"]["sample"])
    for arm, count in ((FIXED_MAX, trace.max_replicas), (FIXED_MIN, trace.min_replicas)):
        run = runs[arm]
        assert "error" not in run, (run.get("error"), run.get("error_detail", "")[-1500:])
        (stats,) = [r[MODEL_A] for r in run["runs"]]
        series = run["series"][MODEL_A]
        assert run["series_by_repeat"] == [run["series"]]
        assert set(series["ready"]) == {count} and set(series["starting"]) == {0}, (arm, series)  # a fixed fleet
        assert stats["reversals"] == 0 and stats["step_to_serving_s"] is None
        assert stats["sent"] == stats["completed"] + stats["dropped"] > 0
        assert stats["dropped"] == sum(stats["dropped_by"].values())
        assert stats["oracle_replica_seconds"] == pytest.approx(oracle.replica_seconds)
        # held from the first sample (just after the trace's start) to its end: the fleet's size times the trace's
        # length, but for that first moment
        assert stats["replica_seconds"] == pytest.approx(count * trace.seconds, rel=0.05)
        assert f"| step | {arm} | {MODEL_A} |" in report["markdown"]
        assert f"step / {arm} / {MODEL_A}:" in printed


async def test_the_sleep_arm_starts_its_trace_with_replicas_asleep_and_wakes_one_from_zero(tmp_path):
    # 20x (the autoscaler decides every 0.05 s, its floor): the scale-downs that put the warm-up's replicas to sleep
    # take about a minute of wall time
    done, report = await run_bench(tmp_path, "autoscale", "--quick", "--traces", "idle", "--arms", AUTOSCALED_SLEEP,
                                   "--time-factor", "20", "--capacity", "3", "--workdir", str(tmp_path / "work"),
                                   timeout=400)
    (run,) = report["runs"]
    if not autoscale_available():
        assert run["error"].startswith("not available")
        return
    assert "error" not in run, (run.get("error"), run.get("error_detail", "")[-1500:])
    (stats,) = [r[MODEL_A] for r in run["runs"]]
    assert stats["asleep_at_start"] >= 1, stats  # the warm-up's replicas above min 0 slept before the trace
    # every request counted; how many the compressed deadlines (5 s of wall time at 20x) drop is the bench's to measure
    assert stats["sent"] == stats["completed"] + stats["dropped"] > 0, stats
    control = (tmp_path / "work" / f"idle-{AUTOSCALED_SLEEP}-0" / "control.log").read_text()
    assert "from_zero 0 -> 1" in control and "woke 1 sleeping replica (a hot start)" in control
    assert f"| idle | {AUTOSCALED_SLEEP} | {MODEL_A} |" in report["markdown"]
    assert [t["trace"] for t in report["targets_sleep"]] and report["settings"]["warm_up"] == 240.0
