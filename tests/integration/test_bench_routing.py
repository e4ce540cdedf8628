"""``llmgw bench routing`` as a real command on real simulators: the report's shape and where its numbers come from.

No routing claim is asserted (those are the benchmark's, measured with repeats on a quiet machine); the
structural facts are: every arm and repeat sent the same requests (ids and bodies), hit rates are the
engines' cached over prompt tokens from the per-request usage, request counts per replica are the
engines' own, and only a router process has a CPU time.
"""

from __future__ import annotations

import json
import statistics
import sys

import pytest
import trio

from llmgw.sim import tokenizer

pytestmark = pytest.mark.slow

SYSTEM = "You answer questions about the shared handbook. " + "the quick brown fox jumps over the lazy dog " * 20


def write_trace(path) -> list[dict]:
    lines = []
    for s in range(2):
        for t in range(2):
            lines.append({"id": f"s{s}-t{t}", "session": f"s{s}", "max_tokens": 8,
                          "messages": [{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": f"session {s} question {t}"}]})
    lines.append({"id": "alone", "messages": [{"role": "user", "content": "a question of its own"}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return lines


async def test_every_arm_sends_the_same_requests_and_hit_rates_come_from_engine_usage(tmp_path):
    trace = write_trace(tmp_path / "trace.jsonl")
    out = tmp_path / "routing.json"
    argv = [sys.executable, "-m", "llmgw", "bench", "routing", "--workload", f"trace:{tmp_path / 'trace.jsonl'}",
            "--arms", "round_robin,kv_index,oracle", "--concurrency", "2", "--repeats", "2", "--replicas", "2",
            "--time-scale", "0.05", "--json", str(out), "--markdown", str(tmp_path / "routing.md")]
    with trio.fail_after(240):
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    fields = report["record_fields"]
    workload = report["workloads"][f"trace:{tmp_path / 'trace.jsonl'}"]
    assert workload["requests"] == len(trace)
    assert set(workload["arms"]) == {"round_robin", "kv_index", "oracle"}

    sent = set()
    prompt_lengths = {line["id"]: len(tokenizer.encode_chat(line["messages"])) for line in trace}
    for name, arm in workload["arms"].items():
        runs = arm["runs"]["2"]
        assert len(runs) == 2
        for run in runs:
            records = [dict(zip(fields, values)) for values in run["records"]]
            assert sorted(r["id"] for r in records) == sorted(prompt_lengths)
            sent.add(tuple((r["id"], r["digest"]) for r in records))
            summary = run["summary"]
            assert summary["errors"] == 0 and all(r["status"] == 200 for r in records)
            # the engines' usage: prompt_tokens as the simulator tokenizes, hit rate = cached / prompt
            assert all(r["prompt_tokens"] == prompt_lengths[r["id"]] for r in records)
            assert summary["hit_rate"] == pytest.approx(sum(r["cached_tokens"] for r in records)
                                                        / sum(r["prompt_tokens"] for r in records))
            assert summary["output_tokens"] == sum(r["completion_tokens"] for r in records) > 0
            assert sum(summary["per_replica"]) == len(records)  # the simulators' own request counters
            # the second turn of a session repeats the first's system prompt: an infinite cache holds it
            assert all(r["ideal_cached_tokens"] > 0 for r in records if r["id"].endswith("-t1"))
            assert (summary["router_cpu_s"] is None) == (name == "oracle")
            # calibration: every kv_index decision read from the gateway's ring, with its estimate and TTFT
            decisions = [dict(zip(report["decision_fields"], row)) for row in run["decisions"]]
            assert len(decisions) == (len(records) if name == "kv_index" else 0)
            assert summary.get("decisions_read") == (None if name == "oracle" else len(decisions))
            assert all(d["estimated_ttft_s"] > 0 and d["actual_ttft_s"] > 0 for d in decisions)
            # every candidate's estimate, the chosen one's among them
            assert all(set(d["candidates_ttft_s"]) == {"sim-0", "sim-1"} for d in decisions)
            assert all(d["candidates_ttft_s"][d["replica"]] == d["estimated_ttft_s"] for d in decisions)
        if name == "kv_index":
            pooled = arm["calibration"]["2"]
            assert pooled["all"]["decisions"] == 2 * len(trace)
            assert sum(s["decisions"] for outcome, s in pooled.items() if outcome != "all") == 2 * len(trace)
        else:
            assert not arm.get("calibration", {}).get("2")
        point = arm["by_concurrency"]["2"]
        assert point["repeats"] == 2 and point["hit_rate"] is not None and point["ttft_p90_ms"] > 0
        assert arm["knee"] == {"concurrency": 2, "reached": False,
                               "output_tokens_per_s": point["output_tokens_per_s"]}
    assert len(sent) == 1  # every arm and repeat: the same ids and the same bodies
    table = (tmp_path / "routing.md").read_text()
    assert all(f"| {label} |" in table for label in ("round_robin", "kv_index", "oracle"))
    assert "| kv_index | 2 | all | 10 |" in table  # the calibration table: kv_index's 2 x 5 decisions


async def test_several_gateways_share_the_requests_round_robin_and_the_load_balance_is_reported(tmp_path):
    trace = write_trace(tmp_path / "trace.jsonl")
    out = tmp_path / "gateways.json"
    argv = [sys.executable, "-m", "llmgw", "bench", "routing", "--workload", f"trace:{tmp_path / 'trace.jsonl'}",
            "--arms", "kv_index", "--gateways", "1,2", "--concurrency", "2", "--repeats", "1", "--replicas", "2",
            "--time-scale", "0.05", "--json", str(out)]
    with trio.fail_after(120):
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["gateways"] == [1, 2]
    arms = report["workloads"][f"trace:{tmp_path / 'trace.jsonl'}"]["arms"]
    assert set(arms) == {"kv_index N=1", "kv_index N=2"}
    fields = report["record_fields"]
    for n in (1, 2):
        (run,) = arms[f"kv_index N={n}"]["runs"]["2"]
        records = [dict(zip(fields, values)) for values in run["records"]]
        summary = run["summary"]
        assert summary["errors"] == 0 and summary["gateways"] == n
        # request i through gateway i mod N: with 5 requests, 3 and 2 (every gateway served, the followers too)
        assert summary["per_gateway"] == ([len(trace)] if n == 1 else [3, 2])
        assert sorted(r["gateway"] for r in records) == sorted(i % n for i in range(len(trace)))
        assert sum(summary["per_replica"]) == len(trace)  # the engines' own counts, whichever gateway sent them
        assert summary["load_cov"] == pytest.approx(statistics.pstdev(summary["per_replica"])
                                                    / statistics.fmean(summary["per_replica"]))
        assert summary["router_cpu_s"] is not None  # every gateway (and the cluster's redis-server)
    assert "| kv_index | 2 | 2 |" in done.stdout.decode()  # the table of N beside N=1


async def test_a_new_workload_on_a_gpu_profile_reports_itl_goodput_and_its_cache_reset(tmp_path):
    out = tmp_path / "restart.json"
    argv = [sys.executable, "-m", "llmgw", "bench", "routing", "--workload", "restart", "--quick",
            "--arms", "kv_index,oracle", "--replicas", "2", "--sim-profile", "h100-llama-3.1-8b",
            "--time-scale", "0.05", "--json", str(out)]
    with trio.fail_after(240):
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["sim_profile"] == "h100-llama-3.1-8b"
    workload = report["workloads"]["restart"]
    assert workload["profiles"] == ["h100-llama-3.1-8b"] * 2
    assert workload["simulators"]["num_blocks"] is None  # the GPU's memory: restart needs no given capacity
    assert workload["objectives"]["measured"] == {"ttft_ms": pytest.approx(1000 * 0.05),
                                                  "itl_ms": pytest.approx(50 * 0.05)}
    fields = report["record_fields"]
    requests = workload["requests"]
    for arm in workload["arms"].values():
        (run,) = arm["runs"]["8"]
        summary = run["summary"]
        records = [dict(zip(fields, values)) for values in run["records"]]
        assert summary["errors"] == 0 and len(records) == requests
        # replica 0's prefix cache was reset once, 40% of the way through, and the engine accepted it
        reset = summary["cache_reset"]
        assert reset["after"] == round(0.4 * requests) and reset["replica"] == 0 and reset["success"] is True
        assert 0 < reset["at_s"] < summary["wall_s"]
        # ITL: every stream's gaps between its content chunks, at most one per token after the first
        assert all(len(r["itl_ms"]) <= r["completion_tokens"] - 1 for r in records)
        assert all(r["ttft_ms"] + sum(r["itl_ms"]) <= r["latency_ms"] + 1e-6 for r in records)
        gaps = sorted(g for r in records for g in r["itl_ms"])
        assert gaps and summary["itl_p50_ms"] in gaps and summary["itl_p90_ms"] in gaps
        good = sum(1 for r in records if r["ttft_ms"] <= summary["slo_ttft_ms"]
                   and (not r["itl_ms"] or sum(r["itl_ms"]) / len(r["itl_ms"]) <= summary["slo_itl_ms"]))
        assert summary["goodput_requests"] == good
        assert summary["goodput_rps"] == pytest.approx(good / summary["wall_s"])
        point = arm["by_concurrency"]["8"]
        assert {"itl_p50_ms", "itl_p90_ms", "goodput_rps", "hit_rate", "ttft_p90_ms"} <= set(point)
    assert "Latency and goodput (objectives: TTFT <= 1000 ms and mean ITL <= 50 ms modelled" in done.stdout.decode()
