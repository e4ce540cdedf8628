"""Log lines for machines: the JSON format."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from llmgw.logsetup import JsonFormatter


def test_json_log_lines_carry_the_traceback():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("llmgw.x", logging.ERROR, __file__, 1, "failed: %s", ("it",),
                                   exc_info=sys.exc_info())
    entry = json.loads(JsonFormatter().format(record))
    assert entry["level"] == "error" and entry["logger"] == "llmgw.x" and entry["message"] == "failed: it"
    assert entry["ts"].endswith("Z") and "ValueError: boom" in entry["exc"]


@pytest.fixture
def restored_logging():
    """The root logger's handlers and level, and the Redis client's logger, as they were before the test."""
    root, coredis = logging.getLogger(), logging.getLogger("coredis")
    handlers, level, coredis_level, filters = list(root.handlers), root.level, coredis.level, list(coredis.filters)
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    coredis.setLevel(coredis_level)
    coredis.filters[:] = filters


def test_a_workers_lines_say_which_worker_it_is(capsys, restored_logging):
    from llmgw.logsetup import setup_logging

    record = logging.LogRecord("llmgw.x", logging.INFO, __file__, 1, "hello", (), None)
    assert json.loads(JsonFormatter(worker=2).format(record))["worker"] == 2
    assert "worker" not in json.loads(JsonFormatter().format(record))
    setup_logging("info", "text", worker=1)
    logging.getLogger("llmgw.x").info("hello")
    assert capsys.readouterr().err.rstrip().endswith("INFO [worker 1] llmgw.x: hello")


def test_the_redis_clients_line_per_failed_connection_attempt_is_dropped_but_at_debug(capsys, restored_logging):
    from llmgw.logsetup import setup_logging

    coredis = logging.getLogger("coredis")
    for configured, shown in (("info", False), ("info", False), ("debug", True)):  # twice: one filter
        setup_logging(configured, "text")
        try:
            raise ConnectionResetError("reset by peer")
        except ConnectionResetError:
            coredis.exception("Connection attempt failed unexpectedly!")
        coredis.warning("something else")
        err = capsys.readouterr().err
        assert ("Connection attempt failed" in err) == shown and ("ConnectionResetError" in err) == shown, err
        assert "WARNING coredis: something else" in err
