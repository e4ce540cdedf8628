"""The numbers of ``llmgw bench overload``: one load level's per class, then medians over the repeats and the table.

:func:`level_stats` reads one run of one level (its :class:`~.overload_workload.Loop` and KV samples); per class:
TTFT p50/p99 and ITL p99 of the answered requests, goodput (requests meeting the class's SLO: TTFT for interactive,
the whole answer for batch, per second from the first arrival to the last answer, so that a backlog drained after
the arrivals stopped is not counted as the arrivals' rate), completed, shed (429), expired (llmgw's 429
``queue_timeout``, or vllm-router's 408) and error counts, the refusals' latency p50/p99 and the share of them that
carried ``Retry-After``; for the level: total goodput over the fleet's capacity, the interactive tenants' fairness
(the smaller one's tokens in answers that met the SLO over the larger one's: they send equally many requests), and
the engines' KV usage while a gateway queue held requests (and while the engines' own queues did), and the
sequences the engines preempted (their KV cache ran out: what a room that lets in too much costs). :func:`summary`
takes each number's median, min and max over the repeats; :func:`markdown` prints them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .chaos import spread
from .chaos_schedule import median_and_range
from .cluster_events import percentile
from .overload_workload import BATCH, CLASSES, ERROR, EXPIRED, INTERACTIVE, OK, SHED, Loop, Outcome


def _ms(values: list[float], q: float) -> float | None:
    found = percentile(values, q)
    return None if found is None else found * 1000


def meets_slo(outcome: Outcome, slo: dict[str, float]) -> bool:
    if outcome.kind != OK:
        return False
    return outcome.ttft <= slo[INTERACTIVE] if outcome.priority == INTERACTIVE else outcome.latency <= slo[BATCH]


def class_stats(outcomes: Sequence[Outcome], slo: dict[str, float], seconds: float) -> dict:
    ok = [o for o in outcomes if o.kind == OK]
    refused = [o for o in outcomes if o.kind in (SHED, EXPIRED)]
    good = sum(meets_slo(o, slo) for o in outcomes)
    return {"sent": len(outcomes), "completed": len(ok), "good": good, "goodput_rps": good / seconds,
            "shed": sum(o.kind == SHED for o in outcomes), "expired": sum(o.kind == EXPIRED for o in outcomes),
            "errors": sum(o.kind == ERROR for o in outcomes),
            "ttft_p50_ms": _ms([o.ttft for o in ok], 0.5), "ttft_p99_ms": _ms([o.ttft for o in ok], 0.99),
            "itl_p99_ms": _ms([gap for o in ok for gap in o.itl], 0.99),
            "rejection_p50_ms": _ms([o.latency for o in refused], 0.5),
            "rejection_p99_ms": _ms([o.latency for o in refused], 0.99),
            "retry_after_share": sum(o.retry_after for o in refused) / len(refused) if refused else None,
            "tokens": sum(o.tokens for o in ok)}


def _kv(samples: Sequence[dict], when: Callable[[dict], bool], key: str = "kv") -> dict:
    kv = [s[key] for s in samples if when(s) and s.get(key) is not None]
    return {"samples": len(kv), "mean": sum(kv) / len(kv) if kv else None, "min": min(kv) if kv else None}


SLOW_REFUSAL = 0.05  # seconds: issue 31's target for a refusal's answer


def refusal_breakdown(outcomes: Sequence[Outcome]) -> dict:
    """Where the refusals' latency comes from: per reason (llmgw's expired, overflow, unservable on arrival,
    unservable_waiting: found while it waited) and per gateway,
    their count and latency p50/p99; and the slow ones (over :data:`SLOW_REFUSAL`) per reason and per second of
    the run they were sent in."""
    refused = [o for o in outcomes if o.kind in (SHED, EXPIRED)]

    def stats(group: list[Outcome]) -> dict:
        return {"count": len(group), "p50_ms": _ms([o.latency for o in group], 0.5),
                "p99_ms": _ms([o.latency for o in group], 0.99)}

    def grouped(key: Callable[[Outcome], object], group: list[Outcome]) -> dict[str, list[Outcome]]:
        out: dict[str, list[Outcome]] = {}
        for o in group:
            out.setdefault(str(key(o)), []).append(o)
        return dict(sorted(out.items()))

    slow = [o for o in refused if o.latency > SLOW_REFUSAL]
    return {"by_reason": {k: stats(v) for k, v in grouped(lambda o: o.reason, refused).items()},
            "by_gateway": {k: stats(v) for k, v in grouped(lambda o: o.gateway, refused).items()},
            "slow": len(slow),
            "slow_by_reason": {k: len(v) for k, v in grouped(lambda o: o.reason, slow).items()},
            "slow_by_second": {k: len(v) for k, v in grouped(lambda o: int(o.sent), slow).items()}}


def level_stats(loop: Loop, kv_samples: Sequence[dict], slo: dict[str, float], capacity_rps: float) -> dict:
    by_class = {c: class_stats([o for o in loop.outcomes if o.priority == c], slo, loop.elapsed) for c in CLASSES}
    tenants: dict[str, int] = {}  # each interactive tenant's tokens in answers that met the SLO
    for o in loop.outcomes:
        if o.priority == INTERACTIVE:
            tenants[o.tenant] = tenants.get(o.tenant, 0) + (o.tokens if meets_slo(o, slo) else 0)
    fairness = min(tenants.values()) / max(tenants.values()) if len(tenants) > 1 and max(tenants.values()) else None
    goodput = sum(c["goodput_rps"] for c in by_class.values())
    gateway_queues = any(s["queued"] is not None for s in kv_samples)
    return {"classes": by_class, "goodput_rps": goodput, "refusals": refusal_breakdown(loop.outcomes),
            "goodput_of_capacity": goodput / capacity_rps if capacity_rps else None,
            "fairness": fairness, "interactive_tokens": tenants, "over_cap": loop.over_cap,
            "most_in_flight": loop.most_in_flight,
            "kv_gateway_queued": _kv(kv_samples, lambda s: bool(s["queued"])) if gateway_queues else None,
            "kv_engines_waiting": _kv(kv_samples, lambda s: s["waiting"] > 0),
            "busy_gateway_queued": _kv(kv_samples, lambda s: bool(s["queued"]), "busy") if gateway_queues else None,
            "kv_all": _kv(kv_samples, lambda s: True), "preemptions": _preemptions(kv_samples),
            "output_allowance": kv_samples[-1].get("allowance") if kv_samples else None}


def _preemptions(samples: Sequence[dict]) -> float | None:
    """The engines' preemptions during the run: their counters' rise from the first whole sample to the last."""
    counts = [s["preemptions"] for s in samples if s.get("preemptions") is not None]
    return counts[-1] - counts[0] if len(counts) > 1 else None


# Each number of the summary and the table: its path in a level's stats
def _class_paths(name: str) -> dict[str, tuple[str, ...]]:
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "goodput_rps", "completed", "shed", "expired", "errors",
            "rejection_p50_ms", "rejection_p99_ms", "retry_after_share")
    return {f"{name}_{key}": ("classes", name, key) for key in keys}


MEASURES: dict[str, tuple[str, ...]] = {
    **_class_paths(INTERACTIVE), **_class_paths(BATCH),
    "goodput_rps": ("goodput_rps",), "goodput_of_capacity": ("goodput_of_capacity",), "fairness": ("fairness",),
    "kv_when_gateway_queued": ("kv_gateway_queued", "mean"), "kv_min_when_gateway_queued": ("kv_gateway_queued", "min"),
    "kv_when_engines_waiting": ("kv_engines_waiting", "mean"), "over_cap": ("over_cap",),
    "preemptions": ("preemptions",), "output_allowance": ("output_allowance",),
    "busy_when_gateway_queued": ("busy_gateway_queued", "mean"),
    **{f"engine_{key}": ("engines", key) for key in ("step_p50_ms", "step_p99_ms", "overrun_p50_ms", "overrun_p99_ms",
                                                      "itl_p99_ms", "capped_chunks", "steps", "gateway_wait_p50_ms",
                                                      "gateway_wait_p99_ms")},
}


def _at(run: dict, path: tuple[str, ...]) -> float | None:
    value: object = run
    for key in path:
        if not isinstance(value, dict) or value.get(key) is None:
            return None
        value = value[key]
    return float(value)  # type: ignore[arg-type]


def summary(runs: Sequence[dict], measures: dict[str, tuple[str, ...]] | None = None) -> dict:
    """Median, min and max of each of ``measures`` (:data:`MEASURES`) over ``runs`` (a level's repeats); None where
    none had it."""
    out = {}
    for name, path in (MEASURES if measures is None else measures).items():
        found = median_and_range([v for run in runs if (v := _at(run, path)) is not None])
        out[name] = None if found is None else dict(zip(("median", "min", "max"), found))
    return out


def spread_cell(entry: dict | None, spec: str, unit: str = "", scale: float = 1.0) -> str:
    if entry is None:
        return "-"
    return spread((entry["median"] * scale, entry["min"] * scale, entry["max"] * scale), spec, unit)


COLUMNS: list[tuple[str, str, str, float]] = [  # header, measure (per class: after the class's prefix), spec, scale
    ("TTFT p50 ms", "ttft_p50_ms", ".0f", 1), ("TTFT p99 ms", "ttft_p99_ms", ".0f", 1),
    ("ITL p99 ms", "itl_p99_ms", ".0f", 1), ("goodput req/s", "goodput_rps", ".2f", 1),
    ("completed", "completed", ".0f", 1), ("shed", "shed", ".0f", 1), ("expired", "expired", ".0f", 1),
    ("errors", "errors", ".0f", 1), ("refusal p50 ms", "rejection_p50_ms", ".1f", 1),
    ("refusal p99 ms", "rejection_p99_ms", ".1f", 1), ("Retry-After %", "retry_after_share", ".0f", 100),
]


def markdown(report: dict) -> str:
    settings = report["settings"]
    capacity = report["capacity"]
    given = ""
    if capacity.get("given"):
        given = f"given with --capacity; the ramp measured {capacity['measured_rps']:.2f}, "
    lines = [f"Fleet: {settings['replicas']} x `llmgw sim --profile {settings['profile']}` "
             f"({settings['sim_note']}); capacity {capacity['rps']:.2f} req/s ({given}"
             f"closed-loop ramp, the highest throughput with interactive TTFT p99 <= "
             f"{settings['slo_interactive_ms']:.0f} ms, at "
             f"{capacity['knee_concurrency']} clients; unloaded interactive TTFT p99 "
             f"{capacity['unloaded_interactive_ttft_p99_ms'] or 0:.0f} ms, at {settings['ramp'][0]}). vllm-router: "
             f"`{settings.get('vllm_router_options', '')}`. Open-loop Poisson arrivals for {settings['seconds']:g} "
             f"s per level, {settings['repeats']} repeat(s): median [min-max]. Goodput: interactive TTFT <= "
             f"{settings['slo_interactive_ms']:.0f} ms, batch answered within {settings['slo_batch_s']:g} s.", "",
             "| arm | load | class | " + " | ".join(h for h, *_ in COLUMNS) + " |",
             "|---|---|---|" + "---|" * len(COLUMNS)]
    unloaded = capacity["unloaded_interactive_ttft_p99_ms"]
    totals = ["", "| arm | load | goodput / capacity | interactive TTFT p99 / unloaded | interactive fairness | "
                  "KV while a gateway queue waits (mean; min) | engines busy then (KV or seats) | "
                  "KV while engines queue | over the in-flight cap | engine preemptions | output allowance |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in report["arms"]:
        if arm.get("error"):
            lines.append(f"| {arm['label']} | - | - | {arm['error']} |" + " |" * (len(COLUMNS) - 1))
            totals.append(f"| {arm['label']} | - | {arm['error']} | | | | | | | | |")
            continue
        for level in arm["levels"]:
            s = level["summary"]
            load = f"{level['load']:g}x"
            for name in CLASSES:
                lines.append(f"| {arm['label']} | {load} | {name} | "
                             + " | ".join(spread_cell(s[f"{name}_{m}"], spec, scale=scale)
                                          for _, m, spec, scale in COLUMNS)
                             + " |")
            ratio = spread_cell(s["interactive_ttft_p99_ms"], ".1f", "x", 1 / unloaded) if unloaded else "-"
            totals.append(f"| {arm['label']} | {load} | {spread_cell(s['goodput_of_capacity'], '.0f', '%', 100)} | "
                          f"{ratio} | {spread_cell(s['fairness'], '.2f')} | "
                          f"{spread_cell(s['kv_when_gateway_queued'], '.0f', '%', 100)}; "
                          f"{spread_cell(s['kv_min_when_gateway_queued'], '.0f', '%', 100)} | "
                          f"{spread_cell(s.get('busy_when_gateway_queued'), '.0f', '%', 100)} | "
                          f"{spread_cell(s['kv_when_engines_waiting'], '.0f', '%', 100)} | "
                          f"{spread_cell(s['over_cap'], '.0f')} | {spread_cell(s.get('preemptions'), '.0f')} | "
                          f"{spread_cell(s.get('output_allowance'), '.2f')} |")
    return "\n".join(lines + totals + engine_lines(report["arms"], unloaded))


def engine_lines(arms: Sequence[dict], unloaded: float | None) -> list[str]:
    """The table of what the simulators said of each level (:mod:`.overload_engines`) beside the interactive TTFT:
    the modelled steps apart from the host's overrun; an arm on simulators of its own (``llmgw-flow-chunk``) also
    over its own unloaded p99."""
    out = ["", "| arm | load | interactive TTFT p99 ms | / unloaded | / its engines' unloaded | engine steps | "
               "modelled step p50 / p99 ms | modelled ITL p99 ms | host overrun p50 / p99 ms | chunks capped | "
               "interactive gateway wait p50 / p99 ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        if arm.get("error"):
            continue
        own = arm.get("unloaded_interactive_ttft_p99_ms")
        for level in arm["levels"]:
            s = level["summary"]
            p99 = s["interactive_ttft_p99_ms"]
            out.append(f"| {arm['label']} | {level['load']:g}x | {spread_cell(p99, '.0f')} | "
                       f"{spread_cell(p99, '.1f', 'x', 1 / unloaded) if unloaded else '-'} | "
                       f"{spread_cell(p99, '.1f', 'x', 1 / own) if own else '-'} | "
                       f"{spread_cell(s.get('engine_steps'), '.0f')} | "
                       f"{spread_cell(s.get('engine_step_p50_ms'), '.1f')} / "
                       f"{spread_cell(s.get('engine_step_p99_ms'), '.1f')} | "
                       f"{spread_cell(s.get('engine_itl_p99_ms'), '.0f')} | "
                       f"{spread_cell(s.get('engine_overrun_p50_ms'), '.1f')} / "
                       f"{spread_cell(s.get('engine_overrun_p99_ms'), '.1f')} | "
                       f"{spread_cell(s.get('engine_capped_chunks'), '.0f')} | "
                       f"{spread_cell(s.get('engine_gateway_wait_p50_ms'), '.0f')} / "
                       f"{spread_cell(s.get('engine_gateway_wait_p99_ms'), '.0f')} |")
    return out
