"""The agent's KV side: a subscription per KV-publishing shard, to private ipc sockets, relayed per stream."""

from __future__ import annotations

import os
import stat
from functools import partial
from pathlib import Path

import pytest
import trio
from prometheus_client import CollectorRegistry

from llmgw import wire
from llmgw.agent.kv import AgentKv, wants_kv
from llmgw.agent.kv_sockets import SOCKET_PATH_MAX, KvEndpoints, KvSocketDir, UnsafeDirectory, fits, private_directory
from llmgw.plugins_manager import default_registry


def spec(**fields) -> wire.StartShard:
    profile = wire.ShardProfile(name="p", engine="sim", model_path="m", kv_events=fields.pop("kv_events", True))
    return wire.StartShard(**{"shard_id": "r1-g1-r0", "replica_id": "r1", "generation": 1, "profile": profile,
                              **fields})


def test_only_rank_0_of_a_kv_profile_is_followed():
    assert wants_kv(spec())
    assert not wants_kv(spec(kv_events=False))
    assert not wants_kv(spec(node_count=2, rank=1))
    assert wants_kv(spec(node_count=2, rank=0))


async def test_a_shard_is_relayed_with_a_full_copy_and_an_adopted_one_reconnects_to_its_sockets(nursery, tmp_path):
    kv = AgentKv(default_registry(), "n1", metrics_registry=CollectorRegistry(), sockets=KvSocketDir(tmp_path / "kv"))
    sent: list[wire.KvChanges] = []

    async def send(message):
        sent.append(message)

    session = trio.CancelScope()

    async def stream(task_status=trio.TASK_STATUS_IGNORED):
        with session:
            await kv.session(send, task_status=task_status)

    await nursery.start(stream)
    shard_scope = trio.CancelScope()

    async def shard(task_status=trio.TASK_STATUS_IGNORED, **endpoints):
        with shard_scope:
            await kv.run_shard(spec(), task_status=task_status, **endpoints)

    first = await nursery.start(shard)
    assert kv.get(spec()) is first
    # The engine will bind both sockets in the agent's private folder; the agent connects.
    assert [path.parent for path in first.endpoints.paths()] == [tmp_path / "kv"] * 2
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    assert first.subscriptions[0].mode == "connect"
    with trio.fail_after(2):
        while not sent:
            await trio.sleep(0.01)
    assert (sent[0].kind, sent[0].shard_id, sent[0].replica_id, sent[0].data_parallel_rank) == (
        wire.KvChangeKind.FULL, "r1-g1-r0", "r1", 0)
    assert isinstance(sent[0], wire.KvChanges)  # the mirror's changes go up as the wire message

    # The router asks for a resync: a full copy through the same relay; an unknown shard or rank is refused.
    assert kv.resync(wire.KvResync(shard_id="r1-g1-r0", replica_id="r1", mode="full"))
    with trio.fail_after(2):
        while not any(m.kind is wire.KvChangeKind.FULL and m.reason == "resync" for m in sent):
            await trio.sleep(0.01)
    assert not kv.resync(wire.KvResync(shard_id="other", mode="full"))
    assert not kv.resync(wire.KvResync(shard_id="r1-g1-r0", data_parallel_rank=1, mode="full"))
    assert kv.resync(wire.KvResync(shard_id="r1-g1-r0", mode="reset"))
    with trio.fail_after(2):
        while not any(m.kind is wire.KvChangeKind.RESET and m.reason == "resync" for m in sent):
            await trio.sleep(0.01)
    assert first.subscriptions[0].resets["resync"] == 1

    # The shard's supervisor ends: sockets closed, relay stopped.
    shard_scope.cancel()
    with trio.fail_after(2):
        while kv.get(spec()) is not None:
            await trio.sleep(0.01)

    # A new agent adopting the engine connects to the endpoints the ledger recorded.
    recorded = KvEndpoints("ipc:///elsewhere/a.ev", "ipc:///elsewhere/a.rp")
    shard_scope = trio.CancelScope()
    adopted = await nursery.start(partial(shard, endpoints=recorded))
    assert adopted.endpoints == recorded and adopted.subscriptions[0].endpoint == recorded.events
    with trio.fail_after(2):  # a FULL again, through the stream that is up
        while len([m for m in sent if m.kind is wire.KvChangeKind.FULL]) < 2:
            await trio.sleep(0.01)
    shard_scope.cancel()
    session.cancel()


def test_the_socket_folder_is_private_and_each_shard_generation_has_its_own_sockets(tmp_path):
    sockets = KvSocketDir(tmp_path / "kv")
    one, again, newer = (sockets.endpoints(spec(generation=g)) for g in (1, 1, 2))
    assert one == again and one != newer
    assert one.events.startswith(f"ipc://{tmp_path}/kv/") and one.events.endswith(".ev")
    assert one.replay.endswith(".rp")
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    # Removal when the engine stopped: the socket files go, the folder stays.
    for path in one.paths():
        path.touch()
    sockets.remove(one)
    assert not any(path.exists() for path in one.paths()) and (tmp_path / "kv").is_dir()
    sockets.remove(one)  # already gone: nothing to do

    # A folder that exists with a loose mode is made private.
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o777)
    assert KvSocketDir(loose).path == loose and stat.S_IMODE(os.stat(loose).st_mode) == 0o700


def test_a_long_or_unsafe_folder_falls_back_to_a_private_one_under_tmp(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 90) / "kv"  # its sockets' paths would not fit a unix socket address
    deep.parent.mkdir()
    long = KvSocketDir(deep)
    fallback = long.path
    assert fallback.parent == Path("/tmp") and fallback.name.startswith("llmgw-kv-") and not deep.exists()
    assert stat.S_IMODE(os.stat(fallback).st_mode) == 0o700 and fits(fallback)
    assert all(len(os.fsencode(p)) <= SOCKET_PATH_MAX for p in long.endpoints(spec()).paths())
    # The next agent on the same state dir uses the same fallback (its adopted engines' sockets are there).
    assert KvSocketDir(deep).path == fallback
    fallback.chmod(0o755)  # no longer private: not reused
    other = KvSocketDir(deep).path
    assert other != fallback
    fallback.rmdir()
    other.rmdir()

    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    linked = KvSocketDir(tmp_path / "link").path
    assert linked.parent == Path("/tmp")
    linked.rmdir()
    with pytest.raises(UnsafeDirectory, match="not a directory"):
        private_directory(tmp_path / "link")
    real_uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: real_uid + 1)  # the folder is then someone else's
    with pytest.raises(UnsafeDirectory, match="belongs to uid"):
        private_directory(target)
