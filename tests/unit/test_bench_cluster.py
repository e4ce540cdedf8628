"""The benchmarks of several gateways (``cluster-events``, ``fault --gateways``, ``proxy``'s ``llmgw-redis``): their
options, and the arithmetic and tables they report, on made-up numbers (the runs themselves are in
tests/integration/test_bench_cluster.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from llmgw import cli
from llmgw.bench import cluster_events, fault_cluster, proxy


@pytest.mark.parametrize("name, options", [
    ("cluster-events", ("--followers", "--rate", "--poll-interval", "--json")),
    ("fault", ("--gateways", "--redis-down", "--load-ttl", "--json")),
])
def test_the_cluster_benchmarks_are_dispatched_and_say_their_options(capsys, name, options):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", name, "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith(f"usage: llmgw bench {name}") and all(option in help_text for option in options)


@pytest.mark.parametrize("argv", [["--followers", "0"], ["--duration", "0"], ["--rate", "500"]])
def test_cluster_events_refuses_options_out_of_bounds(argv):
    with pytest.raises(SystemExit) as exit_:
        cluster_events.main(argv)
    assert exit_.value.code == 2


def test_fault_refuses_too_many_gateways():
    from llmgw.bench import fault

    with pytest.raises(SystemExit) as exit_:
        fault.main(["--gateways", "9"])
    assert exit_.value.code == 2


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert cluster_events.percentile(values, 0.5) == 50.0
    assert cluster_events.percentile(values, 0.99) == 99.0
    assert cluster_events.percentile(values, 1.0) == 100.0
    assert cluster_events.percentile([], 0.5) is None


def test_the_log_delay_histogram_is_read_and_interpolated_as_prometheus_does():
    text = "\n".join([
        "# TYPE llmgw_cluster_log_delay_seconds histogram",
        'llmgw_cluster_log_delay_seconds_bucket{le="0.001"} 0.0',
        'llmgw_cluster_log_delay_seconds_bucket{le="0.002"} 50.0',
        'llmgw_cluster_log_delay_seconds_bucket{le="0.005"} 100.0',
        'llmgw_cluster_log_delay_seconds_bucket{le="+Inf"} 100.0',
        "llmgw_cluster_log_delay_seconds_count 100.0",
    ])
    buckets = cluster_events.histogram(text, cluster_events.DELAY_METRIC)
    assert buckets == {0.001: 0.0, 0.002: 50.0, 0.005: 100.0, math.inf: 100.0}
    assert cluster_events.histogram_quantile(0.5, buckets) == pytest.approx(0.002)
    assert cluster_events.histogram_quantile(0.75, buckets) == pytest.approx(0.0035)
    assert cluster_events.histogram_quantile(0.5, {0.001: 0.0, math.inf: 0.0}) is None


def test_cluster_events_summary_and_table():
    seen = {"c": cluster_events.Seen(10.010, 2, 1.0), "f": cluster_events.Seen(10.020, 1, 1.0)}
    samples = [cluster_events.Sample("sim-0", 56, 56, 10.0, 10.005, dict(seen))]
    summary = cluster_events.summarize(samples, [("c", "control"), ("f", "gateway")],
                                       {"f": {0.005: 3.0, math.inf: 4.0}})
    follower = summary["gateways"][1]
    assert follower["from_event_p50_ms"] == pytest.approx(20.0) and follower["from_response_p50_ms"] == 15.0
    assert follower["at_first_poll"] == 1 and follower["log_delay"]["batches"] == 4
    assert summary["followers_p99_from_event_ms"] == pytest.approx(20.0) and summary["target_met"]
    assert "| f | gateway | 1 |" in cluster_events.markdown(summary)


def run(target: str, scenario: str, p50_ms: float, cpu_us: float) -> proxy.RunResult:
    return proxy.RunResult(target=target, scenario=scenario, connections=1, requests=1000, seconds=1.0, rps=1000.0,
                           p50_ms=p50_ms, p90_ms=p50_ms, p99_ms=p50_ms, p999_ms=p50_ms, max_ms=p50_ms, errors={},
                           proxy_cpu_share=None if target == "direct" else cpu_us / 1000,
                           proxy_cpu_us_per_request=None if target == "direct" else cpu_us)


def test_proxy_compares_llmgw_on_redis_with_llmgw_round_by_round():
    results = []
    for _ in range(2):  # two rounds
        for scenario, *_ in proxy.SCENARIOS:
            results += [run("direct", scenario, 0.1, 0), run("llmgw", scenario, 0.5, 100),
                        run(proxy.REDIS_TARGET, scenario, 0.52, 104)]
    summary = proxy.summarize(results, ["direct", "llmgw", proxy.REDIS_TARGET])
    ratios = summary["ratios_llmgw_redis_vs_llmgw"]
    assert ratios["c32_cpu_ratio"] == pytest.approx(1.04) and ratios["c32_cpu_ratio_rounds"] == [1.04, 1.04]
    assert ratios["c1_added_p50_ratio"] == pytest.approx(1.05)
    assert all(summary["redis_targets_met"].values())


def test_proxy_knows_the_redis_target_and_refuses_unknown_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        proxy.main(["--targets", "direct,nope"])
    assert exit_.value.code == 2 and "unknown targets: nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        proxy.main(["--help"])
    assert proxy.REDIS_TARGET in capsys.readouterr().out


def test_fault_cluster_table_tells_the_killed_gateway_from_the_others():
    outcome = fault_cluster.GatewayOutcome
    results = [
        fault_cluster.ClusterFaultResult("gateway", "gw-2", 100, True, 2, 3.0, None, [
            outcome("control", "control", 40, {}, 0, load_gone_s=1.6),
            outcome("gw-2", "gateway", 20, {"in_flight": 2}, 7)]),
        fault_cluster.ClusterFaultResult("redis", None, 100, True, None, None, 10.1, [
            outcome("control", "control", 50, {}, 0, degraded_after_s=0.05, degraded_for_s=11.3,
                    live_after_return_s=1.2),
            outcome("gw-2", "gateway", 50, {}, 0, degraded_after_s=0.05, degraded_for_s=11.3,
                    live_after_return_s=1.2, index_equal_after_return_s=1.3, index_differed_before_return=True)]),
    ]
    assert results[0].failed_elsewhere() == 0
    table = fault_cluster.markdown(results)
    assert "| kill -9 gw-2 | gw-2 (killed) | 20 | 2 in_flight | 7 |" in table
    assert "| 1.30 s (had differed) |" in table
    assert "0 failed on the other gateways" in table and "2 lost in flight on it" in table
    again = [fault_cluster.result_from_dict(dataclasses.asdict(r)) for r in results]
    assert again == results
