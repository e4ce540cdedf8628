"""The numbers of ``llmgw bench autoscale``: one run of a trace on an arm, per model, then medians and the table.

A run gives samples (every ``--sample`` wall seconds: per model its ``ready`` and ``starting`` replicas, the
requests ``queued`` at the gateway and ``inflight``) and the requests' :class:`~.overload_workload.Outcome`\\ s
(``sent``: wall seconds from the trace's start). :func:`model_stats` reads them against the trace and the
oracle's plan (:mod:`.autoscale_oracle`):

- ``step_to_serving_s``: from the trace's step to the first sample with more replicas ready than just before it
  (fleet seconds: the wall's times the time factor);
- ``from_zero_first_token_s``: an idle model's first request after it is called, sent to first token (fleet s);
- ``dropped``: requests not answered 200, of ``sent`` (``dropped_by`` kind: shed, expired, error);
- ``reversals``: how often the provisioned count (ready + starting) turned from rising to falling or back;
- ``slo_attainment``: the share of windows (``--window`` fleet seconds) with requests whose TTFT p95 met the SLO
  (a request not answered counts as missing it); ``ttft_p95_ms`` over the whole run;
- ``replica_seconds``: provisioned replicas integrated over the run (fleet seconds), against the oracle's
  (``vs_oracle``); ``most_over_oracle``: the most provisioned replicas beyond the oracle's at any sample.

:func:`chart` draws replicas against demand as text; :func:`markdown` the table of medians [min-max] over repeats;
:func:`targets` checks the autoscaled arm's medians against issue 32's targets.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from .autoscale_oracle import OraclePlan
from .autoscale_traces import Trace
from .cluster_events import percentile
from .common import cell
from .overload_report import spread_cell, summary
from .overload_workload import ERROR, EXPIRED, OK, SHED, Outcome

Sample = dict  # {"t": wall seconds, "models": {model: {"ready", "starting", "queued", "inflight"}}}


def provisioned(sample: Sample, model: str) -> int:
    counts = sample["models"].get(model) or {}
    return int(counts.get("ready", 0)) + int(counts.get("starting", 0))


def ready(sample: Sample, model: str) -> int:
    return int((sample["models"].get(model) or {}).get("ready", 0))


def reversals(counts: Sequence[int]) -> int:
    """How many times a sequence of counts changed direction (up then down, or down then up)."""
    turns, direction = 0, 0
    for before, after in zip(counts, counts[1:]):
        if after == before:
            continue
        now = 1 if after > before else -1
        if direction and now != direction:
            turns += 1
        direction = now
    return turns


def step_to_serving(samples: Sequence[Sample], model: str, step_at: float) -> float | None:
    """Wall seconds from ``step_at`` to the first sample with more replicas of ``model`` ready than the last
    sample before it had; None when none came."""
    before = [s for s in samples if s["t"] < step_at]
    if not before:
        return None
    base = ready(before[-1], model)
    return next((s["t"] - step_at for s in samples if s["t"] >= step_at and ready(s, model) > base), None)


def ttft_or_miss(outcome: Outcome) -> float:
    return outcome.ttft if outcome.kind == OK else math.inf


def slo_attainment(outcomes: Sequence[Outcome], slo: float, window: float) -> float | None:
    """The share of ``window``-long stretches (wall seconds) holding requests whose TTFT p95 was within ``slo``."""
    windows: dict[int, list[float]] = {}
    for o in outcomes:
        windows.setdefault(int(o.sent // window), []).append(ttft_or_miss(o))
    if not windows:
        return None
    met = sum((percentile(ttfts, 0.95) or 0.0) <= slo for ttfts in windows.values())
    return met / len(windows)


def replica_seconds(samples: Sequence[Sample], model: str, end: float) -> float:
    """Provisioned replicas integrated over wall time (each sample's count held until the next, the last's until
    ``end``)."""
    total = 0.0
    for sample, after in zip(samples, [*samples[1:], None]):
        until = end if after is None else after["t"]
        total += provisioned(sample, model) * max(0.0, min(until, end) - sample["t"])
    return total


def oracle_at(plan: OraclePlan, wall: float) -> int:
    if not plan.provisioned:
        return 0
    return plan.provisioned[min(len(plan.provisioned) - 1, max(0, int(wall / plan.step)))]


def model_stats(trace: Trace, model: str, factor: float, samples: Sequence[Sample], outcomes: Sequence[Outcome],
                plan: OraclePlan, slo: float, window: float) -> dict:
    """One model's numbers of one run (see the module's docstring); times and replica-seconds in fleet seconds."""
    wall = trace.seconds / factor
    ok = [o for o in outcomes if o.kind == OK]
    p95 = percentile([ttft_or_miss(o) for o in outcomes], 0.95)
    used = replica_seconds(samples, model, wall) * factor
    step = None if trace.step_at is None else step_to_serving(samples, model, trace.step_at / factor)
    first = None
    if trace.called_at is not None:
        called = sorted((o for o in outcomes if o.sent >= trace.called_at / factor), key=lambda o: o.sent)
        first = None if not called else ttft_or_miss(called[0]) * factor
    turns = reversals([provisioned(s, model) for s in samples])
    return {
        "sent": len(outcomes), "completed": len(ok), "dropped": len(outcomes) - len(ok),
        "dropped_by": {kind: sum(o.kind == kind for o in outcomes) for kind in (SHED, EXPIRED, ERROR)},
        "step_to_serving_s": None if step is None else step * factor,
        "from_zero_first_token_s": None if first is None or math.isinf(first) else first,
        "from_zero_dropped": None if trace.called_at is None else first is not None and math.isinf(first),
        "reversals": turns, "reversals_per_10_min": turns / (trace.seconds / 600),
        "ttft_p95_ms": None if p95 is None or math.isinf(p95) else p95 * 1000,
        "slo_attainment": slo_attainment(outcomes, slo, window / factor),
        "replica_seconds": used, "oracle_replica_seconds": plan.replica_seconds,
        "vs_oracle": used / plan.replica_seconds if plan.replica_seconds else None,
        "most_over_oracle": max((provisioned(s, model) - oracle_at(plan, s["t"]) for s in samples), default=None),
    }


def series(trace: Trace, model: str, factor: float, samples: Sequence[Sample], plan: OraclePlan) -> dict:
    """The JSON series of one model: per sample the fleet time, demand, the oracle's count and the arm's."""
    rows = [(s, s["models"].get(model) or {}) for s in samples]
    return {"t": [round(s["t"] * factor, 2) for s, _ in rows],
            "demand": [round(trace.demand(model, s["t"] * factor), 3) for s, _ in rows],
            "oracle": [oracle_at(plan, s["t"]) for s, _ in rows],
            **{key: [c.get(key, 0) for _, c in rows] for key in ("ready", "starting", "queued", "inflight")}}


def chart(model_series: dict, width: int = 72) -> str:
    """Replicas over time against demand, one row per replica count (top: the most), one column per stretch of
    the run: ``#`` ready, ``+`` starting, ``.`` demand not covered by them, ``o`` the oracle's count (when
    nothing else is drawn there)."""
    count = len(model_series["t"])
    if not count:
        return "(no samples)"
    columns = min(width, count)
    picks = [min(count - 1, i * count // columns) for i in range(columns)]
    top = max(1, *(model_series["ready"][i] + model_series["starting"][i] for i in picks),
              *(math.ceil(model_series["demand"][i] - 1e-9) for i in picks),
              *(model_series["oracle"][i] for i in picks))
    lines = []
    for level in range(top, 0, -1):
        row = []
        for i in picks:
            up, starting = model_series["ready"][i], model_series["starting"][i]
            if level <= up:
                row.append("#")
            elif level <= up + starting:
                row.append("+")
            elif level <= math.ceil(model_series["demand"][i] - 1e-9):
                row.append(".")
            else:
                row.append("o" if level == model_series["oracle"][i] else " ")
        lines.append(f"{level:3d} |{''.join(row)}")
    span = model_series["t"][-1]
    lines.append("    +" + "-" * columns)
    lines.append(f"     0 s{' ' * max(1, columns - 12)}{span:.0f} s")
    return "\n".join(lines)


MEASURES: dict[str, tuple[str, ...]] = {name: (name,) for name in (
    "sent", "dropped", "step_to_serving_s", "from_zero_first_token_s", "reversals", "reversals_per_10_min",
    "ttft_p95_ms", "slo_attainment", "replica_seconds", "oracle_replica_seconds", "vs_oracle", "most_over_oracle")}

COLUMNS: list[tuple[str, str, str, str, float]] = [  # header, measure, spec, unit, scale
    ("step to serving s", "step_to_serving_s", ".1f", "", 1), ("first token from 0 s", "from_zero_first_token_s",
                                                                ".1f", "", 1),
    ("dropped", "dropped", ".0f", "", 1), ("sent", "sent", ".0f", "", 1), ("reversals", "reversals", ".0f", "", 1),
    ("TTFT p95 ms", "ttft_p95_ms", ".0f", "", 1), ("SLO met", "slo_attainment", ".0f", "%", 100),
    ("replica-s", "replica_seconds", ".0f", "", 1), ("vs oracle", "vs_oracle", ".2f", "x", 1),
    ("most over oracle", "most_over_oracle", ".0f", "", 1),
]


def run_summary(runs: Sequence[dict]) -> dict:
    """Per model, each of :data:`MEASURES`' median, min and max over the repeats that measured it, and ``of``: how
    many did, of how many (a step whose extra replica never came has no time to serving)."""
    out = {}
    for model in sorted({model for run in runs for model in run}):
        mine = [run[model] for run in runs if model in run]
        out[model] = summary(mine, MEASURES)
        for name, entry in out[model].items():
            if entry is not None:
                entry["of"] = [sum(run.get(name) is not None for run in mine), len(mine)]
    return out


def summary_cell(entry: dict | None, spec: str, unit: str, scale: float) -> str:
    """A median [min-max] cell, saying how many repeats measured it when some did not."""
    shown = spread_cell(entry, spec, unit, scale)
    if entry is not None and "of" in entry and entry["of"][0] < entry["of"][1]:
        shown += f" ({entry['of'][0]} of {entry['of'][1]})"
    return shown


def boot_note(settings: dict) -> str:
    if not settings.get("boot_s"):
        return ""
    return (f" (the simulator's process itself takes {statistics.median(settings['boot_s']):.1f} s of wall time to "
            f"start here: its modelled cold start is the rest, {settings['sim_startup_seconds']:.1f} s)")


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"Fleet: {s['nodes']} nodes x {s['gpus_per_node']} fixture {s['gpu']} GPUs, remote `llmgw agent`s "
             f"deploying `llmgw sim --profile {s['profile']}` ({s['sim_note']}); startup {s['cold_start_s']:g} s "
             f"cold / {s['hot_start_s']:g} s hot{boot_note(s)}; fleet time runs {s['time_factor']:g}x faster than "
             f"the wall (startup, the scaler's windows and the traces divided by {s['time_factor']:g}; a request "
             f"runs at the engine's speed). Times and replica-seconds below are fleet seconds. One replica's worth = "
             f"{report['capacity']['replica_worth_rps']:.2f} req/s ({s['utilisation']:.0%} of the "
             f"{report['capacity']['rps']:.2f} req/s measured). TTFT SLO {s['ttft_slo_ms']:.0f} ms (p95 per "
             f"{s['window_s']:g} s window). {s['repeats']} repeat(s): median [min-max].", "",
             "| trace | arm | model | " + " | ".join(h for h, *_ in COLUMNS) + " |",
             "|---|---|---|" + "---|" * len(COLUMNS)]
    for run in report["runs"]:
        if run.get("error"):
            lines.append(f"| {run['trace']} | {run['arm']} | - | {run['error']} |" + " |" * (len(COLUMNS) - 1))
            continue
        for model, stats in run["summary"].items():
            lines.append(f"| {run['trace']} | {run['arm']} | {model} | " + " | ".join(
                summary_cell(stats[m], spec, unit, scale) for _, m, spec, unit, scale in COLUMNS) + " |")
    return "\n".join(lines)


# Issue 32's targets: (trace, what, measure, the bound given the settings, at most (True) or at least)
TARGETS: list[tuple[str, str, str, Callable[[dict], float], bool]] = [
    ("step", "the extra replica serves within the cold start + 15 s", "step_to_serving_s",
     lambda s: s["cold_start_s"] + 15, True),
    ("step", "at most one reversal per 10 minutes under constant load", "reversals_per_10_min", lambda s: 1, True),
    ("idle", "from zero, no request dropped", "dropped", lambda s: 0, True),
    ("idle", "from zero, the first token within the cold start + 2 s", "from_zero_first_token_s",
     lambda s: s["cold_start_s"] + 2, True),
    ("diurnal", "replica-seconds within 15 % of the oracle's", "vs_oracle", lambda s: 1.15, True),
    ("diurnal", "TTFT p95 within its SLO >= 99 % of the time", "slo_attainment", lambda s: 0.99, False),
    ("*", "never more replicas than the oracle's + 1", "most_over_oracle", lambda s: 1, True),
]


def targets(report: dict, arm: str) -> list[dict]:
    """Each of :data:`TARGETS` that ``arm``'s runs measured: its median, the bound and whether it was met."""
    found = []
    for run in report["runs"]:
        if run["arm"] != arm or run.get("error"):
            continue
        for trace, what, measure, bound, at_most in TARGETS:
            if trace not in ("*", run["trace"]):
                continue
            for model, stats in run["summary"].items():
                entry = stats.get(measure)
                limit = bound(report["settings"])
                value = None if entry is None else entry["median"]
                met = value is not None and (value <= limit if at_most else value >= limit)
                found.append({"trace": run["trace"], "model": model, "target": what, "measure": measure,
                              "median": value, "bound": limit, "met": met})
    return found


def targets_markdown(report: dict, arm: str) -> str:
    rows = targets(report, arm)
    if not rows:
        return f"(no {arm} run measured issue 32's targets)"
    lines = [f"Issue 32's targets, the {arm} arm (medians of the repeats that measured it; a measure that is missing "
             "misses its target):", "",
             "| trace | model | target | measured | bound | met |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['trace']} | {r['model']} | {r['target']} | {cell(r['median'], '.2f')} | {r['bound']:g} | "
              f"{'yes' if r['met'] else 'no'} |" for r in rows]
    return "\n".join(lines)


def charts(report: dict) -> str:
    """Every run's chart (its first repeat), titled."""
    out = []
    for run in report["runs"]:
        for model, model_series in (run.get("series") or {}).items():
            out.append(f"{run['trace']} / {run['arm']} / {model}: # ready, + starting, . demand not covered, "
                       f"o the oracle's count\n{chart(model_series)}")
    return "\n\n".join(out)
