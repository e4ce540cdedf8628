"""vLLM KV-event payloads and ZMQ frames: decode every release's layout, encode any of them byte-exactly.

Payload (``docs/vllm-notes.md`` section 2): a msgpack array
``[ts, events]`` (0.9.0) or ``[ts, events, dp_rank]`` (0.9.1+). Events are
arrays ``[tag, field1, ...]`` with every declared field present up to 0.23,
and maps ``{"type": tag, ...}`` omitting None optional fields from 0.24.
Fields were only ever appended, so the decoder names array fields by position
and ignores extra positions and unknown map keys. Unknown event tags are
skipped and reported in :attr:`EventBatch.skipped`. Anything else that is not
a valid payload raises :class:`EventDecodeError`, and nothing else.

Live frames are ``[topic, seq (8 bytes big-endian), payload]``; replay replies
as a DEALER receives them are ``[b"", seq, payload]`` (0.9-0.25) or
``[b"", topic, seq, payload]`` (0.26+), ended by a message whose seq is
:data:`END_SEQ`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent

BLOCK_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
BLOCK_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
# Fields without a default: always written in the map layout, even when None.
BLOCK_STORED_REQUIRED = frozenset(BLOCK_STORED_FIELDS[:7])
BLOCK_REMOVED_REQUIRED = frozenset(BLOCK_REMOVED_FIELDS[:2])

# Declared BlockStored field count of each release layout -> declared BlockRemoved field count.
ARRAY_VARIANTS = {5: 1, 6: 2, 7: 2, 8: 2, 9: 3, 11: 3}  # A0/A1, A2, A3, A4, A5, A6
MAP_VARIANTS = {11: 3, 12: 4, 13: 5, 14: 5, 15: 5}  # M7, M8, M9, M10, M11

END_SEQ = 0xFFFF_FFFF_FFFF_FFFF  # replay end marker: -1 as a signed 8-byte big-endian int
END_SEQ_BYTES = END_SEQ.to_bytes(8, "big")


class EventDecodeError(ValueError):
    """A frame or payload that is not a valid vLLM KV-event message."""


# --------------------------------------------------------------------------- decoding

_NONE: type = type(None)
_INT_ONLY = frozenset({int})
_HASH_TYPES = frozenset({int, bytes})
_OPT_HASH = frozenset({int, bytes, _NONE})
_OPT_INT = frozenset({int, _NONE})
_OPT_STR = frozenset({str, _NONE})
_OPT_LIST = frozenset({list, _NONE})


def _is_hash_list(value: object) -> bool:
    return type(value) is list and set(map(type, value)) <= _HASH_TYPES


def _is_int_list(value: object) -> bool:
    return type(value) is list and set(map(type, value)) <= _INT_ONLY


def _is_opt_extra_keys(value: object) -> bool:
    return value is None or (type(value) is list and set(map(type, value)) <= _OPT_LIST)


def _is_opt_int_lists(value: object) -> bool:
    return value is None or (type(value) is list and all(map(_is_int_list, value)))


_Rule = tuple[Callable[[object], bool], str]


def _type_rule(allowed: frozenset[type], expected: str) -> _Rule:
    return (lambda value: type(value) in allowed, expected)


# Per declared field: (is the value valid?, what it should have been). Only used to name the culprit.
_HASHES_RULE: _Rule = (_is_hash_list, "a list of int or bytes hashes")
_OPT_INT_RULE = _type_rule(_OPT_INT, "an int or nil")
_OPT_STR_RULE = _type_rule(_OPT_STR, "a string or nil")
_STORED_RULES: tuple[_Rule, ...] = (
    _HASHES_RULE,
    _type_rule(_OPT_HASH, "an int or bytes hash or nil"),
    (_is_int_list, "a list of ints"),
    _type_rule(_INT_ONLY, "an int"),
    _OPT_INT_RULE,  # lora_id
    _OPT_STR_RULE,  # medium
    _OPT_STR_RULE,  # lora_name
    (_is_opt_extra_keys, "nil or a list of (nil or list) per block"),
    _OPT_INT_RULE,  # group_idx
    _OPT_STR_RULE,  # kv_cache_spec_kind
    _OPT_INT_RULE,  # kv_cache_spec_sliding_window
    _OPT_STR_RULE,  # locality
    _OPT_STR_RULE,  # ownership
    _OPT_STR_RULE,  # session_id
    (_is_opt_int_lists, "nil or a list of lists of ints"),
)
_REMOVED_RULES: tuple[_Rule, ...] = (_HASHES_RULE, _OPT_STR_RULE, _OPT_INT_RULE, _OPT_STR_RULE, _OPT_STR_RULE)


def _field_error(values: list[Any], rules: tuple[_Rule, ...], names: tuple[str, ...], index: int) -> EventDecodeError:
    tag = "BlockStored" if names is BLOCK_STORED_FIELDS else "BlockRemoved"
    for (valid, expected), value, name in zip(rules, values, names):
        if not valid(value):
            return EventDecodeError(f"event {index} ({tag}): {name} must be {expected}, got {_describe(value)}")
    raise AssertionError("no invalid field found")  # pragma: no cover - callers found one


def _stored_from_values(v: list[Any], index: int) -> BlockStored:
    # One fused check on the hot path; _field_error names the culprit only when it fails.
    if (
        _is_hash_list(v[0])
        and type(v[1]) in _OPT_HASH
        and _is_int_list(v[2])
        and type(v[3]) is int
        and {type(v[4]), type(v[8]), type(v[10])} <= _OPT_INT
        and {type(v[5]), type(v[6]), type(v[9]), type(v[11]), type(v[12]), type(v[13])} <= _OPT_STR
        and _is_opt_extra_keys(v[7])
        and _is_opt_int_lists(v[14])
    ):
        return BlockStored(*v)
    raise _field_error(v, _STORED_RULES, BLOCK_STORED_FIELDS, index)


def _removed_from_values(v: list[Any], index: int) -> BlockRemoved:
    if _is_hash_list(v[0]) and type(v[2]) in _OPT_INT and {type(v[1]), type(v[3]), type(v[4])} <= _OPT_STR:
        return BlockRemoved(*v)
    raise _field_error(v, _REMOVED_RULES, BLOCK_REMOVED_FIELDS, index)


def _cleared_from_values(v: list[Any], index: int) -> AllBlocksCleared:
    return AllBlocksCleared()


# tag -> (declared fields, builder)
_EVENT_TYPES: dict[str, tuple[tuple[str, ...], Callable[[list[Any], int], KVEvent]]] = {
    "BlockStored": (BLOCK_STORED_FIELDS, _stored_from_values),
    "BlockRemoved": (BLOCK_REMOVED_FIELDS, _removed_from_values),
    "AllBlocksCleared": ((), _cleared_from_values),
}


def _decode_event(raw: object, index: int, skipped: list[str]) -> KVEvent | None:
    if type(raw) is dict:
        tag = raw.get("type")
    elif type(raw) is list and raw:
        tag = raw[0]
    else:
        raise EventDecodeError(f"event {index}: expected a non-empty array or a map, got {_describe(raw)}")
    if type(tag) is not str:
        raise EventDecodeError(f"event {index}: the event type tag must be a string, got {type(tag).__name__}")
    known = _EVENT_TYPES.get(tag)
    if known is None:
        skipped.append(tag)
        return None
    names, build = known
    if type(raw) is dict:
        values = list(map(raw.get, names))
    else:
        values = raw[1 : len(names) + 1]
        values += [None] * (len(names) - len(values))
    return build(values, index)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one KV-event payload of any vLLM release (0.9.0 - 0.34.0)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise EventDecodeError(f"payload is not valid msgpack: {type(exc).__name__}: {exc}") from exc
    if type(raw) is not list or len(raw) < 2:
        raise EventDecodeError(f"batch must be an array [ts, events, dp_rank?], got {_describe(raw)}")
    ts, raw_events = raw[0], raw[1]
    if type(ts) is int:
        ts = float(ts)
    elif type(ts) is not float:
        raise EventDecodeError(f"batch: ts must be a number, got {type(ts).__name__}")
    if type(raw_events) is not list:
        raise EventDecodeError(f"batch: events must be an array, got {type(raw_events).__name__}")
    rank = raw[2] if len(raw) > 2 else None
    if rank is not None and type(rank) is not int:
        raise EventDecodeError(f"batch: data_parallel_rank must be an int or nil, got {type(rank).__name__}")
    events: list[KVEvent] = []
    skipped: list[str] = []
    for index, raw_event in enumerate(raw_events):
        event = _decode_event(raw_event, index, skipped)
        if event is not None:
            events.append(event)
    return EventBatch(ts, events, rank, skipped)


def _describe(value: object) -> str:
    if type(value) is not list:
        return type(value).__name__
    if not value:
        return "an empty array"
    return f"an array of {len(value)} holding {', '.join(sorted({type(item).__name__ for item in value}))}"


# --------------------------------------------------------------------------- frames and replay


def _seq(frame: bytes, where: str) -> int:
    if len(frame) != 8:
        raise EventDecodeError(f"{where}: the sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def parse_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """``[topic, seq, payload]`` of a live message -> ``(topic, seq, payload)``."""
    if len(frames) != 3:
        raise EventDecodeError(f"a KV-event message has 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    return bytes(topic), _seq(seq, "live message"), bytes(payload)


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to replay every buffered batch from ``start_seq`` on."""
    if not 0 <= start_seq < END_SEQ:
        raise ValueError(f"replay start sequence must be in [0, 2**64 - 1), got {start_seq}")
    return [b"", start_seq.to_bytes(8, "big")]


def parse_replay_reply(frames: Sequence[bytes]) -> tuple[str, int, bytes] | tuple[str]:
    """One replay reply as a DEALER receives it -> ``("data", seq, payload)`` or ``("end",)``.

    Accepts ``[b"", seq, payload]`` (0.9-0.25) and ``[b"", topic, seq, payload]`` (0.26+).
    """
    if len(frames) not in (3, 4) or len(frames[0]) != 0:
        shape = [len(frame) for frame in frames]
        raise EventDecodeError(
            f"a replay reply as a DEALER receives it is [b'', (topic,) seq, payload]; got frames of lengths {shape}"
        )
    seq = _seq(frames[-2], "replay reply")
    if seq == END_SEQ:
        return ("end",)
    return ("data", seq, bytes(frames[-1]))


# --------------------------------------------------------------------------- encoding

_TAGS = {BlockStored: "BlockStored", BlockRemoved: "BlockRemoved", AllBlocksCleared: "AllBlocksCleared"}
_PACKED_KEYS = {name: msgpack.packb(name) for name in ("type", *BLOCK_STORED_FIELDS, *BLOCK_REMOVED_FIELDS)}
_Pack = Callable[[object], bytes]


def _array_head(length: int) -> bytes:
    if length < 16:
        return bytes((0x90 | length,))
    if length < 1 << 16:
        return b"\xdc" + length.to_bytes(2, "big")
    return b"\xdd" + length.to_bytes(4, "big")


def _map_head(entries: int, declared: int) -> bytes:
    # msgspec sizes the header by the struct's maximum entry count (declared fields + the tag).
    if declared + 1 < 16:
        return bytes((0x80 | entries,))
    return b"\xde" + entries.to_bytes(2, "big")


def _event_fields(event: KVEvent, stored_count: int, removed_count: int) -> tuple[str, tuple[str, ...], list[Any]]:
    """The event's tag, its declared field names in this variant, and their values."""
    tag = _TAGS.get(type(event))
    if tag is None:
        raise TypeError(f"cannot encode {type(event).__name__} as a KV event")
    all_names: tuple[str, ...]
    if isinstance(event, BlockStored):
        all_names, count = BLOCK_STORED_FIELDS, stored_count
    elif isinstance(event, BlockRemoved):
        all_names, count = BLOCK_REMOVED_FIELDS, removed_count
    else:
        return tag, (), []
    values = [getattr(event, name) for name in all_names]
    for name, value in zip(all_names[count:], values[count:]):
        if value is not None:
            raise ValueError(f"{tag}.{name} is set but the chosen layout declares only {count} fields")
    return tag, all_names[:count], values[:count]


def _encode_array_event(pack: _Pack, event: KVEvent, stored_count: int, removed_count: int) -> bytes:
    tag, _, values = _event_fields(event, stored_count, removed_count)
    return pack([tag, *values])


def _encode_map_event(pack: _Pack, event: KVEvent, stored_count: int, removed_count: int) -> bytes:
    tag, names, values = _event_fields(event, stored_count, removed_count)
    required = BLOCK_STORED_REQUIRED if isinstance(event, BlockStored) else BLOCK_REMOVED_REQUIRED
    entries = [_PACKED_KEYS["type"], pack(tag)]
    for name, value in zip(names, values):
        if value is not None or name in required:
            entries += (_PACKED_KEYS[name], pack(value))
    return _map_head(len(entries) // 2, len(names)) + b"".join(entries)


def encode_batch(batch: EventBatch, *, layout: str = "map", fields: int | None = None) -> bytes:
    """Encode ``batch`` exactly as the vLLM release layout chosen would publish it.

    ``layout="array"`` (0.9-0.23): every declared field present, trailing nils
    included; ``fields`` is BlockStored's declared count, one of 5, 6, 7, 8, 9,
    11 (default 11, 0.22-0.23). ``layout="map"`` (0.24+): ``"type"`` first,
    declared fields in order, optional ones omitted when None; ``fields`` is one
    of 11-15 (default 15, 0.33+). BlockRemoved's field count follows the same
    release. A batch whose ``data_parallel_rank`` is None is written as
    ``[ts, events]`` (0.9.0). Setting a field the layout does not declare is a
    ValueError rather than silent data loss.
    """
    if layout == "array":
        variants, default, encode_event = ARRAY_VARIANTS, 11, _encode_array_event
    elif layout == "map":
        variants, default, encode_event = MAP_VARIANTS, 15, _encode_map_event
    else:
        raise ValueError(f"layout must be 'array' or 'map', got {layout!r}")
    stored_count = default if fields is None else fields
    if stored_count not in variants:
        raise ValueError(f"a {layout} layout declares {sorted(variants)} BlockStored fields, not {stored_count}")
    removed_count = variants[stored_count]
    pack = msgpack.Packer(use_bin_type=True).pack  # one per call: a Packer is not thread-safe
    parts = [_array_head(2 if batch.data_parallel_rank is None else 3), pack(float(batch.ts))]
    parts.append(_array_head(len(batch.events)))
    parts += (encode_event(pack, event, stored_count, removed_count) for event in batch.events)
    if batch.data_parallel_rank is not None:
        parts.append(pack(batch.data_parallel_rank))
    return b"".join(parts)
