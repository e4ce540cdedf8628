"""``llmgw.gateway.health_report`` over a stand-in for the shared state: the reasons, since when each holds, the
gauge, and one log line per transition however often it is asked."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import trio
from prometheus_client import CollectorRegistry

from llmgw.gateway.health_report import HealthReport


def shared_state(**link) -> SimpleNamespace:
    return SimpleNamespace(
        link=SimpleNamespace(healthy=True, reason="", address="redis://r:6379/0", **link),
        leader_holder={"generation": 3, "origin": "a", "control_url": "http://a"},
        leading=False, follower=SimpleNamespace(loaded=trio.Event()), settings=SimpleNamespace(lease_renew=0.5))


def test_reasons_their_since_and_one_log_line_per_transition(caplog):
    caplog.set_level(logging.INFO, "llmgw.gateway.health_report")
    now = [1000.0]
    shared = shared_state()
    shared.follower.loaded.set()
    registry = CollectorRegistry()
    report = HealthReport(shared, registry, clock=lambda: now[0])  # type: ignore[arg-type]
    assert report.to_json() == {"status": "ok", "reasons": []}

    shared.link.healthy, shared.link.reason = False, "ConnectionError: refused"
    for _ in range(50):  # polls
        answer = report.to_json()
        now[0] += 1
    assert answer["status"] == "degraded"
    (redis,) = answer["reasons"]
    assert redis["code"] == "redis_unreachable" and redis["since"] == "1970-01-01T00:16:40Z"
    assert "Redis at redis://r:6379/0 is unreachable (ConnectionError: refused)" in redis["message"]
    assert registry.get_sample_value("llmgw_health_degraded", {"reason": "redis_unreachable"}) == 1

    shared.leader_holder = None
    codes = [r["code"] for r in report.to_json()["reasons"]]
    assert codes == ["redis_unreachable", "no_leader"]
    assert report.to_json()["reasons"][0]["since"] == "1970-01-01T00:16:40Z"  # still the first one's start
    assert any("no leader" in sentence and "(since " in sentence for sentence in report.sentences())
    assert report.sentences(detailed=False) == [
        "the cluster's shared state is degraded: Redis is unreachable (since 1970-01-01T00:16:40Z)",
        f"the cluster has no leader (since {report.to_json()['reasons'][1]['since']})"]

    shared.link.healthy, shared.leader_holder = True, {"generation": 4}
    for _ in range(5):
        assert report.to_json() == {"status": "ok", "reasons": []}
    assert registry.get_sample_value("llmgw_health_degraded", {"reason": "redis_unreachable"}) == 0
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("health: degraded: shared state degraded: Redis at") and "no leader" not in lines[0]
    assert lines[1].startswith("health: still degraded, now: shared state degraded") and "no leader" in lines[1]
    assert lines[2] == "health: ok again after 50.0s degraded"
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING", "INFO"]


def test_a_follower_that_has_not_loaded_the_state_says_so_and_a_leader_never_does():
    shared = shared_state()
    report = HealthReport(shared, CollectorRegistry())  # type: ignore[arg-type]
    assert [r["code"] for r in report.to_json()["reasons"]] == ["state_not_loaded"]
    shared.leading = True
    assert report.to_json()["status"] == "ok"
    assert HealthReport(None, CollectorRegistry()).to_json() == {"status": "ok", "reasons": []}
