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


LIMITS = records.LoadLimits(frozenset({"r1", "r2"}), 2.0, 10_000)


def test_a_load_report_round_trips_and_clamps_its_figures():
    fields = {"o": b"gw-1", "x": b"2000",
              "l": records.pack([["r1", 3, 900, 600, 2, 120], ["r2", -5, 1 << 50, 0, 0, 0]])}
    origin, ttl, load = records.decode_load_report(fields, LIMITS)
    assert (origin, ttl) == ("gw-1", 2.0)
    assert load == {"r1": (3, 900, 600, 2, 120), "r2": (0, 1 << 40, 0, 0, 0)}


def test_a_load_report_is_clamped_to_what_one_gateway_can_have_and_to_known_replicas():
    """The poisoned report of issue 29: replicas nobody knows, a real one at 2**40 in flight, a 600 s life."""
    unknown = [[f"ghost-{i}", 1, 1, 1, 1, 1] for i in range(5000)]
    fields = {"o": b"gw-1", "x": b"600000",
              "l": records.pack([*unknown, ["r1", 1 << 40, 1 << 50, 1 << 50, 1 << 40, 1 << 40]])}
    origin, ttl, load = records.decode_load_report(fields, LIMITS)
    assert ttl == 2.0  # the reader's load_ttl, not the 600 s written
    assert load == {"r1": (10_000, 1 << 40, 1 << 40, 10_000, records.MAX_QUEUED_MS)}
    limits = records.load_limits(frozenset({"r1", "r2"}), 2.0, 10_000)
    assert limits.replicas == records.REPORT_REPLICAS_FLOOR
    fields["l"] = records.pack([[f"ghost-{i}", 1, 1, 1, 1, 1] for i in range(99_998)])
    with pytest.raises(RecordError):  # far more replicas than a sender's table: refused, not decoded
        records.decode_load_report(fields, limits)


packable = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=10)
                        | st.binary(max_size=10), lambda inner: st.lists(inner, max_size=6), max_leaves=30)


@settings(max_examples=300)
@given(origin=st.binary(max_size=20), ttl=st.binary(max_size=8),
       load=st.one_of(st.binary(max_size=60), packable.map(records.pack)))
def test_any_load_report_decodes_or_is_a_record_error(origin, ttl, load):
    try:
        _, seconds, figures = records.decode_load_report({"o": origin, "x": ttl, "l": load}, LIMITS)
    except RecordError:
        return
    assert 0 <= seconds <= LIMITS.ttl and set(figures) <= LIMITS.known
    assert all(len(f) == records.LOAD_FIGURES and 0 <= f[0] <= LIMITS.requests for f in figures.values())


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
        records.decode_learn_batch(records.pack([["r", 1, 10, [1]]] * (records.LEARN_MAX_PREDICTIONS + 1)))


def test_a_learn_batch_larger_than_a_sender_writes_is_refused_before_it_is_built():
    """The 5M-key entry of issue 29: refused on its size (nothing decoded), and one array longer than a sender's
    whole buffer is refused by the decoder's bound, not built."""
    huge = records.pack([["r", 1, 10, list(range(5_000_000))]])
    with pytest.raises(RecordError, match="too large"):
        records.decode_learn_batch(huge)
    with pytest.raises(RecordError):
        records.decode_learn_batch(records.pack([["r", 1, 10, [1] * (records.LEARN_MAX_KEYS + 1)]]))


@settings(max_examples=100)
@given(items=st.lists(st.tuples(names, st.integers(0, 100), st.integers(0, records.MAX_LEARNED_TTL_MS),
                                st.integers(0, 2000)), max_size=4),
       ttl_limit=st.integers(0, records.MAX_LEARNED_TTL_MS))
def test_a_learn_batch_is_clamped_to_the_readers_ttl_and_the_senders_keys(items, ttl_limit):
    raw = records.pack([records.learn_item(name, made, ttl, list(range(n))) for name, made, ttl, n in items])
    batch = records.decode_learn_batch(raw, ttl_limit)
    assert all(p.ttl_ms <= ttl_limit for p in batch)
    assert sum(len(p.keys) for p in batch) <= records.LEARN_MAX_KEYS


KEYS = records.Keys("c")


def snapshot(writer: str = "w1", seq: int = 3, signer: records.Signer | None = None, **changes) -> tuple:
    """A snapshot as LogWriter.write_snapshot writes it: (pointer bytes, meta bytes)."""
    record = ReplicaRecord("r1", "m", "http://127.0.0.1:1", "static")
    meta = {"writer": writer, "seq": seq, "stream_id": "1-0",
            "models": [records.model_entry("static", TierModel.of("m", "round_robin"))],
            "replicas": [[record.as_array(), False, ""]], "kv": {"r1": ["healthy", 16], "ghost": ["healthy", 16]},
            "parts": {"r1": KEYS.snapshot_part(writer, seq, "kv:0"), "ghost": KEYS.snapshot_part(writer, seq, "kv:1")},
            "digests": {"r1": "d0", "ghost": "d1"}}
    meta.update(changes)
    raw_meta = records.pack(meta)
    return records.snapshot_pointer(KEYS, writer, seq, raw_meta, signer or records.Signer(None)), raw_meta


def test_a_snapshot_round_trips_and_leaves_out_replicas_it_does_not_publish():
    signer = records.Signer(b"k" * 32)
    raw_pointer, raw_meta = snapshot(signer=signer)
    pointer = records.decode_snapshot_pointer(raw_pointer, KEYS)
    assert signer.valid(pointer.sig, *pointer.signed(raw_meta))
    assert not signer.valid(pointer.sig, *pointer.signed(raw_meta + b"x"))
    assert not signer.valid(pointer.sig, *pointer._replace(seq=4).signed(raw_meta))  # the pointer's fields too
    meta = records.decode_snapshot_meta(raw_meta, KEYS, pointer)
    assert [record.name for record, _, _ in meta.members] == ["r1"]
    assert meta.kv == {"r1": ("healthy", 16)} and list(meta.parts) == ["r1"]  # "ghost" gets no slot
    assert len(meta.every_part) == 2 and meta.stream_id == b"1-0"


def test_a_snapshot_pointer_names_only_its_writers_meta():
    for forged in ({"writer": "w1", "seq": 3, "meta": "llmgw:c:snapshot", "sig": b""},
                   {"writer": "w1", "seq": 3, "meta": 5, "sig": b""},
                   {"writer": "w1", "seq": "3", "meta": KEYS.snapshot_part("w1", 3, "meta"), "sig": b""},
                   {"writer": ["w1"], "seq": 3, "meta": KEYS.snapshot_part("w1", 3, "meta"), "sig": b""},
                   {"writer": "w1", "seq": 3, "meta": KEYS.snapshot_part("w1", 3, "meta"), "sig": 7}, [1, 2]):
        with pytest.raises(RecordError):
            records.decode_snapshot_pointer(records.pack(forged), KEYS)


def test_a_snapshot_meta_with_wrong_types_or_foreign_keys_is_a_record_error():
    pointer = records.decode_snapshot_pointer(snapshot()[0], KEYS)
    for changes in ({"parts": {"r1": 5}}, {"parts": {"r1": "llmgw:c:snapshot"}}, {"parts": [1]},
                    {"kv": {"r1": ["healthy", 1 << 30]}}, {"kv": {"r1": "healthy"}}, {"replicas": [[1, 2, 3]]},
                    {"replicas": {"r1": 1}}, {"models": [[records.ADD, 1]]}, {"seq": 4}, {"stream_id": 5},
                    {"replicas": [[ReplicaRecord("r1", "m", "u", "static").as_array(), "no", ""]]}):
        with pytest.raises(RecordError):
            records.decode_snapshot_meta(snapshot(**changes)[1], KEYS, pointer)


@settings(max_examples=300)
@given(value=st.dictionaries(st.sampled_from(["writer", "seq", "stream_id", "models", "replicas", "kv", "parts",
                                              "digests"]), packable, max_size=8))
def test_any_snapshot_meta_decodes_or_is_a_record_error(value):
    pointer = records.decode_snapshot_pointer(snapshot()[0], KEYS)
    try:
        meta = records.decode_snapshot_meta(records.pack({"writer": "w1", "seq": 3, **value}), KEYS, pointer)
    except RecordError:
        return
    assert set(meta.parts) <= set(meta.kv) <= {record.name for record, _, _ in meta.members}


@settings(max_examples=300)
@given(st.one_of(st.binary(max_size=80), packable.map(records.pack),
                 st.dictionaries(st.sampled_from(["writer", "seq", "meta", "sig"]), packable).map(records.pack)))
def test_any_snapshot_pointer_decodes_or_is_a_record_error(raw):
    try:
        pointer = records.decode_snapshot_pointer(raw, KEYS)
    except RecordError:
        return
    assert pointer.meta == KEYS.snapshot_part(pointer.writer, pointer.seq, "meta")


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


scalars = st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=300)


@given(model=st.text(max_size=300), kind=st.text(max_size=50),
       payload=st.lists(scalars, max_size=records.MAX_TIER_PAYLOAD))
def test_a_tier_items_counted_size_is_at_least_its_encoding(model, kind, payload):
    """What a sender's buffer counts of an item bounds its msgpack size: a batch within the sender's budget is
    never larger than what the readers read (MAX_TIER_BATCH_BYTES)."""
    item = [model, kind, payload]
    assert len(records.pack(item)) <= records.tier_item_bytes(item)


def test_a_load_report_of_the_readers_replicas_is_within_the_bytes_it_reads():
    """The largest report a sender of the reader's table writes: every replica named with MAX_NAME 4-byte
    characters, every figure at its largest."""
    known = frozenset(f"{i:04d}" + "\U0001F600" * (records.MAX_NAME - 4) for i in range(3))
    limits = records.load_limits(known, 2.0, 10_000)
    load = [[name, *([(1 << 64) - 1] * records.LOAD_FIGURES)] for name in sorted(known)]
    load = (load * limits.replicas)[:limits.replicas]
    assert len(records.pack(load)) <= records.load_report_bytes(limits)
