"""The status page's replicas over time (``GET /admin/capacity``): how replicas are counted, the bounded ring per
deployment, and a reading that fails."""

from __future__ import annotations

import logging

from llmgw.gateway.capacity_history import MAX_DEPLOYMENTS, CapacityHistory, Counts, count_replicas


def test_replicas_count_as_ready_starting_or_neither():
    listed = [{"model": "a", "state": "up", "inflight": 3}, {"model": "a", "state": "unknown", "inflight": 1},
              {"model": "a", "state": "starting"}, {"model": "a", "state": "pending"},
              {"model": "a", "state": "up", "retiring": "scaled down", "inflight": 2},
              {"model": "a", "state": "draining", "inflight": 5}, {"model": "a", "state": "unplaced"},
              {"model": "a", "state": "down"}, {"model": "b", "state": "up"}, {"state": "up"}]
    assert count_replicas(listed, ["a", "c"]) == {"a": {"ready": 2, "starting": 2, "inflight": 9},
                                                  "c": {"ready": 0, "starting": 0, "inflight": 0}}


def test_the_ring_keeps_the_last_samples_of_each_deployment_and_drops_a_gone_one():
    history = CapacityHistory(lambda: {}, size=3)
    for at in range(5):
        history.record(float(at), {"a": Counts(ready=at), "b": Counts(queued=at, inflight=2 * at, starting=1)})
    history.record(5.0, {"a": Counts(ready=5)})
    shown = history.to_json()
    assert shown["size"] == 3 and [d["model"] for d in shown["deployments"]] == ["a"]
    assert shown["deployments"][0] == {"model": "a", "at": [3.0, 4.0, 5.0], "ready": [3, 4, 5], "starting": [0] * 3,
                                       "queued": [0] * 3, "inflight": [0] * 3}
    history.record(6.0, {f"m{i:03d}": Counts() for i in range(MAX_DEPLOYMENTS + 10)})
    assert len(history.to_json()["deployments"]) == MAX_DEPLOYMENTS


def test_a_reading_that_fails_is_said_once_and_sampling_goes_on(caplog):
    readings = iter([RuntimeError("no control plane"), RuntimeError("still"), {"a": Counts(ready=1)}])

    def read():
        found = next(readings)
        if isinstance(found, Exception):
            raise found
        return found

    history = CapacityHistory(read, clock=lambda: 100.0)
    with caplog.at_level(logging.ERROR, "llmgw.gateway.capacity_history"):
        history.sample()
        history.sample()
        history.sample()
    assert len([r for r in caplog.records if "capacity history" in r.getMessage()]) == 1
    assert history.to_json()["deployments"][0]["ready"] == [1]
