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


# Each measure of the JSON summary: where it is in a repeat's result
MEASURES: dict[str, tuple[str, ...]] = {
    "rpm_burst_admitted": (RPM, "admitted"), "rpm_burst_over": (RPM, "over"),
    "tpm_burst_admitted": (TPM, "admitted"), "tpm_burst_tokens_over": (TPM, "tokens_over"),
    "budget_burst_admitted": (BUDGET, "admitted"), "budget_burst_nano_over": (BUDGET, "nano_over"),
    "concurrency_burst_admitted": (CONCURRENCY, "admitted"),
    "concurrency_most_in_flight": (CONCURRENCY, "most_in_flight"),
    "rpm_steady_usable": (RPM_STEADY, "usable"), "rpm_steady_over": (RPM_STEADY, "over"),
    "tpm_steady_usable": (TPM_STEADY, "usable"), "tpm_steady_over": (TPM_STEADY, "over"),
    "added_p50_ms": ("latency", "added_p50_ms"), "added_p99_ms": ("latency", "added_p99_ms"),
    "limited_lane_ok": ("latency", "limited", "requests"),
    "redis_away_admitted": (REDIS_KILL, "away", "admitted"), "redis_away_expected": (REDIS_KILL, "away", "expected"),
    "redis_after_admitted": (REDIS_KILL, "after", "admitted"),
    "redis_after_expected": (REDIS_KILL, "after", "expected"),
}


def _at(path: tuple[str, ...]) -> Callable[[dict], float | None]:
    def get(run: dict) -> float | None:
        value: object = run
        for key in path:
            value = value[key]  # type: ignore[index]
        return value  # type: ignore[return-value]
    return get


def summary(runs: Runs) -> dict:
    """The numbers of the tables, as JSON: median, min and max of each measure over the repeats."""
    out = {}
    for name, path in MEASURES.items():
        found = median_and_range(_values(runs, _at(path)))
        out[name] = None if found is None else dict(zip(("median", "min", "max"), found))
    return out


Column = tuple[str, Callable[[Runs], str]]

BURSTS: list[Column] = [
    ("rpm: admitted", lambda runs: _cell(runs, lambda r: r[RPM]["admitted"])),
    ("largest over", lambda runs: _largest(runs, lambda r: r[RPM]["over"])),
    ("tpm: admitted", lambda runs: _cell(runs, lambda r: r[TPM]["admitted"])),
    ("largest tokens over", lambda runs: _largest(runs, lambda r: r[TPM]["tokens_over"])),
    ("budget: admitted", lambda runs: _cell(runs, lambda r: r[BUDGET]["admitted"])),
    ("largest money over", lambda runs: _largest(runs, lambda r: r[BUDGET]["nano_over"] / 1e9, ".6f") + " USD"),
    ("concurrency: admitted", lambda runs: _cell(runs, lambda r: r[CONCURRENCY]["admitted"])),
    ("most in flight", lambda runs: _largest(runs, lambda r: r[CONCURRENCY]["most_in_flight"])),
]
STEADY: list[Column] = [
    ("rpm usable", lambda runs: _cell(runs, lambda r: 100 * r[RPM_STEADY]["usable"], ".1f", "%")),
    ("tpm usable", lambda runs: _cell(runs, lambda r: 100 * r[TPM_STEADY]["usable"], ".1f", "%")),
    ("largest over (rpm, tpm)", lambda runs: f"{_largest(runs, lambda r: r[RPM_STEADY]['over'])}, "
                                             f"{_largest(runs, lambda r: r[TPM_STEADY]['over'])}"),
    ("added p50", lambda runs: _cell(runs, lambda r: r["latency"]["added_p50_ms"], ".2f", " ms")),
    ("added p99", lambda runs: _cell(runs, lambda r: r["latency"]["added_p99_ms"], ".2f", " ms")),
    ("not 200 below the limits",
     lambda runs: _largest(runs, lambda r: sum(r["latency"]["limited"]["not_ok"].values()))),
    ("Redis away: admitted / exact", lambda runs: f"{_cell(runs, lambda r: r[REDIS_KILL]['away']['admitted'])} / "
                                                  f"{_cell(runs, lambda r: r[REDIS_KILL]['away']['expected'])}"),
    ("after", lambda runs: f"{_cell(runs, lambda r: r[REDIS_KILL]['after']['admitted'])} / "
                           f"{_cell(runs, lambda r: r[REDIS_KILL]['after']['expected'])}"),
]


def _table(arms: Sequence[dict], columns: list[Column]) -> list[str]:
    lines = ["| arm | processes | " + " | ".join(header for header, _ in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for arm in arms:
        if arm.get("error"):
            lines.append(f"| {arm['label']} | {arm.get('processes', '-')} | not run: {arm['error']} |"
                         + " |" * (len(columns) - 1))
        else:
            lines.append(f"| {arm['label']} | {arm['processes']} | "
                         + " | ".join(column(arm["runs"]) for _, column in columns) + " |")
    return lines


def markdown(arms: Sequence[dict], plan: dict) -> str:
    """Two tables over ``arms`` (each ``{"label", "processes", "runs", "error"?}``)."""
    burst, limit = plan["burst"], plan["burst_limit"]
    return "\n".join([
        f"Bursts of {burst} requests at once over the gateways, on a fresh limit of {limit} requests "
        f"(rpm {limit}; tpm {limit} requests' tokens; a total budget of {limit} requests' cost) and "
        f"concurrency {plan['concurrency']}. Admitted = not 429.", "", *_table(arms, BURSTS), "",
        f"Steady: a burst of the limit ({plan['steady_limit']} rpm; tpm the same in requests' tokens), "
        f"then {plan['overload']:g}x the limit for {plan['steady_seconds']:g} s: usable = admitted of what "
        "an exact limiter of the arm's kind admits for the same requests. Latency: the same gateways, a key "
        "with every kind of limit (never reached) against one without (and how many of the limited key's "
        "answers were not 200 all the same). Redis: the steady rpm load, "
        f"Redis killed (SIGKILL) {plan['redis_before']:g} s in and restarted empty "
        f"{plan['redis_away']:g} s later: admitted / exact.", "", *_table(arms, STEADY)])
