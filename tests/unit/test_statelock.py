"""The state dir lock in one process, and what it reads from a lock file anyone local may have written."""

from __future__ import annotations

import json
import logging
import os

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.agent.statelock import LOCK_FILE, StateDirBusy, StateDirLock, _holder
from llmgw.logsetup import JsonFormatter


def test_a_second_lock_on_the_same_dir_is_refused_until_the_first_is_released(tmp_path):
    with StateDirLock(tmp_path):
        with pytest.raises(StateDirBusy) as refused:
            StateDirLock(tmp_path).acquire()
        assert f"in use by pid {os.getpid()}" in str(refused.value)
    with StateDirLock(tmp_path):  # released: free again, the file stays
        assert (tmp_path / LOCK_FILE).exists()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=6000))
def test_whatever_the_lock_file_holds_the_holder_is_one_bounded_line(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("lock") / LOCK_FILE
    path.write_bytes(content)
    fd = os.open(path, os.O_RDONLY)
    try:
        holder = _holder(fd)
    finally:
        os.close(fd)
    assert holder == "another process" or holder.startswith("pid ")
    assert "\n" not in holder and holder.isprintable() and len(holder) < 230


def test_json_log_lines_carry_the_traceback():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("llmgw.x", logging.ERROR, __file__, 1, "failed: %s", ("it",),
                                   exc_info=__import__("sys").exc_info())
    entry = json.loads(JsonFormatter().format(record))
    assert entry["level"] == "error" and entry["logger"] == "llmgw.x" and entry["message"] == "failed: it"
    assert entry["ts"].endswith("Z") and "ValueError: boom" in entry["exc"]
