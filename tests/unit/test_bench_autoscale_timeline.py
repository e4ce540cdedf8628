"""The scale-up timeline of ``llmgw bench autoscale``, read from JSON log lines (llmgw/bench/autoscale_timeline.py)."""

from __future__ import annotations

import json
import time

import pytest

from llmgw.bench.autoscale_timeline import PHASES, engine_logs, log_events, scale_up_timeline, timeline_rows

BASE = 1_800_000_000.0  # an epoch second


def line(at: float, message: str, **fields) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(BASE + at)) + f".{round((at % 1) * 1000):03d}Z"
    return json.dumps({"ts": stamp, "level": "info", "logger": "x", "message": message, **fields})


CONTROL = [
    "llmgw listening on http://127.0.0.1:1 (control: http://127.0.0.1:2)",  # not JSON: skipped
    line(1.0, "autoscale: h100-llama-a (llama-a) up 2 -> 3: before the moment"),
    line(10.5, "autoscale: h100-llama-a (llama-a) up 2 -> 4: 9 queued over 2 replicas"),
    line(10.6, "place replica h100-llama-a-3 (generation 1) on r0@node-b[1]: wanted"),
    line(10.6, "place replica h100-llama-a-2 (generation 1) on r0@node-a[2]: wanted"),
    line(17.2, "replica h100-llama-a-3 (llama-a) enters routing at http://x: shard s3 is ready"),
    line(17.9, "replica h100-llama-a-2 (llama-a) enters routing at http://x: shard s2 is ready"),
    # started 15.0 (before it, on another replica), 17.0 and 17.1; the first dispatched to -3 left the queue at 17.4
    line(15.5, "", logger="llmgw.access", model="llama-a", replica="h100-llama-a-1", latency_ms=500, queue_wait_ms=1,
         status=200),
    line(19.0, "", logger="llmgw.access", model="llama-a", replica="h100-llama-a-3", latency_ms=2000,
         queue_wait_ms=800.0, ttft_ms=900.0, status=200),
    line(19.1, "", logger="llmgw.access", model="llama-a", replica="h100-llama-a-3", latency_ms=2000,
         queue_wait_ms=300.0, ttft_ms=600.0, status=200),
    line(19.5, "", logger="llmgw.access", model="llama-a", replica="h100-llama-a-2", latency_ms=1000,
         queue_wait_ms=0.0, ttft_ms=100.0, status=200),
    line(20.0, "", logger="llmgw.access", model="llama-a", replica=None, status=429, latency_ms=10000,
         queue_wait_ms=10000.0),  # expired in the queue (started at 10.0): never timed
]
AGENTS = [
    line(10.8, "shard s2 is starting", replica="h100-llama-a-2", state="starting"),
    line(10.9, "shard s3 is starting", replica="h100-llama-a-3", state="starting"),
    line(17.0, "shard s3 is ready", replica="h100-llama-a-3", state="ready"),
    "{not json",
]
ENGINES = {  # the shards' engine logs: -3's cold start began at 11.4 and took 5.5 s
    "h100-llama-a-3-g1-r0": log_events([line(11.4, "loading the model: ready in 5.5s (cold start)")]),
    "h100-llama-a-30-g1-r0": log_events([line(10.9, "loading the model: ready in 1s (cold start)")]),  # another
}


def test_the_first_added_replica_to_be_routed_is_timed_from_the_moment():
    timeline = scale_up_timeline(log_events(CONTROL), log_events(AGENTS), "h100-llama-a", "llama-a", BASE + 10.0,
                                 ENGINES)
    assert timeline is not None
    assert timeline["replica"] == "h100-llama-a-3"
    assert timeline["change"] == "up 2 -> 4"
    got = timeline["wall_s"]
    assert got["decided"] == pytest.approx(0.5, abs=0.002)
    assert got["placed"] == pytest.approx(0.6, abs=0.002)
    assert got["spawned"] == pytest.approx(0.9, abs=0.002)
    assert got["engine_ready"] == pytest.approx(6.9, abs=0.002)  # its own engine's line, not -30's
    assert got["reported"] == pytest.approx(7.0, abs=0.002)
    assert got["routed"] == pytest.approx(7.2, abs=0.002)
    assert got["dispatched"] == pytest.approx(7.4, abs=0.002)  # the 17.1 start: the first to leave the queue
    assert got["first_token"] == pytest.approx(7.7, abs=0.002)


def test_from_zero_the_request_timed_is_the_first_sent_after_the_call():
    timeline = scale_up_timeline(log_events(CONTROL), log_events(AGENTS), "h100-llama-a", "llama-a", BASE + 10.0,
                                 ENGINES, from_zero=True)
    assert timeline is not None
    # the 15.0 start, 1 ms queued (the 429 that started at 10.0 was served by no replica)
    assert timeline["wall_s"]["dispatched"] == pytest.approx(5.001, abs=0.002)
    assert timeline["wall_s"]["first_token"] is None  # no first token in its line


def test_rows_give_fleet_seconds_and_each_phases_own_cost():
    timeline = {"replica": "r", "change": "from_zero 0 -> 1",
                "wall_s": {"decided": 0.1, "placed": 0.2, "spawned": 0.5, "engine_ready": 6.5, "reported": 7.0,
                           "routed": None, "dispatched": None, "first_token": 7.5}}
    rows = timeline_rows(timeline, 10.0)
    assert [r[0] for r in rows] == [what for _, what in PHASES]
    assert rows[4][1:] == pytest.approx((70.0, 7.0, 0.5))
    assert rows[5][1:] == (None, None, None)
    assert rows[7][3] == pytest.approx(0.5)  # from the last phase seen


def test_no_scale_up_after_the_moment_is_none():
    assert scale_up_timeline(log_events(CONTROL), [], "h100-llama-a", "llama-a", BASE + 20.0, ENGINES) is None
    assert scale_up_timeline(log_events(CONTROL), [], "h100-llama-b", "llama-b", BASE, ENGINES) is None


def test_engine_logs_are_read_from_the_agents_state_folders(tmp_path):
    logs = tmp_path / "agent-node-a" / "logs"
    logs.mkdir(parents=True)
    (logs / "h100-llama-a-0-g1-r0.log").write_text("starting shard ...\n" + line(3.0, "loading the model: ready in 2s"))
    found = engine_logs(tmp_path)
    assert list(found) == ["h100-llama-a-0-g1-r0"] and found["h100-llama-a-0-g1-r0"][0]["at"] == BASE + 3.0
