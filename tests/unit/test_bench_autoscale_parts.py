"""``llmgw bench autoscale``'s pure parts: the traces and their arrivals, the oracle, the report's numbers and chart,
and the fleet's config (each arm's deployments as the config loader reads them)."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.bench import autoscale
from llmgw.bench.autoscale_oracle import needed, plan
from llmgw.bench.autoscale_report import (
    chart,
    charts,
    markdown,
    model_stats,
    replica_seconds,
    reversals,
    run_summary,
    series,
    slo_attainment,
    step_to_serving,
    targets,
    targets_markdown,
)
from llmgw.bench.autoscale_rig import EngineShape, fleet_config
from llmgw.bench.autoscale_traces import (
    MODEL_A,
    MODEL_B,
    TRACES,
    arrival_times,
    diurnal_trace,
    idle_trace,
    shortened,
    step_trace,
    swap_trace,
)
from llmgw.bench.chaos_rig import H100, node_fixture
from llmgw.bench.overload_workload import ERROR, INTERACTIVE, OK, SHED, Outcome
from llmgw.config.loading import parse_config
from llmgw.flow.model import DEFAULT_CLASSES


def outcome(sent: float, ttft: float = 0.1, kind: str = OK) -> Outcome:
    return Outcome(MODEL_A, INTERACTIVE, sent, kind, 200 if kind == OK else 429, ttft, ttft + 0.5)


def sample(t: float, ready: int, starting: int = 0, model: str = MODEL_A) -> dict:
    return {"t": t, "models": {model: {"ready": ready, "starting": starting, "queued": 0, "inflight": 0}}}


# -- traces ----------------------------------------------------------------------------------------------------------


def test_the_traces_are_a_step_a_day_a_swap_and_an_idle_model():
    step = step_trace(600, base=1.8)
    assert step.demand(MODEL_A, 0) == 1.8 and step.demand(MODEL_A, 199) == 1.8 and step.demand(MODEL_A, 200) == 3.6
    assert step.step_at == 200 and step.min_replicas == 2  # the fleet is at the base's need when the step comes
    day = diurnal_trace(1200, low=0.5, high=3.5)
    assert day.demand(MODEL_A, 0) == pytest.approx(0.5) and day.demand(MODEL_A, 600) == pytest.approx(3.5)
    assert day.demand(MODEL_A, 300) == pytest.approx(2.0)
    swap = swap_trace(900, busy=3.4, quiet=0.6)
    assert (swap.demand(MODEL_A, 10), swap.demand(MODEL_B, 10)) == (3.4, 0.6)
    assert (swap.demand(MODEL_A, 460), swap.demand(MODEL_B, 460)) == (0.6, 3.4)
    idle = idle_trace(600, load=1.2)
    assert idle.min_replicas == 0 and idle.demand(MODEL_A, 299) == 0 and idle.demand(MODEL_A, 300) == 1.2
    assert idle.called_at == 300
    assert set(TRACES) == {"step", "diurnal", "swap", "idle"}


def test_a_shortened_trace_is_the_same_shape_over_a_share_of_its_length():
    short = shortened(step_trace(600), 0.25)
    assert short.seconds == 150 and short.step_at == 50
    assert short.demand(MODEL_A, 49) == 1.8 and short.demand(MODEL_A, 50) == 3.6


def test_arrivals_follow_the_traces_rate_in_wall_time():
    trace = step_trace(600, base=2.0)  # 2 then 4 replicas' worth; 60 wall seconds at factor 10
    times = arrival_times(trace, MODEL_A, replica_rps=5.0, factor=10.0, rng=random.Random(1))
    before = [t for t in times if t < 20]  # 20 wall s at 10 req/s, then 40 at 20 req/s
    after = [t for t in times if t >= 20]
    assert len(before) == pytest.approx(200, rel=0.2) and len(after) == pytest.approx(800, rel=0.15)
    idle = arrival_times(idle_trace(600), MODEL_A, 5.0, 10.0, random.Random(2))
    assert idle and min(idle) >= 30  # nothing while the model is idle


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(TRACES)), rps=st.floats(0.0, 20.0), factor=st.floats(1.0, 100.0),
       seed=st.integers(0, 1000))
def test_arrivals_are_ascending_within_the_trace_and_only_where_there_is_demand(name, rps, factor, seed):
    trace = TRACES[name]()
    for model in trace.models:
        times = arrival_times(trace, model, rps, factor, random.Random(seed))
        assert times == sorted(times) and all(0 <= t < trace.seconds / factor for t in times)
        assert all(trace.demand(model, t * factor) > 0 for t in times)


# -- the oracle ------------------------------------------------------------------------------------------------------


def test_the_oracle_needs_the_ceiling_of_demand_within_min_and_max():
    trace = step_trace(600, base=1.8)
    assert needed(trace, MODEL_A, 0) == 2 and needed(trace, MODEL_A, 300) == 4
    assert needed(idle_trace(), MODEL_A, 0) == 0 and needed(idle_trace(), MODEL_A, 400) == 2
    assert needed(diurnal_trace(1200, low=0.2, high=9.0), MODEL_A, 600) == 4  # the trace's max


def test_the_oracle_starts_a_replica_one_ready_time_before_it_is_needed():
    trace = step_trace(600, base=1.8)  # 4 needed from 200 s; 60 s to start: provisioned from 140 s
    oracle = plan(trace, MODEL_A, factor=10.0, ready_seconds=60.0, step=1.0)  # a point per 10 fleet seconds
    assert len(oracle.provisioned) == 60
    assert oracle.needed[13] == 2 and oracle.needed[20] == 4
    assert oracle.provisioned[13] == 2 and oracle.provisioned[14] == 4 and oracle.provisioned[59] == 4
    assert oracle.replica_seconds == pytest.approx(140 * 2 + 460 * 4)
    unshifted = plan(trace, MODEL_A, 10.0, 0.0, 1.0)
    assert unshifted.provisioned == unshifted.needed and unshifted.replica_seconds == 200 * 2 + 400 * 4


# -- the report ------------------------------------------------------------------------------------------------------


def test_reversals_count_turns_not_steps():
    assert reversals([1, 2, 3, 4, 4, 4]) == 0
    assert reversals([2, 3, 2]) == 1
    assert reversals([1, 2, 2, 1, 1, 2, 3, 2]) == 3
    assert reversals([]) == 0 and reversals([4, 3, 2, 2, 1]) == 0


def test_step_to_serving_is_from_the_step_to_the_extra_replica_ready():
    samples = [sample(0, 2), sample(5, 2), sample(10, 2, 2), sample(12, 3, 1), sample(14, 4)]
    assert step_to_serving(samples, MODEL_A, 9.0) == pytest.approx(3.0)
    assert step_to_serving(samples[:3], MODEL_A, 9.0) is None  # never served
    assert step_to_serving(samples, MODEL_A, -1.0) is None  # no sample before the step


def test_slo_attainment_is_the_share_of_windows_whose_p95_met_it_and_a_drop_misses():
    good = [outcome(t / 10, 0.2) for t in range(100)]  # 10 s of requests within the SLO
    assert slo_attainment(good, slo=0.5, window=2.0) == 1.0
    slow = [outcome(4 + t / 10, 2.0) for t in range(20)]  # the window [4, 6) all slow
    assert slo_attainment(good + slow, 0.5, 2.0) == pytest.approx(4 / 5)
    dropped = [outcome(8.5, kind=SHED) for _ in range(5)]  # [8, 10): 5 of 25 dropped: its p95 misses
    assert slo_attainment(good + dropped, 0.5, 2.0) == pytest.approx(4 / 5)
    assert slo_attainment([], 0.5, 2.0) is None


def test_replica_seconds_hold_each_samples_count_until_the_next():
    samples = [sample(0, 1), sample(2, 1, 1), sample(5, 3)]
    assert replica_seconds(samples, MODEL_A, end=6.0) == pytest.approx(1 * 2 + 2 * 3 + 3 * 1)
    assert replica_seconds(samples, MODEL_A, end=4.0) == pytest.approx(1 * 2 + 2 * 2)


def test_a_runs_stats_against_the_trace_and_the_oracle():
    trace = step_trace(60, base=1.8)  # the step at 20 fleet s = 2 wall s at factor 10
    oracle = plan(trace, MODEL_A, 10.0, 0.0, 0.5)
    samples = [sample(t / 2, 2 if t < 6 else 4, 2 if 3 <= t < 6 else 0) for t in range(12)]  # starting early
    outcomes = [outcome(t / 4, 0.1) for t in range(24)] + [outcome(3.0, kind=ERROR)]
    stats = model_stats(trace, MODEL_A, 10.0, samples, outcomes, oracle, slo=0.5, window=10.0)
    assert stats["sent"] == 25 and stats["dropped"] == 1 and stats["dropped_by"]["error"] == 1
    assert stats["step_to_serving_s"] == pytest.approx(10.0)  # ready at 3 wall s, 1 after the step
    assert stats["reversals"] == 0 and stats["from_zero_first_token_s"] is None
    assert stats["replica_seconds"] == pytest.approx((2 * 1.5 + 4 * 1.5 + 4 * 3) * 10)
    assert stats["oracle_replica_seconds"] == pytest.approx(20 * 2 + 40 * 4)
    assert stats["vs_oracle"] == pytest.approx(210 / 200)
    assert stats["most_over_oracle"] == 2  # 4 provisioned at 1.5 wall s, while 2 were needed
    assert stats["slo_attainment"] == pytest.approx(5 / 6)  # the window holding the failed request misses


def test_from_zero_is_the_first_called_requests_first_token():
    trace = idle_trace(60)  # called at 30 fleet s = 3 wall s
    oracle = plan(trace, MODEL_A, 10.0, 60.0, 0.5)
    outcomes = [outcome(3.2, 0.8), outcome(3.5, 0.1)]
    stats = model_stats(trace, MODEL_A, 10.0, [sample(0, 0), sample(3.5, 1)], outcomes, oracle, 1.0, 10.0)
    assert stats["from_zero_first_token_s"] == pytest.approx(8.0) and stats["from_zero_dropped"] is False
    lost = model_stats(trace, MODEL_A, 10.0, [sample(0, 0)], [outcome(3.2, kind=SHED)], oracle, 1.0, 10.0)
    assert lost["from_zero_first_token_s"] is None and lost["from_zero_dropped"] is True


def test_the_chart_draws_ready_starting_and_uncovered_demand():
    trace = step_trace(60, base=1.8)
    oracle = plan(trace, MODEL_A, 10.0, 0.0, 1.0)
    samples = [sample(0, 2), sample(1, 2), sample(2, 2), sample(3, 2, 2), sample(4, 4), sample(5, 4)]
    drawn = series(trace, MODEL_A, 10.0, samples, oracle)
    assert drawn["t"] == [0, 10, 20, 30, 40, 50] and drawn["demand"][2] == 3.6 and drawn["oracle"][2] == 4
    rows = chart(drawn).splitlines()
    assert rows[0] == "  4 |  .+##" and rows[1] == "  3 |  .+##"
    assert rows[2] == "  2 |######" and rows[3] == "  1 |######"
    assert "50 s" in rows[-1]
    assert chart({"t": []}) == "(no samples)"


def test_the_table_has_a_row_per_trace_arm_and_model_and_says_an_arm_that_could_not_run():
    stats = {"sent": 10, "dropped": 0, "step_to_serving_s": 70.0, "from_zero_first_token_s": None, "reversals": 1,
             "reversals_per_10_min": 1.0, "ttft_p95_ms": 120.0, "slo_attainment": 1.0, "replica_seconds": 900.0,
             "oracle_replica_seconds": 800.0, "vs_oracle": 1.125, "most_over_oracle": 1}
    summary = run_summary([{MODEL_A: stats}, {MODEL_A: {**stats, "step_to_serving_s": 90.0}},
                           {MODEL_A: {**stats, "step_to_serving_s": None}}])
    assert summary[MODEL_A]["step_to_serving_s"] == {"median": 80.0, "min": 70.0, "max": 90.0, "of": [2, 3]}
    assert summary[MODEL_A]["dropped"]["of"] == [3, 3]
    report = {"settings": {"nodes": 2, "gpus_per_node": 4, "gpu": "H100 80GB", "profile": "h100-llama-3.1-8b",
                           "sim_note": "--max-num-seqs 2", "cold_start_s": 60.0, "hot_start_s": 5.0,
                           "time_factor": 10.0, "utilisation": 0.7, "ttft_slo_ms": 1000.0, "window_s": 30.0,
                           "repeats": 3},
              "capacity": {"rps": 3.0, "replica_worth_rps": 2.1},
              "runs": [{"trace": "step", "arm": "fixed-max", "summary": summary,
                        "series": {MODEL_A: {"t": [0], "demand": [1.8], "oracle": [2], "ready": [4],
                                             "starting": [0]}}},
                       {"trace": "step", "arm": "autoscaled", "error": "not available: no autoscaling"}]}
    table = markdown(report)
    assert "| step | fixed-max | llama-a | 80.0 [70.0-90.0] (2 of 3) | - | 0 [0-0] |" in table
    assert "1.12x [1.12-1.12]" in table and "100% [100-100]" in table
    assert "| step | autoscaled | - | not available: no autoscaling |" in table
    assert "2.10 req/s (70% of the 3.00 req/s measured)" in table
    assert charts(report).startswith("step / fixed-max / llama-a:")


# -- the fleet ------------------------------------------------------------------------------------------------------


def test_each_arms_fleet_config_loads(tmp_path: Path):
    engine = EngineShape("h100-llama-3.1-8b", 2, 6.0, 0.5)
    trace = swap_trace()
    for arm in (autoscale.FIXED_MAX, autoscale.FIXED_MIN):
        text = fleet_config(tmp_path, engine,
                            {m: autoscale.deployment_lines(arm, trace, 10.0) for m in trace.models})
        config = parse_config(text, "fleet.yaml")
        counts = {d.profile: d.replicas for d in config.deployments}
        expected = trace.max_replicas if arm == autoscale.FIXED_MAX else trace.min_replicas
        assert counts == {"h100-llama-a": expected, "h100-llama-b": expected}
        assert config.profile("h100-llama-a").args[:4] == ["--profile", "h100-llama-3.1-8b", "--max-num-seqs", "2"]
        assert config.profile("h100-llama-b").served_model_name == MODEL_B


def test_the_autoscaled_arm_loads_with_its_windows_divided_or_says_this_llmgw_cannot_autoscale(tmp_path: Path):
    trace = idle_trace()
    if not autoscale.autoscale_available():
        with pytest.raises(autoscale.ArmUnavailable, match="no autoscaling"):
            autoscale.deployment_lines(autoscale.AUTOSCALED, trace, 10.0)
        return
    text = fleet_config(tmp_path, EngineShape("h100-llama-3.1-8b", 2, 6.0, 0.5),
                        {MODEL_A: autoscale.deployment_lines(autoscale.AUTOSCALED, trace, 10.0)},
                        autoscale.config_extra(autoscale.AUTOSCALED, 10.0))
    config = parse_config(text, "fleet.yaml")
    (deployment,) = config.deployments
    settings = deployment.autoscale_settings()
    assert (settings.min_replicas, settings.max_replicas) == (0, 4) and deployment.autoscaled
    assert (settings.scale_up_after, settings.scale_down_after, settings.idle_to_zero) == (0.5, 30.0, 60.0)
    assert config.autoscale.interval == 0.1
    assert autoscale.config_extra(autoscale.FIXED_MAX, 10.0) == ""


def test_the_sleep_arm_is_the_autoscaled_one_with_sleep_mode_and_a_keep_warm_longer_than_any_trace(tmp_path: Path):
    if not autoscale.autoscale_available():
        return
    trace = swap_trace()
    text = fleet_config(tmp_path, EngineShape("h100-llama-3.1-8b", 2, 6.0, 0.5),
                        {m: autoscale.deployment_lines(autoscale.AUTOSCALED_SLEEP, trace, 10.0) for m in trace.models},
                        autoscale.config_extra(autoscale.AUTOSCALED_SLEEP, 10.0),
                        autoscale.profile_extra(autoscale.AUTOSCALED_SLEEP))
    config = parse_config(text, "fleet.yaml")
    cold = parse_config(fleet_config(tmp_path, EngineShape("h100-llama-3.1-8b", 2, 6.0, 0.5),
                                     {m: autoscale.deployment_lines(autoscale.AUTOSCALED, trace, 10.0)
                                      for m in trace.models}, autoscale.config_extra(autoscale.AUTOSCALED, 10.0),
                                     autoscale.profile_extra(autoscale.AUTOSCALED)), "fleet.yaml")
    for deployment, same in zip(config.deployments, cold.deployments):
        settings = deployment.autoscale_settings()
        assert settings.keep_warm == 360.0 and settings.keep_warm * 10 > max(t().seconds for t in TRACES.values())
        assert dataclasses.replace(settings, keep_warm=0.0) == same.autoscale_settings()
        assert config.profile(deployment.profile).sleep_mode and not cold.profile(same.profile).sleep_mode
    assert config.autoscale.interval == cold.autoscale.interval == 0.1
    assert autoscale.AUTOSCALED_SLEEP not in autoscale.parse([]).arms  # opt-in
    assert autoscale.parse(["--arms", "autoscaled-sleep"]).arms == [autoscale.AUTOSCALED_SLEEP]


def test_at_a_smaller_compression_the_flow_classes_wait_as_long_in_fleet_seconds(tmp_path: Path):
    text = fleet_config(tmp_path, EngineShape("h100-llama-3.1-8b", 2, 30.0, 2.5), {MODEL_A: "replicas: 1"},
                        autoscale.config_extra(autoscale.FIXED_MAX, 2.0))
    waits = {c.name: c.max_wait for c in parse_config(text, "fleet.yaml").flow.classes}
    assert waits == {c.name: c.max_wait * 10 / 2 for c in DEFAULT_CLASSES}  # standard: 10 s at 10x, 50 s at 2x


def test_the_nodes_are_recorded_h100s_with_uuids_of_their_own():
    a, b = node_fixture(4, H100, "node-a", 0), node_fixture(4, H100, "node-b", 1)
    uuids = [d["uuid"] for node in (a, b) for d in node["nvml"]["devices"]]
    assert len(set(uuids)) == 8 and a["host"]["hostname"] == "node-a"
    assert all(d["name"] == "NVIDIA H100 80GB HBM3" for d in a["nvml"]["devices"])
    json.dumps(a)


def test_quick_is_one_repeat_and_names_are_checked(capsys):
    args = autoscale.parse(["--quick", "--traces", "step,idle"])
    assert args.repeats == 1 and args.traces == ["step", "idle"] and args.arms == list(autoscale.ARMS)
    assert [t.seconds for t in autoscale.traces_of(args)] == [150.0, 150.0]
    with pytest.raises(SystemExit):
        autoscale.parse(["--traces", "weekly"])
    assert "unknown traces: weekly" in capsys.readouterr().err


def test_the_autoscaled_arms_medians_are_checked_against_the_issues_targets():
    def summary(**values):
        return {MODEL_A: {key: {"median": v, "min": v, "max": v} for key, v in values.items()}}

    report = {"settings": {"cold_start_s": 60.0},
              "runs": [{"trace": "step", "arm": "autoscaled",
                        "summary": summary(step_to_serving_s=72.0, reversals_per_10_min=2.0, most_over_oracle=1)},
                       {"trace": "idle", "arm": "autoscaled",
                        "summary": summary(dropped=0, from_zero_first_token_s=None, most_over_oracle=0)},
                       {"trace": "diurnal", "arm": "fixed-max", "summary": summary(vs_oracle=1.6)},
                       {"trace": "diurnal", "arm": "autoscaled", "error": "not available"}]}
    found = {(t["trace"], t["measure"]): (t["median"], t["bound"], t["met"]) for t in targets(report, "autoscaled")}
    assert found == {("step", "step_to_serving_s"): (72.0, 75.0, True),
                     ("step", "reversals_per_10_min"): (2.0, 1, False),
                     ("step", "most_over_oracle"): (1, 1, True),
                     ("idle", "dropped"): (0, 0, True),
                     ("idle", "from_zero_first_token_s"): (None, 62.0, False),  # every first request dropped
                     ("idle", "most_over_oracle"): (0, 1, True)}
    table = targets_markdown(report, "autoscaled")
    assert "| step | llama-a | the extra replica serves within the cold start + 15 s | 72.00 | 75 | yes |" in table
    assert targets_markdown(report, "nope").startswith("(no nope run")
