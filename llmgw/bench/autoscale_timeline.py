"""Where the seconds of one scale-up go in ``llmgw bench autoscale``: its timeline, read from the processes' logs.

The control process and the agents log in JSON (``ts`` to the millisecond, :mod:`llmgw.logsetup`). For the first
scale-up of a deployment after a moment (the trace's step, or an idle model's call), :func:`scale_up_timeline`
finds, for the first of the replicas it adds (``{profile}-{i}``, ``i`` from the count before the step):

- ``decided``: the autoscaler's decision (``autoscale: DEPLOYMENT (MODEL) up 2 -> 3: ...``);
- ``placed``: the control plane places the replica (``place replica ID ...``);
- ``spawned``: its agent starts the engine (the shard's ``starting`` report);
- ``engine_ready``: when the engine answers ``/health``: the simulator's own JSON log says when its modelled cold
  start began and how long it takes (``loading the model: ready in 4.7s``; its log is the agent's
  ``logs/SHARD.log``, the shard's id starting with the replica's): the engine's part ends there, llmgw's begins;
- ``reported``: the agent's probe sees it ready (the shard's ``ready`` report);
- ``routed``: the control plane puts it in routing (``replica ID (MODEL) enters routing``);
- ``dispatched`` and ``first_token``: the first request the replica served (from zero: the first request sent
  after the call), as the access log has it (``llmgw.access``: its start is the line's time less its latency, it
  left the gateway queue ``queue_wait_ms`` later and had its first token ``ttft_ms`` after its start).

Each is in wall seconds from the moment; :func:`timeline_rows` adds the step's own phases (the gap from the previous
event) and the fleet seconds (wall x the time factor) for the report.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

PHASES = (
    ("decided", "the autoscaler decides"),
    ("placed", "the control plane places the replica"),
    ("spawned", "the agent starts the engine"),
    ("engine_ready", "the engine answers /health"),
    ("reported", "the agent reports it ready"),
    ("routed", "it enters routing"),
    ("dispatched", "the gateway queue dispatches its first request"),
    ("first_token", "that request's first token"),
)
CHANGE = re.compile(r" (up|from_zero) (\d+) -> (\d+): ")
LOADING = re.compile(r"^loading the model: ready in ([0-9.e+-]+)s")


def epoch(stamp: str) -> float:
    """``2026-12-07T21:00:15.123Z`` as seconds since the epoch."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def log_events(lines: Iterable[str]) -> list[dict]:
    """The JSON log records among ``lines`` (anything else skipped), each with ``at`` (epoch seconds)."""
    found = []
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
            record["at"] = epoch(record["ts"])
        except (ValueError, KeyError, TypeError):
            continue
        found.append(record)
    return found


def first(events: Sequence[dict], after: float, matches) -> float | None:
    return next((e["at"] for e in events if e["at"] >= after and matches(e)), None)


def engine_logs(workdir: Path) -> dict[str, list[dict]]:
    """Every engine's JSON log records under ``workdir``'s agents' state folders, by shard id."""
    return {path.stem: log_events(path.read_text(errors="replace").splitlines())
            for path in sorted(workdir.glob("agent-*/logs/*.log"))}


def engine_ready_at(engines: Mapping[str, Sequence[dict]], replica: str, after: float) -> float | None:
    """When ``replica``'s engine (started at or after ``after``) was ready: its cold start's line plus its length."""
    for shard, events in engines.items():
        if not shard.startswith(f"{replica}-g"):
            continue
        for e in events:
            if e["at"] >= after and (loading := LOADING.match(e.get("message", ""))) is not None:
                return e["at"] + float(loading.group(1))
    return None


def first_served(control: Sequence[dict], model: str, since: float, replica: str | None) -> dict | None:
    """The access line of the first request of ``model`` that started at or after ``since`` (``replica``: the
    first that replica served, by when it left the queue), with ``started``, ``dispatched`` and ``first_token``
    (epoch seconds)."""
    served = []
    for e in control:
        if e.get("logger") != "llmgw.access" or e.get("model") != model or e.get("status") != 200 \
                or e.get("latency_ms") is None:
            continue
        started = e["at"] - e["latency_ms"] / 1000
        if started < since or (replica is not None and e.get("replica") != replica):
            continue
        dispatched = started + (e.get("queue_wait_ms") or 0.0) / 1000
        first_token = None if e.get("ttft_ms") is None else started + e["ttft_ms"] / 1000
        served.append({**e, "started": started, "dispatched": dispatched, "first_token": first_token})
    if not served:
        return None
    return min(served, key=lambda e: e["dispatched"] if replica is not None else e["started"])


def scale_up_timeline(control: Sequence[dict], agents: Sequence[dict], deployment: str, model: str, since: float,
                      engines: Mapping[str, Sequence[dict]], from_zero: bool = False) -> dict | None:
    """The first scale-up of ``deployment`` at or after ``since`` (epoch seconds): each of :data:`PHASES` in wall
    seconds from ``since`` (None: not seen); None when no scale-up was decided. ``engines``: :func:`engine_logs`;
    ``from_zero``: the request timed is the first sent after ``since`` (else the first the new replica served)."""
    prefix = f"autoscale: {deployment} ({model}) "
    decision = next((e for e in control if e["at"] >= since and e.get("message", "").startswith(prefix)
                     and CHANGE.search(e["message"])), None)
    if decision is None:
        return None
    change = CHANGE.search(decision["message"])
    assert change is not None
    added = {f"{deployment}-{i}" for i in range(int(change.group(2)), int(change.group(3)))}
    decided = decision["at"]
    routed = [(e["at"], e["message"].split(" ")[1]) for e in control if e["at"] >= decided
              and e.get("message", "").startswith("replica ") and " enters routing" in e["message"]
              and e["message"].split(" ")[1] in added]
    replica = min(routed)[1] if routed else min(added)
    spawned = first(agents, decided, lambda e: e.get("replica") == replica and e.get("state") == "starting")
    request = first_served(control, model, since, None if from_zero else replica)
    at = {
        "decided": decided,
        "placed": first(control, decided, lambda e: e.get("message", "").startswith(f"place replica {replica} ")),
        "spawned": spawned,
        "engine_ready": engine_ready_at(engines, replica, decided),
        "reported": first(agents, decided, lambda e: e.get("replica") == replica and e.get("state") == "ready"),
        "routed": min(routed)[0] if routed else None,
        "dispatched": None if request is None else request["dispatched"],
        "first_token": None if request is None else request["first_token"],
    }
    return {"replica": replica, "change": f"{change.group(1)} {change.group(2)} -> {change.group(3)}",
            "wall_s": {name: None if t is None else t - since for name, t in at.items()}}


Row = tuple[str, float | None, float | None, float | None]


def timeline_rows(timeline: dict, factor: float) -> list[Row]:
    """Per phase: its description, fleet seconds from the moment, wall seconds from it, and wall seconds since the
    phase before it that was seen (the step's own cost)."""
    rows: list[Row] = []
    previous = 0.0
    for name, what in PHASES:
        wall = timeline["wall_s"].get(name)
        if wall is None:
            rows.append((what, None, None, None))
            continue
        rows.append((what, wall * factor, wall, wall - previous))
        previous = wall
    return rows


def timeline_markdown(title: str, timeline: dict, factor: float) -> str:
    lines = [f"{title}: replica {timeline['replica']} ({timeline['change']})", "",
             "| phase | fleet s from the moment | wall s from it | wall s of this step |", "|---|---|---|---|"]
    for what, fleet, wall, own in timeline_rows(timeline, factor):
        cells = ["-" if v is None else f"{v:.2f}" for v in (fleet, wall, own)]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def timelines_markdown(report: dict, arm: str) -> str:
    """Every repeat's scale-up timeline of ``arm`` (the step's, an idle model's from zero), one table each."""
    factor = report["settings"]["time_factor"]
    parts = []
    for entry in report["runs"]:
        if entry["arm"] != arm:
            continue
        for repeat, run in enumerate(entry["runs"], 1):
            for model, stats in run.items():
                if stats.get("timeline"):
                    moment = "the call (from zero)" if entry["trace"] == "idle" else "the step"
                    parts.append(timeline_markdown(f"{entry['trace']} / {model} / repeat {repeat}, from {moment}",
                                                   stats["timeline"], factor))
    return "\n\n".join(parts)
