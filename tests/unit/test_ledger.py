"""The agent's local state: the shard ledger, per-shard log files, and the HTTP port allocator."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import socket
import stat
import subprocess
import sys

import pytest
import trio

from llmgw import wire
from llmgw.agent.ledger import Ledger, LedgerEntry
from llmgw.agent.logs import ShardLog, secure_log_folder
from llmgw.agent.ports import NoFreePort, PortAllocator
from llmgw.procgroup import process_start_time


def spec(shard_id: str = "r1-0", generation: int = 3) -> wire.StartShard:
    return wire.StartShard(
        shard_id=shard_id, replica_id="r1", rank=0, node_count=1, gpu_indices=[0, 1], gpu_uuids=["GPU-a", "GPU-b"],
        generation=generation, fingerprint="fp-1", engine_api_key="secret", cpu_threads=4,
        profile=wire.ShardProfile(name="tiny-sim", engine="sim", model_path="tiny", served_model_name="tiny",
                                  args=["--num-blocks", "256"], env={"A": "1"}, kv_events=True,
                                  lora_adapters=[wire.LoraModule("sql", "/loras/sql")], startup_timeout=30.0))


def entry_for(pid: int, start_time: int | None = None, **kw) -> LedgerEntry:
    start_time = process_start_time(pid) if start_time is None else start_time
    return LedgerEntry.for_process(kw.pop("spec", spec()), pid=pid, pid_start_time=start_time, pgid=pid,
                                   http_port=21000, endpoint="http://10.0.0.5:21000", model="tiny", **kw)


# -- ledger -------------------------------------------------------------------------------------------------------


def test_entries_survive_a_new_ledger_with_the_whole_spec(tmp_path):
    path = tmp_path / "state" / "shards.json"
    ledger = Ledger(path)
    entry = entry_for(os.getpid(), restarts=2)
    ledger.put(entry)
    ledger.put(entry_for(os.getpid(), spec=spec("r2-0")))

    reread = Ledger(path)
    assert sorted(e.shard_id for e in reread.entries()) == ["r1-0", "r2-0"]
    back = reread.get("r1-0")
    assert back == entry
    assert back.spec == spec()  # everything needed to restart it, API key and LoRA adapters included
    assert (back.replica_id, back.rank, back.generation, back.fingerprint, back.gpu_indices, back.model) == (
        "r1", 0, 3, "fp-1", [0, 1], "tiny")
    assert back.restarts == 2 and back.pgid == os.getpid() and back.started_at > 0


def test_the_file_is_private_and_written_atomically(tmp_path):
    ledger = Ledger(tmp_path / "shards.json")
    ledger.put(entry_for(os.getpid()))
    assert stat.S_IMODE((tmp_path / "shards.json").stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["shards.json"]  # no temporary file left behind
    body = json.loads((tmp_path / "shards.json").read_text())
    assert body["version"] == 1 and list(body["shards"]) == ["r1-0"]


@contextlib.contextmanager
def no_descriptor_left():
    """Every descriptor this process may open is taken (the soft limit lowered to what it holds, the holes below
    filled) until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(map(int, os.listdir("/proc/self/fd"))) + 1, hard))
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        assert exc.errno == errno.EMFILE
    try:
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_write_without_a_descriptor_is_kept_and_written_once_one_is_free(tmp_path):
    ledger = Ledger(tmp_path / "shards.json")
    entry = entry_for(4242, start_time=1)
    with no_descriptor_left():
        ledger.put(entry)  # nothing raised: an engine just spawned must not take its supervisor down
    assert ledger.get("r1-0") == entry and not (tmp_path / "shards.json").exists()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ledger.save_when_possible)
        with trio.fail_after(10):
            while not (tmp_path / "shards.json").exists():
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert Ledger(tmp_path / "shards.json").get("r1-0").pid == 4242


def test_remove_only_the_process_named(tmp_path):
    ledger = Ledger(tmp_path / "shards.json")
    ledger.put(entry_for(os.getpid()))
    ledger.remove("r1-0", pid=os.getpid() + 1)  # a predecessor's cleanup must not remove its successor
    assert ledger.get("r1-0") is not None
    ledger.remove("r1-0", pid=os.getpid())
    ledger.remove("never-there")
    assert Ledger(tmp_path / "shards.json").entries() == []


def test_alive_needs_the_same_pid_and_start_time():
    assert Ledger.alive(entry_for(os.getpid()))
    assert not Ledger.alive(entry_for(os.getpid(), start_time=process_start_time(os.getpid()) - 1))  # pid reused
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    assert not Ledger.alive(entry_for(exited.pid, start_time=1))


def test_a_zombie_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start_time = process_start_time(child.pid)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    try:
        assert not Ledger.alive(entry_for(child.pid, start_time=start_time or 0))
    finally:
        child.wait()


def test_unknown_fields_are_ignored_and_unreadable_entries_dropped(tmp_path):
    path = tmp_path / "shards.json"
    Ledger(path).put(entry_for(os.getpid()))
    body = json.loads(path.read_text())
    body["shards"]["r1-0"]["added_by_a_newer_agent"] = 1
    body["shards"]["r1-0"]["spec"]["profile"]["new_knob"] = True
    body["shards"]["broken"] = {"shard_id": "broken", "spec": "not a map"}
    path.write_text(json.dumps(body))
    ledger = Ledger(path)
    assert [e.shard_id for e in ledger.entries()] == ["r1-0"]


def test_an_unreadable_ledger_is_set_aside(tmp_path):
    path = tmp_path / "shards.json"
    path.write_text("{half a ledger")
    assert Ledger(path).entries() == []
    assert [p.name.startswith("shards.json.broken-") for p in tmp_path.iterdir()] == [True]


# -- logs ---------------------------------------------------------------------------------------------------------


def test_the_engine_writes_its_log_itself(tmp_path):
    log = ShardLog(tmp_path, "r1/0")
    log.write_header("starting")
    fd = log.open_for_child()
    try:
        subprocess.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
                       stdout=fd, stderr=fd, check=True)
    finally:
        os.close(fd)
    assert log.path == tmp_path / "logs" / "r1_0.log"
    lines = log.tail(10)
    assert lines[0].startswith("==== llmgw ") and lines[0].endswith(" starting ====")
    assert lines[1:] == ["out", "err"]


def test_rotation_copies_then_truncates_and_keeps_n_files(tmp_path):
    log = ShardLog(tmp_path, "s", max_bytes=100, keep=2)
    fd = log.open_for_child()  # stays open across rotations, as the engine's does
    try:
        for generation in range(4):
            os.write(fd, "".join(f"gen{generation} line{i}\n" for i in range(10)).encode())
            assert log.rotate_if_needed()
        os.write(fd, b"after\n")
        assert not log.rotate_if_needed()
    finally:
        os.close(fd)
    assert log.path.read_text() == "after\n"  # O_APPEND: the write after the truncate starts at 0
    assert (tmp_path / "logs" / "s.log.1").read_text().startswith("gen3 line0")
    assert (tmp_path / "logs" / "s.log.2").read_text().startswith("gen2 line0")
    assert not (tmp_path / "logs" / "s.log.3").exists()
    assert log.tail(3) == ["gen3 line8", "gen3 line9", "after"]  # the tail reaches into the rotated file


def test_logs_and_their_rotated_copies_are_0600_in_a_0700_folder(tmp_path):
    log = ShardLog(tmp_path, "s", max_bytes=10, keep=2)
    log.write_header("starting")
    os.close(log.open_for_child())
    assert log.rotate_if_needed()
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "logs").iterdir()}
    assert modes == {"s.log": 0o600, "s.log.1": 0o600}, modes
    assert stat.S_IMODE((tmp_path / "logs").stat().st_mode) == 0o700


def test_an_unsafe_log_folder_is_refused_not_written(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "logs").symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="not a directory"):
        ShardLog(tmp_path / "state", "s").open_for_child()
    assert secure_log_folder(tmp_path / "state") == 0  # logged, not raised: the agent still starts
    assert list(elsewhere.iterdir()) == []


def test_tail_of_a_missing_log_is_empty(tmp_path):
    assert ShardLog(tmp_path, "never").tail(5) == []


# -- ports --------------------------------------------------------------------------------------------------------


def test_ports_are_free_and_never_handed_out_twice():
    ports = PortAllocator("127.0.0.1", 41000, 41009)
    taken = [ports.allocate() for _ in range(5)]
    assert len(set(taken)) == 5 and all(41000 <= p <= 41009 for p in taken)
    ports.release(taken[0])
    assert ports.allocate() not in taken[1:]


def test_ports_in_use_or_reserved_are_skipped():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = PortAllocator("127.0.0.1", port, port + 1)
        ports.reserve(port + 1)
        with pytest.raises(NoFreePort):
            ports.allocate()
    ports.release(port + 1)
    assert ports.allocate() in (port, port + 1)
