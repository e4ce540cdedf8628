"""The :class:`~.interfaces.SignalSource` of a gateway: one model's demand and state from what this process holds.

- queued: the requests (and their tokens) this gateway's flow queue holds for the model, plus what the other
  gateways' load reports say they hold (``q``, llmgw/cluster/load.py);
- in flight: every replica's ``inflight`` (this gateway's exact count plus the peers' latest reports);
- KV usage: the mean of the ready replicas' last scrape (the room's, llmgw/flow/room.py);
- the drain rate: the replicas' ``served`` counters, smoothed; the last request: the last reading with anything
  queued or in flight, or a counter that moved (a fresh source counts its start as one, so a new leader does not
  scale an idle model to zero before ``idle_to_zero`` has passed under it).

Local copies only: nothing here waits on Redis or an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .model import ModelSignals

if TYPE_CHECKING:
    from ..router.router import Router

SMOOTHING = 0.3  # the weight of the newest reading in the served-per-second average


@dataclass
class _Seen:
    served: int
    at: float
    rate: float = 0.0
    last_request_at: float | None = None


class GatewaySignals:
    def __init__(self, router: "Router", held: Callable[[str], tuple[int, int]],
                 peer_held: Callable[[str], list[int]] = lambda model: []):
        """``held(model)``: (requests, tokens) this gateway's flow queue holds; ``peer_held(model)``: what each
        other gateway's latest load report says it holds."""
        self.router = router
        self.held = held
        self.peer_held = peer_held
        self._seen: dict[str, _Seen] = {}

    def signals(self, model: str, now: float) -> ModelSignals:
        route = self.router.models.get(model)
        replicas = list(route.replicas) if route is not None else []
        requests, tokens = self.held(model)
        queued = requests + sum(self.peer_held(model))
        inflight = sum(replica.inflight for replica in replicas)
        served = sum(replica.served for replica in replicas)
        usage = [replica.engine_load.kv_usage for replica in replicas
                 if replica.routable and replica.engine_load is not None and replica.engine_load.kv_usage is not None]
        seen = self._seen.get(model)
        if seen is None:
            seen = self._seen[model] = _Seen(served, now, last_request_at=now)
        elif now > seen.at:
            # A replica that left takes its count with it: a drop is no negative rate.
            rate = max(0, served - seen.served) / (now - seen.at)
            seen.rate = SMOOTHING * rate + (1 - SMOOTHING) * seen.rate
            if served != seen.served:
                seen.last_request_at = now
            seen.served, seen.at = served, now
        if queued or inflight:
            seen.last_request_at = now
        return ModelSignals(model=model, at=now, queued=queued, queued_tokens=tokens, inflight=inflight,
                            served_per_s=seen.rate, kv_usage=sum(usage) / len(usage) if usage else None,
                            last_request_at=seen.last_request_at)

    def forget(self, keep: set[str]) -> None:
        """Drop what is remembered of models no longer autoscaled (bounded by the config's models)."""
        for model in list(self._seen):
            if model not in keep:
                del self._seen[model]
