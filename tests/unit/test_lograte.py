"""RepeatLimitedLog: the same message at most once per interval, the held-back ones counted, on a fake clock."""

from __future__ import annotations

import logging

import pytest

from llmgw.lograte import RepeatLimitedLog


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def limited(caplog):
    caplog.set_level(logging.DEBUG, logger="test.lograte")
    clock = FakeClock()
    return RepeatLimitedLog(logging.getLogger("test.lograte"), interval=10.0, max_messages=3, clock=clock), clock


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.lograte"]


def test_a_flood_of_one_error_is_one_line_per_interval_with_a_count(limited, caplog):
    log, clock = limited
    written = [log.error("cannot accept: %s", "Too many open files") for _ in range(600)]  # 600 in one instant
    assert written.count(True) == 1
    clock.now += 9.9
    assert not log.error("cannot accept: %s", "Too many open files")
    clock.now += 0.2  # the interval is over: the next one is written, with the count of the 600 held back
    assert log.error("cannot accept: %s", "Too many open files")
    assert lines(caplog) == ["cannot accept: Too many open files",
                             "cannot accept: Too many open files (and 600 more like it in the last 10s)"]
    assert all(r.levelno == logging.ERROR for r in caplog.records)


def test_different_messages_and_levels_are_limited_apart(limited, caplog):
    log, _ = limited
    assert log.error("connection from %s failed", "10.0.0.1")
    assert log.error("connection from %s failed", "10.0.0.2")
    assert log.warning("connection from %s failed", "10.0.0.1")
    assert not log.error("connection from %s failed", "10.0.0.1")
    assert len(lines(caplog)) == 3


def test_forgetting_a_message_writes_its_held_back_count(limited, caplog):
    log, clock = limited
    log.error("a")
    log.error("a")
    log.error("a")  # two held back
    for name in ("b", "c", "d"):  # max_messages=3: "a" is forgotten when "d" comes
        clock.now += 1
        log.error(name)
    assert lines(caplog) == ["a", "b", "c", "a (and 2 more like it in the last 3s)", "d"]


def test_a_disabled_level_costs_nothing_and_is_not_counted(limited, caplog):
    log, _ = limited
    logging.getLogger("test.lograte").setLevel(logging.ERROR)
    assert not log.warning("quiet")
    assert log.error("loud")
    assert lines(caplog) == ["loud"]


def test_lines_of_one_kind_count_as_one_message_whatever_they_name(limited, caplog):
    log, clock = limited
    assert log.warning("refused 10.0.0.1: bad token", kind="bad_token")
    for peer in range(2, 50):
        assert not log.warning(f"refused 10.0.0.{peer}: bad token", kind="bad_token")
    assert log.warning("refused 10.0.0.9: no token", kind="missing_token")  # another kind: a line of its own
    clock.now += 11
    assert log.warning("refused 10.0.0.77: bad token", kind="bad_token")
    assert lines(caplog) == ["refused 10.0.0.1: bad token", "refused 10.0.0.9: no token",
                             "refused 10.0.0.77: bad token (and 48 more like it in the last 11s)"]
