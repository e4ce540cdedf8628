"""Prometheus series of the cost model's decode part: what it learnt per replica, and the picks it moved.

One collector per metrics registry (as :mod:`llmgw.router.tree_metrics`), holding weak references to the
models' :class:`~llmgw.router.decode_cost.DecodeModel`; nothing is updated per request beyond the model's own
counters, read when ``/metrics`` is rendered.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .decode_cost import DecodeModel

_collectors: "weakref.WeakKeyDictionary[CollectorRegistry, DecodeCollector]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class DecodeCollector:
    def __init__(self) -> None:
        self._models: dict[str, weakref.ref[DecodeModel]] = {}

    def track(self, model: str, decode: DecodeModel) -> None:
        self._models[model] = weakref.ref(decode)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily]:
        per_sequence = GaugeMetricFamily(
            "llmgw_routing_itl_per_sequence_seconds", "Learnt growth of the inter-token latency per request in "
            "flight on the replica (the cost model's decode charge).", labels=["model", "replica"])
        per_context = GaugeMetricFamily(
            "llmgw_routing_itl_per_context_token_seconds", "Learnt growth of the inter-token latency per context "
            "token in flight on the replica.", labels=["model", "replica"])
        output = GaugeMetricFamily("llmgw_routing_expected_output_tokens", "The model's typical output length "
                                   "(tokens per stream) the decode charge expects.", labels=["model"])
        moves = CounterMetricFamily("llmgw_routing_decode_moves", "Decisions the decode or capacity charge sent "
                                    "elsewhere than the smallest estimated TTFT and delay to others.",
                                    labels=["model", "charge"])
        return per_sequence, per_context, output, moves

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        per_sequence, per_context, output, moves = self._families()
        for model, ref in list(self._models.items()):
            decode = ref()
            if decode is None:
                self._models.pop(model, None)
                continue
            for replica in sorted(decode.replicas):
                _, context_slope, sequence_slope, _ = decode.line(replica)
                per_sequence.add_metric([model, replica], sequence_slope)
                per_context.add_metric([model, replica], context_slope)
            output.add_metric([model], decode.typical_output_tokens)
            for charge, count in decode.moved.items():
                moves.add_metric([model, charge], count)
        return [per_sequence, per_context, output, moves]


def track_decode(registry: CollectorRegistry, model: str, decode: DecodeModel) -> None:
    """Report ``decode`` as model ``model``'s decode cost model in ``registry``."""
    with _lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = _collectors[registry] = DecodeCollector()
            registry.register(collector)
    collector.track(model, decode)
