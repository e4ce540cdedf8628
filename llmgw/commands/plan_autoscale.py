"""``llmgw plan --load``: what the autoscaler would decide for a given load, and why, touching nothing.

The load is held constant for ``--for`` seconds (default: until every window of the config has passed) and the
scaler of the product (:class:`~llmgw.autoscale.scaler.TargetScaler`) decides every ``autoscale.interval``; a
step's replicas are ready ``--ready-after`` seconds after it (default 60: a cold start), a step down frees its
GPUs at once. Each deployment starts at ``--replicas PROFILE=N`` or at its config's count. The queue, the requests in
flight and the TTFT attainment stay as given; the KV usage spreads over the ready replicas (its value times the
replicas at the start, over the replicas ready now).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from llmgw.autoscale.model import DeploymentView, ModelSignals, ReplicaCounts, ScaleDecision
from llmgw.autoscale.scaler import TargetScaler, change_of
from llmgw.config import Config

UNLIMITED = 1_000_000  # free GPUs when neither --free-gpus nor nodes say
MAX_TICKS = 100_000  # a preview's decisions: --for over autoscale.interval
LOAD_KEYS = {"kv": "kv_usage", "ttft": "ttft_attainment", "inflight": "inflight", "idle": "idle", "busy": "busy"}


class LoadError(ValueError):
    """A ``--load``, ``--replicas`` or ``--free-gpus`` value that cannot be read."""


@dataclass(frozen=True)
class Load:
    """One ``--load MODEL=QUEUED[,kv=F][,ttft=F][,inflight=N][,idle=S][,busy=R]``: a model's signals, held
    constant (``busy``: the replicas' worth of engine seats the load keeps busy)."""

    model: str
    queued: int
    inflight: int = 0
    kv_usage: float | None = None
    ttft_attainment: float | None = None
    idle: float | None = None  # seconds since its last request when the preview starts (only with no request)
    busy: float | None = None  # replicas' worth of busy seats (capped at the replicas ready)


def _number(text: str, what: str, *, whole: bool = False, fraction: bool = False) -> float:
    try:
        value = int(text) if whole else float(text)
    except ValueError:
        raise LoadError(f"{what}: expected {'a whole number' if whole else 'a number'}, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (fraction and value > 1) or value > 10**9:
        raise LoadError(f"{what}: must be {'between 0 and 1' if fraction else 'at least 0'}, got {text!r}")
    return value


def parse_load(text: str) -> Load:
    head, *options = text.split(",")
    model, equals, queued = head.partition("=")
    if not equals or not model:
        raise LoadError(f"--load {text!r}: expected MODEL=QUEUED[,kv=0.9][,ttft=0.95][,inflight=N][,idle=SECONDS]"
                        "[,busy=REPLICAS]")
    values: dict[str, Any] = {}
    for option in options:
        key, equals, value = option.partition("=")
        if not equals or key not in LOAD_KEYS:
            raise LoadError(f"--load {text!r}: unknown option {option!r} (options: {', '.join(LOAD_KEYS)})")
        values[LOAD_KEYS[key]] = _number(value, f"--load {model} {key}", whole=key == "inflight",
                                         fraction=key in ("kv", "ttft"))
    return Load(model=model, queued=int(_number(queued, f"--load {model} queued", whole=True)), **values)


def parse_counts(items: Sequence[str], flag: str, *, classes: bool = False) -> dict[str | None, int]:
    """``NAME=N`` items (``--replicas``); with ``classes``, a bare ``N`` is keyed None (``--free-gpus``)."""
    counts: dict[str | None, int] = {}
    for item in items:
        name, equals, count = item.rpartition("=")
        if not equals and not classes:
            raise LoadError(f"{flag} {item!r}: expected NAME=N")
        counts[name if equals else None] = int(_number(count, f"{flag} {item}", whole=True))
    return counts


@dataclass
class _Deployment:
    """A deployment as the preview runs it."""

    view: DeploymentView
    desired: int
    ready: int
    stepped_at: float = -math.inf
    busy: float | None = None  # the load's busy seats, in replicas (held, at most the replicas ready)
    history: list[ScaleDecision] = field(default_factory=list)


def preview(config: Config, loads: Sequence[Load], *, replicas: dict[str | None, int],
            free_gpus: dict[str | None, int], duration: float | None, ready_after: float) -> dict[str, Any]:
    """Run the scaler over the constant load; the deployments' decisions and where each ends."""
    by_model = {load.model: load for load in loads}
    unknown = set(by_model) - {d.profile for d in config.deployments} - set(config.model_names())
    if unknown:
        raise LoadError(f"--load: no deployment of {', '.join(sorted(unknown))} in {config.source or 'the config'}")
    settings = config.autoscale_settings()
    if not settings:
        raise LoadError(f"{config.source or 'the config'} has no autoscaled deployment (replicas: {{min, max}})")
    runs: dict[str, _Deployment] = {}
    for deployment in config.deployments:
        if deployment.profile not in settings:
            continue
        profile = config.profile(deployment.profile)
        load = by_model.get(profile.name) or by_model.get(profile.served_model_name) or Load(profile.name, 0)
        start = max(0, replicas.get(profile.name, deployment.replicas))
        idle_since = -load.idle if load.idle is not None and not load.queued and not load.inflight else None
        signals = ModelSignals(model=profile.served_model_name, at=0.0, queued=load.queued, inflight=load.inflight,
                               kv_usage=load.kv_usage, ttft_attainment=load.ttft_attainment,
                               last_request_at=idle_since)
        view = DeploymentView(key=profile.name, model=profile.served_model_name, settings=settings[profile.name],
                              counts=ReplicaCounts(ready=start), desired=start, gpus_per_replica=profile.gpus,
                              gpu_class=profile.gpu_class, signals=signals)
        runs[profile.name] = _Deployment(view, start, start, busy=load.busy)
    interval = config.autoscale.interval
    horizon = duration if duration is not None else 1 + max(
        max(s.scale_up_after, s.scale_down_after, s.idle_to_zero) for s in settings.values()) + ready_after
    ticks = min(MAX_TICKS, int(horizon / interval) + 1)
    scaler, free = TargetScaler(settings), dict(free_gpus)
    for tick in range(ticks):
        now = tick * interval
        views = []
        for run in runs.values():
            if now - run.stepped_at >= ready_after or run.desired < run.ready:
                run.ready = run.desired
            given = run.view.signals
            busy = given.queued or given.inflight
            kv = given.kv_usage  # the KV demand spreads over the replicas ready now
            if kv is not None and run.view.counts.ready and run.ready:
                kv = min(1.0, kv * run.view.counts.ready / run.ready)
            held = None if run.busy is None else min(run.busy, float(run.ready))
            signals = dataclasses.replace(given, at=now, kv_usage=kv, busy=held,
                                          last_request_at=now if busy else given.last_request_at)
            views.append(dataclasses.replace(run.view, signals=signals, desired=run.desired, counts=ReplicaCounts(
                ready=run.ready, starting=run.desired - run.ready)))
        for decision in scaler.decide(now, views, free):
            run = runs[decision.key]
            run.history.append(decision)
            if decision.desired != run.desired:
                change = (decision.desired - run.desired) * run.view.gpus_per_replica
                for gpu_class in {None, run.view.gpu_class}:
                    if gpu_class in free:
                        free[gpu_class] -= change
                run.desired, run.stepped_at = decision.desired, now
    return {
        "duration": (ticks - 1) * interval, "interval": interval, "ready_after": ready_after,
        "free_gpus": {("any" if k is None else k): v for k, v in free_gpus.items()},
        "deployments": [{
            "deployment": key, "model": run.view.model, "min": run.view.settings.min_replicas,
            "max": run.view.settings.max_replicas, "start": run.view.desired, "end": run.desired,
            "load": {"queued": run.view.signals.queued, "inflight": run.view.signals.inflight,
                     "kv": run.view.signals.kv_usage, "ttft_attainment": run.view.signals.ttft_attainment,
                     "busy": run.busy},
            "decisions": run.history,
        } for key, run in runs.items()],
    }


def render_text(result: dict[str, Any]) -> list[str]:
    free = ", ".join(f"{name} {count}" for name, count in result["free_gpus"].items() if count < UNLIMITED)
    free = free or "unlimited"
    lines = [f"autoscale preview: {result['duration']:g} s of a constant load, a decision every "
             f"{result['interval']:g} s, replicas ready {result['ready_after']:g} s after their step; "
             f"free GPUs: {free}"]
    for item in result["deployments"]:
        load = item["load"]
        said = [f"{load['queued']} queued"] + ([f"{load['inflight']} in flight"] if load["inflight"] else [])
        said += [f"kv {load['kv']:g}"] if load["kv"] is not None else []
        said += [f"TTFT attainment {load['ttft_attainment']:g}"] if load["ttft_attainment"] is not None else []
        said += [f"busy {load['busy']:g} replicas"] if load.get("busy") is not None else []
        lines += ["", f"{item['deployment']} (model {item['model']}): {item['start']} -> {item['end']} replicas "
                      f"(min {item['min']}, max {item['max']}); load: {', '.join(said)}"]
        for decision in item["decisions"]:
            lines.append(f"  +{decision.at:>7.1f} s  {change_of(decision)}: {decision.reason}")
        if not item["decisions"]:
            lines.append("  no decision: the load is within the targets")
    return lines


def render_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2, default=dataclasses.asdict)
