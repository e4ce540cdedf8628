"""How well the routers' cost estimates predicted what the requests then got: ``llmgw bench routing``'s calibration.

An llmgw gateway keeps its last routing decisions (``GET /admin/decisions`` on
its control listener, a ring of 100): per decision the outcome, the estimate
of each candidate under the cost rule (``detail.estimates``: seconds to first
token), the chosen replica's estimate and its uncertainty
(``detail.cost``), and the time to first token the gateway then measured.
:class:`DecisionCollector` reads that ring while a run goes on, often enough
that no decision falls out of it unread (after every :data:`POLL_EVERY`
answered requests, and once at the end), and keeps each decision once.

:func:`calibration` turns the collected decisions into, per outcome (``hit``,
``miss``, ``cost_override``, ...) and for all of them: how many, the median
and p90 of actual / estimated TTFT (1.0: exact; above: the estimate was
optimistic), the mean error (actual - estimated, ms) and the mean absolute
error, the estimates' mean uncertainty (their standard error, the override
gate's measure: :mod:`llmgw.router.uncertainty`) and the share of them within
it of the TTFT measured, and for the decisions that went off the preferred replica (overrides)
the mean gain the rule expected (the preferred replica's cost less the
chosen one's) beside the mean uncertainty of that gain it was compared with.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

import httpx
import trio

from .chat_workloads import percentile
from .common import cell

POLL_EVERY = 40  # answered requests between two reads of a ring of 100 (the clients in flight finish meanwhile)
POLL_TIMEOUT = 10.0
# one decision as the JSON keeps it: the chosen replica's estimate and its uncertainty (None before the gate existed),
# the TTFT measured, and for a decision that left the preferred replica the cost it expected to save and the
# uncertainty of that gain; then every candidate's estimated TTFT ({replica: seconds}) and the replica chosen
DECISION_FIELDS = ["outcome", "estimated_ttft_s", "actual_ttft_s", "uncertainty_s", "gain_uncertainty_s",
                   "expected_gain_s", "candidates_ttft_s", "replica"]
ALL = "all"


class DecisionCollector:
    """The decisions of a run's llmgw gateways (their control URLs), each kept once, in the order read."""

    def __init__(self, urls: list[str]):
        self.urls = urls
        self.decisions: list[list] = []
        self.seen: set[tuple] = set()
        self.lost = 0  # reads that found the ring turned over past the last decision kept (some never read)
        self._answered = 0
        self._wanted = trio.Event()

    def answered(self) -> None:
        """One more request answered; every POLL_EVERY of them the rings are read."""
        self._answered += 1
        if self._answered % POLL_EVERY == 0:
            self._wanted.set()

    async def run(self, http: httpx.AsyncClient) -> None:
        """Read the rings whenever :meth:`answered` asks (until cancelled)."""
        if not self.urls:
            return
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            await self.read(http)

    async def read(self, http: httpx.AsyncClient) -> None:
        for url in self.urls:
            with trio.move_on_after(POLL_TIMEOUT):
                response = await http.get(url + "/admin/decisions")
                if response.status_code == 200:
                    body = response.json()
                    self.keep(body.get("decisions", []), body.get("capacity", 0))

    def keep(self, ring: list[dict], capacity: int = 0) -> None:
        """The decisions of one ring (newest first, ``capacity`` at most) not kept yet."""
        fresh = []
        for d in ring:
            key = (d.get("at"), d.get("request_id"), d.get("replica"))
            if key in self.seen:
                break  # the rest is older: read before
            self.seen.add(key)
            fresh.append(d)
        if ring and len(fresh) == len(ring) >= capacity and len(self.seen) > len(fresh):
            self.lost += 1  # a full ring, none of it read before, after earlier reads: it turned over in between
        for d in reversed(fresh):
            row = decision_row(d)
            if row is not None:
                self.decisions.append(row)


def decision_row(decision: dict) -> list | None:
    """A decision as :data:`DECISION_FIELDS`; None when it made no estimate (another rule) or had no first token."""
    cost = decision.get("detail", {}).get("cost")
    actual = decision.get("ttft_ms")
    if not isinstance(cost, dict) or actual is None or decision.get("status") != 200:
        return None
    estimated = cost.get("estimated_ttft_s")
    if not isinstance(estimated, (int, float)):
        return None
    return [decision.get("outcome", ""), estimated, actual / 1000.0, cost.get("uncertainty_s"),
            cost.get("gain_uncertainty_s"), cost.get("expected_gain_s"), decision["detail"].get("estimates"),
            decision.get("replica")]


def calibration(rows: Iterable[list]) -> dict[str, dict[str, Any]]:
    """Per outcome (and ``all``): count, actual/estimated median and p90, mean error and mean absolute error (ms),
    the estimates' mean uncertainty (ms) and how many of them were within it of the TTFT measured, and where the
    preferred replica was left, the mean expected gain and the mean uncertainty of that gain (ms)."""
    groups: dict[str, list[list]] = {}
    for row in rows:
        groups.setdefault(row[0], []).append(row)
        groups.setdefault(ALL, []).append(row)
    out = {}
    for outcome in sorted(groups, key=lambda o: (o == ALL, o)):
        group = groups[outcome]
        ratios = [actual / estimated for _, estimated, actual, *_ in group if estimated > 0]
        errors = [1000 * (actual - estimated) for _, estimated, actual, *_ in group]
        gains = [1000 * row[5] for row in group if row[5] is not None]
        spreads = [1000 * row[4] for row in group if row[5] is not None and row[4] is not None]
        own = [(1000 * u, abs(actual - estimated) <= u) for _, estimated, actual, u, *_ in group if u is not None]
        out[outcome] = {
            "decisions": len(group),
            "ratio_p50": percentile(ratios, 0.5) if ratios else None,
            "ratio_p90": percentile(ratios, 0.9) if ratios else None,
            "mean_error_ms": statistics.fmean(errors),
            "mean_abs_error_ms": statistics.fmean(abs(e) for e in errors),
            "mean_estimate_uncertainty_ms": statistics.fmean(u for u, _ in own) if own else None,
            "within_uncertainty": sum(inside for _, inside in own) / len(own) if own else None,
            "mean_expected_gain_ms": statistics.fmean(gains) if gains else None,
            "mean_uncertainty_ms": statistics.fmean(spreads) if spreads else None,
        }
    return out


def calibration_table(workload: dict, levels: list[str]) -> list[str]:
    """The calibration of every llmgw arm that made estimates, pooled over its repeats (Markdown lines)."""
    rows = []
    for arm in workload["arms"].values():
        for c in levels:
            for outcome, s in arm.get("calibration", {}).get(c, {}).items():
                rows.append(f"| {arm['label']} | {c} | {outcome} | {s['decisions']} | {cell(s['ratio_p50'], '.2f')} | "
                            f"{cell(s['ratio_p90'], '.2f')} | {s['mean_error_ms']:+.1f} | "
                            f"{s['mean_abs_error_ms']:.1f} | {cell(s['mean_estimate_uncertainty_ms'], '.1f')} | "
                            f"{cell(s['within_uncertainty'], '.2f')} | {cell(s['mean_expected_gain_ms'], '.1f')} | "
                            f"{cell(s['mean_uncertainty_ms'], '.1f')} |")
    if not rows:
        return []
    return ["Calibration of the cost estimates (the gateway's measured TTFT against the chosen replica's estimate, "
            "every decision of the repeats; ratio: actual / estimated; error: actual - estimated; uncertainty: the "
            "estimate's standard error, and the share of estimates within it of the TTFT; gain and its uncertainty: "
            "of the decisions that left the preferred replica)", "",
            "| arm | C | outcome | decisions | ratio p50 | ratio p90 | mean error (ms) | mean abs error (ms) | "
            "uncertainty (ms) | within it | expected gain (ms) | gain uncertainty (ms) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows, ""]
