"""``llmgw bench overload --quick`` as a real command: simulators, the capacity ramp, then every arm at two loads;
the JSON says what each arm did and the table holds it. An arm that cannot run here says why: flow control before
this llmgw has it, vllm-router where it is not installed (CI).

No claim about overload control is asserted (its own tests prove it; the benchmark measures it): what is checked is
that the benchmark counts what it says it counts."""

from __future__ import annotations

import pytest

from llmgw.bench.overload_arms import FLOW, FLOW_CHUNK, OFF, VLLM_ROUTER, flow_available
from llmgw.bench.overload_workload import BATCH, INTERACTIVE
from llmgw.testing.processes import run_bench

pytestmark = pytest.mark.slow


async def test_overload_quick_runs_every_arm_and_reports_each_class(tmp_path):
    done, report = await run_bench(tmp_path, "overload", "--quick", timeout=300)
    assert report["markdown"] in done.stdout.decode()
    assert len(report["settings"]["load_average_at_start"]) == len(report["settings"]["load_average_at_end"]) == 3
    capacity = report["capacity"]
    assert capacity["rps"] > 0 and capacity["knee_concurrency"] in (2, 8)
    assert [step["concurrency"] for step in capacity["ramp"]][0] == 2
    arms = {arm["arm"]: arm for arm in report["arms"]}
    assert set(arms) == {FLOW, OFF, VLLM_ROUTER}
    if not flow_available():
        assert arms[FLOW]["error"].startswith("not available") and arms[FLOW]["levels"] == []
    if report["settings"]["vllm_router"] is None:
        assert arms[VLLM_ROUTER]["error"].startswith("vllm-router is not installed")
    ran = [arm for arm in arms.values() if not arm.get("error")]
    assert arms[OFF] in ran
    for arm in ran:
        assert arm["label"] in report["markdown"]
        assert [level["load"] for level in arm["levels"]] == [0.5, 2.0], arm["label"]
        for level in arm["levels"]:
            (run,) = level["runs"]
            assert level["rate_rps"] == pytest.approx(level["load"] * capacity["rps"])
            sent = 0
            for name in (INTERACTIVE, BATCH):
                numbers = run["classes"][name]
                assert numbers["sent"] == numbers["completed"] + numbers["shed"] + numbers["expired"] \
                    + numbers["errors"], (arm["label"], name, numbers)
                assert numbers["errors"] == 0, (arm["label"], name, numbers)
                assert numbers["good"] <= numbers["completed"]
                if numbers["completed"]:
                    assert numbers["ttft_p50_ms"] <= numbers["ttft_p99_ms"] and numbers["tokens"] > 0
                sent += numbers["sent"]
            assert sent > 0 and run["over_cap"] == 0
            assert run["kv_all"]["samples"] > 0 and 0 <= run["kv_all"]["mean"] <= 1
            assert level["summary"]["goodput_rps"]["median"] == run["goodput_rps"]


async def test_the_chunk_arm_runs_on_engines_of_its_own_that_cap_the_prefill(tmp_path):
    """``llmgw-flow-chunk`` beside ``llmgw-off``: its simulators (started with the cap, their own unloaded TTFT
    measured) cut batch prompts into chunks, the shared fleet's never do; every run carries what the engines said."""
    if not flow_available():
        pytest.skip("this llmgw has no flow control")
    done, report = await run_bench(tmp_path, "overload", "--quick", "--arms", f"{OFF},{FLOW_CHUNK}",
                                   "--prefill-cap", "128", "--capacity", "6", timeout=300)
    arms = {arm["arm"]: arm for arm in report["arms"]}
    assert not arms[OFF].get("error") and not arms[FLOW_CHUNK].get("error"), report["arms"]
    chunk = arms[FLOW_CHUNK]
    assert chunk["prefill_cap"] == 128 and report["settings"]["prefill_cap"] == 128
    assert chunk["unloaded"]["concurrency"] == 2 and chunk["unloaded_interactive_ttft_p99_ms"] > 0
    capped = {}
    for arm in (arms[OFF], chunk):
        for level in arm["levels"]:
            (run,) = level["runs"]
            engines = run["engines"]
            assert engines["steps"] > 0 and engines["step_p50_ms"] <= engines["step_p99_ms"], engines
            assert engines["overrun_p99_ms"] is not None
            capped[arm["arm"], level["load"]] = engines["capped_chunks"]
            # the gateways' interactive queue wait: read where flow control queues, absent where it is off
            assert (engines["gateway_wait_p99_ms"] is None) == (arm["arm"] == OFF), engines
    # a ~2,100-token batch prompt is cut into chunks of 128 whenever another request is held: at 2x of a capacity
    # given (the ramp's, on a loaded machine, can be a handful of requests), some 14 batch prompts among 34 others
    assert capped[FLOW_CHUNK, 2.0] > 0 and capped[OFF, 0.5] == capped[OFF, 2.0] == 0, capped
    assert "| / its engines' unloaded |" in report["markdown"] and chunk["label"] in report["markdown"]
