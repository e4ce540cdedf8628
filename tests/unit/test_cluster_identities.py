"""Node identities kept in Redis (signed secret hashes, never secrets), the cluster's placement key, and the
agent's choice among several --join URLs (docs/scaling.md#leader-election)."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, strategies as st

from llmgw.cluster import records
from llmgw.cluster.identities import decode, encode, placement_key
from llmgw.control.identity import Identity, NodeIdentities
from llmgw.wire.channel import FailoverConnector, UpgradeRefused, WebSocketConnector

SIGNER = records.Signer(b"a cluster secret of 16+ bytes")
IDENTITY = Identity(hashlib.sha256(b"the node's secret").hexdigest(), 1700000000.5, "10.0.0.7:51234")


def test_an_identity_round_trips_and_holds_no_secret():
    raw = encode("gpu-1", IDENTITY, SIGNER)
    assert decode("gpu-1", raw, SIGNER) == IDENTITY
    assert b"the node's secret" not in raw


@pytest.mark.parametrize("node_id, signer", [
    ("gpu-2", SIGNER),  # moved to another node id
    ("gpu-1", records.Signer(b"another secret of 16+ bytes")),  # not the cluster's
])
def test_an_identity_under_another_name_or_secret_is_refused(node_id, signer):
    with pytest.raises(records.RecordError):
        decode(node_id, encode("gpu-1", IDENTITY, SIGNER), signer)


@given(st.binary(max_size=300))
def test_any_bytes_are_an_identity_or_a_record_error(raw):
    try:
        identity = decode("gpu-1", raw, records.Signer(None))
    except records.RecordError:
        return
    assert len(identity.secret_sha256) == 64


def test_the_placement_key_is_the_clusters_own_and_none_without_a_secret():
    assert placement_key(b"x" * 16) == placement_key(b"x" * 16) != placement_key(b"y" * 16)
    assert len(placement_key(b"x" * 16) or b"") == 32 and placement_key(None) is None


def test_a_merged_store_proves_what_the_other_leader_placed_and_checks_the_same_secrets(tmp_path):
    key = placement_key(b"x" * 16)
    old, new = NodeIdentities(tmp_path / "old", placement_key=key), NodeIdentities(tmp_path / "new",
                                                                                     placement_key=key)
    old.bind("gpu-1", "the node's secret")
    assert new.merge(old.identities()) == 1 and new.merge(old.identities()) == 0
    assert new.verify("gpu-1", "the node's secret") and not new.verify("gpu-1", "a guess")
    assert b"placement_key\": null" in (tmp_path / "new" / "nodes.json").read_bytes()  # derived: never stored


def connectors() -> FailoverConnector:
    return FailoverConnector([WebSocketConnector(url) for url in ("http://a:1", "http://b:1", "http://c:1")])


def test_an_agent_goes_to_the_leader_a_refusal_names_when_it_is_one_of_its_urls():
    failover = connectors()
    failover._move_on(UpgradeRefused(503, "not_leader", leader="http://c:1"))
    assert failover.url == "ws://c:1/agent"


@pytest.mark.parametrize("error", [UpgradeRefused(503, "not_leader", leader="http://evil:1"),
                                   UpgradeRefused(503, "not_leader"), OSError("refused")])
def test_otherwise_it_tries_the_next_of_its_own_urls(error):
    failover = connectors()
    failover._move_on(error)
    assert failover.url == "ws://b:1/agent"
    failover._move_on(error)
    failover._move_on(error)
    assert failover.url == "ws://a:1/agent"
