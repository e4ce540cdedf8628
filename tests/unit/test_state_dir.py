"""The state dir in one process: its lock, what is read from a lock file anyone local may have written, and what
``llmgw down`` does with ledger entries that do not name one of its engines."""

from __future__ import annotations

import os
import subprocess

import pytest
from hypothesis import given, settings, strategies as st

from llmgw import wire
from llmgw.agent.ledger import Ledger, LedgerEntry
from llmgw.agent.leftover import stop_engines
from llmgw.agent.statelock import LOCK_FILE, StateDirBusy, StateDirLock, _holder
from llmgw.procgroup import process_start_time


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


async def test_down_leaves_malformed_and_foreign_ledger_entries_alone(tmp_path):
    bystander = subprocess.Popen(["sleep", "30"])  # same process group as this test: not an engine's leader
    try:
        spec = wire.StartShard(shard_id="s-0", profile=wire.ShardProfile(name="p", engine="sim", model_path="m"))
        ledger = Ledger(tmp_path / "shards.json")
        ledger.put(LedgerEntry.for_process(spec, pid=bystander.pid, pid_start_time=process_start_time(bystander.pid),
                                           pgid=bystander.pid, http_port=1, endpoint="", model="m"))
        odd = LedgerEntry.for_process(spec, pid=1, pid_start_time=0, pgid=1, http_port=1, endpoint="", model="m")
        odd.shard_id, odd.pid = "s-1", "self"
        ledger.put(odd)
        results = {done.entry.shard_id: done.outcome for done in await stop_engines(tmp_path, grace=1)}
        assert results["s-0"].startswith("left alone: pid ")
        assert results["s-1"] == "left alone: its ledger entry does not name a process"
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
