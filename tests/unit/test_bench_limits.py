"""The parts of ``llmgw bench limits``: the exact limiters it judges against, its counts, the configs it writes for
llmgw and LiteLLM, and its tables."""

from __future__ import annotations

import argparse

import pytest
import yaml

from llmgw.bench.limits import arm_runs, parse
from llmgw.bench.limits_litellm import MASTER_KEY, lanes_of, litellm_config
from llmgw.bench.limits_report import markdown, summary
from llmgw.bench.limits_rig import (
    BUDGET,
    CONCURRENCY,
    LIMITED,
    REDIS_KILL,
    RPM,
    RPM_STEADY,
    SCENARIOS,
    TPM,
    TPM_STEADY,
    Plan,
    llmgw_tenancy_config,
)
from llmgw.bench.limits_workloads import (
    BUCKET,
    WINDOW,
    Answer,
    MinuteWindow,
    TokenBucket,
    count,
    count_in,
    expected,
    most_in_flight,
    prompt_tokens,
    request_tokens,
)
from llmgw.config import parse_config
from llmgw.tenancy.directory import build_directory


def test_a_token_bucket_holds_its_limit_and_refills_it_per_minute():
    bucket = TokenBucket(60)
    assert sum(bucket.take(0.0, 1) for _ in range(100)) == 60  # a burst: the limit, no more
    assert not bucket.take(0.5, 1)  # half a request refilled
    assert bucket.take(1.0, 1) and not bucket.take(1.0, 1)  # one a second
    assert sum(bucket.take(1000.0, 1) for _ in range(100)) == 60  # refilled up to the limit only


def test_a_token_bucket_admits_a_cost_only_whole():
    bucket = TokenBucket(100)
    assert bucket.take(0.0, 60) and not bucket.take(0.0, 60) and bucket.take(0.0, 40)


def test_a_minute_window_starts_over_at_each_calendar_minute():
    window = MinuteWindow(2)
    assert [window.take(t, 1) for t in (120.0, 130.0, 179.9, 180.0, 180.1, 181.0)] == \
        [True, True, False, True, True, False]


def test_expected_replays_in_time_order_and_answers_in_the_given_order():
    assert expected(BUCKET, 2, [3.0, 1.0, 2.0]) == [False, True, True]
    assert expected(WINDOW, 1, [59.0, 61.0, 60.5]) == [True, False, True]
    assert expected(BUCKET, 10, [0.0, 0.0], cost=6) == [True, False]
    with pytest.raises(ValueError):
        expected("leaky", 1, [0.0])


def answer(sent: float, status: int = 200, done: float | None = None, tokens: int = 0) -> Answer:
    return Answer(sent, sent + 0.1 if done is None else done, status, 0, tokens, 0)


def test_counts_admitted_as_every_answer_but_429_and_none():
    answers = [answer(0, 200), answer(0, 429), answer(0, 500), answer(0, 0)]
    counted = count(answers, [True, True, False, False])
    assert (counted.offered, counted.admitted, counted.expected, counted.errors) == (4, 2, 2, 2)
    assert counted.over == 0 and counted.usable == 1.0
    over = count([answer(0)] * 5, [True, True, False, False, False])
    assert over.over == 3 and over.usable == 1.0
    under = count([answer(0), answer(0, 429)], [True, True])
    assert under.over == 0 and under.usable == 0.5
    assert count([answer(0, 429)], [False]).usable is None


def test_count_in_takes_the_requests_sent_in_the_interval():
    answers = [answer(t, 200 if t < 2 else 429) for t in (0.0, 1.0, 2.0, 3.0)]
    counted = count_in(answers, [True, False, True, True], 1.0, 3.0)
    assert (counted.offered, counted.admitted, counted.expected) == (2, 1, 1)


def test_most_in_flight_counts_admitted_requests_that_overlap():
    answers = [answer(0.0, done=1.0), answer(0.5, done=1.5), answer(0.9, 429, done=0.95), answer(1.0, done=2.0)]
    assert most_in_flight(answers) == 2  # one ends at 1.0 as the next starts: not three at once


def test_the_plan_limits_hold_exactly_burst_limit_requests_of_this_client():
    plan = Plan()
    assert plan.request_tokens == prompt_tokens() + plan.max_tokens == request_tokens(plan.max_tokens)
    assert plan.limits(RPM) == {"rpm": 50}
    assert plan.limits(TPM)["tpm"] // plan.request_tokens == 50
    assert plan.limits(BUDGET)["budget_nano"] // plan.request_nano == 50
    assert plan.request_nano == prompt_tokens() * 2000 + plan.max_tokens * 8000  # $2 and $8 per million
    lanes = plan.lanes()
    assert len(lanes) == len(SCENARIOS) * plan.repeats
    assert len({lane.key for _, _, lane in lanes}) == len(lanes)  # no repeat inherits another's counters


def test_the_llmgw_config_gives_every_lane_its_limits_and_budget():
    plan = Plan(repeats=2)
    config = parse_config("models:\n  - name: tiny\n    replicas: [{url: 'http://127.0.0.1:9'}]\n"
                          + llmgw_tenancy_config(plan))
    directory = build_directory(config)
    rpm = directory.lookup(f"Bearer {plan.lane(RPM, 1).key}")
    assert rpm is not None and rpm.limits.rpm == 50 and rpm.limits.tpm is None
    budget = directory.lookup(f"Bearer {plan.lane(BUDGET, 0).key}")
    assert budget is not None and budget.limits.budgets[0].period == "total"
    assert budget.limits.budgets[0].nano_usd == plan.limits(BUDGET)["budget_nano"]
    limited = directory.lookup(f"Bearer {plan.lane(LIMITED, 0).key}")
    assert limited is not None and limited.limits.concurrency and limited.limits.rpm and limited.limits.tpm
    free = directory.lookup(f"Bearer {plan.lane('latency-free', 0).key}")
    assert free is not None and not free.limited
    price = config.prices[0]
    assert (price.model, price.input, price.cached_input, price.output) == ("tiny", 2.0, 2.0, 8.0)


def test_the_litellm_config_is_a_limited_model_group_per_lane_on_the_shared_redis():
    plan = Plan(repeats=1)
    config = yaml.safe_load(litellm_config(plan, ["http://127.0.0.1:1", "http://127.0.0.1:2"], 6399))
    groups = {m["model_name"]: m["litellm_params"] for m in config["model_list"]}
    assert plan.lane(CONCURRENCY, 0).name not in groups  # queues per instance: not measured
    assert groups[plan.lane(RPM, 0).name]["rpm"] == 50
    assert groups[plan.lane(TPM_STEADY, 0).name]["tpm"] == plan.limits(TPM_STEADY)["tpm"]
    budget = groups[plan.lane(BUDGET, 0).name]
    assert budget["max_budget"] == pytest.approx(plan.limits(BUDGET)["budget_nano"] / 1e9)
    assert budget["input_cost_per_token"] == pytest.approx(2e-6)
    router = config["router_settings"]
    assert router["redis_port"] == 6399 and "enforce_model_rate_limits" in router["optional_pre_call_checks"]
    assert config["general_settings"]["master_key"] == MASTER_KEY
    lane = lanes_of(plan)[plan.lane(RPM, 0).name]
    assert (lane.key, lane.model) == (MASTER_KEY, plan.lane(RPM, 0).name)


def test_the_workers_arms_run_once_at_the_largest_n():
    args = parse(["--arms", "llmgw,litellm-workers", "--gateways", "1,4"])
    assert arm_runs(args) == [("llmgw", 1, 1), ("llmgw", 4, 1), ("litellm-workers", 4, 2)]
    quick = parse(["--quick"])
    assert quick.repeats == 1 and quick.gateways == [1, 2]
    with pytest.raises(SystemExit):
        parse(["--arms", "nginx"])


def run_result(rpm_admitted: int, over_money: int) -> dict:
    burst = {"offered": 100, "admitted": rpm_admitted, "expected": 50, "over": max(0, rpm_admitted - 50),
             "usable": 1.0}
    return {RPM: burst, TPM: {**burst, "tokens_over": 0}, BUDGET: {**burst, "nano_over": over_money},
            RPM_STEADY: {**burst, "usable": 0.99}, TPM_STEADY: {**burst, "usable": 1.0},
            "latency": {"added_p50_ms": 0.5, "added_p99_ms": 2.0, "limited": {"requests": 199, "not_ok": {"429": 1}}},
            REDIS_KILL: {"away": {"admitted": 20, "expected": 20}, "after": {"admitted": 25, "expected": 24}}}


def test_the_report_gives_medians_with_their_range_and_the_largest_overshoot():
    runs = [run_result(50, 0), run_result(52, 3_200_000), run_result(51, 0)]
    numbers = summary(runs)
    assert numbers["rpm_burst_admitted"] == {"median": 51, "min": 50, "max": 52}
    assert numbers["concurrency_burst_admitted"] is None  # no such lane: left out, not zero
    settings = {"burst": 100, "burst_limit": 50, "concurrency": 10, "steady_limit": 120, "overload": 1.2,
                "steady_seconds": 60, "redis_before": 5, "redis_away": 10}
    table = markdown([{"label": "llmgw N=2", "processes": 2, "runs": runs},
                      {"label": "LiteLLM N=2", "processes": 2, "runs": [], "error": "it would not start"}],
                     settings)
    assert "| llmgw N=2 | 2 | 51 [50-52] | 2 |" in table
    assert "0.003200 USD" in table and "99.0% [99.0-99.0]" in table
    assert "| 0.50 ms [0.50-0.50] | 2.00 ms [2.00-2.00] | 1 |" in table  # a refusal below the limits shows
    assert "| LiteLLM N=2 | 2 | not run: it would not start |" in table


def test_parse_gives_a_namespace_the_runs_read():
    args = parse([])
    assert isinstance(args, argparse.Namespace) and args.arms[0] == "llmgw" and args.gateways == [1, 2, 4]
