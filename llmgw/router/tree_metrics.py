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

from .cost import CONFIGURED, CostModel
from .deal import DealCounts
from .model_collectors import PerModelCollector, track
from .radix import RadixTree
from .token_ratio import TokensPerChar
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


class EnginePrefillCollector(PerModelCollector[CostModel]):
    def families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (GaugeMetricFamily("llmgw_routing_engine_prefill_tokens_per_second", "Each replica's prefill rate as "
                                  "its engine reports it on /metrics (new prompt tokens per second of prefill), the "
                                  "prior of the cost model's slope; absent until the engine told it.",
                                  labels=["model", "replica"]),
                GaugeMetricFamily("llmgw_routing_configured_prefill_tokens_per_second", "Each replica's configured "
                                  "prefill rate (prefill_tokens_per_s) while it is the prior of the cost model's "
                                  "slope: before its engine reported one; absent otherwise.",
                                  labels=["model", "replica"]))

    def add(self, families: Sequence[Any], model: str, cost: CostModel) -> None:
        for replica, c in sorted(cost.replicas.items()):
            if c.known_slope is not None:
                families[1 if c.slope_from == CONFIGURED else 0].add_metric([model, replica], 1.0 / c.known_slope)


class TokensPerCharCollector(PerModelCollector[TokensPerChar]):
    def families(self) -> tuple[GaugeMetricFamily]:
        return (GaugeMetricFamily("llmgw_routing_tokens_per_char", "Prompt tokens per character of the canonical "
                                  "text the prefix tree counts tokens with: learnt from the responses' usage "
                                  "(0.25 until one said).", labels=["model"]),)

    def add(self, families: Sequence[Any], model: str, ratio: TokensPerChar) -> None:
        families[0].add_metric([model], ratio.ratio)


def track_tree(registry: CollectorRegistry, model: str, tree: RadixTree, gate: Uncertainty | None = None,
               deals: DealCounts | None = None, cost: CostModel | None = None,
               ratio: TokensPerChar | None = None) -> None:
    """Report ``tree`` as model ``model``'s prefix tree in ``registry`` (with ``gate``'s refused overrides,
    ``deals``, its tier's new prefixes, ``cost``'s engine-reported prefill rates and ``ratio``)."""
    track(registry, PrefixTreeCollector, model, tree)
    if cost is not None:
        track(registry, EnginePrefillCollector, model, cost)
    if ratio is not None:
        track(registry, TokensPerCharCollector, model, ratio)
    if gate is not None:
        track(registry, GatedOverridesCollector, model, gate)
    if deals is not None:
        track(registry, NewPrefixesCollector, model, deals)
