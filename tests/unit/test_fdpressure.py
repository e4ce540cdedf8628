"""Telling a shortage of descriptors from other errors, counting it once per site, and the back-off."""

from __future__ import annotations

import errno
import logging

import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.fdpressure import FD_EXHAUSTION, FdExhaustion, ShortageBackoff, capacity_errno, note_shortage, repeats


def raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except BaseException as caught:
        return caught


@pytest.mark.parametrize("number", [errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM])
def test_shortages_are_recognised_however_they_are_wrapped(number):
    assert capacity_errno(OSError(number, "short")) == number
    assert capacity_errno(zmq.ZMQError(number)) == number
    assert capacity_errno(raised_from(RuntimeError("wrapped"), OSError(number, "short"))) == number
    # every address of a host tried (trio's open_tcp_stream), one of them short
    group = ExceptionGroup("all attempts failed", [ConnectionRefusedError(), OSError(number, "short")])
    assert capacity_errno(raised_from(OSError("all attempts to connect failed"), group)) == number


def test_other_errors_are_not_shortages():
    assert capacity_errno(None) is None
    assert capacity_errno(ConnectionRefusedError(errno.ECONNREFUSED, "refused")) is None
    assert capacity_errno(zmq.ZMQError(errno.EADDRINUSE)) is None
    assert capacity_errno(ValueError("no errno")) is None
    assert capacity_errno(raised_from(RuntimeError("wrapped"), PermissionError(errno.EACCES, "no"))) is None


def test_a_cycle_of_causes_ends():
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert capacity_errno(a) is None


def test_the_backoff_doubles_to_its_cap_and_starts_over_after_a_success():
    backoff = ShortageBackoff(0.1, 0.5)
    assert [backoff.next_delay() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.succeeded()
    assert backoff.next_delay() == 0.1


def test_each_site_is_counted_and_logged_once_per_interval(caplog):
    repeats._seen.clear()
    before = dict(FD_EXHAUSTION.counts)
    with caplog.at_level(logging.ERROR, logger="llmgw.fdpressure"):
        for source in ("a", "b", "c"):
            note_shortage("kv_replay", OSError(errno.EMFILE, "Too many open files"), source)
        note_shortage("redis", OSError(errno.ENFILE, "Too many open files in system"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # one per site, whatever the source
    assert lines[0].startswith("out of file descriptors (EMFILE) at kv_replay (a): ")
    assert lines[1].startswith("out of file descriptors (ENFILE) at redis: ")
    assert FD_EXHAUSTION.counts["kv_replay"] == before.get("kv_replay", 0) + 3  # every one counted
    assert FD_EXHAUSTION.counts["redis"] == before.get("redis", 0) + 1


def test_the_counts_are_a_counter_in_every_registry_that_registers_them():
    counter = FdExhaustion()
    first, second = CollectorRegistry(), CollectorRegistry()
    first.register(counter)
    second.register(counter)
    counter.add("kv_replay")
    counter.add("kv_replay")
    for registry in (first, second):
        assert 'llmgw_fd_exhaustion_total{where="kv_replay"} 2.0' in generate_latest(registry).decode()
