"""KV event codec: every golden frame decodes to its meaning and re-encodes byte-identically; fuzzing finds nothing."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from golden import from_json_lists, load_golden
from llmgw.kv.codec import (
    ARRAY_VARIANTS,
    BLOCK_REMOVED_FIELDS,
    BLOCK_STORED_FIELDS,
    END_SEQ,
    END_SEQ_BYTES,
    MAP_VARIANTS,
    EventDecodeError,
    decode_batch,
    encode_batch,
    parse_frames,
    parse_replay_reply,
    replay_request,
)
from llmgw.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    is_device_medium,
    is_main_attention,
    is_placeholder,
)
from llmgw.kv.keys import normalize_hash
from llmgw.plugins import kv_builtin

GOLDEN = load_golden("vllm_kv_event_frames.json")
VARIANTS = GOLDEN["variants"]
VARIANT_IDS = [variant["variant"] for variant in VARIANTS]
FRAMES = [(variant, frame) for variant in VARIANTS for frame in variant["published_frames"]]
FRAME_IDS = [f"{variant['variant']}-seq{frame['seq']}" for variant, frame in FRAMES]
EVENT_CLASSES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}


def test_golden_file_has_every_variant():
    assert len(VARIANTS) == 15
    assert len(FRAMES) == 60


def _hex_frames(frames_hex: list[str]) -> list[bytes]:
    return [bytes.fromhex(h) for h in frames_hex]


def _expected_batch(decoded: dict) -> EventBatch:
    events = []
    for raw in decoded["events"]:
        fields = {name: from_json_lists(value) for name, value in raw.items() if name != "type"}
        events.append(EVENT_CLASSES[raw["type"]](**fields))
    rank = decoded["data_parallel_rank"]
    return EventBatch(decoded["ts"], events, None if rank == "n/a" else rank, [])


def _layout(variant: dict) -> tuple[str, int]:
    array_like = variant["struct_options"]["BlockStored"]["array_like"]
    return ("array" if array_like else "map"), len(variant["struct_fields"]["BlockStored"])


# --------------------------------------------------------------------------- golden frames


@pytest.mark.parametrize(("variant", "frame"), FRAMES, ids=FRAME_IDS)
def test_golden_frame_decodes_to_its_meaning(variant, frame):
    topic, seq, payload = parse_frames(_hex_frames(frame["frames_hex"]))
    assert topic == variant["topic"].encode()
    assert seq == frame["seq"]
    assert decode_batch(payload) == _expected_batch(frame["decoded"])


@pytest.mark.parametrize(("variant", "frame"), FRAMES, ids=FRAME_IDS)
def test_encoder_reproduces_golden_payload(variant, frame):
    payload = bytes.fromhex(frame["frames_hex"][2])
    layout, fields = _layout(variant)
    assert encode_batch(_expected_batch(frame["decoded"]), layout=layout, fields=fields) == payload


def test_field_tables_match_the_event_classes():
    assert tuple(f.name for f in dataclasses.fields(BlockStored)) == BLOCK_STORED_FIELDS
    assert tuple(f.name for f in dataclasses.fields(BlockRemoved)) == BLOCK_REMOVED_FIELDS


def test_golden_layouts_are_the_declared_variants():
    for variant in VARIANTS:
        layout, fields = _layout(variant)
        declared = ARRAY_VARIANTS if layout == "array" else MAP_VARIANTS
        assert declared[fields] == len(variant["struct_fields"]["BlockRemoved"])
        assert tuple(variant["struct_fields"]["BlockStored"]) == BLOCK_STORED_FIELDS[:fields]
        assert tuple(variant["struct_fields"]["BlockRemoved"]) == BLOCK_REMOVED_FIELDS[: declared[fields]]


def test_newest_stored_event_uses_a_map16_header():
    variant = next(v for v in VARIANTS if v["variant"].startswith("M11_"))
    batch = _expected_batch(variant["published_frames"][0]["decoded"])
    assert b"\xde\x00\x0b\xa4type" in encode_batch(batch, layout="map", fields=15)
    assert b"\x8b\xa4type" in encode_batch(batch, layout="map", fields=14)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_replay_capture_parses(variant):
    dealer = variant["replay_via_dealer"]
    assert replay_request(1) == _hex_frames(dealer["request_frames_hex"])
    published = {frame["seq"]: bytes.fromhex(frame["frames_hex"][2]) for frame in variant["published_frames"]}
    replies = [parse_replay_reply(_hex_frames(message)) for message in dealer["reply_messages_hex"]]
    assert replies[-1] == ("end",)
    assert [reply[1] for reply in replies[:-1]] == [1, 2, 3]
    for _, seq, payload in replies[:-1]:
        assert payload == published[seq]
        decode_batch(payload)


def test_replay_reply_shape_follows_the_release():
    old = next(v for v in VARIANTS if v["variant"].startswith("M7"))["replay_via_dealer"]["reply_messages_hex"]
    new = next(v for v in VARIANTS if v["variant"].startswith("M8"))["replay_via_dealer"]["reply_messages_hex"]
    assert {len(message) for message in old} == {3}
    assert {len(message) for message in new} == {4}


# --------------------------------------------------------------------------- hash forms


def _variant_batches(prefix: str) -> list[EventBatch]:
    variant = next(v for v in VARIANTS if v["variant"].startswith(prefix))
    return [decode_batch(bytes.fromhex(frame["frames_hex"][2])) for frame in variant["published_frames"]]


def _hashes(batches: list[EventBatch]) -> list:
    events = [ev for batch in batches for ev in batch.events if not isinstance(ev, AllBlocksCleared)]
    return [h for ev in events for h in ev.block_hashes]


def test_signed_hashes_are_kept_as_given():
    hashes = _hashes(_variant_batches("A0"))
    assert any(h < 0 for h in hashes)
    assert -7631615348320973721 in hashes
    assert normalize_hash(-7631615348320973721) == 2**64 - 7631615348320973721


@pytest.mark.parametrize(("ints", "raw"), [("A2_", "A2b"), ("M11_", "M11b")])
def test_bytes_hashes_are_kept_and_normalise_to_the_int_form(ints, raw):
    int_batches, bytes_batches = _variant_batches(ints), _variant_batches(raw)
    raw_hashes = _hashes(bytes_batches)
    assert raw_hashes and all(type(h) is bytes and len(h) == 32 for h in raw_hashes)
    assert [normalize_hash(h) for h in raw_hashes] == _hashes(int_batches)
    stored = bytes_batches[1].events[0]
    assert type(stored.parent_block_hash) is bytes
    assert normalize_hash(stored.parent_block_hash) == int_batches[1].events[0].parent_block_hash


# --------------------------------------------------------------------------- tolerance


def _pack(batch: list) -> bytes:
    return msgpack.packb(batch, use_bin_type=True)


def test_unknown_event_types_are_skipped_and_reported():
    payload = _pack(
        [
            1.5,
            [
                {"type": "BlockMoved", "block_hashes": [1]},
                ["BlockRemoved", [7], "GPU"],
                ["FutureEvent", 1, 2, 3],
                {"type": "AllBlocksCleared"},
                {"type": "BlockMoved"},
            ],
            2,
        ]
    )
    batch = decode_batch(payload)
    assert batch.skipped == ["BlockMoved", "FutureEvent", "BlockMoved"]
    assert batch.events == [BlockRemoved([7], "GPU"), AllBlocksCleared()]
    assert batch.data_parallel_rank == 2


def test_unknown_map_keys_and_extra_array_positions_are_ignored():
    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [5] * 4}
    stored |= {"block_size": 4, "medium": "GPU", "some_future_field": [1, {"x": b"y"}], 17: "int key"}
    array_stored = ["BlockStored", [1], None, [5] * 4, 4, None, "GPU", *([None] * 9), "future", 99]
    batch = decode_batch(_pack([2.0, [stored, array_stored, ["BlockRemoved", [1], "GPU", 0, None, None, "x"]], 0]))
    expected = BlockStored([1], None, [5] * 4, 4, medium="GPU")
    assert batch.events == [expected, expected, BlockRemoved([1], "GPU", 0)]
    assert batch.skipped == []


def test_missing_trailing_positions_and_optional_keys_are_nil():
    events = [["BlockStored", [9], 8, [1, 2], 2], {"type": "BlockRemoved", "block_hashes": [9]}]
    batch = decode_batch(_pack([3, events]))
    assert batch == EventBatch(3.0, [BlockStored([9], 8, [1, 2], 2), BlockRemoved([9])], None, [])


PLACEHOLDER_STORE = {"type": "BlockStored", "block_hashes": [1], "token_ids": [], "block_size": 0}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),
        (_pack([1.0, []]) + b"\x00", "not valid msgpack"),
        (_pack({"ts": 1.0}), "batch must be an array"),
        (_pack([1.0]), "batch must be an array"),
        (_pack(["1.0", []]), "ts must be a number"),
        (_pack([True, []]), "ts must be a number"),
        (_pack([1.0, {}]), "events must be an array"),
        (_pack([1.0, [], "0"]), "data_parallel_rank"),
        (_pack([1.0, [[]]]), "event 0: expected a non-empty array or a map"),
        (_pack([1.0, [5]]), "event 0: expected"),
        (_pack([1.0, [[1, 2]]]), "type tag must be a string"),
        (_pack([1.0, [{"block_hashes": [1]}]]), "type tag must be a string"),
        (_pack([1.0, [["BlockStored", [1], None, [1, "x"], 16]]]), "event 0 (BlockStored): token_ids"),
        (_pack([1.0, [["BlockStored", [1.5], None, [1], 16]]]), "block_hashes"),
        (_pack([1.0, [["BlockStored", [1], "p", [1], 16]]]), "parent_block_hash"),
        (_pack([1.0, [["BlockStored", [1], None, [1]]]]), "block_size must be an int"),
        (_pack([1.0, [["BlockStored", [1], None, [True], 1]]]), "token_ids"),
        (_pack([1.0, [{**PLACEHOLDER_STORE, "extra_keys": [1]}]]), "extra_keys"),
        (_pack([1.0, [{**PLACEHOLDER_STORE, "lookahead_token_ids": [[1, None]]}]]), "lookahead_token_ids"),
        (_pack([1.0, [["AllBlocksCleared"], ["BlockRemoved", [1], 5]]]), "event 1 (BlockRemoved): medium"),
        (_pack([1.0, [["BlockRemoved", None]]]), "block_hashes"),
        (_pack([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "session_id": 3, "ownership": 4}]]), "ownership"),
    ],
)
def test_malformed_payloads_raise_event_decode_error(payload, message):
    with pytest.raises(EventDecodeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decode_batch(payload)


# --------------------------------------------------------------------------- fuzzing

msgpack_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
msgpack_scalars = st.one_of(
    st.none(),
    st.booleans(),
    msgpack_ints,
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU", *BLOCK_STORED_FIELDS]),
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(
            st.one_of(st.sampled_from(["type", *BLOCK_STORED_FIELDS]), st.text(max_size=5), msgpack_ints),
            inner,
            max_size=6,
        ),
    ),
    max_leaves=16,
)
tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
plausible_events = st.one_of(
    st.builds(lambda tag, rest: [tag, *rest], tags, st.lists(msgpack_values, max_size=17)),
    st.builds(
        lambda tag, fields: {"type": tag, **fields},
        tags,
        st.dictionaries(st.sampled_from(BLOCK_STORED_FIELDS), msgpack_values, max_size=15),
    ),
    msgpack_values,
)
plausible_batches = st.one_of(
    st.tuples(st.one_of(st.floats(allow_nan=False), msgpack_values), st.lists(plausible_events, max_size=5)).map(list),
    st.tuples(
        st.one_of(st.floats(allow_nan=False), msgpack_values),
        st.lists(plausible_events, max_size=5),
        st.one_of(st.none(), st.integers(min_value=-5, max_value=5), msgpack_values),
    ).map(list),
    msgpack_values,
)


def _check_decoded_invariants(batch: EventBatch) -> None:
    """What consumers may rely on once decode_batch returned."""
    assert type(batch.ts) is float
    assert batch.data_parallel_rank is None or type(batch.data_parallel_rank) is int
    assert all(type(tag) is str for tag in batch.skipped)
    for ev in batch.events:
        if isinstance(ev, AllBlocksCleared):
            continue
        assert all(type(h) in (int, bytes) for h in ev.block_hashes)
        for name in ("medium", "locality", "ownership"):
            assert getattr(ev, name) is None or type(getattr(ev, name)) is str
        if isinstance(ev, BlockStored):
            assert all(type(t) is int for t in ev.token_ids)
            assert type(ev.block_size) is int
            assert ev.parent_block_hash is None or type(ev.parent_block_hash) in (int, bytes)


def _decode_or_decode_error(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except EventDecodeError:
        return
    _check_decoded_invariants(batch)


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(payload):
    _decode_or_decode_error(payload)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plausible_batches)
def test_fuzz_structurally_plausible_msgpack(batch):
    _decode_or_decode_error(_pack(batch))


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=300), st.data())
def test_fuzz_corrupted_golden_payloads(noise, data):
    _, frame = data.draw(st.sampled_from(FRAMES))
    payload = bytearray.fromhex(frame["frames_hex"][2])
    position = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
    payload[position : position + len(noise)] = noise
    _decode_or_decode_error(bytes(payload))


# --------------------------------------------------------------------------- encoder round trip

hashes = st.one_of(st.integers(min_value=0, max_value=2**64 - 1), st.binary(min_size=32, max_size=32))
extra_key_items = st.one_of(st.text(max_size=8), msgpack_ints, st.lists(msgpack_ints, max_size=3))
opt_str = st.one_of(st.none(), st.text(max_size=300))
opt_int = st.one_of(st.none(), st.integers(min_value=-(2**63), max_value=2**64 - 1))
stored_events = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, max_size=20),
    parent_block_hash=st.one_of(st.none(), hashes),
    token_ids=st.lists(st.integers(min_value=0, max_value=2**32), max_size=70),
    block_size=st.integers(min_value=0, max_value=2**20),
    lora_id=opt_int,
    medium=opt_str,
    lora_name=opt_str,
    extra_keys=st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(extra_key_items, max_size=3)), max_size=4)),
    group_idx=opt_int,
    kv_cache_spec_kind=opt_str,
    kv_cache_spec_sliding_window=opt_int,
    locality=opt_str,
    ownership=opt_str,
    session_id=opt_str,
    lookahead_token_ids=st.one_of(st.none(), st.lists(st.lists(msgpack_ints, max_size=3), max_size=4)),
)
removed_events = st.builds(
    BlockRemoved, st.lists(hashes, max_size=20), medium=opt_str, group_idx=opt_int, locality=opt_str, ownership=opt_str
)
batches = st.builds(
    EventBatch,
    ts=st.floats(allow_nan=False),
    events=st.lists(st.one_of(stored_events, removed_events, st.just(AllBlocksCleared())), max_size=20),
    data_parallel_rank=st.one_of(st.none(), st.integers(min_value=0, max_value=2**16)),
)
layouts = st.sampled_from([("array", n) for n in ARRAY_VARIANTS] + [("map", n) for n in MAP_VARIANTS])


def _drop_undeclared(batch: EventBatch, stored_count: int, removed_count: int) -> EventBatch:
    events = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            ev = BlockStored(*[getattr(ev, n) for n in BLOCK_STORED_FIELDS[:stored_count]])
        elif isinstance(ev, BlockRemoved):
            ev = BlockRemoved(*[getattr(ev, n) for n in BLOCK_REMOVED_FIELDS[:removed_count]])
        events.append(ev)
    return EventBatch(batch.ts, events, batch.data_parallel_rank, [])


@settings(max_examples=300, deadline=None)
@given(batches, layouts)
def test_encode_then_decode_round_trips(batch, layout):
    name, fields = layout
    removed = (ARRAY_VARIANTS if name == "array" else MAP_VARIANTS)[fields]
    batch = _drop_undeclared(batch, fields, removed)
    assert decode_batch(encode_batch(batch, layout=name, fields=fields)) == batch


def test_encoder_rejects_fields_the_layout_does_not_declare():
    batch = EventBatch(1.0, [BlockStored([1], None, [1], 1, session_id="s")], 0)
    with pytest.raises(ValueError, match="session_id"):
        encode_batch(batch, layout="map", fields=13)
    with pytest.raises(ValueError, match="declares"):
        encode_batch(batch, layout="array", fields=10)
    with pytest.raises(ValueError, match="layout"):
        encode_batch(batch, layout="json")
    assert decode_batch(encode_batch(batch, layout="map", fields=14)) == batch


def test_encoder_defaults_are_the_newest_layouts():
    batch = EventBatch(1.0, [BlockRemoved([1], "GPU")], 0)
    assert encode_batch(batch) == encode_batch(batch, layout="map", fields=15)
    assert encode_batch(batch, layout="array") == _pack([1.0, [["BlockRemoved", [1], "GPU", None]], 0])


# --------------------------------------------------------------------------- frames and replay


def test_parse_frames_requires_three_frames_and_an_8_byte_seq():
    assert parse_frames([b"t", (5).to_bytes(8, "big"), b"p"]) == (b"t", 5, b"p")
    with pytest.raises(EventDecodeError, match="3 frames"):
        parse_frames([b"", b"\x00" * 8])
    with pytest.raises(EventDecodeError, match="3 frames"):
        parse_frames([b"", b"", b"\x00" * 8, b"p"])
    with pytest.raises(EventDecodeError, match="8 bytes"):
        parse_frames([b"", b"\x00" * 7, b"p"])


def test_replay_helpers():
    assert END_SEQ == 2**64 - 1 and END_SEQ_BYTES == b"\xff" * 8
    assert replay_request(0) == [b"", b"\x00" * 8]
    with pytest.raises(ValueError):
        replay_request(-1)
    with pytest.raises(ValueError):
        replay_request(END_SEQ)
    assert parse_replay_reply([b"", b"\x00" * 7 + b"\x09", b"p"]) == ("data", 9, b"p")
    assert parse_replay_reply([b"", b"topic", b"\x00" * 7 + b"\x09", b"p"]) == ("data", 9, b"p")
    assert parse_replay_reply([b"", END_SEQ_BYTES, b""]) == ("end",)
    assert parse_replay_reply([b"", b"", END_SEQ_BYTES, b""]) == ("end",)
    for bad in ([b"x", b"\x00" * 8, b"p"], [b"", b"\x00" * 8], [b"", b"\x00" * 3, b"p"], [b"", b"", b"", b"", b""]):
        with pytest.raises(EventDecodeError):
            parse_replay_reply(bad)


# --------------------------------------------------------------------------- event helpers and plugin


def test_event_filters():
    assert is_device_medium(None) and is_device_medium("GPU") and is_device_medium("gpu")
    assert not is_device_medium("CPU") and not is_device_medium("cpu")

    def stored(**kw):
        return BlockStored([1], None, [1], 1, **kw)

    assert is_main_attention(stored())
    assert is_main_attention(stored(group_idx=0))
    assert not is_main_attention(stored(group_idx=1))
    assert is_main_attention(stored(group_idx=1, kv_cache_spec_kind="full_attention"))
    assert is_main_attention(stored(group_idx=2, kv_cache_spec_kind="mla_attention"))
    assert not is_main_attention(stored(group_idx=0, kv_cache_spec_kind="sliding_window"))
    assert not is_main_attention(stored(kv_cache_spec_kind="mamba"))
    assert is_main_attention(BlockRemoved([1], "GPU", 0)) and not is_main_attention(BlockRemoved([1], "GPU", 1))
    assert is_main_attention(BlockRemoved([1], "GPU", 1), main_groups={1})
    assert not is_main_attention(BlockRemoved([1], "GPU", 0), main_groups={1})
    assert is_main_attention(AllBlocksCleared())

    assert is_placeholder(BlockStored([1], None, [], 0, medium="CPU"))
    assert not is_placeholder(stored())
    assert not is_placeholder(BlockRemoved([1]))


def test_decoder_plugin():
    decoders = kv_builtin.register_event_decoders()
    assert decoders["vllm"]() is decode_batch
