"""What the gateways of one cluster keep in Redis, and how each record is encoded (msgpack, checked on the way in).

Keys, all under ``llmgw:{cluster}:`` (:class:`Keys`):

- ``log``: a stream of *batches* of the shared truth's changes, written by the
  control plane alone. Each stream entry has the writer's id (``w``, new at
  every start), a batch number (``n``, one more than the writer's previous
  batch: a follower that sees a jump or another writer re-reads the snapshot),
  the writer's wall clock in ms (``t``, for the event-to-visible delay) and
  the batch (``e``: a msgpack array of entries, below).
- ``snapshot``: a pointer (``{writer, seq, meta}``) to the newest snapshot;
  its ``meta`` key holds the declarations, the replicas and, per replica, its
  KV state and the key of the part holding its block keys. A follower starts
  from the snapshot and reads the log after the snapshot's stream id.
- ``load``: a stream of each gateway's own in-flight load (``o`` origin,
  ``x`` its time to live in ms, ``l`` the load), the newest per origin wins.
- ``requests``: a stream of the gateways' asks to the control plane (a KV
  resync of a replica whose index drifted).
- ``learn``: a stream of the predictions each gateway's tiers make (``o``
  origin, ``e`` a batch: an array of ``[replica, made_ms, ttl_ms, [keys...]]``,
  ``made_ms`` the origin's wall clock when it predicted; :func:`decode_learn_batch`).

Entries of a batch (msgpack arrays, the kind first):

``["model", source, name, routing, routing_options, model_path, [[adapter, path]...], [engine args]]``,
``["unmodel", source, name]``, ``["add", replica]`` (a :class:`ReplicaRecord` as an array),
``["drain", name, reason]``, ``["remove", name]``,
``["kv", replica, kind, block_size, [stored...], [removed...], reason]``, ``["kv_forget", replica]``,
``["kv_drop", replica]``.

With a cluster secret (``state.secret_env``) every record is signed (HMAC-SHA256:
a log batch, a load report, an ask, a snapshot's meta, whose parts are named by
their SHA-256) and a gateway applies only what carries the right signature,
so whoever can write to Redis can no longer steer routing or point a replica
(and its API key) elsewhere. Without one Redis is trusted with the cluster's
routing state (it holds no secret: API keys and TLS files stay in each
gateway's own config). Either way what comes back is checked: sizes are
bounded by the decoder, types by :func:`decode_entry`, and a record that fails
is a :class:`RecordError` (counted and skipped, or a snapshot re-read), never
an exception that stops a gateway.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Sequence

import msgpack

from ..kv.changes import BlockChanges, KvChangeKind
from ..router.model import LoraRef, TierModel

MODEL, UNMODEL, ADD, DRAIN, REMOVE = "model", "unmodel", "add", "drain", "remove"
KV, KV_FORGET, KV_DROP = "kv", "kv_forget", "kv_drop"
ENTRY_KINDS = (MODEL, UNMODEL, ADD, DRAIN, REMOVE, KV, KV_FORGET, KV_DROP)

MAX_RECORD_BYTES = 512 * 1024 * 1024  # Redis's own limit of one value
MAX_ARRAY = 50_000_000  # block keys of one replica's snapshot part, or of one batch
MAX_NAME = 1024  # replica, model and source names, reasons
MAX_LEARNED = 100_000  # predictions in one learn batch
MAX_LEARNED_TTL_MS = 600_000  # a prediction's time to live, at most
MAX_WALL_MS = 1 << 53  # a wall clock in ms (year 287 396)
INT64 = (-(1 << 63), (1 << 64) - 1)  # block keys are signed or unsigned 64-bit ints


class RecordError(ValueError):
    """A record read from Redis that is not what a gateway of this version writes."""


@dataclass(frozen=True)
class Keys:
    """The Redis keys of one cluster."""

    cluster: str

    @property
    def prefix(self) -> str:
        return f"llmgw:{self.cluster}:"

    @property
    def log(self) -> str:
        return self.prefix + "log"

    @property
    def snapshot(self) -> str:
        return self.prefix + "snapshot"

    @property
    def load(self) -> str:
        return self.prefix + "load"

    @property
    def requests(self) -> str:
        return self.prefix + "requests"

    @property
    def tiers(self) -> str:
        return self.prefix + "tiers"

    @property
    def learn(self) -> str:
        return self.prefix + "learn"

    @property
    def nodes(self) -> str:
        return self.prefix + "nodes"

    @property
    def leader(self) -> str:
        return self.prefix + "leader"

    @property
    def leader_generation(self) -> str:
        return self.prefix + "leader:generation"

    def snapshot_part(self, writer: str, seq: int, part: str) -> str:
        return f"{self.prefix}snap:{writer}:{seq}:{part}"


@dataclass(frozen=True)
class ReplicaRecord:
    """A replica as the cluster knows it: no secret (its API key and TLS come from each gateway's config)."""

    name: str
    model: str
    url: str
    source: str
    weight: int = 1
    labels: dict[str, str] = field(default_factory=dict)
    engine_id: str = ""  # the engine behind it (Replica.engine_id): learnt speed and shared observations key on it

    def as_array(self) -> list[Any]:
        return [self.name, self.model, self.url, self.source, self.weight, self.labels, self.engine_id]

    @classmethod
    def from_array(cls, value: Any) -> "ReplicaRecord":
        items = _array(value, 7, "replica")
        labels = items[5]
        if not isinstance(labels, dict) or len(labels) > 64 or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_NAME and len(v) <= MAX_NAME
                for k, v in labels.items()):
            raise RecordError("replica labels must be a map of at most 64 short strings")
        weight = items[4]
        if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= 1000:
            raise RecordError("replica weight must be an int from 1 to 1000")
        return cls(_name(items[0]), _name(items[1]), _text(items[2], 4096), _name(items[3]), weight, dict(labels),
                   _name(items[6]))


# -- encoding -------------------------------------------------------------------------------------------------------

def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack(raw: object) -> Any:
    """Decode one msgpack value within the size bounds; :class:`RecordError` for anything else."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise RecordError(f"expected bytes, got {type(raw).__name__}")
    if len(raw) > MAX_RECORD_BYTES:
        raise RecordError("record too large")
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False,
                               max_str_len=1 << 20, max_bin_len=1 << 20, max_array_len=MAX_ARRAY,
                               max_map_len=1 << 20, max_ext_len=0)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise RecordError(f"not a msgpack record: {type(exc).__name__}") from None


def model_entry(source: str, model: TierModel) -> list[Any]:
    return [MODEL, source, model.name, model.routing, dict(model.routing_options), model.model_path,
            [[a.name, a.path] for a in model.lora_adapters], list(model.engine_args)]


def kv_entry(replica_id: str, changes: Any) -> list[Any]:
    """``changes``: anything with :class:`~llmgw.kv.changes.ChangesFields`."""
    return [KV, replica_id, changes.kind.value, changes.block_size, list(changes.stored), list(changes.removed),
            changes.reason or ""]


# -- decoding -------------------------------------------------------------------------------------------------------

def decode_batch(raw: object) -> list[list[Any]]:
    """A log batch's entries, each checked by :func:`decode_entry` (the first bad one raises)."""
    value = unpack(raw)
    if not isinstance(value, list):
        raise RecordError("a batch must be an array of entries")
    return [decode_entry(entry) for entry in value]


def decode_entry(value: Any) -> list[Any]:
    """One entry checked and normalised: names are short strings, block keys 64-bit ints, models TierModels."""
    if not isinstance(value, list) or not value or value[0] not in ENTRY_KINDS:
        raise RecordError("an entry must be an array starting with a known kind")
    kind = value[0]
    if kind == MODEL:
        items = _array(value, 8, kind)
        options = items[4]
        if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
            raise RecordError("routing_options must be a map with string keys")
        adapters = items[6]
        if not isinstance(adapters, list) or len(adapters) > 10_000:
            raise RecordError("lora adapters must be an array")
        lora = tuple(LoraRef(_name(a[0]), _text(a[1], 4096)) for a in (_array(a, 2, "adapter") for a in adapters))
        args = items[7]
        if not isinstance(args, list) or len(args) > 10_000 or not all(isinstance(a, str) for a in args):
            raise RecordError("engine args must be an array of strings")
        path = items[5]
        if path is not None:
            path = _text(path, 4096)
        return [MODEL, _name(items[1]), TierModel(_name(items[2]), _name(items[3]), options, path, lora, tuple(args))]
    if kind == UNMODEL:
        items = _array(value, 3, kind)
        return [kind, _name(items[1]), _name(items[2])]
    if kind == ADD:
        return [kind, ReplicaRecord.from_array(_array(value, 2, kind)[1])]
    if kind == DRAIN:
        items = _array(value, 3, kind)
        return [kind, _name(items[1]), _text(items[2], MAX_NAME)]
    if kind in (REMOVE, KV_FORGET, KV_DROP):
        return [kind, _name(_array(value, 2, kind)[1])]
    items = _array(value, 7, kind)  # KV
    block_size = items[3]
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 0 <= block_size <= 1 << 20:
        raise RecordError("block_size must be an int from 0 to 2**20")
    return [kind, _name(items[1]), BlockChanges(KvChangeKind(_name(items[2])), block_size, _keys(items[4]),
                                                _keys(items[5]), _text(items[6], MAX_NAME))]


def _array(value: Any, length: int, what: str) -> list[Any]:
    if not isinstance(value, list) or len(value) != length:
        raise RecordError(f"{what}: expected an array of {length}")
    return value


def _text(value: Any, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise RecordError(f"expected a string of at most {limit} characters")
    return value


def _name(value: Any) -> str:
    return _text(value, MAX_NAME)


def _keys(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise RecordError("block keys must be an array")
    low, high = INT64
    for key in value:
        if type(key) is not int or not low <= key <= high:
            raise RecordError("block keys must be 64-bit ints")
    return value


class LearnedPrediction(NamedTuple):
    """One prediction of another gateway: ``replica`` holds ``keys`` for ``ttl_ms`` from ``made_ms`` (its clock)."""

    replica: str
    made_ms: int
    ttl_ms: int
    keys: list[int]


def learn_item(replica_id: str, made_ms: int, ttl_ms: int, keys: Sequence[int]) -> list[Any]:
    """One prediction of a learn batch, as :func:`decode_learn_batch` reads it back."""
    return [replica_id, made_ms, ttl_ms, keys if isinstance(keys, list) else list(keys)]


def decode_learn_batch(raw: object) -> list[LearnedPrediction]:
    """A learn batch (``pack([learn_item(...), ...])``) checked: names short strings, times bounded ints, block
    keys 64-bit ints; :class:`RecordError` for anything else."""
    value = unpack(raw)
    if not isinstance(value, list) or len(value) > MAX_LEARNED:
        raise RecordError(f"a learn batch must be an array of at most {MAX_LEARNED} predictions")
    predictions = []
    for item in value:
        replica, made_ms, ttl_ms, keys = _array(item, 4, "prediction")
        predictions.append(LearnedPrediction(_name(replica), _int(made_ms, 0, MAX_WALL_MS),
                                             _int(ttl_ms, 0, MAX_LEARNED_TTL_MS), _keys(keys)))
    return predictions


MAX_TIER_ITEMS = 10_000  # tier learning items in one batch
MAX_TIER_TEXT = 65_536  # characters of one string in a tier's payload (a routed prompt prefix)
MAX_TIER_PAYLOAD = 16  # values in one payload


def decode_tier_batch(raw: object) -> list[tuple[str, str, list[Any]]]:
    """A tiers batch: ``[[model, kind, payload], ...]`` with payloads of at most ``MAX_TIER_PAYLOAD`` scalars
    (strings of at most ``MAX_TIER_TEXT`` characters, ints, floats, booleans, None); :class:`RecordError` else."""
    value = unpack(raw)
    if not isinstance(value, list) or len(value) > MAX_TIER_ITEMS:
        raise RecordError(f"a tiers batch must be an array of at most {MAX_TIER_ITEMS} items")
    items = []
    for item in value:
        model, kind, payload = _array(item, 3, "tier item")
        if not isinstance(payload, list) or len(payload) > MAX_TIER_PAYLOAD or not all(
                x is None or isinstance(x, (bool, int, float)) or (isinstance(x, str) and len(x) <= MAX_TIER_TEXT)
                for x in payload):
            raise RecordError("a tier payload is an array of a few scalars")
        items.append((_name(model), _name(kind), payload))
    return items


def _int(value: Any, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise RecordError(f"expected an int from {low} to {high}")
    return value


def decode_keys(raw: object) -> list[int]:
    """A snapshot part: one replica's block keys."""
    return _keys(unpack(raw))


# Per replica: in-flight requests, their prompt tokens, queued prefill tokens, queued requests, and how long ago (ms)
# the oldest of those was routed.
LOAD_FIGURES = 5
MAX_REPLICAS_PER_REPORT = 100_000
Load = dict[str, tuple[int, ...]]


def decode_load_report(fields: dict[str, Any]) -> tuple[str, float, Load]:
    """A ``load`` stream entry's ``(origin, ttl in s, {replica: figures})``: ``o`` the origin, ``x`` its time to
    live in ms (at most 600 s), ``l`` an array of ``[name, requests, tokens, queued tokens, queued requests,
    ms since the oldest queued request was routed]``."""
    try:
        origin = fields["o"].decode()[:64]
        ttl = min(max(int(fields["x"]), 0) / 1000, 600.0)
    except (KeyError, ValueError, TypeError, AttributeError, UnicodeDecodeError):
        raise RecordError("a load report needs an origin (o) and a time to live in ms (x)") from None
    items = unpack(fields.get("l"))
    if not isinstance(items, list) or len(items) > MAX_REPLICAS_PER_REPORT:
        raise RecordError(f"a load report is an array of at most {MAX_REPLICAS_PER_REPORT} replicas")
    load: Load = {}
    for item in items:
        if not isinstance(item, list) or len(item) != 1 + LOAD_FIGURES or not isinstance(item[0], str) \
                or len(item[0]) > MAX_NAME or not all(type(n) is int for n in item[1:]):
            raise RecordError("a load entry is [name, requests, tokens, queued tokens, queued requests, queued ms]")
        load[item[0]] = tuple(max(0, min(n, 1 << 40)) for n in item[1:])
    return origin, ttl, load


class Signer:
    """Signs and checks records with the cluster secret; without one, signs with nothing and accepts all."""

    def __init__(self, secret: bytes | None):
        self.secret = secret or None

    def sign(self, *parts: bytes) -> bytes:
        if self.secret is None:
            return b""
        digest = hmac.new(self.secret, digestmod=hashlib.sha256)
        for part in parts:
            digest.update(len(part).to_bytes(8, "big"))  # lengths first: no two splits of the bytes sign alike
            digest.update(part)
        return digest.digest()

    def valid(self, signature: object, *parts: bytes) -> bool:
        if self.secret is None:
            return True
        return isinstance(signature, bytes) and hmac.compare_digest(signature, self.sign(*parts))


def continuation(writer: str, seq: int) -> bytes:
    """A new writer's first batch says whose log, up to which batch, its state continues (field ``c``)."""
    return f"{writer} {seq}".encode()


def part_digest(raw: bytes) -> str:
    """How a snapshot's meta names a part's content."""
    return hashlib.sha256(raw).hexdigest()


def entry_id(identifier: str | bytes) -> bytes:
    """A stream entry's id as bytes, whichever way the client decoded it."""
    return identifier.encode() if isinstance(identifier, str) else identifier


def iter_fields(fields: Any) -> Iterator[tuple[str, bytes]]:
    """A stream entry's fields as ``(name, value)`` (coredis gives bytes names with ``decode_responses=False``)."""
    for name, value in fields.items():
        yield (name.decode("latin-1") if isinstance(name, bytes) else str(name)), value
