"""Rotating the cluster secret (docs/runbook.md): every check accepts the previous secret too, signs with the current.

The rolling procedure's three configurations are ``(OLD)``, ``(OLD, previous NEW)``, ``(NEW, previous OLD)`` and
``(NEW)``; two processes one step apart must accept each other's records, which these tests check record by
record (leases and their release marks, log batches and load reports through the signer, node identities,
tenancy records and placement proofs).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from llmgw import wire
from llmgw.cluster import identities, records
from llmgw.cluster.election import lease_value, parse_holder, release_mark, release_marks
from llmgw.cluster.link import previous_cluster_secret
from llmgw.config import ConfigError, parse_config
from llmgw.control.identity import Identity, NodeIdentities
from llmgw.tenancy import codec
from llmgw.tenancy.directory import KeyEntry
from llmgw.tenancy.store_redis import KEY, RedisKeyStore

OLD, NEW = b"the old cluster secret, 16+ bytes", b"the new cluster secret, 16+ bytes"
STEPS = [records.Signer(OLD), records.Signer(OLD, NEW), records.Signer(NEW, OLD), records.Signer(NEW)]


def test_neighbouring_steps_of_the_rotation_accept_each_others_records_and_no_others():
    def accepts(reader: records.Signer, writer: records.Signer) -> bool:
        return reader.valid(writer.sign(b"lease", b"1 a b"), b"lease", b"1 a b")

    for i, one in enumerate(STEPS):
        for j, other in enumerate(STEPS):
            # processes two steps apart (one signing OLD alone, one NEW alone) would refuse each other
            assert (accepts(one, other) and accepts(other, one)) == (abs(i - j) <= 1), (i, j)


def test_a_record_signed_only_by_the_previous_secret_is_counted():
    counted = []
    signer = records.Signer(NEW, OLD, lambda: counted.append(1))
    assert signer.verify(records.Signer(NEW).sign(b"x"), b"x") is records.Signed.CURRENT
    assert signer.verify(records.Signer(OLD).sign(b"x"), b"x") is records.Signed.PREVIOUS
    assert signer.verify(records.Signer(b"a third secret, 16+ bytes").sign(b"x"), b"x") is records.Signed.NOT
    assert signer.verify(None, b"x") is records.Signed.NOT
    assert len(counted) == 1
    assert signer.sign(b"x") == records.Signer(NEW).sign(b"x")  # never signs with the previous one


def test_without_a_current_secret_a_previous_one_is_ignored():
    signer = records.Signer(None, OLD)
    assert signer.previous is None and signer.sign(b"x") == b"" and signer.valid(None, b"x")


@settings(max_examples=200)
@given(signature=st.binary(max_size=40) | st.none() | st.integers() | st.text(max_size=10),
       parts=st.lists(st.binary(max_size=20), max_size=4))
def test_any_signature_is_current_previous_or_not_never_an_error(signature, parts):
    signer = records.Signer(NEW, OLD)
    assert signer.verify(signature, *parts) is records.Signed.NOT  # random bytes are no HMAC of either


@settings(max_examples=100)
@given(st.binary(max_size=300))
def test_any_lease_value_parses_or_is_refused_under_two_secrets(raw):
    holder = parse_holder(raw, STEPS[2])
    assert holder is None or holder["generation"] >= 0


def test_a_lease_and_its_release_mark_from_the_previous_secret_are_accepted():
    old_leader, new_candidate = STEPS[1], STEPS[2]
    lease = lease_value(7, "0123456789ab", "http://127.0.0.1:8001", old_leader)
    assert parse_holder(lease, new_candidate) == {"generation": 7, "origin": "0123456789ab",
                                                  "control_url": "http://127.0.0.1:8001"}
    assert parse_holder(lease, STEPS[3]) is None  # once the previous secret is dropped: not a candidate's
    assert release_mark(lease, old_leader) in release_marks(lease, new_candidate)
    assert release_mark(lease, old_leader) not in release_marks(lease, STEPS[3])
    assert release_marks(lease, records.Signer(None)) == [lease]


def test_a_node_identity_signed_with_the_previous_secret_is_read_and_told_apart():
    identity = Identity("ab" * 32, 1.5, "10.0.0.9")
    raw = identities.encode("gpu-1", identity, STEPS[0])
    assert identities.decode_signed("gpu-1", raw, STEPS[2]) == (identity, records.Signed.PREVIOUS)
    assert identities.decode_signed("gpu-1", identities.encode("gpu-1", identity, STEPS[2]), STEPS[2])[1] \
        is records.Signed.CURRENT
    with pytest.raises(records.RecordError):
        identities.decode("gpu-1", raw, STEPS[3])


def test_a_placement_proof_of_the_previous_key_is_accepted_until_it_is_dropped(tmp_path):
    old_key, new_key = identities.placement_key(OLD), identities.placement_key(NEW)
    report = wire.ShardReport(shard_id="s1", replica_id="r1", rank=0, generation=3, fingerprint="f" * 12,
                              state=wire.ShardState.READY)
    before = NodeIdentities(tmp_path / "a", placement_key=old_key)
    report.placement_proof = before.placement_proof("gpu-1", report)
    rotating = NodeIdentities(tmp_path / "b", placement_key=new_key, previous_placement_key=old_key)
    assert rotating.proven("gpu-1", report) and rotating.proven_by_previous("gpu-1", report)
    assert not rotating.proven("gpu-2", report)  # still bound to its node
    after = NodeIdentities(tmp_path / "c", placement_key=new_key)
    assert not after.proven("gpu-1", report)
    report.placement_proof = rotating.placement_proof("gpu-1", report)  # issued anew
    assert after.proven("gpu-1", report) and not rotating.proven_by_previous("gpu-1", report)


def test_tenancy_records_of_the_previous_secret_are_admitted_and_listed_for_re_signing():
    entry = KeyEntry("k-0123456789abcdef", "app", b"\xcd" * 32)
    body = codec.encode_key(entry)
    old = RedisKeyStore(None, "llmgw:t:", STEPS[1], max_keys=10, max_teams=10)  # type: ignore[arg-type]
    new = RedisKeyStore(None, "llmgw:t:", STEPS[2], max_keys=10, max_teams=10)  # type: ignore[arg-type]
    sealed = old.seal(KEY, entry.key_id, body, 5)
    refused, resign = {"key": 0, "replayed_key": 0}, []
    assert new._decoded(KEY, [entry.key_id.encode(), sealed], codec.decode_key, lambda e: e.key_id, refused, {},
                        resign) == [entry]
    assert resign == [(KEY, entry.key_id, body, sealed)] and refused == {"key": 0, "replayed_key": 0}
    resign.clear()
    assert new._decoded(KEY, [entry.key_id.encode(), new.seal(KEY, entry.key_id, body, 6)], codec.decode_key,
                        lambda e: e.key_id, refused, {}, resign) == [entry]
    assert resign == []  # signed with the current secret: nothing to do
    dropped = RedisKeyStore(None, "llmgw:t:", STEPS[3], max_keys=10, max_teams=10)  # type: ignore[arg-type]
    assert dropped._decoded(KEY, [entry.key_id.encode(), sealed], codec.decode_key, lambda e: e.key_id,
                            refused, {}) == []


def test_the_previous_secret_has_the_current_ones_rules():
    base = "state:\n  backend: redis\n  url: redis://127.0.0.1\n"
    settings_ = parse_config(base + "  secret_env: NEW\n  previous_secret_env: OLD\n", filename="llmgw.yaml").state
    assert previous_cluster_secret(settings_, {"OLD": "x" * 16}) == b"x" * 16
    with pytest.raises(ValueError, match="at least 16 bytes"):
        previous_cluster_secret(settings_, {"OLD": "short"})
    with pytest.raises(ValueError, match="OLD, which is not set"):
        previous_cluster_secret(settings_, {})
    for extra, words in (("  secret_env: S\n  previous_secret_env: S\n", "same variable"),
                         ("  secret_env: null\n  previous_secret_env: OLD\n", "must be set too")):
        with pytest.raises(ConfigError) as caught:
            parse_config(base + extra, filename="llmgw.yaml")
        assert any("previous_secret_env" in str(issue) and words in str(issue) for issue in caught.value.errors), \
            caught.value.errors
