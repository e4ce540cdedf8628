"""The room's Prometheus series (``llmgw_flow_replica_*``: capacity, seats, saturation, KV, ramp;
``llmgw_flow_ramps``, ``llmgw_flow_ramp_held_requests``, ``llmgw_flow_ramp_seconds``;
``llmgw_flow_room_free``, ``llmgw_flow_capacity_changes``, ``llmgw_flow_prompt_token_ratio``,
``llmgw_flow_output_allowance_ratio``, ``llmgw_flow_output_allowance_answers``, ``llmgw_flow_engine_queues``;
docs/metrics.md,
"Flow control"), read from the room when ``/metrics`` is rendered.

Labels are the router's models and replicas (what the configuration and the control plane declare), so they are
bounded; a replica taken out disappears from the exposition with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .capacity import CUT, QUEUE_KINDS, RAISE, UNBOUNDED
from .room import kv_capacity

if TYPE_CHECKING:
    from .room import EngineRoom


class RoomMetrics:
    def __init__(self, registry: CollectorRegistry | None):
        self.registry = registry
        self._room: weakref.ref[EngineRoom] | None = None
        self._changes: dict[str, dict[str, int]] = {}  # model -> CUT/RAISE -> count
        self._queues: dict[str, dict[str, int]] = {}  # model -> QUEUE_KINDS -> scrapes
        self._ramps: dict[str, list[float]] = {}  # model -> [ramps begun, requests held then, seconds of ramps ended]

    def track(self, room: EngineRoom) -> None:
        """Expose ``room``'s figures (registered with the first room; a later one replaces it)."""
        first = self._room is None
        self._room = weakref.ref(room)
        if first and self.registry is not None:
            self.registry.register(self)

    def capacity_changed(self, model: str, change: str) -> None:
        counts = self._changes.setdefault(model, {CUT: 0, RAISE: 0})
        counts[change] += 1

    def engine_queued(self, model: str, kind: str) -> None:
        """A scrape of one of ``model``'s engines found it queueing (two in a row) for ``kind`` (QUEUE_KINDS)."""
        counts = self._queues.setdefault(model, dict.fromkeys(QUEUE_KINDS, 0))
        counts[kind] += 1

    def ramp_started(self, model: str, held: int) -> None:
        counts = self._ramp_counts(model)
        counts[0] += 1
        counts[1] += held

    def ramp_ended(self, model: str, seconds: float) -> None:
        self._ramp_counts(model)[2] += seconds

    def _ramp_counts(self, model: str) -> list[float]:
        return self._ramps.setdefault(model, [0, 0, 0.0])

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily,
                                 GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily,
                                 GaugeMetricFamily, CounterMetricFamily, CounterMetricFamily, GaugeMetricFamily,
                                 CounterMetricFamily, CounterMetricFamily, CounterMetricFamily]:
        capacity = GaugeMetricFamily("llmgw_flow_replica_capacity", "The requests in flight (all gateways') each "
                                     "replica takes, learnt from its engine's queue and KV usage; absent while "
                                     "unknown (its engine never said it was full: nothing is held for it).",
                                     labels=["model", "replica"])
        saturation = GaugeMetricFamily("llmgw_flow_replica_saturation", "Each replica's requests in flight over "
                                       "its learnt capacity (while unknown: its engine's KV usage over kv_high); "
                                       "1 and above: full.", labels=["model", "replica"])
        free = GaugeMetricFamily("llmgw_flow_room_free", "Requests of the highest class this gateway may still "
                                 "dispatch to the model now (its share of the replicas' free room; +Inf while "
                                 "no capacity is known).", labels=["model"])
        changes = CounterMetricFamily("llmgw_flow_capacity_changes", "Learnt capacities cut (an engine queued or "
                                      "filled its KV cache) and raised (it had room while requests waited), per "
                                      "model.", labels=["model", "change"])
        held = GaugeMetricFamily("llmgw_flow_replica_kv_held_tokens", "The KV tokens the requests in flight on "
                                 "each replica (all gateways') will hold at most: prompts in the engine's count "
                                 "and max_tokens; absent while its engine's KV capacity is unknown.",
                                 labels=["model", "replica"])
        kv = GaugeMetricFamily("llmgw_flow_replica_kv_capacity_tokens", "Each replica's KV cache in tokens (its "
                               "engine's blocks x block size); a class dispatches only while the held tokens stay "
                               "within its max_fill of it.", labels=["model", "replica"])
        ratio = GaugeMetricFamily("llmgw_flow_prompt_token_ratio", "Prompt tokens the model's engines counted per "
                                  "token the gateway estimated (characters / 4), from the answers' usage; 1 until "
                                  "an answer says.", labels=["model"])
        seats = GaugeMetricFamily("llmgw_flow_replica_seats", "The sequences each replica's engine runs at once, "
                                  "learnt from its running count when it queued with KV to spare; a class below "
                                  "max_fill 1.0 fills at most its share of them. Absent while unknown.",
                                  labels=["model", "replica"])
        allowance = GaugeMetricFamily("llmgw_flow_output_allowance_ratio", "Of a request's max_tokens, the share "
                                      "the room reserves in the KV cache: a high quantile of what groups of the "
                                      "model's answers held (completion over max_tokens); 1 until enough answers.",
                                      labels=["model"])
        answers = CounterMetricFamily("llmgw_flow_output_allowance_answers", "Answers with a max_tokens and usage "
                                      "the model's output allowance learnt from.", labels=["model"])
        queues = CounterMetricFamily("llmgw_flow_engine_queues", "Scrapes that found one of the model's engines "
                                     "queueing on two scrapes in a row, by what for: seats and blocks (a full "
                                     "engine: its capacity is cut) or budget (its step's token budget, a chunked "
                                     "prefill: no cut).", labels=["model", "kind"])
        ramp = GaugeMetricFamily("llmgw_flow_replica_ramp", "The requests in flight a replica of unknown capacity "
                                 "may take while requests for its model are held (a held burst's pace: oldest "
                                 "first, doubling on each scrape while its KV cache has room); absent outside one.",
                                 labels=["model", "replica"])
        ramps = CounterMetricFamily("llmgw_flow_ramps", "Ramps begun: a replica of unknown capacity took requests "
                                    "held for its model (after a start from zero, an outage, a restart, a step).",
                                    labels=["model"])
        ramp_held = CounterMetricFamily("llmgw_flow_ramp_held_requests", "The requests held (at every gateway) when "
                                        "each ramp began.", labels=["model"])
        ramp_seconds = CounterMetricFamily("llmgw_flow_ramp_seconds", "Seconds the ramps that ended lasted, from "
                                           "the replica's first room to nothing held (divided by llmgw_flow_ramps: "
                                           "how long a held burst took to dispatch).", labels=["model"])
        return (capacity, saturation, free, changes, held, kv, ratio, seats, allowance, answers, queues, ramp,
                ramps, ramp_held, ramp_seconds)

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        (capacity, saturation, free, changes, held, kv, ratio, seats, allowance, answers, queues, ramp, ramps,
         ramp_held, ramp_seconds) = families
        room = self._room() if self._room is not None else None
        if room is not None:
            top = min(room.settings.classes, key=lambda c: c.rank)
            for model, route in list(room.router.models.items()):
                for replica in list(route.replicas):
                    limit = room.capacity(replica)
                    if limit is not None:
                        capacity.add_metric([model, replica.name], limit)
                    saturation.add_metric([model, replica.name], room.replica_saturation(replica))
                    if (ramped := room.ramp(replica)) is not None:
                        ramp.add_metric([model, replica.name], ramped)
                    if (known_seats := room.seats(replica)) is not None:
                        seats.add_metric([model, replica.name], known_seats)
                    tokens = kv_capacity(replica)
                    if tokens is not None:
                        kv.add_metric([model, replica.name], tokens)
                        held.add_metric([model, replica.name], room.held_tokens(replica, route.prompt_ratio))
                ratio.add_metric([model], route.prompt_ratio.ratio)
                allowance.add_metric([model], route.output_allowance.fraction)
                answers.add_metric([model], route.output_allowance.answers)
                room_free = room.free(model, top)
                free.add_metric([model], float("inf") if room_free >= UNBOUNDED else room_free)
        for model, counts in sorted(self._changes.items()):
            for change, count in counts.items():
                changes.add_metric([model, change], count)
        for model, counts in sorted(self._queues.items()):
            for kind, count in counts.items():
                queues.add_metric([model, kind], count)
        for model, (begun, held_then, seconds) in sorted(self._ramps.items()):
            ramps.add_metric([model], begun)
            ramp_held.add_metric([model], held_then)
            ramp_seconds.add_metric([model], seconds)
        return list(families)
