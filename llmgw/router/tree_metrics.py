"""Prometheus series of the prefix trees: sizes and evictions per model, read at scrape time.

The trees' own counters, read when ``/metrics`` is rendered by one collector per metrics registry
(:mod:`llmgw.router.model_collectors`: weak references, registered once).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .model_collectors import PerModelCollector, track
from .radix import RadixTree


class PrefixTreeCollector(PerModelCollector[RadixTree]):
    def families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily]:
        nodes = GaugeMetricFamily("llmgw_prefix_tree_nodes", "Nodes of the model's prefix tree.", labels=["model"])
        chars = GaugeMetricFamily("llmgw_prefix_tree_chars", "Characters stored on the edges of the model's "
                                  "prefix tree.", labels=["model"])
        replica_chars = GaugeMetricFamily("llmgw_prefix_tree_replica_chars",
                                          "Characters of the prefix tree attributed to each replica (what "
                                          "tree_chars_per_replica bounds).", labels=["model", "replica"])
        evictions = CounterMetricFamily("llmgw_prefix_tree_evictions", "Tree entries (node, replica) evicted, "
                                        "by reason: size (over the per-replica limits) or age (older than the "
                                        "TTL).", labels=["model", "reason"])
        return nodes, chars, replica_chars, evictions

    def add(self, families: Sequence[Any], model: str, tree: RadixTree) -> None:
        nodes, chars, replica_chars, evictions = families
        stats = tree.stats()
        nodes.add_metric([model], stats.nodes)
        chars.add_metric([model], stats.chars)
        for replica, count in sorted(stats.replica_chars.items()):
            replica_chars.add_metric([model, replica], count)
        evictions.add_metric([model, "size"], stats.evicted_for_size)
        evictions.add_metric([model, "age"], stats.evicted_for_age)


def track_tree(registry: CollectorRegistry, model: str, tree: RadixTree) -> None:
    """Report ``tree`` as model ``model``'s prefix tree in ``registry``."""
    track(registry, PrefixTreeCollector, model, tree)
