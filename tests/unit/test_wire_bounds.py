"""The wire decoder's cost is bounded by the frame's size (issue 18, finding 2).

Any frame of N bytes is either a message or a :class:`WireError` (never another exception), and decoding it
allocates at most ``K * N + C`` bytes at its peak (traced with ``tracemalloc``: msgpack's C allocations go
through Python's allocator). Before the bound, a Register whose ``gpus`` list held empty maps cost ~560 bytes
per byte of frame: each empty map became a whole default GpuInfo.
"""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from llmgw import wire
from llmgw.bench.agent_socket import hostile_register
from llmgw.wire.messages import BYTES_PER_CONTAINER, CONTAINERS_BASE

K = 64  # bytes of memory per byte of frame, at most (a negative fixint is 1 byte and a 28-byte int in a list)
C = 128 * 1024  # and a constant: the containers every frame may hold, as default records


def peak_of_decode(frame: bytes) -> tuple[int, object]:
    """Peak bytes allocated while decoding ``frame``, and what it gave (a message or the WireError)."""
    tracemalloc.start()
    try:
        result: object = wire.decode(frame)
    except wire.WireError as exc:
        result = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, result


@pytest.fixture(autouse=True, scope="module")
def warm() -> None:
    for cls in wire.Message.TYPES.values():  # type hints are read once per class: not a frame's cost
        wire.decode(wire.encode(cls()))


def with_field(type_name: str, name: str, raw_value: bytes) -> bytes:
    """A frame ``{"v": 1, "t": type_name, name: <raw_value>}`` with ``raw_value`` as msgpack bytes."""
    return b"\x83" + msgpack.packb("v") + b"\x01" + msgpack.packb("t") + msgpack.packb(type_name) \
        + msgpack.packb(name) + raw_value


def array_of(items: list[bytes]) -> bytes:
    return b"\xdd" + len(items).to_bytes(4, "big") + b"".join(items)


# Values msgpack encodes in one or a few bytes that become the largest objects: empty maps and arrays, negative
# fixints (28-byte ints), floats, and maps and arrays nested in them.
SMALL_HOSTILE = st.sampled_from([b"\x80", b"\x90", b"\xe0", b"\xc0", b"\xc3", b"\xa0", b"\xca\x00\x00\x00\x00",
                                 b"\x81\xa0\x80", b"\x91\x80", b"\x81\xa5index\x01"])
FIELDS = st.sampled_from([("Register", "gpus"), ("Register", "shards"), ("Register", "fabrics"),
                          ("Register", "features"), ("Register", "labels"), ("KvChanges", "stored"),
                          ("ShardStatus", "shard"), ("Heartbeat", "gpu_utilization"), ("Teleport", "anything")])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FIELDS, st.lists(SMALL_HOSTILE, min_size=1, max_size=64), st.integers(16_384, 200_000))
def test_hostile_containers_cost_at_most_k_bytes_per_byte(field, items, count):
    frame = with_field(*field, array_of((items * (count // len(items) + 1))[:count]))
    peak, result = peak_of_decode(frame)
    assert isinstance(result, (wire.WireError, wire.Message, wire.UnknownMessage))
    assert peak <= K * len(frame) + C, f"{peak} bytes for a frame of {len(frame)}"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096))
def test_any_bytes_decode_to_a_message_or_a_wire_error_within_the_bound(frame):
    peak, result = peak_of_decode(frame)
    assert isinstance(result, (wire.WireError, wire.Message, wire.UnknownMessage))
    assert peak <= K * len(frame) + C


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=2048), st.sampled_from(sorted(wire.Message.TYPES)))
def test_bytes_after_a_valid_head_decode_or_fail_within_the_bound(tail, type_name):
    frame = with_field(type_name, "gpus", tail)
    peak, result = peak_of_decode(frame)
    assert isinstance(result, (wire.WireError, wire.Message, wire.UnknownMessage))
    assert peak <= K * len(frame) + C


@pytest.mark.parametrize("size", [64 * 1024, 1024 * 1024])
def test_the_issues_frame_is_refused_for_its_containers(size):
    frame = hostile_register(size)
    peak, result = peak_of_decode(frame)
    assert isinstance(result, wire.WireError) and "maps and arrays" in str(result)
    assert peak <= K * len(frame) + C


def test_a_frame_holds_at_most_its_budget_of_containers():
    budget = CONTAINERS_BASE + 10_000 // BYTES_PER_CONTAINER
    padded = msgpack.packb({"v": 1, "t": "Register", "hostname": "x" * 10_000,
                            "gpus": [{}] * (budget - 2)})
    assert len(wire.decode(padded).gpus) == budget - 2
    over = msgpack.packb({"v": 1, "t": "Register", "hostname": "x" * 10_000, "gpus": [{}] * (budget + 100)})
    with pytest.raises(wire.WireError, match="maps and arrays"):
        wire.decode(over)


def test_a_large_real_register_fits_the_first_frame_limit_and_its_budget():
    from llmgw.agent.discovery import discover
    from llmgw.wire.channel import MAX_REGISTER_BYTES

    register = discover("fixture:tests/fixtures/nodes/dgx-h100-8gpu.json", node_id="n" * 63, address="10.0.0.1")
    register.gpus = register.gpus * 2  # 16 GPUs
    register.shards = [wire.ShardReport(shard_id=f"profile-g{i}-r0-s0", replica_id=f"profile-g{i}-r0",
                                        endpoint=f"http://10.0.0.1:{40000 + i}", fingerprint="f" * 64,
                                        gpu_indices=[i % 16], model="org/model-70b", placement_proof="p" * 64)
                       for i in range(112)]  # 16 GPUs, 7 MIG slices each
    frame = wire.encode(register)
    assert len(frame) <= MAX_REGISTER_BYTES
    assert wire.decode(frame) == register


def test_extension_types_and_long_maps_are_refused():
    with pytest.raises(wire.WireError):
        wire.decode(with_field("Register", "hostname", b"\xd6\xff\x00\x00\x00\x01"))  # a msgpack timestamp
    with pytest.raises(wire.WireError, match="max_map_len"):
        wire.decode(msgpack.packb({"v": 1, "t": "Register", "labels": {str(i): "" for i in range(5000)}}))
