"""The benchmarks of several gateways as real commands, briefly: the reports' shape and where their numbers come from.

No latency or timing claim is asserted (those are the benchmarks' own, measured on a quiet machine); what is
checked: every sample was seen by every gateway and timed from the engine's own event, the followers' log-delay
histograms counted batches, and the fault run's rows name every gateway with what each fault measures.
"""

from __future__ import annotations

import json
import sys

import pytest
import trio

pytestmark = pytest.mark.slow


async def bench(tmp_path, *argv: str) -> dict:
    out = tmp_path / "report.json"
    command = [sys.executable, "-m", "llmgw", "bench", *argv, "--json", str(out)]
    with trio.fail_after(120):
        done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()[-3000:]
    report = json.loads(out.read_text())
    assert report["markdown"] in done.stdout.decode()
    return report


async def test_cluster_events_times_every_sample_on_every_gateway_from_the_engines_event(tmp_path):
    report = await bench(tmp_path, "cluster-events", "--followers", "1", "--duration", "2", "--rate", "4")
    samples = report["samples"]
    assert samples and report["event_decode_errors"] == 0
    for sample in samples:
        assert sample["event_ts"] is not None and sample["stored"] >= 1 and sample["blocks"] >= 1
        assert set(sample["seen"]) == {"llmgw control", "llmgw gateway-1"}
        assert all(seen["at"] is not None for seen in sample["seen"].values())
    control, follower = report["summary"]["gateways"]
    assert (control["role"], follower["role"]) == ("control", "gateway")
    assert control["samples"] == follower["samples"] == len(samples) and follower["missed"] == 0
    assert "log_delay" not in control and follower["log_delay"]["batches"] >= 1


async def test_fault_with_several_gateways_kills_one_then_redis_and_reports_each_gateway(tmp_path):
    report = await bench(tmp_path, "fault", "--gateways", "3", "--duration", "2", "--redis-down", "1",
                         "--rate", "10")
    gateway, leader, redis = report["results"]
    names = {"llmgw control", "llmgw candidate-1", "llmgw gateway-2"}
    assert gateway["fault"] == "gateway" and gateway["victim"] == "llmgw gateway-2"
    assert {row["gateway"] for row in gateway["gateways"]} == names
    for row in gateway["gateways"]:
        # each survivor saw the killed gateway's load reports expire
        assert (row["load_gone_s"] is None) == (row["gateway"] == gateway["victim"])
    assert gateway["back_s"] is not None and gateway["lost_before_gone"]
    # The leader killed: the other candidate leads, every follower's index becomes its, nothing fails elsewhere.
    assert leader["fault"] == "leader" and leader["victim"] == "llmgw control"
    assert leader["new_leader"] == "llmgw candidate-1" and leader["new_leader_s"] is not None
    assert leader["index_equal_s"] is not None and leader["engines_same_pids"] and leader["lost_before_gone"]
    # gateway-2 held the old leader's log to its end: it went on with the new one's, loading no snapshot
    assert leader["continued"] == 1 and leader["snapshots_loaded"] == 0, leader
    assert [row["failed"] for row in leader["gateways"] if row["gateway"] != leader["victim"]] == [{}, {}], leader
    assert redis["fault"] == "redis" and redis["down_s"] >= 1
    assert redis["leaderless_while_down"] and redis["new_leader"] in ("llmgw control", "llmgw candidate-1")
    for row in redis["gateways"]:
        assert row["degraded_after_s"] is not None and row["live_after_return_s"] is not None
        assert (row["index_equal_after_return_s"] is None) == (row["gateway"] == redis["new_leader"])


async def test_fault_behind_sentinel_kills_the_primary_and_reports_the_promotion(tmp_path):
    report = await bench(tmp_path, "fault", "--gateways", "2", "--redis", "sentinel", "--duration", "2",
                         "--rate", "10")
    _gateway, primary = report["results"]
    assert report["settings"]["redis"] == "sentinel"
    assert primary["fault"] == "primary" and primary["down_s"] > 0  # kill -> the sentinel named the replica
    for row in primary["gateways"]:
        assert row["failed"] == {}, row
        assert (row["index_equal_after_return_s"] is None) == (row["role"] == "control")


async def test_chaos_quick_cuts_the_last_gateway_from_redis_under_load_and_reports_every_gateway(tmp_path):
    report = await bench(tmp_path, "chaos", "--quick")
    (result,) = report["results"]
    assert result["fault"] == "partition" and result["fault_s"] >= 4 and result["victim"] is None
    # two candidates and one --role gateway, each under load, the first candidate leading when it started
    assert [row["gateway"] for row in result["gateways"]] == ["A", "B", "F1"]
    assert all(row["requests"] > 0 for row in result["gateways"])
    # the cut reached the last gateway only: its /health said degraded, the candidates' never did
    assert [row["degraded_s"] > 0 for row in result["gateways"]] == [False, False, True], result["gateways"]
    assert result["leaders"][0].startswith("A term ")
    # the fixed deployment's two replicas and the autoscaled one's (at its min) deployed through the remote agent,
    # their engines' pids as the agent reported them; the scaler's count read from the leader, unmoved by the cut
    assert sorted(result["engines_before"]) == ["tiny-auto-sim-0", "tiny-sim-0", "tiny-sim-1"]
    assert all(pid > 0 for pid in result["engines_before"].values())
    assert (result["scaler"]["before"], result["scaler"]["after"], result["scaler"]["decisions"]) == (1, 1, [])
    assert report["settings"]["gateways"] == 1 and report["settings"]["partition"] == 4


async def test_chaos_soak_samples_every_process_and_reports_each_ones_slope(tmp_path):
    report = await bench(tmp_path, "chaos", "--soak", "0.5", "--soak-every", "10", "--faults",
                         "partition,engine-kill", "--partition", "4", "--observe", "2", "--before", "1",
                         "--stable", "1", "--sample-every", "1", "--routing-options", "{tree_ttl: 30s}")
    assert [r["fault"] for r in report["results"]] == ["partition", "engine-kill"]
    assert report["routing_options"] == {"tree_ttl": "30s"}
    assert set(report["redis_pool_recycles"]) == {"A", "B", "F1"}  # from each gateway's /metrics at the end
    assert all(isinstance(n, int) for n in report["redis_pool_recycles"].values()), report["redis_pool_recycles"]
    processes = report["processes"]
    assert set(processes) == {"A", "B", "F1", "agent", "redis"}
    for name, entry in processes.items():
        assert entry["samples"] >= 5 and entry["rss_bytes"]["first"] > 0 and entry["fds"]["first"] > 0
        assert entry["rss_bytes"]["per_hour"] is not None
        # the gateways' Trio task count comes from their /metrics (llmgw_trio_tasks); the others have none
        assert (entry["trio_tasks"]["first"] is not None) == (name in ("A", "B", "F1")), (name, entry)
    assert report["requests"] > 0 and isinstance(report["failed_outside_victims"], int)
