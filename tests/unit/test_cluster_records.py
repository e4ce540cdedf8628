"""The shared state's records: what the control process writes decodes to the same thing, and anything else read
from Redis is a RecordError (never another exception, never a crash)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from llmgw.cluster import records
from llmgw.cluster.records import RecordError, ReplicaRecord
from llmgw.kv.changes import BlockChanges, KvChangeKind
from llmgw.router.model import LoraRef, TierModel

names = st.text(min_size=1, max_size=40)
keys = st.lists(st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1), max_size=50)


@given(name=names, source=st.sampled_from(["static", "deployed"]), routing=names,
       adapters=st.lists(st.tuples(names, names), max_size=3), args=st.lists(st.text(max_size=20), max_size=5))
def test_a_model_declaration_round_trips(name, source, routing, adapters, args):
    model = TierModel(name, routing, {"seed": 1, "nested": {"a": [1, 2]}}, "/models/x",
                      tuple(LoraRef(a, p) for a, p in adapters), tuple(args))
    decoded = records.decode_batch(records.pack([records.model_entry(source, model)]))
    assert decoded == [[records.MODEL, source, model]]


@given(replica=names, kind=st.sampled_from(list(KvChangeKind)), block_size=st.integers(0, 1 << 20), stored=keys,
       removed=keys, reason=st.text(max_size=50))
def test_kv_changes_round_trip(replica, kind, block_size, stored, removed, reason):
    changes = BlockChanges(kind, block_size, stored, removed, reason)
    [entry] = records.decode_batch(records.pack([records.kv_entry(replica, changes)]))
    assert entry == [records.KV, replica, changes]


@given(name=names, model=names, url=st.text(max_size=100), labels=st.dictionaries(names, names, max_size=5),
       weight=st.integers(1, 1000))
def test_a_replica_record_round_trips(name, model, url, labels, weight):
    record = ReplicaRecord(name, model, url, "deployed", weight, labels)
    [[kind, decoded]] = records.decode_batch(records.pack([[records.ADD, record.as_array()]]))
    assert kind == records.ADD and decoded == record


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_random_bytes_are_a_record_error_or_a_batch(raw):
    try:
        batch = records.decode_batch(raw)
    except RecordError:
        return
    assert isinstance(batch, list)


plain = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.text(max_size=10)
                     | st.binary(max_size=10) | st.floats(allow_nan=False),
                     lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=5), inner,
                                                                                   max_size=4),
                     max_leaves=30)


@settings(max_examples=500)
@given(kind=st.sampled_from(records.ENTRY_KINDS), rest=st.lists(plain, max_size=8))
def test_any_wrongly_shaped_entry_is_a_record_error(kind, rest):
    try:
        entry = records.decode_entry([kind, *rest])
    except RecordError:
        return
    assert entry[0] == kind  # it was well-shaped after all


def test_block_keys_beyond_64_bits_and_non_ints_are_refused():
    for bad in ([1 << 64], [-(1 << 63) - 1], [1.5], [True], ["1"]):
        with pytest.raises(RecordError):
            records.decode_entry([records.KV, "r", "delta", 16, bad, [], ""])


def test_sizes_are_bounded_before_decoding():
    with pytest.raises(RecordError):
        records.unpack(msgpack.packb("x" * (2 << 20)))  # a string above the 1 MiB limit
    with pytest.raises(RecordError):
        records.unpack("not bytes")


def test_an_unknown_change_kind_reads_as_a_reset():
    [[_, _, changes]] = records.decode_batch(records.pack([[records.KV, "r", "new-kind", 16, [1], [], ""]]))
    assert changes.kind is KvChangeKind.RESET


def test_a_load_report_round_trips_and_clamps_its_figures():
    fields = {"o": b"gw-1", "x": b"2000",
              "l": records.pack([["r1", 3, 900, 600, 2, 120], ["r2", -5, 1 << 50, 0, 0, 0]])}
    origin, ttl, load = records.decode_load_report(fields)
    assert (origin, ttl) == ("gw-1", 2.0)
    assert load == {"r1": (3, 900, 600, 2, 120), "r2": (0, 1 << 40, 0, 0, 0)}


packable = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=10)
                        | st.binary(max_size=10), lambda inner: st.lists(inner, max_size=6), max_leaves=30)


@settings(max_examples=300)
@given(origin=st.binary(max_size=20), ttl=st.binary(max_size=8),
       load=st.one_of(st.binary(max_size=60), packable.map(records.pack)))
def test_any_load_report_decodes_or_is_a_record_error(origin, ttl, load):
    try:
        _, seconds, figures = records.decode_load_report({"o": origin, "x": ttl, "l": load})
    except RecordError:
        return
    assert 0 <= seconds <= 600 and all(len(f) == records.LOAD_FIGURES for f in figures.values())


def test_records_signed_with_the_cluster_secret_check_out_and_nothing_else_does():
    signer, other = records.Signer(b"k" * 32), records.Signer(b"x" * 32)
    signature = signer.sign(b"w1", b"7", b"batch")
    assert signer.valid(signature, b"w1", b"7", b"batch")
    assert not signer.valid(signature, b"w1", b"8", b"batch")
    assert not signer.valid(signature, b"w17", b"", b"batch")  # the same bytes split otherwise
    assert not other.valid(signature, b"w1", b"7", b"batch")
    assert not signer.valid(b"", b"w1", b"7", b"batch") and not signer.valid(None, b"w1", b"7", b"batch")
    unsigned = records.Signer(None)  # no secret configured: Redis is trusted, nothing is signed or refused
    assert unsigned.sign(b"a") == b"" and unsigned.valid(None, b"a")


learned = st.tuples(names, st.integers(0, records.MAX_WALL_MS), st.integers(0, records.MAX_LEARNED_TTL_MS), keys)


@given(items=st.lists(learned, max_size=5))
def test_a_learn_batch_round_trips(items):
    batch = records.decode_learn_batch(records.pack([records.learn_item(*item) for item in items]))
    assert [tuple(p) for p in batch] == [tuple(item) for item in items]
    assert all(isinstance(p, records.LearnedPrediction) for p in batch)


def test_a_learn_item_takes_any_sequence_of_keys():
    [prediction] = records.decode_learn_batch(records.pack([records.learn_item("r", 5, 2000, (1, 2))]))
    assert prediction == records.LearnedPrediction("r", 5, 2000, [1, 2])


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_random_bytes_are_a_record_error_or_a_learn_batch(raw):
    try:
        batch = records.decode_learn_batch(raw)
    except RecordError:
        return
    assert isinstance(batch, list)


packable = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=10)
                       | st.binary(max_size=10) | st.floats(allow_nan=False),
                       lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=4),
                       max_leaves=30)


@settings(max_examples=500)
@given(st.lists(st.lists(packable, min_size=3, max_size=5) | packable, max_size=4))
def test_any_wrongly_shaped_learn_batch_is_a_record_error(value):
    try:
        batch = records.decode_learn_batch(records.pack(value))
    except RecordError:
        return
    for prediction in batch:  # it was well-shaped after all
        assert isinstance(prediction.replica, str) and type(prediction.made_ms) is int
        assert 0 <= prediction.ttl_ms <= records.MAX_LEARNED_TTL_MS
        assert all(type(key) is int for key in prediction.keys)


def test_learn_batches_refuse_out_of_range_times_and_keys():
    for bad in (["r", -1, 10, [1]], ["r", 1, records.MAX_LEARNED_TTL_MS + 1, [1]], ["r", 1, 10, [1.5]],
                ["r", 1.0, 10, [1]], ["r", 1, True, [1]], ["r", 1, 10, "keys"], [1, 1, 10, [1]], ["r", 1, 10]):
        with pytest.raises(RecordError):
            records.decode_learn_batch(records.pack([bad]))
    with pytest.raises(RecordError):
        records.decode_learn_batch(records.pack([["r", 1, 10, [1]]] * (records.MAX_LEARNED + 1)))


def test_a_tiers_batch_round_trips_and_only_small_scalar_payloads_pass():
    items = [["tiny", "route", ["a prompt", "sim-0"]], ["tiny", "ttft", ["sim-0@x", "sim-0", 2048.0, 3.0, 0.12]]]
    assert records.decode_tier_batch(records.pack(items)) == [(m, k, p) for m, k, p in items]
    for bad in ([["tiny", "route", [["nested"]]]], [["tiny", "route", ["x" * 70_000]]], [["tiny", "route"]],
                [["tiny", 5, []]], [["tiny", "route", list(range(17))]]):
        with pytest.raises(RecordError):
            records.decode_tier_batch(records.pack(bad))


@settings(max_examples=300)
@given(st.one_of(st.binary(max_size=80), packable.map(records.pack)))
def test_any_tiers_batch_decodes_or_is_a_record_error(raw):
    try:
        items = records.decode_tier_batch(raw)
    except RecordError:
        return
    assert all(isinstance(payload, list) for _, _, payload in items)
