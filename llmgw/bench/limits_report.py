"""The tables of ``llmgw bench limits``: per arm, the medians of its repeats with their range, and the worst case.

Reads the repeats :func:`~.limits_runs.run_repeat` returned. A cell ``m [lo-hi]`` is the median over the repeats
and its range; "largest" columns are the maximum over the repeats (an overshoot's worst case is what a limit
promises against). ``-`` is a limit the arm does not have (LiteLLM's concurrency, see :mod:`.limits_litellm`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .chaos import spread
from .chaos_schedule import median_and_range
from .limits_rig import BUDGET, CONCURRENCY, REDIS_KILL, RPM, RPM_STEADY, TPM, TPM_STEADY

Runs = Sequence[dict]


def _values(runs: Runs, get: Callable[[dict], float | None]) -> list[float]:
    values = []
    for run in runs:
        try:
            value = get(run)
        except (KeyError, TypeError):
            continue
        if value is not None:
            values.append(float(value))
    return values


def _cell(runs: Runs, get: Callable[[dict], float | None], spec: str = ".0f", unit: str = "") -> str:
    return spread(median_and_range(_values(runs, get)), spec, unit)


def _largest(runs: Runs, get: Callable[[dict], float | None], spec: str = ".0f") -> str:
    values = _values(runs, get)
    return format(max(values), spec) if values else "-"


def summary(runs: Runs) -> dict:
    """The numbers of the tables, as JSON: median, min and max of each measure, and the largest overshoots."""
    measures: dict[str, Callable[[dict], float | None]] = {
        "rpm_burst_admitted": lambda r: r[RPM]["admitted"],
        "rpm_burst_over": lambda r: r[RPM]["over"],
        "tpm_burst_admitted": lambda r: r[TPM]["admitted"],
        "tpm_burst_tokens_over": lambda r: r[TPM]["tokens_over"],
        "budget_burst_admitted": lambda r: r[BUDGET]["admitted"],
        "budget_burst_nano_over": lambda r: r[BUDGET]["nano_over"],
        "concurrency_burst_admitted": lambda r: r[CONCURRENCY]["admitted"],
        "concurrency_most_in_flight": lambda r: r[CONCURRENCY]["most_in_flight"],
        "rpm_steady_usable": lambda r: r[RPM_STEADY]["usable"],
        "rpm_steady_over": lambda r: r[RPM_STEADY]["over"],
        "tpm_steady_usable": lambda r: r[TPM_STEADY]["usable"],
        "tpm_steady_over": lambda r: r[TPM_STEADY]["over"],
        "added_p50_ms": lambda r: r["latency"]["added_p50_ms"],
        "added_p99_ms": lambda r: r["latency"]["added_p99_ms"],
        "redis_away_admitted": lambda r: r[REDIS_KILL]["away"]["admitted"],
        "redis_away_expected": lambda r: r[REDIS_KILL]["away"]["expected"],
        "redis_after_admitted": lambda r: r[REDIS_KILL]["after"]["admitted"],
        "redis_after_expected": lambda r: r[REDIS_KILL]["after"]["expected"],
    }
    out = {}
    for name, get in measures.items():
        found = median_and_range(_values(runs, get))
        out[name] = None if found is None else dict(zip(("median", "min", "max"), found))
    return out


def markdown(arms: Sequence[dict], plan: dict) -> str:
    """Two tables over ``arms`` (each ``{"label", "processes", "runs", "error"?}``)."""
    burst, limit = plan["burst"], plan["burst_limit"]
    lines = [f"Bursts of {burst} requests at once over the gateways, on a fresh limit of {limit} requests "
             f"(rpm {limit}; tpm {limit} requests' tokens; a total budget of {limit} requests' cost) and "
             f"concurrency {plan['concurrency']}. Admitted = not 429.", "",
             "| arm | processes | rpm: admitted | largest over | tpm: admitted | largest tokens over "
             "| budget: admitted | largest money over | concurrency: admitted | most in flight |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        runs = arm.get("runs") or []
        if arm.get("error"):
            lines.append(f"| {arm['label']} | {arm.get('processes', '-')} | not run: {arm['error']} "
                         "| | | | | | | |")
            continue
        lines.append(
            f"| {arm['label']} | {arm['processes']} | {_cell(runs, lambda r: r[RPM]['admitted'])} "
            f"| {_largest(runs, lambda r: r[RPM]['over'])} | {_cell(runs, lambda r: r[TPM]['admitted'])} "
            f"| {_largest(runs, lambda r: r[TPM]['tokens_over'])} "
            f"| {_cell(runs, lambda r: r[BUDGET]['admitted'])} "
            f"| {_largest(runs, lambda r: r[BUDGET]['nano_over'] / 1e9, '.6f')} USD "
            f"| {_cell(runs, lambda r: r[CONCURRENCY]['admitted'])} "
            f"| {_largest(runs, lambda r: r[CONCURRENCY]['most_in_flight'])} |")
    lines += ["", f"Steady: a burst of the limit ({plan['steady_limit']} rpm; tpm the same in requests' tokens), "
              f"then {plan['overload']:g}x the limit for {plan['steady_seconds']:g} s: usable = admitted of what "
              "an exact limiter of the arm's kind admits for the same sends. Latency: the same gateways, a key "
              "with every kind of limit (never reached) against one without. Redis: the steady rpm load, "
              f"Redis killed (SIGKILL) {plan['redis_before']:g} s in and restarted empty "
              f"{plan['redis_away']:g} s later: admitted / exact.", "",
              "| arm | rpm usable | tpm usable | largest over (rpm, tpm) | added p50 | added p99 "
              "| Redis away: admitted / exact | after |",
              "|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        runs = arm.get("runs") or []
        if arm.get("error"):
            continue
        lines.append(
            f"| {arm['label']} | {_cell(runs, lambda r: 100 * r[RPM_STEADY]['usable'], '.1f', '%')} "
            f"| {_cell(runs, lambda r: 100 * r[TPM_STEADY]['usable'], '.1f', '%')} "
            f"| {_largest(runs, lambda r: r[RPM_STEADY]['over'])}, {_largest(runs, lambda r: r[TPM_STEADY]['over'])} "
            f"| {_cell(runs, lambda r: r['latency']['added_p50_ms'], '.2f', ' ms')} "
            f"| {_cell(runs, lambda r: r['latency']['added_p99_ms'], '.2f', ' ms')} "
            f"| {_cell(runs, lambda r: r[REDIS_KILL]['away']['admitted'])} / "
            f"{_cell(runs, lambda r: r[REDIS_KILL]['away']['expected'])} "
            f"| {_cell(runs, lambda r: r[REDIS_KILL]['after']['admitted'])} / "
            f"{_cell(runs, lambda r: r[REDIS_KILL]['after']['expected'])} |")
    return "\n".join(lines)
