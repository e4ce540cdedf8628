"""Node identities: the store (secrets, placement proofs, the file) and the agent service's admission rules."""

from __future__ import annotations

import json
import logging
import stat

import pytest
import trio
from hypothesis import given, settings, strategies as st
from prometheus_client import CollectorRegistry

from helpers import RecordingHandler
from llmgw import wire
from llmgw.control.agent_service import AgentService, SessionSettings
from llmgw.control.identity import IdentityStoreError, NodeIdentities, new_secret
from llmgw.control.inventory import Inventory, NodeState
from llmgw.control.metrics import ControlMetrics
from llmgw.wire.channel import ChannelClosed, memory_channel_pair

TOKEN = "join-t0ken"


# -- the store --------------------------------------------------------------------------------------------------------


def test_a_bound_secret_is_verified_persisted_as_a_hash_and_private(tmp_path):
    store = NodeIdentities(tmp_path)
    secret = new_secret()
    assert len(secret) == 64 and int(secret, 16) >= 0
    store.bind("a", secret, "10.0.0.1:5000")
    assert store.verify("a", secret)
    assert not store.verify("a", new_secret()) and not store.verify("a", "") and not store.verify("b", secret)
    text = store.path.read_text()
    assert secret not in text and json.loads(text)["nodes"]["a"]["peer"] == "10.0.0.1:5000"
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    again = NodeIdentities(tmp_path)  # a restarted control plane
    assert again.known("a") and again.verify("a", secret)
    assert again.forget("a") and not again.forget("a")
    assert not NodeIdentities(tmp_path).known("a")


def test_a_placement_proof_holds_for_its_node_and_fields_only_and_survives_a_restart(tmp_path):
    store = NodeIdentities(tmp_path)
    start = wire.StartShard(shard_id="m-0-g7-r0", replica_id="m-0", rank=0, generation=7, fingerprint="f00d")
    proof = store.placement_proof("a", start)
    report = wire.ShardReport(shard_id="m-0-g7-r0", replica_id="m-0", rank=0, generation=7, fingerprint="f00d",
                              placement_proof=proof)
    assert store.proven("a", report)
    assert not store.proven("b", report)  # another node cannot use it
    for change in ({"generation": 8}, {"fingerprint": "beef"}, {"replica_id": "m-1"}, {"rank": 1},
                   {"shard_id": "m-0-g7-r1"}, {"placement_proof": ""}, {"placement_proof": "0" * 64}):
        assert not store.proven("a", wire.ShardReport(**{**report.__dict__, **change})), change
    assert NodeIdentities(tmp_path).proven("a", report)  # the key is persisted
    assert not NodeIdentities(tmp_path / "other").proven("a", report)  # another control plane's key


def test_an_unreadable_store_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "nodes.json").write_text("{not json")
    with pytest.raises(IdentityStoreError, match="nodes.json cannot be read"):
        NodeIdentities(tmp_path)
    (tmp_path / "nodes.json").write_text('{"version": 99, "nodes": {}}')
    with pytest.raises(IdentityStoreError, match="version 99"):
        NodeIdentities(tmp_path)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                              lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=4),
                              max_leaves=20).map(json.dumps)))
def test_any_store_file_loads_or_raises_identity_store_error(tmp_path_factory, text):
    directory = tmp_path_factory.mktemp("store")
    (directory / "nodes.json").write_text(text, encoding="latin-1")
    try:
        NodeIdentities(directory)
    except IdentityStoreError:
        pass


# -- admission --------------------------------------------------------------------------------------------------------


@pytest.fixture
async def service(nursery, tmp_path):
    inventory = Inventory()
    service = AgentService(inventory, RecordingHandler(inventory),
                           SessionSettings(token=TOKEN, reserved_node_ids=frozenset({"local"})),
                           identities=NodeIdentities(tmp_path), metrics=ControlMetrics(CollectorRegistry()))
    await nursery.start(service.run)
    return service


async def connect(service, nursery, register: wire.Register, trusted: bool = False):
    agent_end, control_end = memory_channel_pair(register.node_id)
    nursery.start_soon(service.serve, control_end, trusted)
    await agent_end.send(register)
    return agent_end, await agent_end.receive()


async def closed(channel) -> bool:
    with trio.move_on_after(5):
        try:
            while True:
                await channel.receive()
        except ChannelClosed:
            return True
    return False


def refused(service, reason: str) -> float:
    return service.metrics.agent_refused.labels(reason)._value.get()


async def join(service, nursery, node_id: str):
    """A new node joins with the token and speaks once (so its secret is bound); its channel and secret."""
    agent, reply = await connect(service, nursery, wire.Register(node_id=node_id, token=TOKEN))
    assert reply.accepted and reply.node_secret
    await agent.send(wire.Heartbeat(seq=1))
    await trio.sleep(0.01)
    return agent, reply.node_secret


async def test_a_known_node_id_needs_its_secret_and_the_token_is_not_enough(service, nursery, caplog,
                                                                             autojump_clock):
    caplog.set_level(logging.DEBUG)
    agent, secret = await join(service, nursery, "a")
    assert service.identities.verify("a", secret)
    session = service.inventory.nodes["a"].session
    for attempt in (wire.Register(node_id="a", token=TOKEN), wire.Register(node_id="a", token=TOKEN,
                                                                          node_secret=new_secret())):
        _, reply = await connect(service, nursery, attempt)
        assert not reply.accepted and reply.reason.startswith("bad_node_secret") and not reply.node_secret
    assert refused(service, "bad_node_secret") == 2
    assert service.inventory.nodes["a"].session is session  # the real session was not touched
    assert service.inventory.nodes["a"].state is NodeState.CONNECTED
    assert secret not in caplog.text and TOKEN not in caplog.text
    assert "refused node a from a" in caplog.text  # with the peer

    # The real agent, reconnecting with its secret (and an old token), replaces its old session.
    second, reply = await connect(service, nursery, wire.Register(node_id="a", token="rotated-away",
                                                                  node_secret=secret))
    assert reply.accepted and not reply.node_secret
    assert await closed(agent)
    assert service.inventory.nodes["a"].session is not session


async def test_a_new_node_id_is_held_while_its_first_session_has_not_confirmed_its_secret(service, nursery,
                                                                                          autojump_clock):
    first, reply = await connect(service, nursery, wire.Register(node_id="n", token=TOKEN))
    assert reply.accepted and not service.identities.known("n")  # not bound until the agent speaks again
    _, stolen = await connect(service, nursery, wire.Register(node_id="n", token=TOKEN))
    assert not stolen.accepted and "joining on another connection" in stolen.reason
    # The same agent reconnecting with the issued secret (its first reply was received) is admitted and bound.
    again, reply2 = await connect(service, nursery, wire.Register(node_id="n", token=TOKEN,
                                                                  node_secret=reply.node_secret))
    assert reply2.accepted and service.identities.verify("n", reply.node_secret)
    assert await closed(first)


async def test_a_first_session_that_ends_before_confirming_frees_the_node_id(service, nursery, autojump_clock):
    first, reply = await connect(service, nursery, wire.Register(node_id="n", token=TOKEN))
    await first.aclose()
    await trio.sleep(1)
    assert not service.identities.known("n")
    _, again = await connect(service, nursery, wire.Register(node_id="n", token=TOKEN))
    assert again.accepted and again.node_secret and again.node_secret != reply.node_secret


async def test_the_embedded_agents_node_id_is_never_admitted_remotely(service, nursery, autojump_clock):
    _, reply = await connect(service, nursery, wire.Register(node_id="local", token=TOKEN))
    assert not reply.accepted and reply.reason.startswith("reserved_node_id")
    await connect(service, nursery, wire.Register(node_id="embedded-2"), trusted=True)
    _, reply = await connect(service, nursery, wire.Register(node_id="embedded-2", token=TOKEN))
    assert not reply.accepted and reply.reason.startswith("reserved_node_id")
    assert refused(service, "reserved_node_id") == 2
    _, trusted = await connect(service, nursery, wire.Register(node_id="local"), trusted=True)
    assert trusted.accepted and not trusted.node_secret  # the in-process agent needs no secret


async def test_any_of_the_join_tokens_admits_a_new_node(service, nursery, autojump_clock):
    service.settings = SessionSettings(token="new", tokens=("old",))
    for node_id, token in (("x", "old"), ("y", "new")):
        _, reply = await connect(service, nursery, wire.Register(node_id=node_id, token=token))
        assert reply.accepted, node_id
    _, reply = await connect(service, nursery, wire.Register(node_id="z", token="older"))
    assert not reply.accepted and reply.reason.startswith("bad_token")


async def test_forgetting_a_node_closes_its_session_and_lets_a_new_machine_take_the_id(service, nursery,
                                                                                        autojump_clock):
    agent, secret = await join(service, nursery, "a")
    assert service.forget("a")
    assert await closed(agent)
    assert not service.identities.known("a")
    _, reply = await connect(service, nursery, wire.Register(node_id="a", token=TOKEN))
    assert reply.accepted and reply.node_secret != secret
    assert not service.forget("nobody")


async def test_node_ids_are_bounded_in_length_and_in_number(service, nursery, autojump_clock):
    _, reply = await connect(service, nursery, wire.Register(node_id="n" * 254, token=TOKEN))
    assert not reply.accepted and reply.reason.startswith("protocol")
    _, reply = await connect(service, nursery, wire.Register(node_id="bad\nid", token=TOKEN))
    assert not reply.accepted and reply.reason.startswith("protocol")
    service.identities.max_nodes = 2
    await join(service, nursery, "one")
    await join(service, nursery, "two")
    _, reply = await connect(service, nursery, wire.Register(node_id="three", token=TOKEN))
    assert not reply.accepted and reply.reason.startswith("node_limit")
    assert refused(service, "node_limit") == 1
