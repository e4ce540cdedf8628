"""Prometheus series of the cost model's decode part: what it learnt per replica, and the picks it moved.

Read at scrape time from each model's :class:`~llmgw.router.decode_cost.DecodeModel` by one collector per
metrics registry (:mod:`llmgw.router.model_collectors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .decode_cost import DecodeModel
from .model_collectors import PerModelCollector, track


def _slopes(prefix: str, learnt_from: str) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
    """The per-replica gauges of an ITL line's two slopes, ``prefix``_per_sequence_seconds and
    ``prefix``_per_context_token_seconds."""
    sequence, context = (GaugeMetricFamily(f"{prefix}_per_{unit}_seconds", f"Learnt growth of the inter-token "
                                           f"latency per {what} on the replica, {learnt_from}.",
                                           labels=["model", "replica"])
                         for unit, what in (("sequence", "request in flight"), ("context_token", "context token")))
    return sequence, context


class DecodeCollector(PerModelCollector[DecodeModel]):
    def families(self) -> tuple[Any, ...]:
        per_sequence, per_context = _slopes("llmgw_routing_itl", "from the streams' token gaps the gateway observed "
                                            "(its own fit)")
        output = GaugeMetricFamily("llmgw_routing_expected_output_tokens", "The model's typical output length "
                                   "(tokens per stream) the decode charge expects.", labels=["model"])
        moves = CounterMetricFamily("llmgw_routing_decode_moves", "Decisions the decode or capacity charge sent "
                                    "elsewhere than the smallest estimated TTFT and delay to others.",
                                    labels=["model", "charge"])
        host = GaugeMetricFamily(
            "llmgw_routing_itl_host_per_sequence_seconds", "Learnt growth of every replica's inter-token latency "
            "per request in flight on the fleet's mean replica: the host's or the data plane's slowdown, which no "
            "routing choice avoids and the decode charge does not count.", labels=["model"])
        engine_per_sequence, engine_per_context = _slopes(
            "llmgw_routing_engine_itl", "from its engine's own reported ITL histogram (its /metrics): the decode "
            "charge's line when the source in use is the engine")
        windows = CounterMetricFamily(
            "llmgw_routing_engine_itl_windows", "Scrape windows of the replica's engine's ITL histogram counted "
            "into its ITL fit.", labels=["model", "replica"])
        source = GaugeMetricFamily(
            "llmgw_routing_itl_source", "1 for where the decode charge's ITL line comes from now: engine (the "
            "engines' reported ITL), gateway (the streams' observed token gaps), prior (nothing observed yet: the "
            "prior line) or none.", labels=["model", "source"])
        return (per_sequence, per_context, output, moves, host, engine_per_sequence, engine_per_context, windows,
                source)

    def add(self, families: Sequence[Any], model: str, decode: DecodeModel) -> None:
        (per_sequence, per_context, output, moves, host, engine_per_sequence, engine_per_context, windows,
         source) = families
        for replica in sorted(decode.replicas):
            _, context_slope, sequence_slope, _ = decode.line(replica)
            per_sequence.add_metric([model, replica], sequence_slope)
            per_context.add_metric([model, replica], context_slope)
        output.add_metric([model], decode.typical_output_tokens)
        host.add_metric([model], decode.host_line()[1])
        for charge, count in decode.moved.items():
            moves.add_metric([model, charge], count)
        for replica, engine_itl in sorted(decode.engine_fits(), key=lambda item: item[0]):
            line = decode.engine_line(replica)
            if line is not None:
                engine_per_sequence.add_metric([model, replica], line[2])
                engine_per_context.add_metric([model, replica], line[1])
            windows.add_metric([model, replica], engine_itl.windows)
        source.add_metric([model, decode.source_in_use], 1.0)


def track_decode(registry: CollectorRegistry, model: str, decode: DecodeModel) -> None:
    """Report ``decode`` as model ``model``'s decode cost model in ``registry``."""
    track(registry, DecodeCollector, model, decode)
