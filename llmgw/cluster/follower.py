"""A gateway's side of the shared state: its replica table and KV index follow the control plane's, through Redis.

:class:`LogFollower` loads the newest snapshot, then applies the log's
batches after it as they come (a read bounded by bytes, woken by Redis's
client tracking: :mod:`.streams`; a change is visible here a few
milliseconds after the control plane wrote it). It loads the
snapshot again when the batches jump (a batch was lost, or the stream was
trimmed past what it read), when another writer appears (the control plane
restarted: its first snapshot comes before its first batch), or after Redis
failed. A new leader whose first batch says it continues the log from the
batch this copy ends at (:meth:`LogFollower.catch_up`, on the leader's side)
is followed on with no snapshot. While Redis is away it keeps everything as
it is: requests are routed on the last known table and index (fail-static).

:class:`FollowedReplicas` is the replica source that the log drives: it
declares models and adds, drains and removes replicas in this process's
:class:`~llmgw.router.replicas.ReplicaSet` under the source the control plane
gave them (``static`` or ``deployed``). Secrets never travel through Redis: a
replica's API key and TLS settings come from this gateway's own config (the
static replica of that name, or the deployed replica's profile).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import trio

from ..control.tasks import TaskHost
from ..kv.changes import BlockChanges, ChangesFields, KvChangeKind, sliced, unusable_keys_reason
from ..router.model import TierModel
from ..router.replica import Replica, ReplicaState
from . import records
from .link import BLOCK_MS, RedisLink, Unavailable
from .records import Keys, RecordError, ReplicaRecord
from .streams import Doorbell, read_bounded
from .writer import replica_record

if TYPE_CHECKING:
    from ..kv.index import KvIndex
    from ..router.replicas import ReplicaSet
    from .metrics import ClusterMetrics

log = logging.getLogger(__name__)

DRAIN_TIMEOUT = 600.0
BATCHES_PER_READ = 256
KEYS_PER_SLICE = 16_384  # a KV change is applied this many keys at a time, the loop served in between
INLINE_BYTES = 1 << 20  # a record larger than this is checked and decoded in a worker thread: the loop goes on
T = TypeVar("T")
SNAPSHOT_UNUSABLE_KEYS = ("the engine's block keys cannot match the router's (read from the cluster's snapshot; "
                          "the control plane's /admin/kv says why and the fix)")
ReplicaFactory = Callable[[ReplicaRecord], Replica]
# KEYS: a snapshot's parts; ARGV: the most bytes and block keys a part may have (its msgpack array's header says
# how many). Their values (nil if missing), or the 1-based position of the first one that is larger: never sent.
READ_PARTS = """
local max_bytes, max_keys = tonumber(ARGV[1]), tonumber(ARGV[2])
for i, key in ipairs(KEYS) do
  if redis.call('STRLEN', key) > max_bytes then return i end
  local head = redis.call('GETRANGE', key, 0, 4)
  local kind, count = string.byte(head, 1), 0
  if kind == 0xdc and #head >= 3 then
    count = string.byte(head, 2) * 256 + string.byte(head, 3)
  elseif kind == 0xdd and #head >= 5 then
    local b1, b2, b3, b4 = string.byte(head, 2, 5)
    count = ((b1 * 256 + b2) * 256 + b3) * 256 + b4
  end
  if count > max_keys then return i end
end
local values = {}
for i, key in ipairs(KEYS) do values[i] = redis.call('GET', key) end
return values
"""


class FollowedReplicas(TaskHost):
    """The replicas and models the control plane published, kept in this process's replica set."""

    not_running = "FollowedReplicas.run is not running"

    def __init__(self, replicas: "ReplicaSet", make_replica: ReplicaFactory):
        self.replicas = replicas
        self.make_replica = make_replica
        self.followed: dict[str, tuple[ReplicaRecord, Replica]] = {}  # by name
        self.declared: dict[tuple[str, str], TierModel] = {}  # (source, model name) -> declaration

    def declare(self, source: str, model: TierModel) -> None:
        self.declared[(source, model.name)] = model
        try:
            self.replicas.declare_model(source, model)
        except Exception as exc:  # e.g. a routing tier whose plugin is not installed in this gateway
            log.error("model %s from the cluster's control plane cannot be routed here: %s: %s", model.name,
                      type(exc).__name__, exc)

    def withdraw(self, source: str, name: str) -> None:
        if self.declared.pop((source, name), None) is not None:
            self.replicas.withdraw_model(source, name)

    def add(self, record: ReplicaRecord) -> None:
        current = self.followed.get(record.name)
        if current is not None:
            if current[0] == record:
                return
            self.remove(record.name, "it changed")
        try:
            replica = self.make_replica(record)
        except ValueError as exc:  # refused by this gateway's config, or an address that cannot be dialled
            log.error("replica %s from the cluster's control plane is not routed here: %s", record.name, exc)
            return
        if self.replicas.add(replica, record.source):
            self.followed[record.name] = (record, replica)
            log.info("replica %s (%s) enters routing at %s (from the cluster's control plane)", record.name,
                     record.model, record.url)

    def drain(self, name: str, reason: str) -> None:
        """No new requests to it; it leaves when the control plane removes it."""
        current = self.followed.get(name)
        if current is not None:
            replica = current[1]
            health = self.replicas.health
            if health is not None:
                health.set_state(replica, ReplicaState.DRAINING, reason)
            else:
                replica.state, replica.reason = ReplicaState.DRAINING, reason

    def remove(self, name: str, why: str = "the control plane removed it") -> None:
        """Out of routing; the requests this gateway still has there finish first (up to ``DRAIN_TIMEOUT``)."""
        current = self.followed.pop(name, None)
        if current is None:
            return
        replica = current[1]
        log.info("replica %s leaves routing: %s", name, why)
        if replica.local_inflight:
            self.spawn(self.replicas.drain, replica, why, DRAIN_TIMEOUT)
        else:
            self.spawn(self.replicas.remove, replica)

    def hold(self) -> None:
        """This process starts leading: the replicas it followed stay in routing, *held* (fail-static), until its
        control plane's sources claim them (:meth:`hand_over`: the config's at once, the deployed ones as their
        agents re-register) or the term lets them go (:meth:`held`); the models stay declared until those sources
        say otherwise, so no request finds its model unknown meanwhile."""
        self.declared.clear()

    def held(self) -> dict[str, ReplicaRecord]:
        """While leading: the followed replicas no source of this process has claimed yet, by name."""
        return {name: record for name, (record, _) in self.followed.items()}

    def hand_over(self, successor: Replica) -> ReplicaRecord | None:
        """A source of this leader adds its own replica of the same name: the held one leaves the table in the
        same step (no request finds neither), finishing what it has in flight on its own pool; its record. At the
        same address, ``successor`` starts from the held one's health (not as a replica never probed)."""
        current = self.followed.pop(successor.name, None)
        if current is None:
            return None
        record, replica = current
        # A drain was the old leader's decision: this leader's source makes it again if it wants it.
        if replica.url == successor.url and replica.state is not ReplicaState.DRAINING:
            successor.state, successor.reason = replica.state, replica.reason
        self.replicas.discard(replica)
        self.spawn(self._close_handed_over, replica)
        return record

    async def _close_handed_over(self, replica: Replica) -> None:
        with trio.move_on_after(DRAIN_TIMEOUT):
            while replica.local_inflight:
                await trio.sleep(0.05)
        if self.replicas.health is not None:
            self.replicas.health.forget(replica)
        if replica.pool is not None:
            await replica.pool.aclose()

    def held_json(self, listed: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``listed`` (a leader's ``/admin/replicas``) with the held replicas in: each instead of an entry of its
        name that has no address yet (a deployed replica waiting for its agent), else added."""
        held = {name: replica for name, (_, replica) in self.followed.items()}
        if not held:
            return listed
        answer = []
        for entry in listed:
            replica = held.get(entry.get("name", ""))
            if replica is not None and not entry.get("url"):
                entry = self._held_entry(held.pop(replica.name))
            elif replica is not None:
                held.pop(replica.name)
            answer.append(entry)
        return answer + [self._held_entry(replica) for replica in held.values()]

    def _held_entry(self, replica: Replica) -> dict[str, Any]:
        return {**self.replicas.describe(replica),
                "held": "routed as the previous leader published it until its source here claims it"}

    def adopt_all(self) -> None:
        """This process stops leading: what its control plane left in the table is followed from now on, kept
        and routed to as it is until the next leader's snapshot says otherwise (fail-static)."""
        self.declared = {(source, model.name): model for source, model in self.replicas.declarations()}
        self.followed = {}
        for replica in self.replicas:
            source = self.replicas.source_of(replica)
            if source is not None and replica.state is not ReplicaState.DRAINING:
                self.followed[replica.name] = (replica_record(replica, source), replica)

    def replace(self, models: list[tuple[str, TierModel]], members: list[tuple[ReplicaRecord, bool, str]]) -> None:
        """Make the followed state exactly a snapshot's; replicas that did not change keep their pools and health."""
        wanted_models = {(source, model.name): model for source, model in models}
        for source, model in models:
            if self.declared.get((source, model.name)) != model:
                self.declare(source, model)
        for source, name in list(self.declared):
            if (source, name) not in wanted_models:
                self.withdraw(source, name)
        wanted = {record.name: (record, draining, reason) for record, draining, reason in members}
        for name in list(self.followed):
            if name not in wanted:
                self.remove(name, "it is not in the control plane's snapshot")
        for record, draining, reason in wanted.values():
            self.add(record)
            if draining:
                self.drain(record.name, reason)


class LogFollower:
    """Keeps a :class:`FollowedReplicas` and a :class:`KvIndex` equal to the control plane's, from Redis."""

    def __init__(self, link: RedisLink, keys: Keys, followed: FollowedReplicas, kv_index: "KvIndex",
                 metrics: "ClusterMetrics", signer: records.Signer | None = None):
        self.link = link
        self.snapshot_interval = link.settings.snapshot_interval
        self.signer = signer or records.Signer(None)
        self.keys = keys
        self.followed = followed
        self.kv_index = kv_index
        self.metrics = metrics
        self.writer: str | None = None  # the writer whose snapshot and batches we follow
        self.seq = 0  # its last batch applied
        self.stream_id = b"0-0"
        self.loaded = trio.Event()  # set once a first snapshot has been applied
        self.snapshot_reason = "start"
        # The snapshot a jump in the log calls for: (writer, at least this batch). The batch is in the log before
        # the snapshot that points at it is, so an older snapshot must not be taken for it.
        self.wanted: tuple[str, int] | None = None
        self.wanted_until = 0.0
        self._unsigned_told = False
        self._decoding = trio.CapacityLimiter(1)
        self._doorbell = Doorbell(link.settings, keys.log)  # one for every run: a refusal is told once a process

    async def _off_loop(self, size: int, work: Callable[[], T]) -> T:
        """``work()`` (checking and decoding ``size`` bytes of a record): in a worker thread when they are many."""
        if size <= INLINE_BYTES:
            return work()
        return await trio.to_thread.run_sync(work, limiter=self._decoding)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        failures = 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._doorbell.run)
            while True:
                try:
                    if self.snapshot_reason:
                        if not await self._load_snapshot():
                            await trio.sleep(0.2)  # none yet (a new cluster, or its writer has not settled)
                            continue
                    if not await self._read():
                        await self._doorbell.wait(BLOCK_MS / 1000)
                    failures = 0
                except Unavailable:
                    failures += 1
                    self.snapshot_reason = self.snapshot_reason or "redis_outage"
                    await self.link.backoff(failures)

    def restart(self) -> None:
        """Follow again from the newest snapshot (this process led for a while: what it read is stale)."""
        self.writer, self.seq, self.stream_id, self.wanted = None, 0, b"0-0", None
        self.snapshot_reason = "demoted"

    def position(self) -> tuple[str, int] | None:
        """``(writer, seq)``: the last batch applied, when this copy is exactly the log's up to it (None while a
        snapshot is due because of a gap, another writer or a bad batch; after a Redis outage it still is)."""
        if self.writer is None or self.snapshot_reason not in ("", "redis_outage") or not self.loaded.is_set():
            return None
        return self.writer, self.seq

    async def catch_up(self, timeout: float) -> tuple[str, int] | None:
        """This process has just taken the lease: apply what the previous leader wrote that was not read yet (it
        can write nothing more: its writes are fenced), so this copy is its last state exactly; the position to
        continue its log from (:meth:`position`), or None when that state is not known here (a snapshot was due,
        Redis failed, or the log took longer than ``timeout`` to read)."""
        with trio.move_on_after(timeout):
            try:
                while self.position() is not None:
                    if not await self._read():
                        return self.position()
            except Unavailable:
                return None
        return None

    async def wait_loaded(self, timeout: float) -> bool:
        """Whether a first snapshot was applied within ``timeout`` seconds (a request at start waits for it)."""
        with trio.move_on_after(timeout):
            await self.loaded.wait()
        return self.loaded.is_set()

    # -- the snapshot ----------------------------------------------------------------------------------------------

    async def _load_snapshot(self) -> bool:
        keys = self.keys
        raw = await self.link.call("snapshot_read", lambda client: client.get(keys.snapshot))
        if raw is None:
            return False
        try:
            # Checked before anything it names is read: a forged pointer can make this gateway read no key but
            # its writer's own meta (and that only to find the signature wrong).
            pointer = records.decode_snapshot_pointer(raw, keys)
            if self.snapshot_reason == "redis_outage" and pointer.writer == self.writer and pointer.seq <= self.seq:
                self.snapshot_reason = ""  # nothing was lost: go on reading after what we have
                return True
            if self.wanted is not None and (pointer.writer != self.wanted[0] or pointer.seq < self.wanted[1]):
                if trio.current_time() < self.wanted_until:
                    return False  # the snapshot the log calls for is not written yet
                log.warning("cluster state: no snapshot of writer %s at batch %d came; loading the newest there is "
                            "(the log held an entry that was not the control plane's)", *self.wanted)
                self.wanted = None
            meta_raw = await self.link.call("snapshot_read", lambda client: client.get(pointer.meta))
            if meta_raw is None:
                return False  # replaced in between: read the pointer again
            if not self.signer.valid(pointer.sig, *pointer.signed(meta_raw)):
                raise RecordError("the snapshot's signature is not the cluster secret's")
            meta = records.decode_snapshot_meta(meta_raw, keys, pointer)
            names = list(meta.parts)
            raws = await self._read_parts([meta.parts[n] for n in names]) if names else []
            if any(part is None for part in raws):
                return False
            parts = await self._off_loop(sum(len(raw or b"") for raw in raws),
                                         lambda: self._decode_parts(meta, names, raws))
        except RecordError as exc:
            self.metrics.bad_records.labels("snapshot").inc()
            log.error("cluster state: the snapshot in Redis cannot be read (%s); keeping the current state and "
                      "trying again", exc)
            await trio.sleep(1.0)
            return False
        self.followed.replace(meta.models, meta.members)
        await self._replace_kv(meta.kv, parts)
        self.writer, self.seq, self.stream_id = meta.writer, meta.seq, meta.stream_id
        self.wanted = None
        self.metrics.snapshots.labels("loaded", self.snapshot_reason).inc()
        log.info("cluster state: snapshot %d of control plane %s loaded (%s): %d models, %d replicas, %d blocks",
                 meta.seq, meta.writer, self.snapshot_reason, len(meta.models), len(meta.members),
                 sum(len(p) for p in parts.values()))
        self.snapshot_reason = ""
        self.loaded.set()
        return True

    def _decode_parts(self, meta: records.SnapshotMeta, names: list[str], raws: list[bytes | None]
                      ) -> dict[str, list[int]]:
        """The parts' block keys by replica, each checked against the digest its signed meta names."""
        if self.signer.secret is not None and any(records.part_digest(raw or b"") != meta.digests[name]
                                                  for name, raw in zip(names, raws)):
            raise RecordError("a snapshot part is not the one its signed meta names")
        return {name: records.decode_keys(part) for name, part in zip(names, raws)}

    async def _read_parts(self, part_keys: list[str]) -> list[bytes | None]:
        """The parts' values (None for a missing one), read only when each is at most ``MAX_PART_BYTES``: a larger
        one (more block keys than a writer puts in a part) never leaves Redis, and is a :class:`RecordError`."""
        answer: Any = await self.link.call("snapshot_read", lambda client: client.eval(
            READ_PARTS, keys=part_keys, args=[records.MAX_PART_BYTES, records.MAX_PART_KEYS]))
        if isinstance(answer, int):
            raise RecordError(f"snapshot part {part_keys[answer - 1]} is larger than a writer writes "
                              f"({records.MAX_PART_KEYS} block keys, {records.MAX_PART_BYTES} bytes)")
        if not isinstance(answer, list) or len(answer) != len(part_keys) or \
                not all(part is None or isinstance(part, bytes) for part in answer):
            raise RecordError("the snapshot's parts could not be read")
        return answer

    async def _replace_kv(self, states: dict[str, tuple[str, int]], parts: dict[str, list[int]]) -> None:
        """The index made the snapshot's, ``KEYS_PER_SLICE`` keys at a time with the loop served in between (a
        snapshot of many or large replicas does not stall it)."""
        index = self.kv_index
        routed = self.followed.followed
        states = {name: state for name, state in states.items() if name in routed}  # as the log's kv changes
        for name in index.replicas():
            if name not in states:
                index.remove(name)
        budget = KEYS_PER_SLICE
        for name, (state, block_size) in states.items():
            if state == "no_events":
                index.forget(name)
            elif state == "resetting":
                index.apply(name, BlockChanges(KvChangeKind.RESET, block_size, reason="reset (from the snapshot)"))
            elif state == "unusable_keys":  # the snapshot keeps no problem text: the control plane's has it
                budget = await self._apply_kv(name, BlockChanges(KvChangeKind.FULL, block_size, parts.get(name, []),
                                                                 reason=unusable_keys_reason(SNAPSHOT_UNUSABLE_KEYS)),
                                              budget)
            else:  # healthy, or suspect on the control plane (its owner is resyncing it)
                budget = await self._apply_kv(name, BlockChanges(KvChangeKind.FULL, block_size, parts.get(name, [])),
                                              budget)
            budget -= 1
            if budget <= 0:
                await trio.lowlevel.checkpoint()
                budget = KEYS_PER_SLICE

    # -- the log ---------------------------------------------------------------------------------------------------

    async def _read(self) -> bool:
        """Apply the batches after the last one applied, a read's worth; whether there was any. Read by bytes: an
        entry larger than a writer writes (``LOG_BATCH_BYTES``) never leaves Redis, and is stepped over (counted;
        had a writer written it, the gap after it makes this follower load the snapshot)."""
        read = await read_bounded(self.link, "log_read", self.keys.log, self.stream_id, BATCHES_PER_READ,
                                  records.LOG_BATCH_BYTES + records.ENTRY_FIELDS_BYTES)
        for identifier, fields in zip(read.ids, read.entries):
            if not await self._apply_batch(identifier, fields):
                return True
        if read.oversized:
            self.metrics.bad_records.labels("log").inc(read.oversized)
            if not self._unsigned_told:
                self._unsigned_told = True
                log.warning("cluster state: a log entry larger than a writer writes was skipped unread: someone else "
                            "writes to this cluster's Redis keys (logged once)")
            self.stream_id = read.last
        return bool(read.ids) or bool(read.oversized)

    async def _apply_batch(self, identifier: bytes, fields: Any) -> bool:
        """Apply one log batch; False when the follower must load a snapshot first. Its KV changes go into the index
        ``KEYS_PER_SLICE`` keys at a time with the loop served in between (a batch of many keys never stalls it);
        the table's changes between two of those steps, each whole."""
        values = dict(records.iter_fields(fields))
        try:
            writer = values["w"].decode()
            seq = int(values["n"])
            written_ms = int(values.get("t", b"0"))
        except (KeyError, ValueError, AttributeError):
            self.metrics.bad_records.labels("log").inc()
            self.stream_id = identifier  # not a batch of ours at all: step over it
            return True
        signed = [values["w"], values["n"], values.get("t", b""), values.get("e", b"")]
        if "c" in values:
            signed.append(values["c"])
        size = sum(len(part) if isinstance(part, bytes) else 0 for part in signed)
        if not await self._off_loop(size, lambda: self.signer.valid(values.get("s"), *signed)):
            self.metrics.bad_records.labels("log").inc()
            if not self._unsigned_told:
                self._unsigned_told = True
                log.warning("cluster state: a log entry without the cluster secret's signature was skipped: "
                            "someone else writes to this cluster's Redis keys (logged once)")
            self.stream_id = identifier  # not the writer's: step over it
            return True
        if writer != self.writer and seq == 1 and self.writer is not None and \
                values.get("c") == records.continuation(self.writer, self.seq):
            log.info("cluster state: control plane %s continues the log of %s from batch %d, which this copy "
                     "holds: no snapshot to load", writer, self.writer, self.seq)
            self.metrics.snapshots.labels("skipped", "continued").inc()
            self.writer, self.seq = writer, 0
        if writer != self.writer:
            self._want("new_writer", writer, 0)
            return False
        if seq <= self.seq:
            self.stream_id = identifier  # already in the snapshot we loaded
            return True
        if seq != self.seq + 1:
            self._want("gap", writer, seq - 1)  # one that covers the lost batches
            return False
        try:
            batch = await self._off_loop(size, lambda: records.decode_batch(values.get("e")))
        except RecordError as exc:
            self.metrics.bad_records.labels("log").inc()
            log.error("cluster state: log batch %d cannot be read (%s); loading the snapshot", seq, exc)
            self._want("bad_batch", writer, seq)
            return False
        budget = KEYS_PER_SLICE
        with trio.CancelScope(shield=True):  # a batch is applied whole, then its place noted: never half of it
            for entry in batch:
                try:
                    if entry[0] == records.KV and entry[1] in self.followed.followed:
                        self.metrics.entries.labels("applied", records.KV).inc()
                        budget = await self._apply_kv(entry[1], entry[2], budget)
                    else:
                        self._apply(entry)
                except Exception:  # one entry this gateway cannot apply must not stop it following the others
                    self.metrics.bad_records.labels("log").inc()
                    log.exception("cluster state: a %s change of batch %d could not be applied; skipped", entry[0],
                                  seq)
            self.seq, self.stream_id = seq, identifier
        self.metrics.batches.labels("applied").inc()
        if written_ms:
            self.metrics.log_delay.observe(max(0.0, time.time() - written_ms / 1000))
        return True

    async def _apply_kv(self, name: str, changes: ChangesFields, budget: int) -> int:
        """Apply one replica's KV change a slice at a time, with a checkpoint whenever ``budget`` keys were applied
        since the last one; what is left of the budget."""
        for part in sliced(changes, KEYS_PER_SLICE):
            size = len(part.stored) + len(part.removed)
            if size > budget:
                await trio.lowlevel.checkpoint()
                budget = KEYS_PER_SLICE
            self.kv_index.apply(name, part)
            budget -= size
        return budget

    def _want(self, reason: str, writer: str, seq: int) -> None:
        """Load the snapshot of ``writer`` at ``seq`` or later next; should none come within a few snapshot
        intervals (the entry was not the writer's: a stale or foreign one), the newest one there is."""
        self.snapshot_reason, self.wanted = reason, (writer, seq)
        self.wanted_until = trio.current_time() + max(3 * self.snapshot_interval, 5.0)

    def _apply(self, entry: list[Any]) -> None:
        kind = entry[0]
        followed, index = self.followed, self.kv_index
        if kind == records.KV and entry[1] not in followed.followed:
            self.metrics.entries.labels("ignored", kind).inc()  # a replica not routed here gets no index slot
            return
        self.metrics.entries.labels("applied", kind).inc()
        if kind == records.KV:
            index.apply(entry[1], entry[2])
        elif kind == records.MODEL:
            followed.declare(entry[1], entry[2])
        elif kind == records.UNMODEL:
            followed.withdraw(entry[1], entry[2])
        elif kind == records.ADD:
            followed.add(entry[1])
        elif kind == records.DRAIN:
            followed.drain(entry[1], entry[2])
        elif kind == records.REMOVE:
            followed.remove(entry[1])
        elif kind == records.KV_FORGET:
            index.forget(entry[1])
        elif kind == records.KV_DROP:
            index.remove(entry[1])
