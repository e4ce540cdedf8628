"""Prometheus series of the prefix trees: sizes and evictions per model, read at scrape time.

One collector per metrics registry, registered the first time a tree is
tracked (so re-configuring a model never registers a series twice). It holds
weak references to the trees: a tree whose tier was replaced or dropped
disappears from the exposition. Nothing is updated per request; the numbers
are the trees' own counters, read when ``/metrics`` is rendered.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .deal import DealCounts
from .radix import RadixTree
from .uncertainty import Uncertainty

_collectors: "weakref.WeakKeyDictionary[CollectorRegistry, PrefixTreeCollector]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class PrefixTreeCollector:
    def __init__(self) -> None:
        self._trees: dict[str, weakref.ref[RadixTree]] = {}
        self._gates: dict[str, weakref.ref[Uncertainty]] = {}
        self._deals: dict[str, weakref.ref[DealCounts]] = {}

    def track(self, model: str, tree: RadixTree, gate: Uncertainty | None = None,
              deals: DealCounts | None = None) -> None:
        self._trees[model] = weakref.ref(tree)
        if gate is not None:
            self._gates[model] = weakref.ref(gate)
        if deals is not None:
            self._deals[model] = weakref.ref(deals)

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily,
                                 CounterMetricFamily]:
        nodes = GaugeMetricFamily("llmgw_prefix_tree_nodes", "Nodes of the model's prefix tree.", labels=["model"])
        chars = GaugeMetricFamily("llmgw_prefix_tree_chars", "Characters stored on the edges of the model's "
                                  "prefix tree.", labels=["model"])
        replica_chars = GaugeMetricFamily("llmgw_prefix_tree_replica_chars",
                                          "Characters of the prefix tree attributed to each replica (what "
                                          "tree_chars_per_replica bounds).", labels=["model", "replica"])
        evictions = CounterMetricFamily("llmgw_prefix_tree_evictions", "Tree entries (node, replica) evicted, "
                                        "by reason: size (over the per-replica limits) or age (older than the "
                                        "TTL).", labels=["model", "reason"])
        gated = CounterMetricFamily("llmgw_cost_overrides_gated", "Requests the cost rule would have sent off the "
                                    "replica holding most of their prompt (cost_override) and kept there, since the "
                                    "expected gain was within the uncertainty of the estimates.", labels=["model"])
        deals = CounterMetricFamily("llmgw_routing_new_prefixes", "Prompts no replica held, dealt out by the prefix "
                                    "tiers' cost rule, by how: cheapest (the deal's pick was a cheapest candidate) "
                                    "or dealt (an affordable candidate holding less than the cheapest ones).",
                                    labels=["model", "how"])
        return nodes, chars, replica_chars, evictions, gated, deals

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        nodes, chars, replica_chars, evictions, gated, deals = self._families()
        for model, ref in list(self._trees.items()):
            tree = ref()
            if tree is None:
                self._trees.pop(model, None)
                continue
            stats = tree.stats()
            nodes.add_metric([model], stats.nodes)
            chars.add_metric([model], stats.chars)
            for replica, count in sorted(stats.replica_chars.items()):
                replica_chars.add_metric([model, replica], count)
            evictions.add_metric([model, "size"], stats.evicted_for_size)
            evictions.add_metric([model, "age"], stats.evicted_for_age)
        for model, gate_ref in list(self._gates.items()):
            gate = gate_ref()
            if gate is None:
                self._gates.pop(model, None)
                continue
            gated.add_metric([model], gate.gated)
        for model, deals_ref in list(self._deals.items()):
            counts = deals_ref()
            if counts is None:
                self._deals.pop(model, None)
                continue
            for how, count in counts.counts.items():
                deals.add_metric([model, how], count)
        return [nodes, chars, replica_chars, evictions, gated, deals]


def track_tree(registry: CollectorRegistry, model: str, tree: RadixTree, gate: Uncertainty | None = None,
               deals: DealCounts | None = None) -> None:
    """Report ``tree`` as model ``model``'s prefix tree in ``registry`` (with ``gate``'s refused overrides and
    ``deals``, its tier's new prefixes)."""
    with _lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = _collectors[registry] = PrefixTreeCollector()
            registry.register(collector)
    collector.track(model, tree, gate, deals)
