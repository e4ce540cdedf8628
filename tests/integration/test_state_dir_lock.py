"""One agent per state dir: a second ``llmgw agent`` or ``llmgw serve`` on a taken dir fails at once, naming the
holder; the lock dies with its holder and is never inherited by the engines an agent starts."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import trio

from llmgw import wire
from llmgw.agent.ledger import LedgerEntry
from llmgw.agent.statelock import StateDirBusy, StateDirLock
from llmgw.testing.processes import llmgw_command, start_child


async def start_agent(nursery, state_dir) -> trio.Process:
    """A real ``llmgw agent`` that holds ``state_dir`` (its control plane is unreachable: it keeps retrying)."""
    argv = llmgw_command("agent", "--join", "http://127.0.0.1:9", "--token", "secret-token", "--node-id", "node-a",
                         "--state-dir", str(state_dir), "--discovery", "cpu")
    child = await start_child(nursery, argv, name="agent node-a", ready=None)
    lock_file = state_dir / "agent.lock"
    with trio.fail_after(30):
        while not lock_file.exists() or lock_file.read_text().split("\n")[0] != str(child.pid):
            await trio.sleep(0.05)
    return child.process


async def test_a_second_agent_on_the_same_state_dir_fails_naming_the_first(nursery, tmp_path):
    first = await start_agent(nursery, tmp_path)
    second = await trio.run_process(
        llmgw_command("agent", "--join", "http://127.0.0.1:9", "--token", "secret-token", "--node-id", "node-b",
                      "--state-dir", str(tmp_path), "--discovery", "cpu"), capture_stdout=True, capture_stderr=True,
        check=False)
    assert second.returncode == 2
    assert second.stderr.decode().splitlines() == [
        f"llmgw agent: state dir {tmp_path} is in use by pid {first.pid} (llmgw agent); stop that process first, "
        "or give this one another state dir"]
    assert first.returncode is None  # the first one is untouched
    assert "secret-token" not in (tmp_path / "agent.lock").read_text()


async def test_serve_with_an_embedded_agent_on_a_taken_state_dir_fails_naming_the_holder(nursery, tmp_path):
    first = await start_agent(nursery, tmp_path / "state")
    config = tmp_path / "llmgw.yaml"
    config.write_text(f"agents:\n  embedded: true\n  state_dir: {tmp_path / 'state'}\n")
    serve = await trio.run_process(llmgw_command("serve", "--config", str(config), "--listen", "127.0.0.1:0",
                                                 "--control-listen", "127.0.0.1:0"),
                                   capture_stdout=True, capture_stderr=True, check=False)
    assert serve.returncode == 2
    assert serve.stderr.decode().splitlines()[-1] == (
        f"llmgw serve: state dir {tmp_path / 'state'} is in use by pid {first.pid} (llmgw agent); stop that "
        "process first, or give this one another state dir")


async def test_the_lock_goes_with_its_holder(nursery, tmp_path):
    first = await start_agent(nursery, tmp_path)
    first.kill()
    await first.wait()
    with StateDirLock(tmp_path):  # a killed holder leaves the file, not the lock
        assert (tmp_path / "agent.lock").read_text().split("\n")[0] == str(os.getpid())


def test_a_child_process_does_not_inherit_the_lock(tmp_path):
    lock = StateDirLock(tmp_path)
    lock.acquire()
    engine = subprocess.Popen(["sleep", "30"], close_fds=False)  # an engine that outlives its agent
    try:
        with pytest.raises(StateDirBusy, match=f"in use by pid {os.getpid()}"):
            StateDirLock(tmp_path).acquire()
        lock.release()
        with StateDirLock(tmp_path):
            pass
    finally:
        engine.kill()
        engine.wait()


def test_down_exits_1_when_an_entry_names_no_engine_it_may_stop(tmp_path):
    spec = wire.StartShard(shard_id="s-0", profile=wire.ShardProfile(name="p", engine="sim", model_path="m"))
    entry = LedgerEntry.for_process(spec, pid=os.getpid(), pid_start_time=0, pgid=0, http_port=1, endpoint="",
                                    model="m").to_json()
    entry["pgid"] = "1; rm -rf /"
    (tmp_path / "shards.json").write_text(json.dumps({"version": 1, "shards": {"s-0": entry}}))
    result = subprocess.run(llmgw_command("down", "--state-dir", str(tmp_path)), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines() == [
        f"shard s-0 (pid {os.getpid()}): left alone: its ledger entry does not name a process",
        f"llmgw down: 0 engines stopped in {tmp_path}"]
    assert "s-0" in json.loads((tmp_path / "shards.json").read_text())["shards"]  # kept for a human to look at
