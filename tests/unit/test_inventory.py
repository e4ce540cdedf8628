"""Node states and agent sessions: the agent service over in-process channels, on Trio's mock clock."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import trio
from prometheus_client import CollectorRegistry

from helpers import RecordingHandler
from llmgw import wire
from llmgw.control.agent_service import AgentService, SessionSettings
from llmgw.control.identity import NodeIdentities
from llmgw.control.inventory import Inventory, NodeState
from llmgw.control.metrics import ControlMetrics
from llmgw.wire.channel import ChannelClosed, memory_channel_pair

TOKEN = "t0p-s3cret"
SETTINGS = SessionSettings(token=TOKEN, heartbeat_interval=5.0, suspect_after=15.0, disconnected_after=60.0)


@pytest.fixture
async def service(nursery, tmp_path):
    metrics = ControlMetrics(CollectorRegistry())
    inventory = Inventory(metrics=metrics)
    service = AgentService(inventory, RecordingHandler(inventory), SETTINGS, metrics=metrics,
                           identities=NodeIdentities(tmp_path))
    await nursery.start(service.run)
    return service


async def connect(service, nursery, register: wire.Register, *, trusted: bool = False):
    """An agent end whose Register was sent, and the control plane's first answer."""
    agent_end, control_end = memory_channel_pair(getattr(register, "node_id", "?"))
    nursery.start_soon(service.serve, control_end, trusted)
    await agent_end.send(register)
    return agent_end, await agent_end.receive()


async def until_closed(channel) -> list:
    """Everything still buffered on ``channel``, up to its end (fails if it never ends)."""
    seen = []
    with trio.fail_after(600):
        while True:
            try:
                seen.append(await channel.receive())
            except ChannelClosed:
                return seen


def counted(service, metric: str, **labels) -> float:
    return getattr(service.metrics, metric).labels(**labels)._value.get()


async def test_silence_makes_a_node_suspect_then_disconnected(service, nursery, autojump_clock):
    agent, reply = await connect(service, nursery, wire.Register(node_id="a", token=TOKEN))
    assert isinstance(reply, wire.Registered) and reply.accepted and reply.heartbeat_interval == 5.0
    node = service.inventory.nodes["a"]
    assert node.state is NodeState.CONNECTED and node.reachable

    await trio.sleep(14.9)
    assert node.state is NodeState.CONNECTED
    await trio.sleep(0.2)
    assert node.state is NodeState.SUSPECT and node.reachable  # commands still go out
    await agent.send(wire.Heartbeat(seq=1))
    await trio.sleep(0.01)
    assert node.state is NodeState.CONNECTED

    await trio.sleep(15.1)
    assert node.state is NodeState.SUSPECT
    await trio.sleep(44.0)
    assert node.state is NodeState.SUSPECT
    await trio.sleep(1.0)
    assert node.state is NodeState.DISCONNECTED and not node.reachable
    assert "silent for 60.0s" in node.state_reason
    heartbeats = await until_closed(agent)  # the control plane closed the session
    assert heartbeats and all(isinstance(m, wire.Heartbeat) for m in heartbeats)
    assert counted(service, "nodes", state="disconnected") == 1
    assert counted(service, "agent_messages", node="a", type="Heartbeat") == 1


async def test_a_wrong_token_is_refused_counted_and_never_logged(service, nursery, caplog, autojump_clock):
    caplog.set_level(logging.DEBUG)
    agent, reply = await connect(service, nursery, wire.Register(node_id="evil", token="guess-123"))
    assert isinstance(reply, wire.Registered) and not reply.accepted and reply.reason.startswith("bad_token")
    assert await until_closed(agent) == []
    assert "evil" not in service.inventory.nodes
    assert counted(service, "agent_refused", reason="bad_token") == 1
    assert "guess-123" not in caplog.text and TOKEN not in caplog.text
    assert "refused node evil" in caplog.text


async def test_the_first_message_must_be_a_register(service, nursery, autojump_clock):
    agent, reply = await connect(service, nursery, wire.Heartbeat(seq=1))
    assert not reply.accepted and reply.reason.startswith("protocol")
    assert counted(service, "agent_refused", reason="protocol") == 1


async def test_without_a_token_only_the_in_process_agent_is_admitted(service, nursery, autojump_clock):
    service.settings = SessionSettings(token=None)
    _, remote = await connect(service, nursery, wire.Register(node_id="remote", token="anything"))
    assert not remote.accepted and remote.reason.startswith("no_token_configured")
    _, local = await connect(service, nursery, wire.Register(node_id="local"), trusted=True)
    assert local.accepted and service.inventory.nodes["local"].state is NodeState.CONNECTED


async def test_a_second_connection_of_a_node_replaces_the_first(service, nursery, autojump_clock):
    first, joined = await connect(service, nursery, wire.Register(node_id="a", token=TOKEN))
    second, reply = await connect(service, nursery, wire.Register(node_id="a", token=TOKEN,
                                                                    node_secret=joined.node_secret))
    assert reply.accepted and not reply.node_secret  # the node proved the secret it was issued: not a new one
    await until_closed(first)  # the first session was closed...
    await trio.sleep(1)
    node = service.inventory.nodes["a"]
    assert node.state is NodeState.CONNECTED  # ...without taking the node down with it
    assert node.session is not None and node.session_serial == 2
    await second.send(wire.ShardStatus(shard=wire.ShardReport(shard_id="s1")))
    await trio.sleep(0.01)
    assert [type(m) for m in service.handler.messages] == [wire.ShardStatus]


async def test_a_closed_connection_disconnects_the_node_at_once(service, nursery, autojump_clock):
    agent, _ = await connect(service, nursery, wire.Register(node_id="a", token=TOKEN))
    await agent.aclose()
    await trio.sleep(0.01)
    node = service.inventory.nodes["a"]
    assert node.state is NodeState.DISCONNECTED and node.state_reason.startswith("connection closed")


async def test_register_replaces_the_shards_and_statuses_update_them():
    changes = []
    inventory = Inventory(on_change=lambda: changes.append(1))
    running = wire.ShardReport(shard_id="x", state=wire.ShardState.READY)
    gone = wire.ShardReport(shard_id="y", state=wire.ShardState.READY)
    session, later = object(), object()
    inventory.register(wire.Register(node_id="a", token="secret", shards=[running, gone]), session)
    assert set(inventory.nodes["a"].shards) == {"x", "y"}
    assert inventory.register(wire.Register(node_id="a", shards=[running]), later) is session
    assert set(inventory.nodes["a"].shards) == {"x"}
    inventory.update_shard("a", wire.ShardReport(shard_id="x", state=wire.ShardState.FAILED))
    assert inventory.shard("a", "x").state is wire.ShardState.FAILED
    inventory.session_ended("a", session, "old session")  # not the current one: ignored
    assert inventory.nodes["a"].state is NodeState.CONNECTED
    inventory.session_ended("a", later, "closed")
    assert inventory.nodes["a"].state is NodeState.DISCONNECTED
    assert inventory.shard("a", "x") is not None  # a disconnected node's shards are kept
    body = inventory.node_json(inventory.nodes["a"], used_gpus=[1, 0])
    assert "token" not in body and body["state"] == "disconnected" and body["used_gpus"] == [0, 1]
    assert [s["shard_id"] for s in body["shards"]] == ["x"]
    assert len(changes) == 4


class StubShards:
    """A ShardManager that runs nothing: what was started, and the reports it is told to give."""

    def __init__(self):
        self.started: list[wire.StartShard] = []
        self.running: list[wire.ShardReport] = []

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        await trio.sleep_forever()

    def start(self, spec):
        self.started.append(spec)

    def reports(self):
        return list(self.running)


async def until(predicate, timeout: float = 30.0):
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


async def test_the_in_process_agent_registers_obeys_reports_and_comes_back(service, nursery, tmp_path,
                                                                           autojump_clock):
    from llmgw.agent.agent import Agent
    from llmgw.wire.channel import InProcessConnector

    agent = Agent(InProcessConnector(service.accept_in_process), node_id="n", discovery="cpu", state_dir=tmp_path,
                  address="127.0.0.1")
    agent.shards = shards = StubShards()
    # Discover once, up front: discovery runs in a worker thread, and real time spent in a thread lets the
    # autojump clock leap past every deadline of this test.
    from llmgw.agent.discovery import discover
    discovered = discover("cpu", node_id="n", address="127.0.0.1")

    async def rediscover():
        return dataclasses.replace(discovered)

    agent._discover = rediscover
    shards.running = [wire.ShardReport(shard_id="kept", state=wire.ShardState.READY, pid=7)]
    await nursery.start(agent.run)
    inventory = service.inventory
    await until(lambda: "n" in inventory.nodes and inventory.nodes["n"].reachable)
    node = inventory.nodes["n"]
    assert inventory.shard("n", "kept").pid == 7 and node.register.cpu_count > 0  # Register carried both

    node.session.post(wire.StartShard(shard_id="new", generation=3))
    await until(lambda: shards.started)
    assert (shards.started[0].shard_id, shards.started[0].generation) == ("new", 3)

    # While the stream is down, statuses wait; the next Register carries the current state of every shard
    # instead (so an older buffered status can never overwrite a newer state).
    first = node.session
    first.close("test: the control plane drops the stream")
    await until(lambda: not node.reachable)
    agent._pending.put(wire.ShardReport(shard_id="new", state=wire.ShardState.STARTING))
    shards.running.append(wire.ShardReport(shard_id="new", state=wire.ShardState.READY, pid=8))
    # The agent reconnects by itself, as the same node; its engines were never touched.
    await until(lambda: node.reachable and node.session is not first)
    assert inventory.shard("n", "new").state is wire.ShardState.READY and inventory.shard("n", "kept").pid == 7
    assert node.session_serial == 2
    # From then on every transition flows as a ShardStatus.
    agent._pending.put(wire.ShardReport(shard_id="new", state=wire.ShardState.FAILED))
    await until(lambda: service.handler.messages)
    assert [(m.shard.shard_id, m.shard.state) for m in service.handler.messages] == [("new", wire.ShardState.FAILED)]
