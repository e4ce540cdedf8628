"""The agent's silence limit and backoff and a new leader's hold window, from the heartbeat interval in one place."""

from __future__ import annotations

import pytest

from llmgw.config import parse_config
from llmgw.wire.channel import FailoverConnector, WebSocketConnector
from llmgw.wire.liveness import (
    BACKOFF_CAP,
    BACKOFF_FIRST,
    DEFAULT_HEARTBEAT,
    backoff_cap,
    dial_timeout,
    hold_window,
    next_backoff,
    silence_limit,
)


@pytest.mark.parametrize("heartbeat, silence", [(0.5, 5.5), (5.0, 15.0), (0.01, 5.01)])
def test_an_agent_gives_a_silent_control_plane_up_after_three_heartbeats_and_at_least_five_seconds_more_than_one(
        heartbeat, silence):
    assert silence_limit(heartbeat) == pytest.approx(silence)


def test_the_reconnect_backoff_doubles_from_its_first_step_up_to_a_heartbeat_and_never_past_its_cap():
    delays = [BACKOFF_FIRST]
    for _ in range(10):
        delays.append(next_backoff(delays[-1], 0.5))
    assert delays[:5] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5]) and max(delays) == 0.5
    assert backoff_cap(60.0) == BACKOFF_CAP and backoff_cap(0.001) == BACKOFF_FIRST


@pytest.mark.parametrize("heartbeat", [0.05, 0.5, 5.0, 30.0])
@pytest.mark.parametrize("lease_ttl", [0.3, 2.0, 60.0])
def test_a_new_leader_holds_long_enough_for_an_agent_to_notice_its_old_leader_is_gone_dial_and_register(
        heartbeat, lease_ttl):
    # The old leader may keep its term lease_ttl into the new one, or be frozen and close nothing: the agent
    # notices after its silence limit, and dials after one backoff step at most.
    # It may dial the frozen old leader first (the other candidate, not leading yet, names it): one dial_timeout.
    assert hold_window(heartbeat, lease_ttl) > (silence_limit(heartbeat) + lease_ttl + dial_timeout(heartbeat)
                                                + backoff_cap(heartbeat))


def test_the_shared_state_holds_for_the_window_of_its_own_config():
    from llmgw.cluster.state import SharedState

    config = parse_config("agents:\n  heartbeat_interval: 0.5s\nstate:\n  backend: redis\n  url: redis://127.0.0.1:9\n"
                          "  cluster: c\n  lease_ttl: 2s\n  secret_env: S\n")
    held_for = SharedState.held_for.fget  # type: ignore[attr-defined]
    assert held_for(type("S", (), {"config": config, "settings": config.state})()) == pytest.approx(11.5)


@pytest.mark.parametrize("heartbeat, dial", [(0.5, 2.5), (5.0, 7.0), (0.01, 2.01), (30.0, 32.0)])
def test_a_dial_waits_a_heartbeat_interval_and_two_seconds_never_longer_than_the_silence_limit(heartbeat, dial):
    assert dial_timeout(heartbeat) == pytest.approx(dial) and dial_timeout(heartbeat) <= silence_limit(heartbeat)


def test_an_agents_dials_wait_what_its_control_planes_heartbeat_says():
    connectors = [WebSocketConnector("ws://127.0.0.1:1"), WebSocketConnector("ws://127.0.0.1:2")]
    assert [c.connect_timeout for c in connectors] == [dial_timeout(DEFAULT_HEARTBEAT)] * 2  # 7 s, not 10
    FailoverConnector(connectors).heartbeat(0.5)
    assert [c.connect_timeout for c in connectors] == [2.5, 2.5]
    fixed = WebSocketConnector("ws://127.0.0.1:3", connect_timeout=0.3)
    fixed.heartbeat(0.5)
    assert fixed.connect_timeout == 0.3
