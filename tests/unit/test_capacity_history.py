"""The status page's replicas over time (``GET /admin/capacity``): how replicas are counted, the bounded ring per
deployment with its decisions, and a reading that fails."""

from __future__ import annotations

import logging

from llmgw.gateway.capacity_history import (
    MAX_DECISIONS,
    MAX_DEPLOYMENTS,
    CapacityHistory,
    Counts,
    Decision,
    count_replicas,
)


def test_replicas_count_as_ready_starting_draining_or_none():
    listed = [{"model": "a", "state": "up", "inflight": 3}, {"model": "a", "state": "unknown", "inflight": 1},
              {"model": "a", "state": "starting"}, {"model": "a", "state": "pending"},
              {"model": "a", "state": "up", "retiring": "scaled down", "inflight": 2},
              {"model": "a", "state": "draining", "inflight": 5}, {"model": "a", "state": "unplaced"},
              {"model": "a", "state": "down"}, {"model": "b", "state": "up"}, {"state": "up"}]
    assert count_replicas(listed, ["a", "c"]) == {"a": {"ready": 2, "starting": 2, "draining": 2, "inflight": 11},
                                                  "c": {"ready": 0, "starting": 0, "draining": 0, "inflight": 0}}


def test_the_ring_keeps_the_last_samples_of_each_deployment_and_drops_a_gone_one():
    history = CapacityHistory(lambda: {}, size=3)
    for at in range(5):
        history.record(float(at), {"a": Counts(ready=at), "b": Counts(queued=at, inflight=2 * at, starting=1)})
    history.record(5.0, {"a": Counts(ready=5)})
    shown = history.to_json()
    assert shown["size"] == 3 and [d["model"] for d in shown["deployments"]] == ["a"]
    assert shown["deployments"][0] == {"model": "a", "at": [3.0, 4.0, 5.0], "ready": [3, 4, 5], "starting": [0] * 3,
                                       "sleeping": [None] * 3, "draining": [0] * 3, "queued": [0] * 3,
                                       "inflight": [0] * 3, "arrivals": [None] * 3, "decisions": []}
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


def test_each_decision_is_kept_once_and_only_the_last_ones():
    history = CapacityHistory(lambda: {}, size=5)
    woke = Decision(10.0, "from_zero", 0, 1, "1 request waiting; woke 1 sleeping replica (a hot start)")
    slept = Decision(11.0, "to_zero", 1, 0, "idle")
    history.record(0.0, {"a": Counts(sleeping=1, arrivals=0.5)})
    for at in range(1, 3):  # both made between two samples, then sampled again: each kept once, in order
        history.record(float(at), {"a": Counts(sleeping=1, arrivals=0.5, decisions=(woke, slept))})
    (shown,) = history.to_json()["deployments"]
    assert shown["sleeping"] == [1] * 3 and shown["arrivals"] == [0.5] * 3
    assert shown["decisions"] == [{"at": 10.0, "kind": "from_zero", "from": 0, "to": 1, "reason": woke.reason},
                                  {"at": 11.0, "kind": "to_zero", "from": 1, "to": 0, "reason": "idle"}]
    for i in range(MAX_DECISIONS + 5):
        history.record(20.0 + i, {"a": Counts(decisions=(slept, Decision(20.0 + i, "hold", 1, 1, f"wait {i}")))})
    decisions = history.to_json()["deployments"][0]["decisions"]
    assert len(decisions) == MAX_DECISIONS and decisions[-1]["reason"] == f"wait {MAX_DECISIONS + 4}"
    assert all(d["kind"] == "hold" for d in decisions)  # an old decision seen again is not kept again
    history.record(50.0, {})  # no longer autoscaled: its decisions leave with its samples
    history.record(51.0, {"a": Counts()})
    assert history.to_json()["deployments"][0]["decisions"] == []
