"""``llmgw bench limits`` as a real command at a tiny size: two llmgw gateways on one Redis with the plan's keys, each
scenario measured and reported; the LiteLLM arm left out, saying why, where it may not be installed (CI).

No claim about how exact llmgw's limits are is asserted here (the limiter's own tests prove them; the benchmark
measures them): what is checked is that the benchmark counts what it says it counts."""

from __future__ import annotations

import json
import os
import sys

import pytest
import trio

pytestmark = pytest.mark.slow

TINY = ("--quick", "--burst", "12", "--burst-limit", "6", "--steady-limit", "60", "--steady-seconds", "2",
        "--redis-before", "1", "--redis-away", "1", "--redis-after", "1", "--latency-requests", "10")


async def bench(tmp_path, *argv: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    out = tmp_path / "report.json"
    command = [sys.executable, "-m", "llmgw", "bench", "limits", *argv, "--json", str(out)]
    with trio.fail_after(240):
        done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False,
                                      env={**os.environ, **(env or {})})
    assert done.returncode == 0, (done.stdout + done.stderr).decode()[-3000:]
    report = json.loads(out.read_text())
    assert report["markdown"] in done.stdout.decode()
    return report, done.stderr.decode()


async def test_limits_measures_every_scenario_on_two_gateways_and_leaves_litellm_out_under_ci(tmp_path):
    report, _ = await bench(tmp_path, *TINY, "--arms", "llmgw,litellm", "--gateways", "2",
                            env={"CI": "true", "XDG_CACHE_HOME": str(tmp_path / "cache")})
    llmgw, litellm = report["arms"]
    assert litellm["error"].startswith("LiteLLM is not installed") and litellm["runs"] == []
    assert "not run: LiteLLM is not installed" in report["markdown"]
    assert not (tmp_path / "cache" / "llmgw").exists()  # nothing installed under CI
    assert (llmgw["label"], llmgw["processes"], llmgw["kind"]) == ("llmgw N=2", 2, "bucket")
    (run,) = llmgw["runs"]
    for scenario in ("rpm", "tpm", "budget", "concurrency"):
        burst = run[scenario]
        assert burst["offered"] == 12 and burst["errors"] == 0, (scenario, burst)
        # the exact limiter admits the lane's 6 requests (and what refilled while the burst was answered), or
        # the concurrency lane's 10 at once
        holds = {"rpm": (6, 7), "tpm": (6, 7), "budget": (6, 6), "concurrency": (10, 10)}[scenario]
        assert holds[0] <= burst["expected"] <= holds[1], (scenario, burst)
    assert run["tpm"]["tokens_admitted"] == run["tpm"]["admitted"] * report["settings"]["request_tokens"]
    assert run["budget"]["nano_budget"] == 6 * report["settings"]["request_nano"]
    assert run["concurrency"]["most_in_flight"] >= 1
    for scenario in ("rpm-steady", "tpm-steady"):
        steady = run[scenario]
        assert steady["offered"] == 2 and steady["expected"] >= 1, (scenario, steady)  # 1.2 x 60 rpm for 2 s
    latency = run["latency"]
    assert latency["free"]["requests"] + sum(latency["free"]["not_ok"].values()) == 10, latency
    assert latency["limited"]["requests"] + sum(latency["limited"]["not_ok"].values()) == 10, latency
    assert latency["free"]["requests"] == 10, latency  # a key without limits: every answer a 200
    kill = run["redis-kill"]
    assert kill["away_s"] >= 1 and kill["before"]["offered"] + kill["away"]["offered"] + kill["after"]["offered"] == 3
    assert llmgw["summary"]["rpm_burst_admitted"]["median"] == run["rpm"]["admitted"]
