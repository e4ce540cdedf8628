"""The autoscaler's metrics and log line: each decision counted and logged once, the gauges per deployment."""

from __future__ import annotations

import dataclasses
import logging

from prometheus_client import CollectorRegistry

from llmgw.autoscale.metrics import AutoscaleMetrics
from llmgw.autoscale.model import AutoscaleSettings, DeploymentView, ModelSignals, ReplicaCounts, ScaleDecision


def view(key: str, ready: int, starting: int, desired: int) -> DeploymentView:
    return DeploymentView(key=key, model=key, settings=AutoscaleSettings(min_replicas=0, max_replicas=4),
                          counts=ReplicaCounts(ready=ready, starting=starting), desired=desired,
                          gpus_per_replica=1, gpu_class=None, signals=ModelSignals(model=key, at=0.0))


def test_decisions_are_counted_and_logged_once_and_the_gauges_follow_the_views(caplog):
    registry = CollectorRegistry()
    metrics = AutoscaleMetrics.for_registry(registry)
    assert AutoscaleMetrics.for_registry(registry) is metrics
    up = ScaleDecision("chat", "chat-model", 10.0, 2, 5, "up", "20 requests queued for 5.0 s: 2 -> 5 replicas")
    hold = ScaleDecision("chat", "chat-model", 12.0, 5, 5, "hold", "a step is in flight")
    with caplog.at_level(logging.INFO, logger="llmgw.autoscale"):
        metrics.record([up, hold])
    assert [r.getMessage() for r in caplog.records] == [
        "autoscale: chat (chat-model) up 2 -> 5: 20 requests queued for 5.0 s: 2 -> 5 replicas",
        "autoscale: chat (chat-model) holds at 5: a step is in flight"]
    sample = registry.get_sample_value
    assert sample("llmgw_autoscale_decisions_total", {"deployment": "chat", "kind": "up"}) == 1
    assert sample("llmgw_autoscale_decisions_total", {"deployment": "chat", "kind": "hold"}) == 1
    metrics.observe(20.0, [view("chat", 2, 3, 2), view("batch", 1, 0, 1)], {"chat": 5})
    assert sample("llmgw_autoscale_desired_replicas", {"deployment": "chat"}) == 5
    assert sample("llmgw_autoscale_desired_replicas", {"deployment": "batch"}) == 1  # no decision: the view's
    assert sample("llmgw_autoscale_ready_replicas", {"deployment": "chat"}) == 2
    assert sample("llmgw_autoscale_starting_replicas", {"deployment": "chat"}) == 3
    assert sample("llmgw_autoscale_last_decision_age_seconds", {"deployment": "chat"}) == 8.0
    assert sample("llmgw_autoscale_last_decision_age_seconds", {"deployment": "batch"}) is None
    metrics.observe(21.0, [view("batch", 1, 0, 1)], {})
    assert sample("llmgw_autoscale_desired_replicas", {"deployment": "chat"}) is None  # a deployment gone
    assert sample("llmgw_autoscale_last_decision_age_seconds", {"deployment": "chat"}) is None


def test_one_instance_per_registry_and_class():
    from llmgw.control.metrics import ControlMetrics

    first, second = CollectorRegistry(), CollectorRegistry()
    autoscale, control = AutoscaleMetrics.for_registry(first), ControlMetrics.for_registry(first)
    assert AutoscaleMetrics.for_registry(first) is autoscale and ControlMetrics.for_registry(first) is control
    assert AutoscaleMetrics.for_registry(second) is not autoscale


def test_the_busy_gauge_follows_the_signal_and_is_absent_while_unknown():
    registry = CollectorRegistry()
    metrics = AutoscaleMetrics.for_registry(registry)
    known = view("chat", 2, 0, 2)
    known = dataclasses.replace(known, signals=dataclasses.replace(known.signals, busy=1.25))
    metrics.observe(1.0, [known, view("batch", 1, 0, 1)], {})
    assert registry.get_sample_value("llmgw_autoscale_busy_replicas", {"deployment": "chat"}) == 1.25
    assert registry.get_sample_value("llmgw_autoscale_busy_replicas", {"deployment": "batch"}) is None
    metrics.observe(2.0, [view("batch", 1, 0, 1)], {})
    assert registry.get_sample_value("llmgw_autoscale_busy_replicas", {"deployment": "chat"}) is None
