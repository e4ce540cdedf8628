"""Prometheus series of the prefix tiers: tree sizes and evictions, overrides the uncertainty gate refused and new
prefixes dealt out, per model, read at scrape time.

The tiers' own counters, read when ``/metrics`` is rendered by one collector of each kind per metrics registry
(:mod:`llmgw.router.model_collectors`: weak references, registered once).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .deal import DealCounts
from .model_collectors import PerModelCollector, track
from .radix import RadixTree
from .uncertainty import Uncertainty


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


class GatedOverridesCollector(PerModelCollector[Uncertainty]):
    def families(self) -> tuple[CounterMetricFamily]:
        return (CounterMetricFamily("llmgw_cost_overrides_gated", "Requests the cost rule would have sent off the "
                                    "replica holding most of their prompt (cost_override) and kept there, since the "
                                    "expected gain was within the uncertainty of the estimates.", labels=["model"]),)

    def add(self, families: Sequence[Any], model: str, gate: Uncertainty) -> None:
        families[0].add_metric([model], gate.gated)


class NewPrefixesCollector(PerModelCollector[DealCounts]):
    def families(self) -> tuple[CounterMetricFamily]:
        return (CounterMetricFamily("llmgw_routing_new_prefixes", "Prompts no replica held, dealt out by the prefix "
                                    "tiers' cost rule, by how: cheapest (the deal's pick was a cheapest candidate) "
                                    "or dealt (an affordable candidate holding less than the cheapest ones).",
                                    labels=["model", "how"]),)

    def add(self, families: Sequence[Any], model: str, deals: DealCounts) -> None:
        for how, count in deals.counts.items():
            families[0].add_metric([model, how], count)


def track_tree(registry: CollectorRegistry, model: str, tree: RadixTree, gate: Uncertainty | None = None,
               deals: DealCounts | None = None) -> None:
    """Report ``tree`` as model ``model``'s prefix tree in ``registry`` (with ``gate``'s refused overrides and
    ``deals``, its tier's new prefixes)."""
    track(registry, PrefixTreeCollector, model, tree)
    if gate is not None:
        track(registry, GatedOverridesCollector, model, gate)
    if deals is not None:
        track(registry, NewPrefixesCollector, model, deals)
