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
  ``x`` its time to live in ms, ``l`` the load; ``q`` the requests its overload
  control holds per model, signed apart in ``t``: :func:`decode_load_queued`),
  the newest per origin wins.
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

import enum
import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterator, NamedTuple, Sequence

import msgpack

from ..kv.changes import BlockChanges, KvChangeKind
from ..router.model import LoraRef, TierModel

MODEL, UNMODEL, ADD, DRAIN, REMOVE = "model", "unmodel", "add", "drain", "remove"
KV, KV_FORGET, KV_DROP = "kv", "kv_forget", "kv_drop"
ENTRY_KINDS = (MODEL, UNMODEL, ADD, DRAIN, REMOVE, KV, KV_FORGET, KV_DROP)

MAX_RECORD_BYTES = 512 * 1024 * 1024  # Redis's own limit of one value
LOG_BATCH_BYTES = 32 * 1024 * 1024  # a log batch a writer writes, at most (an entry larger alone: no reader takes it)
MAX_ARRAY = 50_000_000  # block keys of one replica's snapshot part, or of one batch
MAX_NAME = 1024  # replica, model and source names, reasons
# What one sender of the learn stream buffers between two sends (llmgw.cluster.learn): a batch holds no more.
LEARN_MAX_PREDICTIONS = 4096
LEARN_MAX_KEYS = 262_144
LEARN_MAX_BYTES = LEARN_MAX_KEYS * 9 + LEARN_MAX_PREDICTIONS * (4 * MAX_NAME + 32) + 16  # msgpack, at most
MAX_LEARNED_TTL_MS = 600_000  # a prediction's time to live as a sender writes it, at most
MAX_REPLICA_FIGURE = 1 << 40  # a token count in a load report
MAX_QUEUED_MS = 600_000  # the age of a load report's oldest queued request, at most
MAX_LOAD_BYTES = 16 * 1024 * 1024  # one load report's array
MAX_SNAPSHOT_REPLICAS = 100_000  # replicas (and so KV parts) in one snapshot
MAX_SNAPSHOT_MODELS = 100_000
MAX_PART_KEYS = 1 << 22  # block keys of one replica in a snapshot (a writer clamps to it: llmgw.cluster.writer)
MAX_PART_BYTES = MAX_PART_KEYS * 9 + 5  # its part, msgpack, at most
MAX_BLOCK_SIZE = 1 << 20
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

    @property
    def leader_released(self) -> str:
        return self.prefix + "leader:released"

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


def unpack(raw: object, max_bytes: int = MAX_RECORD_BYTES, max_array: int = MAX_ARRAY) -> Any:
    """Decode one msgpack value of at most ``max_bytes`` bytes, no array in it longer than ``max_array`` (the
    bound holds before anything is built); :class:`RecordError` for anything else."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise RecordError(f"expected bytes, got {type(raw).__name__}")
    if len(raw) > max_bytes:
        raise RecordError(f"record too large ({len(raw)} bytes, at most {max_bytes})")
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False,
                               max_str_len=1 << 20, max_bin_len=1 << 20, max_array_len=max_array,
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
    try:
        change_kind = KvChangeKind(_name(items[2]))
    except ValueError:
        raise RecordError("not a kind of KV change") from None
    return [kind, _name(items[1]), BlockChanges(change_kind, _block_size(items[3]), _keys(items[4]),
                                                _keys(items[5]), _text(items[6], MAX_NAME))]


def _block_size(value: Any) -> int:
    if type(value) is not int or not 0 <= value <= MAX_BLOCK_SIZE:
        raise RecordError(f"block_size must be an int from 0 to {MAX_BLOCK_SIZE}")
    return value


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


def decode_learn_batch(raw: object, ttl_limit_ms: int = MAX_LEARNED_TTL_MS) -> list[LearnedPrediction]:
    """A learn batch (``pack([learn_item(...), ...])``) checked: names short strings, times bounded ints, block
    keys 64-bit ints; :class:`RecordError` for anything else. Bounded to what one sender buffers: at most
    ``LEARN_MAX_BYTES`` bytes and ``LEARN_MAX_PREDICTIONS`` predictions (else refused before anything is
    built); the keys past the first ``LEARN_MAX_KEYS`` of the batch, and every time to live past
    ``ttl_limit_ms`` (the reader's ``predicted_ttl``), are clamped off."""
    value = unpack(raw, LEARN_MAX_BYTES, LEARN_MAX_KEYS)
    if not isinstance(value, list) or len(value) > LEARN_MAX_PREDICTIONS:
        raise RecordError(f"a learn batch must be an array of at most {LEARN_MAX_PREDICTIONS} predictions")
    predictions = []
    budget = LEARN_MAX_KEYS
    for item in value:
        replica, made_ms, ttl_ms, keys = _array(item, 4, "prediction")
        keys = _keys(keys)[:budget]
        budget -= len(keys)
        predictions.append(LearnedPrediction(_name(replica), _int(made_ms, 0, MAX_WALL_MS),
                                             min(_int(ttl_ms, 0, MAX_LEARNED_TTL_MS), ttl_limit_ms), keys))
    return predictions


MAX_TIER_ITEMS = 4096  # tier learning items a sender buffers (llmgw.cluster.tier_learning): one batch holds no more
MAX_TIER_TEXT = 65_536  # characters of one string in a tier's payload (a routed prompt prefix)
MAX_TIER_PAYLOAD = 16  # values in one payload
MAX_TIER_BATCH_BYTES = 8 * 1024 * 1024  # what a sender's buffered items may weigh (tier_item_bytes), at most


def tier_item_bytes(item: list[Any]) -> int:
    """An upper bound of ``[model, kind, payload]``'s msgpack size (what a sender's buffer counts)."""
    model, kind, payload = item
    size = 16 + _utf8_bytes(model) + _utf8_bytes(kind)
    for value in payload:
        size += 9 + (_utf8_bytes(value) if isinstance(value, str) else 0)
    return size


def _utf8_bytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def decode_tier_batch(raw: object) -> list[tuple[str, str, list[Any]]]:
    """A tiers batch: ``[[model, kind, payload], ...]`` with payloads of at most ``MAX_TIER_PAYLOAD`` scalars
    (strings of at most ``MAX_TIER_TEXT`` characters, ints, floats, booleans, None); :class:`RecordError` else."""
    value = unpack(raw, max_array=MAX_TIER_ITEMS)
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
    """A snapshot part: one replica's block keys, at most ``MAX_PART_KEYS`` (refused before anything is built)."""
    return _keys(unpack(raw, MAX_PART_BYTES, MAX_PART_KEYS))


class SnapshotPointer(NamedTuple):
    """The ``snapshot`` key: whose snapshot, at which batch, where its meta is, and the signature of all four."""

    writer: str
    seq: int
    meta: str
    sig: bytes

    def signed(self, raw_meta: bytes) -> tuple[bytes, ...]:
        """What the signature covers: the pointer's fields and the meta's bytes (nothing of it can be swapped)."""
        return b"snapshot", self.writer.encode(), str(self.seq).encode(), self.meta.encode(), raw_meta


def snapshot_pointer(keys: Keys, writer: str, seq: int, raw_meta: bytes, signer: "Signer") -> bytes:
    """The ``snapshot`` key's value for ``writer``'s snapshot ``seq`` whose meta is ``raw_meta``."""
    pointer = SnapshotPointer(writer, seq, keys.snapshot_part(writer, seq, "meta"), b"")
    return pack({"writer": writer, "seq": seq, "meta": pointer.meta, "sig": signer.sign(*pointer.signed(raw_meta))})


def decode_snapshot_pointer(raw: object, keys: Keys) -> SnapshotPointer:
    """The ``snapshot`` key checked: a writer id, a batch number, and the meta key the writer of that batch names
    (no other key of Redis is read for it); its signature is checked with the meta (:meth:`SnapshotPointer.signed`)."""
    value = unpack(raw, 64 * 1024)
    if not isinstance(value, dict):
        raise RecordError("a snapshot pointer is a map")
    writer, seq, meta, sig = (value.get(name) for name in ("writer", "seq", "meta", "sig"))
    writer, seq = _name(writer), _int(seq, 0, MAX_WALL_MS)
    if meta != keys.snapshot_part(writer, seq, "meta"):
        raise RecordError("a snapshot pointer names a meta key its writer does not write")
    if not isinstance(sig, bytes) or len(sig) > 64:
        raise RecordError("a snapshot pointer's signature is bytes")
    return SnapshotPointer(writer, seq, meta, sig)


class SnapshotMeta(NamedTuple):
    """A snapshot's meta, checked (:func:`decode_snapshot_meta`)."""

    writer: str
    seq: int
    stream_id: bytes
    models: list[tuple[str, TierModel]]
    members: list[tuple[ReplicaRecord, bool, str]]
    kv: dict[str, tuple[str, int]]  # replica: (index state, block size), members only
    parts: dict[str, str]  # replica: the key of its block keys, members only
    digests: dict[str, str]  # replica: the SHA-256 of its part
    every_part: list[str]  # the keys of all its parts, members or not (what a writer expires)


def decode_snapshot_meta(raw: bytes, keys: Keys, pointer: SnapshotPointer) -> SnapshotMeta:
    """A snapshot's meta as strict as a log batch: every name a short string, at most ``MAX_SNAPSHOT_REPLICAS``
    replicas, block sizes bounded, part keys the writer's own. KV states and parts of replicas that are not
    members of the snapshot are left out (no index slot for a replica nobody publishes)."""
    meta = unpack(raw, max_array=MAX_SNAPSHOT_REPLICAS + MAX_SNAPSHOT_MODELS)
    if not isinstance(meta, dict):
        raise RecordError("a snapshot's meta is a map")
    if meta.get("writer") != pointer.writer or meta.get("seq") != pointer.seq:
        raise RecordError("a snapshot's meta is not the one its pointer names")
    models_raw, replicas_raw = meta.get("models"), meta.get("replicas")
    if not isinstance(models_raw, list) or len(models_raw) > MAX_SNAPSHOT_MODELS:
        raise RecordError(f"a snapshot's models are an array of at most {MAX_SNAPSHOT_MODELS}")
    if not isinstance(replicas_raw, list) or len(replicas_raw) > MAX_SNAPSHOT_REPLICAS:
        raise RecordError(f"a snapshot's replicas are an array of at most {MAX_SNAPSHOT_REPLICAS}")
    models = []
    for entry in models_raw:
        decoded = decode_entry(entry)
        if decoded[0] != MODEL:
            raise RecordError("a snapshot's model is a model entry")
        models.append((decoded[1], decoded[2]))
    members = []
    for item in replicas_raw:
        record, draining, reason = _array(item, 3, "snapshot replica")
        if type(draining) is not bool:
            raise RecordError("a snapshot replica's draining flag is a boolean")
        members.append((ReplicaRecord.from_array(record), draining, _text(reason, MAX_NAME)))
    names = {record.name for record, _, _ in members}
    kv_raw, parts_raw, digests_raw = meta.get("kv"), meta.get("parts"), meta.get("digests", {})
    if not isinstance(kv_raw, dict) or not isinstance(parts_raw, dict) or not isinstance(digests_raw, dict) \
            or max(len(kv_raw), len(parts_raw), len(digests_raw)) > MAX_SNAPSHOT_REPLICAS:
        raise RecordError(f"a snapshot's kv, parts and digests are maps of at most {MAX_SNAPSHOT_REPLICAS}")
    kv = {}
    for name, value in kv_raw.items():
        state, block_size = _array(value, 2, "snapshot kv state")
        if _name(name) in names:
            kv[name] = (_name(state), _block_size(block_size))
    part_prefix = keys.snapshot_part(pointer.writer, pointer.seq, "kv:")
    parts, digests, every_part = {}, {}, []
    for name, key in parts_raw.items():
        key = _text(key, len(part_prefix) + 16)
        if not key.startswith(part_prefix):
            raise RecordError("a snapshot part's key is not its writer's")
        every_part.append(key)
        if _name(name) in kv:
            parts[name] = key
            digest = digests_raw.get(name)
            digests[name] = _text(digest, 64) if digest is not None else ""
    return SnapshotMeta(pointer.writer, pointer.seq, _text(meta.get("stream_id"), 64).encode(), models, members,
                        kv, parts, digests, every_part)


# Per replica: in-flight requests, their prompt tokens, queued prefill tokens, queued requests, and how long ago (ms)
# the oldest of those was routed.
LOAD_FIGURES = 5
MAX_REPLICAS_PER_REPORT = 100_000
REPORT_REPLICAS_FLOOR = 1024  # a load report may always list this many replicas
MAX_LOAD_ORIGINS = 256  # other processes' reports kept at once (a cluster has a few gateways and their workers)
Load = dict[str, tuple[int, ...]]


LOAD_ITEM_BYTES = 3 + 4 * MAX_NAME + 1 + LOAD_FIGURES * 9  # one replica of a load report, msgpack, at most


class LoadLimits(NamedTuple):
    """What a reader takes of a load report: its own replicas only, a report's life at most its ``load_ttl``,
    in-flight and queued requests at most what one gateway can hold (its ``max_connections``). A report lists at
    most ``replicas`` (a sender reports the replicas of its table, which is the reader's: :func:`load_limits`);
    a longer one is refused before it is decoded."""

    known: Container[str]
    ttl: float
    requests: int
    replicas: int = MAX_REPLICAS_PER_REPORT


def load_limits(known: frozenset[str], ttl: float, requests: int) -> LoadLimits:
    """The limits of a reader whose table holds ``known``: a report may list twice as many replicas (the
    sender's table changing meanwhile), and ``REPORT_REPLICAS_FLOOR`` whatever the table."""
    return LoadLimits(known, ttl, requests, min(max(REPORT_REPLICAS_FLOOR, 2 * len(known)), MAX_REPLICAS_PER_REPORT))


def load_report_bytes(limits: LoadLimits) -> int:
    """The largest load report's array a sender of a reader with ``limits`` writes (larger ones stay in Redis)."""
    return min(limits.replicas * LOAD_ITEM_BYTES + 8, MAX_LOAD_BYTES)


def decode_load_report(fields: dict[str, Any], limits: LoadLimits) -> tuple[str, float, Load]:
    """A ``load`` stream entry's ``(origin, ttl in s, {replica: figures})``: ``o`` the origin, ``x`` its time to
    live in ms, ``l`` an array of ``[name, requests, tokens, queued tokens, queued requests, ms since the oldest
    queued request was routed]``; clamped to ``limits`` (replicas ``limits.known`` denies are left out)."""
    try:
        origin = fields["o"].decode()[:64]
        ttl = min(max(int(fields["x"]), 0) / 1000, limits.ttl)
    except (KeyError, ValueError, TypeError, AttributeError, UnicodeDecodeError):
        raise RecordError("a load report needs an origin (o) and a time to live in ms (x)") from None
    items = unpack(fields.get("l"), load_report_bytes(limits), limits.replicas)
    if not isinstance(items, list):
        raise RecordError(f"a load report is an array of at most {limits.replicas} replicas")
    load: Load = {}
    caps = (limits.requests, MAX_REPLICA_FIGURE, MAX_REPLICA_FIGURE, limits.requests, MAX_QUEUED_MS)
    for item in items:
        if not isinstance(item, list) or len(item) != 1 + LOAD_FIGURES or not isinstance(item[0], str) \
                or len(item[0]) > MAX_NAME or not all(type(n) is int for n in item[1:]):
            raise RecordError("a load entry is [name, requests, tokens, queued tokens, queued requests, queued ms]")
        if item[0] in limits.known:
            load[item[0]] = tuple(max(0, min(n, cap)) for n, cap in zip(item[1:], caps))
    return origin, ttl, load


# A load report's ``q``: the requests the origin's overload control holds, per model, as ``[[model, count], ...]``.
# It came after ``l``: a reader of the version before reads ``o``, ``x``, ``l`` and ``s`` alone (``s`` signs those
# three, as it did), and a report without ``q`` holds nothing. ``t`` signs all four, so ``q`` cannot be forged
# onto a report an honest gateway signed.
MAX_QUEUED_MODELS = 4096  # models listed in one report's q (a reader takes its own models only)
MAX_QUEUED_BYTES = 64 * 1024  # q, msgpack (a reader budgets for it and its signature besides l)


def encode_load_queued(queued: dict[str, int]) -> bytes:
    """A report's ``q``: the models with requests held, the most held first, as many as fit
    :data:`MAX_QUEUED_BYTES` (and :data:`MAX_QUEUED_MODELS`)."""
    held = sorted(((model, count) for model, count in queued.items() if count > 0), key=lambda item: -item[1])
    items = [list(item) for item in held[:MAX_QUEUED_MODELS]]
    raw = pack(items)
    while len(raw) > MAX_QUEUED_BYTES:
        items = items[:len(items) // 2]
        raw = pack(items)
    return raw


def decode_load_queued(fields: dict[str, Any], known: Container[str], cap: int) -> dict[str, int]:
    """A load report's ``q`` as ``{model: requests held}``: the models in ``known`` only, each count clamped to
    ``0..cap`` (what an honest gateway can hold); ``{}`` when the report has none (a sender of the version before)."""
    raw = fields.get("q")
    if raw is None:
        return {}
    items = unpack(raw, MAX_QUEUED_BYTES, MAX_QUEUED_MODELS)
    if not isinstance(items, list):
        raise RecordError(f"a load report's q is an array of at most {MAX_QUEUED_MODELS} [model, count]")
    queued: dict[str, int] = {}
    for item in items:
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str) \
                or len(item[0]) > MAX_NAME or type(item[1]) is not int:
            raise RecordError("a load report's q entry is [model, count]")
        if item[0] in known:
            queued[item[0]] = max(0, min(item[1], cap))
    return queued


# A load report's ``f``: per model, what the origin measured that the others decide with (issues 31 and 32), as
# ``[[model, entered, within, seen, output, [[rank, rate], ...]], ...]``: the requests that entered its flow queue
# (a counter), its first tokens of the last minute within the deployment's ``ttft_slo`` and in all, the output
# tokens (max_tokens) of its requests in flight on the model, and per band the drain rate it trusts (tokens/s).
# Like ``q`` it came after ``l``: a reader of a version before ignores it (``g`` signs ``o``, ``x``, ``l``, ``f``),
# and a report without it says nothing of them (None, not zero: a sender of the version before).
MAX_FIGURES_MODELS = 1024  # models in one report's f (a reader takes its own models only)
MAX_FIGURES_BANDS = 16  # bands per model
MAX_FIGURES_BYTES = 64 * 1024  # f, msgpack (a reader budgets for it and its signature besides l and q)
MAX_FIGURES_COUNTER = 1 << 53  # a counter (requests entered)
MAX_FIGURES_FIRST_TOKENS = 1 << 16  # first tokens of the last minute one gateway keeps per model, at most
MAX_FIGURES_RATE = 1 << 32  # tokens/s
MAX_FIGURES_RANK = 1 << 16


class ModelFigures(NamedTuple):
    """One gateway's figures for one model (its load report's ``f``)."""

    entered: int = 0  # requests that entered its flow queue since it started (a counter)
    ttft_within: int = 0  # its first tokens of the last minute within the deployment's ttft_slo
    ttft_seen: int = 0  # its first tokens of the last minute (0: none, or no ttft_slo)
    output_inflight: int = 0  # the output allowance (max_tokens) of its requests in flight on the model
    drains: tuple[tuple[int, int], ...] = ()  # (band rank, trusted drain rate in tokens/s), bands it trusts


def encode_load_figures(figures: dict[str, ModelFigures]) -> bytes:
    """A report's ``f``: the models with the most requests entered first, as many as fit
    :data:`MAX_FIGURES_BYTES` (and :data:`MAX_FIGURES_MODELS`)."""
    ordered = sorted(figures.items(), key=lambda item: -item[1].entered)[:MAX_FIGURES_MODELS]
    items = [[model, f.entered, f.ttft_within, f.ttft_seen, f.output_inflight,
              [list(band) for band in f.drains[:MAX_FIGURES_BANDS]]] for model, f in ordered]
    raw = pack(items)
    while len(raw) > MAX_FIGURES_BYTES:
        items = items[:len(items) // 2]
        raw = pack(items)
    return raw


def decode_load_figures(fields: dict[str, Any], known: Container[str]) -> dict[str, ModelFigures] | None:
    """A load report's ``f`` as ``{model: ModelFigures}``: the models in ``known`` only, every figure clamped to
    its bound (first tokens within the slo at most those seen); None when the report has none (a sender of the
    version before: it says nothing, which is not zero); :class:`RecordError` for anything malformed."""
    raw = fields.get("f")
    if raw is None:
        return None
    items = unpack(raw, MAX_FIGURES_BYTES, MAX_FIGURES_MODELS * (6 + 3 * MAX_FIGURES_BANDS))
    if not isinstance(items, list) or len(items) > MAX_FIGURES_MODELS:
        raise RecordError(f"a load report's f is an array of at most {MAX_FIGURES_MODELS} models")
    figures: dict[str, ModelFigures] = {}
    for item in items:
        if not isinstance(item, list) or len(item) != 6 or not isinstance(item[0], str) or len(item[0]) > MAX_NAME \
                or not all(type(n) is int for n in item[1:5]) or not isinstance(item[5], list) \
                or len(item[5]) > MAX_FIGURES_BANDS:
            raise RecordError("a load report's f entry is [model, entered, within, seen, output, [[rank, rate]]]")
        drains = []
        for band in item[5]:
            if not isinstance(band, list) or len(band) != 2 or not all(type(n) is int for n in band):
                raise RecordError("a load report's drain rate is [rank, tokens per second]")
            drains.append((_clamp(band[0], MAX_FIGURES_RANK), _clamp(band[1], MAX_FIGURES_RATE)))
        if item[0] in known:
            seen = _clamp(item[3], MAX_FIGURES_FIRST_TOKENS)
            figures[item[0]] = ModelFigures(_clamp(item[1], MAX_FIGURES_COUNTER), _clamp(item[2], seen), seen,
                                            _clamp(item[4], MAX_REPLICA_FIGURE), tuple(drains))
    return figures


def _clamp(value: int, high: int) -> int:
    return max(0, min(value, high))


# What the fields of one stream entry weigh besides its batch, at most: the names, an origin, a signature, a ttl.
ENTRY_FIELDS_BYTES = 1024
MAX_ASK_BYTES = 16 * 1024  # a resync ask: ["resync", replica, mode, reason], its reason cut to MAX_NAME characters


class Signer:
    """Signs records with the cluster secret and checks them against it, and during a rotation against the previous
    one too (``state.previous_secret_env``: accepted, never signed with); without a secret, signs with nothing and
    accepts all. Each record that only the previous secret signed is counted (``on_previous``: the operator's sign
    of what is still to be re-signed before that secret is dropped)."""

    def __init__(self, secret: bytes | None, previous: bytes | None = None,
                 on_previous: Callable[[], None] | None = None):
        self.secret = secret or None
        self.previous = (previous or None) if self.secret is not None else None
        self.on_previous = on_previous

    def sign(self, *parts: bytes) -> bytes:
        return _hmac(self.secret, parts) if self.secret is not None else b""

    def valid(self, signature: object, *parts: bytes) -> bool:
        return self.verify(signature, *parts) is not Signed.NOT

    def verify(self, signature: object, *parts: bytes) -> "Signed":
        """Which secret signed ``parts``: the current one (or there is none), the previous one, or neither."""
        if self.secret is None:
            return Signed.CURRENT
        if not isinstance(signature, bytes):
            return Signed.NOT
        if hmac.compare_digest(signature, _hmac(self.secret, parts)):
            return Signed.CURRENT
        if self.previous is not None and hmac.compare_digest(signature, _hmac(self.previous, parts)):
            if self.on_previous is not None:
                self.on_previous()
            return Signed.PREVIOUS
        return Signed.NOT

    def signatures(self, *parts: bytes) -> list[bytes]:
        """Every signature of ``parts`` this signer accepts: the current secret's first (for a mark compared
        whole, such as a lease's release)."""
        return [_hmac(secret, parts) for secret in (self.secret, self.previous) if secret is not None]


class Signed(enum.Enum):
    CURRENT = "current"
    PREVIOUS = "previous"
    NOT = "not"


def _hmac(secret: bytes, parts: Sequence[bytes]) -> bytes:
    digest = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))  # lengths first: no two splits of the bytes sign alike
        digest.update(part)
    return digest.digest()


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
