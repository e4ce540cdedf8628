"""The agent's KV side: a subscription per KV-publishing shard, bound before the engine, relayed per stream."""

from __future__ import annotations

from functools import partial

import trio
import zmq
from prometheus_client import CollectorRegistry

from llmgw import wire
from llmgw.agent.kv import AgentKv, wants_kv
from llmgw.agent.ports import PortAllocator
from llmgw.plugins_manager import default_registry


def spec(**fields) -> wire.StartShard:
    profile = wire.ShardProfile(name="p", engine="sim", model_path="m", kv_events=fields.pop("kv_events", True))
    return wire.StartShard(shard_id="r1-g1-r0", replica_id="r1", generation=1, profile=profile, **fields)


def test_only_rank_0_of_a_kv_profile_is_followed():
    assert wants_kv(spec())
    assert not wants_kv(spec(kv_events=False))
    assert not wants_kv(spec(node_count=2, rank=1))
    assert wants_kv(spec(node_count=2, rank=0))


async def test_a_shard_is_relayed_with_a_full_copy_and_an_adopted_one_rebinds_its_port(nursery):
    kv = AgentKv(default_registry(), "n1", metrics_registry=CollectorRegistry(), ports=PortAllocator())
    sent: list[wire.KvChanges] = []

    async def send(message):
        sent.append(message)

    session = trio.CancelScope()

    async def stream(task_status=trio.TASK_STATUS_IGNORED):
        with session:
            await kv.session(send, task_status=task_status)

    await nursery.start(stream)
    shard_scope = trio.CancelScope()

    async def shard(task_status=trio.TASK_STATUS_IGNORED, **ports):
        with shard_scope:
            await kv.run_shard(spec(), task_status=task_status, **ports)

    first = await nursery.start(shard)
    assert kv.get(spec()) is first and first.events_port > 0 and first.replay_port > 0
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

    # The shard's supervisor ends: sockets closed, relay stopped, ports given back.
    shard_scope.cancel()
    with trio.fail_after(2):
        while kv.get(spec()) is not None:
            await trio.sleep(0.01)
    assert not kv.ports.reserved(first.replay_port)

    # A new agent adopting the engine binds the same port (the engine's PUB keeps connecting to it).
    shard_scope = trio.CancelScope()
    adopted = await nursery.start(partial(shard, events_port=first.events_port, replay_port=first.replay_port))
    assert (adopted.events_port, adopted.replay_port) == (first.events_port, first.replay_port)
    assert kv.ports.reserved(first.replay_port)
    with trio.fail_after(2):  # a FULL again, through the stream that is up
        while len([m for m in sent if m.kind is wire.KvChangeKind.FULL]) < 2:
            await trio.sleep(0.01)
    shard_scope.cancel()
    with trio.fail_after(2):
        while kv.get(spec()) is not None:
            await trio.sleep(0.01)

    # Taken meanwhile: another port is bound (logged), the shard still runs.
    context = zmq.Context()
    squatter = context.socket(zmq.SUB)
    squatter.bind(f"tcp://127.0.0.1:{first.events_port}")
    try:
        shard_scope = trio.CancelScope()
        moved = await nursery.start(partial(shard, events_port=first.events_port))
        assert moved.events_port not in (0, first.events_port)
        shard_scope.cancel()
    finally:
        squatter.close(linger=0)
        context.term()
    session.cancel()
