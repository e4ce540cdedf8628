"""``llmgw bench proxy`` says how far its numbers can be trusted: the spread over rounds, no ratio printed (nor a
target met or missed) when the rounds disagree beyond the bound, and the machine's state around the measurement
(load, the proxy core's governor, who else ran on that core)."""

from __future__ import annotations

import os

from hypothesis import given, strategies as st

from llmgw.bench import machine_state, proxy
from llmgw.bench.agreement import RATIO_SPREAD_BOUND, disagreement, spread


def run(target: str, scenario: str, rps: float, cpu_us: float, others: list[dict] | None = None,
        foreign: float = 0.0, steal: float = 0.0) -> proxy.RunResult:
    """A round: the proxy took ``cpu_us`` per request, others ``foreign`` of its core, the hypervisor ``steal``."""
    return proxy.RunResult(target=target, scenario=scenario, connections=32, requests=int(rps * 5), seconds=5.0,
                           rps=rps, p50_ms=1.0, p90_ms=1.0, p99_ms=2.0, p999_ms=3.0, max_ms=4.0, errors={},
                           proxy_cpu_share=rps * cpu_us / 1e6, proxy_cpu_us_per_request=cpu_us,
                           proxy_core_busy=rps * cpu_us / 1e6 + foreign, proxy_core_steal=steal,
                           others_on_core=others or [])


def test_spread_is_the_range_over_the_median_and_needs_two_rounds():
    assert spread([1.0]) is None
    assert spread([0.9, 1.0, 1.1]) == (1.1 - 0.9) / 1.0
    assert disagreement([0.40, 0.41, 0.39]) is None
    refused = disagreement([0.30, 0.40, 0.41])
    assert refused is not None and "disagree by 27%" in refused and f"bound {RATIO_SPREAD_BOUND * 100:.0f}%" in refused


def test_a_ratio_whose_rounds_disagree_is_not_printed_and_meets_no_target(capsys):
    results = []
    for rps_llmgw, rps_vr in ((4000, 10000), (3000, 10000), (4100, 10000)):  # 0.40, 0.30, 0.41
        results += [run("llmgw", "c32", rps_llmgw, 110), run("vllm-router", "c32", rps_vr, 45)]
    summary = proxy.summarize(results, ["llmgw", "vllm-router"])
    ratios = summary["ratios_llmgw_vs_vllm_router"]
    assert ratios["c32_rps_ratio"] == 0.4 and ratios["c32_rps_ratio_rounds"] == [0.4, 0.3, 0.41]
    assert "disagree" in ratios["c32_rps_ratio_refused"]
    assert summary["targets_met"]["rps_at_least_0.9x"] is None
    proxy.print_table(summary, ["llmgw", "vllm-router"])
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if "requests/s at c=32" in line)
    assert "not printed: the rounds disagree by 27%" in line and "0.40x" not in line, line
    assert "110 (0%)" in printed  # CPU per request, with the spread of its rounds


def test_a_ratio_whose_rounds_agree_is_printed_with_them():
    results = []
    for rps_llmgw in (4000, 3900, 4050):
        results += [run("llmgw", "c32", rps_llmgw, 110), run("vllm-router", "c32", 10000, 45)]
    ratios = proxy.summarize(results, ["llmgw", "vllm-router"])["ratios_llmgw_vs_vllm_router"]
    assert "c32_rps_ratio_refused" not in ratios
    assert proxy.ratio_text(ratios, "c32_rps_ratio") == "0.40x  (rounds: 0.40, 0.39, 0.41)"


def test_the_machine_state_names_who_else_ran_on_the_proxys_core(capsys):
    busy = [{"pid": 7, "name": "pytest", "cpu_s": 1.5}]
    results = [run("llmgw", "c32", 4000, 110, busy, foreign=0.3), run("llmgw", "c32", 4000, 110, busy, foreign=0.3)]
    summary = proxy.summarize(results, ["llmgw"])
    assert summary["llmgw"]["c32"]["others_on_proxy_core"] == [{"name": "pytest", "cpu_s": 3.0}]
    state = {"before": {"loadavg": [0.1, 0.1, 0.1], "cpus": 2, "governor": None},
             "after": {"loadavg": [0.2, 0.1, 0.1], "cpus": 2, "governor": None}}
    proxy.print_machine_state(state, summary, ["llmgw"])
    printed = capsys.readouterr().out
    assert "governor: not readable" in printed and "pytest 3.0" in printed
    assert "NOT A QUIET MEASUREMENT (others took up to 30% of the proxy's core)" in printed


def test_the_load_average_does_not_count_but_the_cpus_busy_just_before_and_steal_do():
    summary = proxy.summarize([run("llmgw", "c32", 4000, 110, foreign=0.02)], ["llmgw"])
    state = {"before": {"loadavg": [2.4, 1.1, 0.5], "cpus": 2, "busy": 0.03}}  # the last run's minute
    assert proxy.not_quiet_reasons(state["before"], summary, ["llmgw"]) == []
    loaded = {"loadavg": [0.9, 0.5, 0.5], "cpus": 2, "busy": 0.4}
    assert proxy.not_quiet_reasons(loaded, summary, ["llmgw"]) == ["the CPUs 40% busy before the run, above 10%"]
    stolen = proxy.summarize([run("llmgw", "c32", 4000, 110, steal=0.12)], ["llmgw"])
    assert proxy.not_quiet_reasons(state["before"], stolen, ["llmgw"]) == [
        "the hypervisor took up to 12% of the proxy's core (steal)"]


def test_a_quiet_machine_is_not_flagged(capsys):
    summary = proxy.summarize([run("llmgw", "c32", 4000, 110)], ["llmgw"])
    state = {"before": {"loadavg": [0.1, 0.1, 0.1], "cpus": 2, "governor": "performance"}}
    proxy.print_machine_state(state, summary, ["llmgw"])
    printed = capsys.readouterr().out
    assert "governor: performance" in printed and "NOT A QUIET" not in printed


def test_this_process_is_seen_with_its_cpu_time_and_core():
    name, seconds, core = machine_state.process_stat(os.getpid()) or ("", -1.0, -1)
    assert name and seconds >= 0 and 0 <= core < (os.cpu_count() or 1)
    state = machine_state.describe(0)
    assert state["cpus"] == os.cpu_count() and (state["loadavg"] is None or len(state["loadavg"]) == 3)
    assert "busy" not in state
    busy = machine_state.describe(0, sample=0.05)["busy"]
    assert busy is None or 0.0 <= busy <= 1.0


def test_busy_on_core_counts_the_growth_of_others_last_run_there():
    before = {1: ("proxy", 5.0, 1), 2: ("other", 1.0, 1), 3: ("elsewhere", 1.0, 0)}
    after = {1: ("proxy", 9.0, 1), 2: ("other", 2.5, 1), 3: ("elsewhere", 3.0, 0), 4: ("new", 0.2, 1)}
    assert machine_state.busy_on_core(before, after, 1, exclude={1}) == [
        {"pid": 2, "name": "other", "cpu_s": 1.5}, {"pid": 4, "name": "new", "cpu_s": 0.2}]


@given(st.text(max_size=300))
def test_the_stat_parser_takes_any_line_without_failing(line):
    parsed = machine_state.parse_stat(line)
    assert parsed is None or (parsed[1] >= 0 and parsed[2] >= 0)


def test_the_stat_parser_reads_a_name_with_spaces_and_parentheses():
    fields = ["S"] + ["0"] * 10 + ["300", "200"] + ["0"] * 23 + ["1"] + ["0"] * 14
    parsed = machine_state.parse_stat(f"42 (a (weird) name) {' '.join(fields)}")
    assert parsed == ("a (weird) name", 500 / os.sysconf("SC_CLK_TCK"), 1)
