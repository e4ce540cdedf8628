"""Property-based fuzzing of the two decoders fed by untrusted peers: the agent protocol (``llmgw.wire``) and the
KV-event frames (``llmgw.kv.codec``). Whatever arrives, the answer is a message or the decoder's own typed error:
never another exception, never a hang, never unbounded memory."""

from __future__ import annotations

import dataclasses

import msgpack
from hypothesis import HealthCheck, given, settings, strategies as st

from llmgw import wire
from llmgw.kv.codec import EventDecodeError, decode_batch, parse_frames, parse_replay_reply
from llmgw.wire import WireError

scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
           | st.binary(max_size=20))
plain = st.recursive(scalars, lambda children: st.lists(children, max_size=4)
                     | st.dictionaries(st.text(max_size=8) | st.integers(-2**63, 2**64 - 1), children, max_size=4),
                     max_leaves=20)


def field_values(cls: type) -> st.SearchStrategy[dict]:
    """Garbage (or nothing) for every field of message class ``cls``, one field at a time and all at once."""
    names = [f.name for f in dataclasses.fields(cls)]
    return st.fixed_dictionaries({}, optional={name: plain for name in names})


messages = st.sampled_from(sorted(wire.Message.TYPES)).flatmap(
    lambda name: st.tuples(st.just(name), field_values(wire.Message.TYPES[name])))


def decode_or_wire_error(frame: bytes) -> None:
    try:
        decoded = wire.decode(frame)
    except WireError:
        return
    assert isinstance(decoded, (wire.Message, wire.UnknownMessage))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
def test_wire_every_field_of_every_message_with_garbage(case):
    type_name, fields = case
    decode_or_wire_error(msgpack.packb({"v": 1, "t": type_name, **fields}, use_bin_type=True))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_wire_random_bytes(frame):
    decode_or_wire_error(frame)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.sampled_from([b"\x91", b"\x81\xa1a"]))
def test_wire_deep_nesting(depth, opening):
    frame = b"\x83\xa1v\x01\xa1t\xa8Register\xa4host" + opening * depth + b"\xc0"
    decode_or_wire_error(frame)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([b"\xdd", b"\xdf", b"\xdb", b"\xc6"]), st.integers(2**20, 2**32 - 1))
def test_wire_lengths_that_lie_do_not_allocate(marker, length):
    """An array, map, str or bin header declaring up to 4 G items in a frame of a few bytes."""
    decode_or_wire_error(b"\x83\xa1v\x01\xa1t\xa8Register\xa4host" + marker + length.to_bytes(4, "big"))


frames = st.lists(st.binary(max_size=12), max_size=6)


@settings(max_examples=1000, deadline=None)
@given(frames)
def test_event_frames_parse_or_raise_decode_errors(parts):
    for parse in (parse_frames, parse_replay_reply):
        try:
            parse(parts)
        except EventDecodeError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.sampled_from([b"\x91", b"\x92\xcb" + bytes(8)]))
def test_event_batch_deep_nesting(depth, opening):
    payload = b"\x92\xcb" + bytes(8) + opening * depth + b"\xc0"
    try:
        decode_batch(payload)
    except EventDecodeError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([b"\xdd", b"\xdf", b"\xdb", b"\xc6"]), st.integers(2**20, 2**32 - 1))
def test_event_batch_lengths_that_lie_do_not_allocate(marker, length):
    try:
        decode_batch(b"\x92\xcb" + bytes(8) + marker + length.to_bytes(4, "big"))
    except EventDecodeError:
        pass
