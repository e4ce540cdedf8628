"""Prometheus metrics of the KV-index routing tier, from engine events to routing accuracy.

One :class:`KvMetrics` per ``CollectorRegistry`` (:meth:`KvMetrics.for_registry`
returns the same instance every time, so a tier rebuilt on reload never
registers a series twice). Who counts what:

- the agent (per engine subscription and mirror): ``llmgw_kv_events_total``,
  ``llmgw_kv_gaps_total``, ``llmgw_kv_replays_total``, ``llmgw_kv_resets_total``,
  ``llmgw_kv_decode_errors_total``, ``llmgw_kv_peer_disconnects_total``, ``llmgw_kv_ignored_total``,
  ``llmgw_kv_hash_parity_checks_total``;
- the control plane: ``llmgw_kv_changes_refused_total``;
- the router: ``llmgw_kv_index_blocks`` and ``llmgw_kv_index_state`` (read from
  the tracked :class:`~llmgw.kv.index.KvIndex` at scrape time),
  ``llmgw_kv_tokenize_seconds``, ``llmgw_route_predicted_cached_tokens_total``
  and ``llmgw_route_actual_cached_tokens_total``, the drift checks
  (``llmgw_route_drift_checks_total``, ``llmgw_route_drift_total``,
  ``llmgw_route_drift_tokens_total``) and ``llmgw_kv_index_resyncs_total``
  (read from the index).

In ``llmgw serve`` with the embedded agent all of them land in the one
registry. Every metric is documented in ``docs/kv-routing.md``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Callable, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..cached_labels import CachedLabels

TOKENIZE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)

_instances: "weakref.WeakKeyDictionary[CollectorRegistry, KvMetrics]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class _Summarized(Protocol):
    """What the collector reads of a :class:`~llmgw.kv.index.KvIndex`."""

    def summary(self) -> dict[str, tuple[int, str]]: ...

    def drift_summary(self) -> dict[str, dict[str, int]]: ...


class _IndexCollector:
    """``llmgw_kv_index_blocks{model,replica}``, ``llmgw_kv_index_state{model,replica,state}`` and
    ``llmgw_kv_index_resyncs_total{model,replica,mode}``, read at scrape time (``model`` from the tracker's
    ``model_of``, "" when it names none)."""

    def __init__(self) -> None:
        self._indexes: list[tuple[weakref.ref[_Summarized], Callable[[str], str] | None]] = []

    def track(self, index: _Summarized, model_of: Callable[[str], str] | None = None) -> None:
        for at, (ref, _model_of) in enumerate(self._indexes):
            if ref() is index:
                if model_of is not None:
                    self._indexes[at] = (ref, model_of)
                return
        self._indexes.append((weakref.ref(index), model_of))

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily]:
        blocks = GaugeMetricFamily("llmgw_kv_index_blocks", "Distinct KV blocks the router's index holds for each "
                                   "replica (confirmed by the engine's events; predicted entries not included).",
                                   labels=["model", "replica"])
        state = GaugeMetricFamily("llmgw_kv_index_state", "1 for the replica's current index state: no_events, "
                                  "healthy, resetting, suspect or unusable_keys (/admin/kv says why and the fix).",
                                  labels=["model", "replica", "state"])
        resyncs = CounterMetricFamily("llmgw_kv_index_resyncs", "Resyncs the router asked of a replica's owner "
                                      "because its index turned suspect (drift), by mode: full (a full copy of the "
                                      "mirror) or reset (drop the mirror, relearn); retries included.",
                                      labels=["model", "replica", "mode"])
        return blocks, state, resyncs

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        blocks, state, resyncs = self._families()
        alive = []
        for ref, model_of in self._indexes:
            index = ref()
            if index is None:
                continue
            alive.append((ref, model_of))
            model = model_of or (lambda replica: "")
            for replica, (count, current) in sorted(index.summary().items()):
                blocks.add_metric([model(replica), replica], count)
                state.add_metric([model(replica), replica, current], 1)
            for replica, modes in sorted(index.drift_summary().items()):
                for mode, count in sorted(modes.items()):
                    resyncs.add_metric([model(replica), replica, mode], count)
        self._indexes = alive
        return [blocks, state, resyncs]


class KvMetrics:
    """The KV tier's series on one registry; see the module docstring for who counts what."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = r = registry
        self.events = CachedLabels(Counter(
            "llmgw_kv_events", "KV events received from engines, by node, replica and event type (BlockStored, "
            "BlockRemoved, AllBlocksCleared, or the tag of an unknown type, which is skipped).",
            ["node", "model", "replica", "type"], registry=r))
        self.gaps = CachedLabels(Counter(
            "llmgw_kv_gaps", "Holes in a replica's event sequence numbers (each one triggers a replay when the "
            "engine has a replay endpoint).", ["model", "replica"], registry=r))
        self.replays = CachedLabels(Counter(
            "llmgw_kv_replays", "Replay attempts by result: filled (the hole was filled), incomplete (the engine "
            "no longer buffers the missing batches), timeout, disabled (no replay endpoint).", ["result"],
            registry=r))
        self.resets = CachedLabels(Counter(
            "llmgw_kv_resets", "Times a replica's mirrored cache was reset, by reason: gap (a hole replay could "
            "not fill), engine_restart (sequence went backwards), cleared (AllBlocksCleared), decode_error.",
            ["model", "replica", "reason"], registry=r))
        self.decode_errors = CachedLabels(Counter(
            "llmgw_kv_decode_errors", "Event messages that could not be decoded, by source (the subscription).",
            ["source"], registry=r))
        self.peer_disconnects = CachedLabels(Counter(
            "llmgw_kv_peer_disconnects", "Peers of a KV-event subscription that were disconnected, by source: a "
            "message over the subscription's maximum message size, or an engine that went away.", ["source"],
            registry=r))
        self.ignored = CachedLabels(Counter(
            "llmgw_kv_ignored", "Blocks in events kept out of the device index, by replica and reason "
            "(medium, group, placeholder, no_token_ids, lora_without_name, unknown_block, unknown_parent, "
            "wrong_rank...).",
            ["model", "replica", "reason"], registry=r))
        self.parity_checks = CachedLabels(Counter(
            "llmgw_kv_hash_parity_checks", "Stores whose block hashes the agent recomputed with the router's key "
            "function, by replica and result (ok, mismatch: the engine's hash algorithm, PYTHONHASHSEED or block "
            "size differ from the tier's, so the index can never match).", ["model", "replica", "result"],
            registry=r))
        self.changes_refused = CachedLabels(Counter(
            "llmgw_kv_changes_refused", "KvChanges messages the control plane refused, by sending node and reason "
            "(e.g. foreign_replica: the replica is not placed on that node).", ["node", "reason"], registry=r))
        self.tokenize_seconds = Histogram(
            "llmgw_kv_tokenize_seconds", "Time of /tokenize calls made for routing (cache hits excluded; "
            "timeouts observed at the timeout).", buckets=TOKENIZE_BUCKETS, registry=r)
        self.tokenize_source = CachedLabels(Counter(
            "llmgw_kv_tokenize_source", "Prompts the kv_index tier tokenized, by model and where the ids came from: "
            "local (the model's tokenizer.json in the router), replica (a replica's /tokenize), cache (the LRU of "
            "earlier answers), local_mismatch (the local tokenizer disagreed with /tokenize and was turned off).",
            ["model", "source"], registry=r))
        self.predicted_cached = CachedLabels(Counter(
            "llmgw_route_predicted_cached_tokens", "Prompt tokens the kv_index tier predicted the chosen replica "
            "would serve from its prefix cache (counted when the response's usage arrives).", ["model"],
            registry=r))
        self.actual_cached = CachedLabels(Counter(
            "llmgw_route_actual_cached_tokens", "Prompt tokens the engine reported as cached "
            "(usage.prompt_tokens_details.cached_tokens) for the same requests.", ["model"], registry=r))
        self.drift_checks = CachedLabels(Counter(
            "llmgw_route_drift_checks", "Responses whose engine-reported cached tokens were compared with the "
            "kv_index tier's prediction, by model, replica and result: match, over (at least one block fewer than "
            "the engine's own events promised) or under (at least one block more than predicted).",
            ["model", "replica", "result"], registry=r))
        self.drift = CachedLabels(Counter(
            "llmgw_route_drift", "Drifted responses (result over or under of llmgw_route_drift_checks_total), by "
            "model, replica and direction; over drifts make a replica's index suspect.",
            ["model", "replica", "direction"], registry=r))
        self.drift_tokens = CachedLabels(Counter(
            "llmgw_route_drift_tokens", "Cached tokens by which drifted responses missed: confirmed minus actual "
            "(over) or actual minus predicted (under).", ["model", "replica", "direction"], registry=r))
        self._index_collector = _IndexCollector()
        r.register(self._index_collector)

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> "KvMetrics":
        with _lock:
            existing = _instances.get(registry)
            if existing is None:
                existing = _instances[registry] = cls(registry)
            return existing

    def track_index(self, index: _Summarized, model_of: Callable[[str], str] | None = None) -> None:
        """Report ``index``'s per-replica sizes and states (a :class:`~llmgw.kv.index.KvIndex`), each labelled
        with ``model_of(replica)`` (the router gives one; tracking again without one keeps it)."""
        self._index_collector.track(index, model_of)

    def source(self, node: str, replica: str, model: str) -> "SourceMetrics":
        return SourceMetrics(self, node, replica, model)


class SourceMetrics:
    """The agent-side series of one engine subscription (node, replica of model) bound once."""

    def __init__(self, metrics: KvMetrics, node: str, replica: str, model: str):
        self.metrics = metrics
        self.node = node
        self.replica = replica
        self.model = model
        self._gaps = metrics.gaps.labels(model, replica)

    def event(self, kind: str, count: int = 1) -> None:
        self.metrics.events.labels(self.node, self.model, self.replica, kind).inc(count)

    def gap(self) -> None:
        self._gaps.inc()

    def replay(self, result: str) -> None:
        self.metrics.replays.labels(result).inc()

    def reset(self, reason: str) -> None:
        self.metrics.resets.labels(self.model, self.replica, reason).inc()

    def decode_error(self, source: str) -> None:
        self.metrics.decode_errors.labels(source).inc()

    def peer_disconnect(self, source: str) -> None:
        self.metrics.peer_disconnects.labels(source).inc()

    def ignored(self, reason: str, count: int = 1) -> None:
        self.metrics.ignored.labels(self.model, self.replica, reason).inc(count)

    def parity(self, ok: bool) -> None:
        self.metrics.parity_checks.labels(self.model, self.replica, "ok" if ok else "mismatch").inc()
