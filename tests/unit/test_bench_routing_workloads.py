"""The routing benchmark's workloads where exact KV knowledge should pay (pressure, restart, hetero, long-output,
burst, cold), what each asks of the simulators, the per-token ITL and goodput of a run, and the oracle's estimate
on a GPU profile's step model."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.bench import routing
from llmgw.bench.routing_arms import Oracle, SimSpec
from llmgw.bench.routing_workloads import WORKLOADS, Objectives, build, needs
from llmgw.sim import tokenizer
from llmgw.sim.profiles import profile
from llmgw.sim.timing import ConstantTiming, GpuTiming, StepWork, causal_attention_pairs

NEW = ("pressure", "restart", "hetero", "long-output", "burst", "cold")


def shape(sessions) -> list:
    return [[(t.id, t.messages, t.max_tokens) for t in s.turns] for s in sessions]


def systems(sessions) -> Counter:
    """How many requests each system prompt heads (first turn of a session: where the system message is)."""
    return Counter(m["content"] for s in sessions for t in s.turns for m in t.messages if m["role"] == "system")


@pytest.mark.parametrize("name", NEW)
def test_every_new_workload_is_the_same_for_a_seed_different_for_another_and_its_ids_are_unique(name):
    for quick in (True, False):
        sessions = build(name, 3, quick=quick)
        assert shape(sessions) == shape(build(name, 3, quick=quick))
        assert shape(sessions) != shape(build(name, 4, quick=quick))
        ids = [t.id for s in sessions for t in s.turns]
        assert ids and len(ids) == len(set(ids))
        assert all(1 <= t.max_tokens <= 65536 and t.messages for s in sessions for t in s.turns)


@settings(max_examples=30, deadline=None)
@given(fleet_tokens=st.integers(40_000, 200_000), seed=st.integers(0, 2**32 - 1))
def test_pressure_has_a_working_set_of_two_to_three_times_the_fleets_kv_cache_and_asks_every_group(fleet_tokens,
                                                                                                   seed):
    sessions = build("pressure", seed, quick=True, fleet_tokens=fleet_tokens)
    heads = systems(sessions)
    working_set = sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in heads)
    assert 2 * fleet_tokens <= working_set <= 3 * fleet_tokens
    assert all(len(s.turns) == 1 and not s.carry for s in sessions)
    assert len(sessions) == 2 * len(heads)  # --quick: two visits per group, every group at least once
    assert max(heads.values()) > 1  # popular groups come back: there is something to keep cached


def test_pressure_is_sized_from_the_replicas_block_capacity_and_asks_for_that_capacity():
    load = needs("pressure")
    assert load.num_blocks == 1025
    spec = routing.Plan(["pressure"], [], [8], 1, 1, True, SimSpec(replicas=3, profile="h100-llama-3.1-8b")) \
        .spec_for(load)
    assert spec.num_blocks == 1025 and spec.fleet_tokens() == 3 * 1024 * 16
    assert spec.explicit_blocks(0) == 1025 and "--profile" in spec.extra(0)
    # the default capacity: four replicas of the workload's blocks
    assert shape(build("pressure", 1, quick=True)) == shape(build("pressure", 1, quick=True,
                                                                  fleet_tokens=4 * 1024 * 16))
    small, large = build("pressure", 1, fleet_tokens=20_000), build("pressure", 1, fleet_tokens=80_000)
    assert len(systems(large)) > 3 * len(systems(small))


def test_restart_resets_one_replicas_cache_part_way_through_grouped_conversations():
    load = needs("restart")
    assert load.reset_after is not None and 0.2 <= load.reset_after <= 0.6
    sessions = build("restart", 5, quick=True)
    assert len(sessions) == 6 * 3 and all(len(s.turns) == 3 and s.carry for s in sessions)
    assert len(systems(sessions)) == 6  # six groups, three users each: one system prompt per group


def test_hetero_runs_a_slower_gpu_for_its_first_replica_on_every_profile():
    load = needs("hetero")
    assert load.slow_replicas == 1
    gpu = SimSpec(profile="h100-llama-3.1-8b", slow_replicas=load.slow_replicas)
    assert [gpu.replica_profile(i) for i in range(4)] == ["a100-40gb-llama-3.1-8b"] + ["h100-llama-3.1-8b"] * 3
    assert gpu.extra(0)[:2] == ["--profile", "a100-40gb-llama-3.1-8b"] and gpu.explicit_blocks(0) is None
    step = StepWork(decode_tokens=8, context_tokens=8000, sequences=8)
    assert gpu.timing(0).step_seconds(step) > 1.5 * gpu.timing(1).step_seconds(step)
    assert gpu.blocks(0) < gpu.blocks(1)  # the A100 40GB also holds less KV cache
    # a 70B over 4 GPUs does not fit on four A100 40GB: the next slower GPU that holds it
    assert SimSpec(profile="h100-llama-3.1-70b-tp4", slow_replicas=1).replica_profile(0) == \
        "a100-80gb-llama-3.1-70b-tp4"
    constant = SimSpec(slow_replicas=1, profile="constant")
    assert constant.extra(0)[:6] == ["--profile", "constant", "--prefill-tokens-per-s", "4000.0",
                                     "--decode-ms-per-step", "60.0"]
    assert constant.extra(1)[:6] == ["--profile", "constant", "--prefill-tokens-per-s", "8000.0",
                                     "--decode-ms-per-step", "30.0"]
    assert constant.explicit_blocks(0) == SimSpec.CONSTANT_NUM_BLOCKS


def test_long_output_is_decode_dominated():
    load = needs("long-output")
    assert load.output_tokens == (1024, 4096)
    sessions = build("long-output", 2, quick=True)
    assert len(sessions) == 12 and all(t.max_tokens >= 4096 for s in sessions for t in s.turns)
    prompts = [len(tokenizer.encode_chat(t.messages)) for s in sessions for t in s.turns]
    assert max(prompts) < 1024  # every answer (1k-4k tokens) is longer than its prompt
    assert SimSpec(output_tokens=load.output_tokens).extra()[2:4] == ["--output-tokens", "1024:4096"]
    assert SimSpec(output_tokens=load.output_tokens, profile="constant").extra()[6:8] == ["--output-tokens",
                                                                                         "1024:4096"]


def test_burst_is_forty_requests_at_once_under_one_system_prompt_of_about_190_tokens():
    load = needs("burst")
    assert load.concurrency == 40
    sessions = build("burst", 9)
    assert len(sessions) == 40 and all(len(s.turns) == 1 for s in sessions)
    (system, count), = systems(sessions).items()
    assert count == 40 and 180 <= len(tokenizer.encode(system, add_special_tokens=False)) <= 200
    plan = routing._plan(routing.build_parser().parse_args(["--workload", "burst,grouped", "--concurrency", "8"]))
    assert plan.levels(plan.needs("burst")) == [40] and plan.levels(plan.needs("grouped")) == [8]


def test_cold_sends_every_groups_first_question_before_any_groups_second():
    sessions = build("cold", 4)
    groups = len(systems(sessions))
    assert groups > 4  # more prompt groups than the default four replicas
    first = [s.turns[0].id.split("-")[0] for s in sessions[:groups]]
    assert sorted(first) == sorted(f"c{g}" for g in range(groups))
    assert [s.turns[0].id.split("-")[1] for s in sessions] == [f"u{u}" for u in range(4) for _ in range(groups)]


def record(ttft_ms: float, gaps: list[float], status: int = 200) -> routing.Record:
    return routing.Record("r", "d", "sim-0", status, 100, 0, len(gaps) + 1, ttft_ms, ttft_ms + sum(gaps), 0, 0, gaps)


def test_itl_is_per_token_gaps_pooled_over_requests_and_goodput_counts_requests_meeting_both_objectives():
    records = [
        record(100, [10.0] * 9),  # meets both
        record(100, [10.0, 10.0, 70.0]),  # mean gap 30: meets an ITL objective of 40
        record(300, [10.0]),  # TTFT 300 > 200: misses
        record(150, [50.0, 50.0]),  # mean gap 50 > 40: misses
        record(120, []),  # one token: no gap, meets on its TTFT
        record(10, [1.0], status=500),  # an error: neither counted nor pooled
    ]
    summary = routing.summarize(records, 2.0, objectives=Objectives(ttft_ms=200, itl_ms=40))
    gaps = sorted([10.0] * 9 + [10.0, 10.0, 70.0] + [10.0] + [50.0, 50.0])  # 15 gaps
    assert summary["itl_p50_ms"] == 10.0 == gaps[7]
    assert summary["itl_p90_ms"] == 50.0 == gaps[13]  # nearest rank: the 14th of 15
    assert summary["goodput_requests"] == 3 and summary["goodput_rps"] == 1.5
    assert (summary["slo_ttft_ms"], summary["slo_itl_ms"]) == (200, 40)
    assert routing.measured(Objectives(1000, 50), 0.25) == Objectives(250, 12.5)


def test_the_goodput_table_prints_the_objectives_and_every_arms_latencies():
    point = {"hit_rate": 0.5, "ideal_hit_rate": 0.6, "ttft_p50_ms": 12.0, "ttft_p90_ms": 30.0, "ttft_mean_ms": 15.0,
             "output_tokens_per_s": 900.0, "itl_p50_ms": 4.5, "itl_p90_ms": 9.25, "goodput_rps": 3.5,
             "goodput_requests": 7, "cold_requests": 0, "errors": 0, "per_replica": [4, 4],
             "router_cpu_percent": None, "repeats": 1}
    report = {"workloads": {"burst": {"requests": 8, "profiles": ["a100-40gb-llama-3.1-8b", "h100-llama-3.1-8b"],
                                      "objectives": {"ttft_ms": 500.0, "itl_ms": 25.0, "time_scale": 0.5,
                                                     "measured": {"ttft_ms": 250.0, "itl_ms": 12.5}},
                                      "arms": {"oracle": {"label": "oracle", "knee": {"concurrency": 40,
                                                                                      "reached": False},
                                                          "by_concurrency": {"40": point}}}}}}
    text = routing.markdown(report)
    assert "TTFT <= 500 ms and mean ITL <= 25 ms modelled, x time scale 0.5 = 250 / 12.5 ms measured" in text
    assert "replicas: a100-40gb-llama-3.1-8b, h100-llama-3.1-8b" in text
    assert "| oracle | 40 | 0.500 | 12.0 ms | 30.0 ms | 4.50 ms | 9.25 ms | 900 | 3.50 | 7/8 |" in text


def test_the_oracle_estimates_on_a_gpu_profile_with_the_running_batch_and_its_context():
    timing = GpuTiming(profile("h100-llama-3.1-8b"))
    idle = {"pending_prefill_tokens": 0, "prompt_tokens": 400, "cached_tokens": 384, "running": 0,
            "running_context_tokens": 0, "max_num_batched_tokens": 8192}
    busy = {**idle, "running": 40, "running_context_tokens": 40 * 4000}
    steps = 1 + 16 / 8192
    expected = timing.request_overhead_s + steps * timing.step_seconds(StepWork(
        prefill_tokens=16, decode_tokens=40, context_tokens=40 * 4000 + 384 + 16,
        attention_pairs=causal_attention_pairs(384, 16), sequences=41))
    assert Oracle.estimate(busy, timing) == pytest.approx(expected)
    # a replica decoding 40 long sequences is slower to a first token than an idle one holding the same prefix
    assert Oracle.estimate(busy, timing) > 1.5 * Oracle.estimate(idle, timing)
    # the constant model has no batch cost: the same estimate either way
    constant = ConstantTiming(8000.0, 30.0)
    assert Oracle.estimate(busy, constant) == Oracle.estimate(idle, constant)


def test_sim_profile_reaches_every_simulator_and_bad_names_are_refused():
    plan = routing._plan(routing.build_parser().parse_args(["--sim-profile", "h100-llama-3.1-8b",
                                                            "--workload", "grouped,pressure"]))
    assert plan.spec.profile == "h100-llama-3.1-8b"
    grouped = plan.spec_for(plan.needs("grouped"))
    assert grouped.explicit_blocks(0) is None  # the GPU's memory decides, unless a workload needs a capacity
    assert all(spec.extra(i)[:2] == ["--profile", "h100-llama-3.1-8b"] for spec in (grouped, plan.spec_for(
        plan.needs("pressure"))) for i in range(4))
    given_blocks = routing._plan(routing.build_parser().parse_args(["--num-blocks", "4000", "--workload", "pressure"]))
    assert given_blocks.spec_for(given_blocks.needs("pressure")).num_blocks == 4000  # the user's capacity wins
    default = routing._plan(routing.build_parser().parse_args([]))
    assert default.spec.profile == "h100-llama-3.1-8b" and default.spec.explicit_blocks(0) is None  # as documented
    assert default.spec.extra(0)[:2] == ["--profile", "h100-llama-3.1-8b"]
    constant = routing._plan(routing.build_parser().parse_args(["--sim-profile", "constant"]))
    assert constant.spec.explicit_blocks(0) == 2861  # the recorded tables' settings
    assert constant.spec.extra(0)[:6] == ["--profile", "constant", "--prefill-tokens-per-s", "8000.0",
                                          "--decode-ms-per-step", "30.0"]
    with pytest.raises(SystemExit, match="--sim-profile"):
        routing._plan(routing.build_parser().parse_args(["--sim-profile", "h200-llama"]))
    with pytest.raises(SystemExit, match="unknown workload"):
        routing._plan(routing.build_parser().parse_args(["--workload", "grouped,storm"]))
    slo = routing._plan(routing.build_parser().parse_args(["--slo-itl-ms", "80"]))
    assert slo.needs("burst").objectives == Objectives(1000.0, 80.0) and slo.needs("burst").concurrency == 40
    with pytest.raises(SystemExit, match="positive"):
        routing._plan(routing.build_parser().parse_args(["--slo-ttft-ms", "0"]))
    assert set(NEW) <= set(WORKLOADS)
