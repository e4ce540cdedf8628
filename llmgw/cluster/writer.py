"""The control plane's side of the shared state: what its sources write locally is also written to Redis.

The replica sources (the config's static models, the deployed replicas) and
the KV feeds (agents' ``KvChanges``, static replicas' subscriptions) write
through :class:`PublishedReplicaTable` and :class:`PublishedKv`: the same
:class:`~llmgw.control.interfaces.ReplicaTable` and
:class:`~llmgw.control.interfaces.KvWriter` interfaces, each call applied to
this process's own table and index first (its routing never waits), then
recorded for :class:`LogWriter`.

:class:`LogWriter` writes the records to the cluster's log stream in batches
(as soon as there are any, each under the leader's
:class:`~.election.Fence`: a term that ended can write nothing), and a snapshot of the whole state: first once the
control plane has settled after its start (agents reconnected and reported
their engines, so followers never see an empty table from a restart; a new
leader that holds the cluster's state writes it at once, and when it holds
the previous leader's log exactly it continues that log), then
every ``snapshot_interval`` while something changed, at once after Redis
failed (a batch that could not be written leaves a gap, which sends the
followers to the snapshot), and when the snapshot pointer in Redis is no longer
the one it wrote (checked every ``POINTER_CHECK`` seconds while nothing changes:
someone overwrote it, and a gateway starting now could load nothing). Snapshots
live until the next one plus a grace (``SNAPSHOT_GRACE``), so a follower
reading one never finds it gone.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable

import trio

from ..kv.changes import ChangesFields
from ..router.model import TierModel
from ..router.replica import Replica, ReplicaState
from . import records
from .link import RedisLink, Unavailable
from .records import Keys, ReplicaRecord

if TYPE_CHECKING:
    from ..config.schema import StateConfig
    from ..kv.index import KvIndex
    from ..router.replicas import ReplicaSet
    from .election import Fence
    from .metrics import ClusterMetrics

log = logging.getLogger(__name__)

SNAPSHOT_GRACE = 60.0  # seconds a superseded snapshot stays readable
POINTER_CHECK = 5.0  # seconds (at least snapshot_interval) between two checks of the snapshot pointer at rest
MAX_BATCH = 4096  # entries per log batch


def entry_bytes(entry: list[Any]) -> int:
    """An upper bound of a log entry's msgpack size: a KV change's keys at 9 bytes, the rest packed."""
    if entry[0] == records.KV:
        return 9 * (len(entry[4]) + len(entry[5])) + 16 * records.MAX_NAME
    return len(records.pack(entry))


def replica_record(replica: Replica, source: str) -> ReplicaRecord:
    return ReplicaRecord(replica.name, replica.model, replica.url, source, replica.weight, dict(replica.labels),
                         replica.engine_id)


class LogWriter:
    """Batches of records to the log stream, and snapshots; the one writer of a cluster's shared truth."""

    def __init__(self, link: RedisLink, keys: Keys, settings: "StateConfig", replicas: "ReplicaSet",
                 kv_index: "KvIndex", metrics: "ClusterMetrics", writer_id: str, fence: "Fence",
                 signer: records.Signer | None = None, continues: tuple[str, int] | None = None):
        """``continues``: ``(writer, seq)`` of the previous leader's log, which this process's table and index
        hold exactly: this writer goes on from there (its first batch says so; a follower holding the same needs
        no snapshot), records changes from the start, and publishes its first snapshot at once (for the others)."""
        self.link = link
        self.fence = fence
        self.continues = continues
        self.signer = signer or records.Signer(None)
        self.keys = keys
        self.settings = settings
        self.replicas = replicas
        self.kv_index = kv_index
        self.metrics = metrics
        self.writer_id = writer_id
        self.seq = 0  # the last batch number given out
        self.stream_id: bytes | None = None  # the log id of the last batch written
        self.pending: list[list[Any]] = []
        self.published = False  # the first snapshot is out
        self.recording = continues is not None  # changes go to the log (from the first snapshot's state on)
        self.need_snapshot = True
        self.dirty = False
        self._wake = trio.Event()
        self._snapshot_keys: list[str] = []  # the current snapshot's keys (expired when the next one is out)
        self._pointer: bytes | None = None  # the snapshot pointer it wrote last
        self._replaced = False  # someone else's pointer was found in its place
        self._clamped_told: set[str] = set()  # replicas whose snapshot part was clamped (logged once each)

    @property
    def ended(self) -> bool:
        """Its term is over: the control plane's last calls while it stops change nothing (fail-static)."""
        return self.fence.term.over

    def record(self, entry: list[Any]) -> None:
        """One change of the shared truth, already applied locally."""
        if not self.recording:
            return  # the first snapshot will hold it
        self.pending.append(entry)
        self.dirty = True
        self._wake.set()

    async def run(self, settled: Callable[[], bool], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write until cancelled. Nothing is written before ``settled()`` (the control plane's adoption window)."""
        task_status.started()
        while not settled():
            await trio.sleep(0.05)
        failures = 0
        last_snapshot = -1e9
        interval = self.settings.snapshot_interval
        next_check = math.inf  # when the pointer in Redis is checked next while nothing changes
        check_every = max(interval, POINTER_CHECK)
        while True:
            due = trio.current_time() >= last_snapshot + interval
            try:
                if self.need_snapshot or (due and self.dirty):
                    await self.write_snapshot("start" if not self._snapshot_keys else
                                              "replaced" if self._replaced else
                                              "recovery" if self.need_snapshot else "interval")
                    last_snapshot = trio.current_time()
                    next_check = last_snapshot + check_every
                elif self.pending:
                    await self._flush()
                elif trio.current_time() >= next_check:
                    next_check = trio.current_time() + check_every
                    await self._check_pointer()
                failures = 0
            except Unavailable:
                self.need_snapshot = True
                failures += 1
                await self.link.backoff(failures)
                continue
            if not self.pending and not self.need_snapshot:
                # A snapshot falls due only after a change, the pointer's check once an interval: sleep until then
                # (a deadline already past would return at once, and this loop would spin at 100% CPU).
                self._wake = trio.Event()
                with trio.move_on_at(last_snapshot + interval if self.dirty else next_check):
                    await self._wake.wait()

    async def _check_pointer(self) -> None:
        """The snapshot pointer in Redis is still the one this writer wrote, else the snapshot is written again
        (someone overwrote it: a gateway starting now would find no snapshot it can load)."""
        raw = await self.link.call("snapshot_read", lambda client: client.get(self.keys.snapshot))
        if self._pointer is not None and raw != self._pointer:
            log.warning("cluster state: the snapshot pointer in Redis is not the one this leader wrote (someone "
                        "else writes to this cluster's keys); writing the snapshot again")
            self.need_snapshot = self._replaced = True

    async def _flush(self) -> None:
        while self.pending:
            size = count = 0
            for entry in self.pending[:MAX_BATCH]:
                size += entry_bytes(entry)
                if count and size > records.LOG_BATCH_BYTES:
                    break
                count += 1
            batch, self.pending = self.pending[:count], self.pending[count:]
            try:
                await self._append(batch)
            except Unavailable:
                self.pending = []  # lost: the gap sends the followers to the next snapshot
                raise

    async def _append(self, batch: list[list[Any]]) -> None:
        self.seq += 1
        seq = self.seq
        fields = {b"w": self.writer_id.encode(), b"n": str(seq).encode(),
                  b"t": str(int(time.time() * 1000)).encode(), b"e": records.pack(batch)}
        if seq == 1 and self.continues is not None:
            fields[b"c"] = records.continuation(*self.continues)
        fields[b"s"] = self.signer.sign(*fields.values())
        xadd = [b"XADD", self.keys.log, b"MAXLEN", b"~", self.settings.stream_length, b"*"]
        for name, value in fields.items():
            xadd += [name, value]
        (added,) = await self.fence.run("log_append", [xadd])
        self.stream_id = records.entry_id(added)
        self.metrics.batches.labels("written").inc()
        for entry in batch:
            self.metrics.entries.labels("written", entry[0]).inc()

    def build_snapshot(self) -> tuple[dict[str, Any], dict[str, list[int]]]:
        """The whole shared truth as it is now: ``(meta, {replica: block keys})`` (synchronous: consistent)."""
        table = self.replicas
        models = [records.model_entry(source, model) for source, model in table.declarations()]
        members = []
        for replica in table:
            source = table.source_of(replica)
            if source is not None:
                members.append([replica_record(replica, source).as_array(),
                                replica.state is ReplicaState.DRAINING, replica.reason])
        index = self.kv_index
        kv_states: dict[str, list[Any]] = {}
        parts: dict[str, list[int]] = {}
        for name in index.replicas():
            kv_states[name] = [index.state(name).value, index.block_size(name) or 0]
            parts[name] = list(index.keys(name))
            if len(parts[name]) > records.MAX_PART_KEYS:  # what the followers read of a part, at most
                if name not in self._clamped_told:
                    self._clamped_told.add(name)
                    log.warning("cluster state: replica %s holds %d blocks; its snapshot part keeps %d of them (the "
                                "most a follower reads; the log's changes still reach the followers; logged once)",
                                name, len(parts[name]), records.MAX_PART_KEYS)
                del parts[name][records.MAX_PART_KEYS:]
        return {"writer": self.writer_id, "models": models, "replicas": members, "kv": kv_states}, parts

    async def write_snapshot(self, reason: str) -> None:
        """Flush what is pending and the state it leads to in one step, then write that state as the snapshot."""
        batch, self.pending = self.pending, []
        meta, parts = self.build_snapshot()  # the state after `batch`, taken with no await in between
        self.dirty = False
        self.need_snapshot = True  # until this one is out
        self.recording = True  # a change from now on is not in it: it goes to the log after it (never dropped)
        await self._append(batch)  # possibly empty: the snapshot always points at a batch of this writer
        seq, stream_id = self.seq, self.stream_id
        assert stream_id is not None
        keys = self.keys
        names = sorted(parts)
        part_keys = {name: keys.snapshot_part(self.writer_id, seq, f"kv:{i}") for i, name in enumerate(names)}
        raw_parts = {name: records.pack(parts[name]) for name in names}
        meta.update(seq=seq, stream_id=stream_id.decode(), parts=part_keys,
                    digests={name: records.part_digest(raw) for name, raw in raw_parts.items()})
        meta_key = keys.snapshot_part(self.writer_id, seq, "meta")
        raw_meta = records.pack(meta)
        pointer = records.snapshot_pointer(keys, self.writer_id, seq, raw_meta, self.signer)
        previous = self._snapshot_keys or await self._previous_snapshot_keys()
        grace_ms = int(SNAPSHOT_GRACE * 1000)

        commands: list[list[Any]] = [[b"SET", part_keys[name], raw_parts[name]] for name in names]
        commands += [[b"SET", meta_key, raw_meta], [b"SET", keys.snapshot, pointer]]
        commands += [[b"PEXPIRE", key, grace_ms] for key in previous]
        await self.fence.run("snapshot_write", commands, timeout=self.settings.timeout + len(names) * 0.01)
        self._snapshot_keys = [*part_keys.values(), meta_key]
        self._pointer = pointer
        self.published = True
        self.need_snapshot = self._replaced = False
        self.metrics.snapshots.labels("written", reason).inc()
        log.log(logging.INFO if reason != "interval" else logging.DEBUG,
                "cluster state: snapshot %d written (%s): %d models, %d replicas, %d blocks", seq, reason,
                len(meta["models"]), len(meta["replicas"]), sum(len(p) for p in parts.values()))

    async def _previous_snapshot_keys(self) -> list[str]:
        """The keys of the snapshot a previous writer left (a restart): they expire once ours is out."""
        raw = await self.link.call("snapshot_read", lambda client: client.get(self.keys.snapshot))
        if raw is None:
            return []
        try:
            pointer = records.decode_snapshot_pointer(raw, self.keys)
            raw_meta = await self.link.call("snapshot_read", lambda client: client.get(pointer.meta))
            if raw_meta is None:
                return []
            # Not checked against the secret (a previous version signed otherwise): the decoder lets it name only
            # keys of that writer's snapshot, which are to expire anyway.
            return [*records.decode_snapshot_meta(raw_meta, self.keys, pointer).every_part, pointer.meta]
        except records.RecordError:
            return []


class TableReads:
    """The reading half of a :class:`~llmgw.control.interfaces.ReplicaTable`: this process's own table."""

    inner: "ReplicaSet"

    def model(self, name: str) -> TierModel | None:
        return self.inner.model(name)

    def declared_models(self) -> list[str]:
        return self.inner.declared_models()

    def members(self, model: str) -> list[Replica]:
        return self.inner.members(model)

    def source_of(self, replica: Replica) -> str | None:
        return self.inner.source_of(replica)

    def describe(self, replica: Replica) -> dict[str, Any]:
        return self.inner.describe(replica)


class PublishedReplicaTable(TableReads):
    """A :class:`~llmgw.control.interfaces.ReplicaTable`: the local :class:`ReplicaSet`, each change recorded.

    Once the writer's term is over, changes are ignored: the control plane stopping (its sources' clean-up) must
    not empty the table this process goes on routing with as a follower."""

    def __init__(self, inner: "ReplicaSet", writer: LogWriter,
                 hand_over: Callable[[Replica], ReplicaRecord | None] = lambda replica: None):
        """``hand_over(replica)``: a replica of its name this leader held from the previous one leaves the table
        (its record, or None), so ``replica``, which a source adds, replaces it."""
        self.inner = inner
        self.writer = writer
        self.hand_over = hand_over

    def declare_model(self, source: str, model: TierModel) -> None:
        if self.writer.ended:
            return
        self.inner.declare_model(source, model)
        self.writer.record(records.model_entry(source, model))

    def withdraw_model(self, source: str, name: str) -> bool:
        if self.writer.ended:
            return False
        gone = self.inner.withdraw_model(source, name)
        self.writer.record([records.UNMODEL, source, name])
        return gone

    def add(self, replica: Replica, source: str) -> bool:
        if self.writer.ended:
            return False
        held = self.hand_over(replica)
        added = self.inner.add(replica, source)
        record = replica_record(replica, source)
        if added and record != held:  # the same as held: the followers have it already
            self.writer.record([records.ADD, record.as_array()])
        elif not added and held is not None:
            self.writer.record([records.REMOVE, replica.name])
        return added

    async def remove(self, replica: Replica) -> None:
        if self.writer.ended:
            return
        self.writer.record([records.REMOVE, replica.name])
        await self.inner.remove(replica)

    async def drain(self, replica: Replica, reason: str, timeout: float) -> None:
        if self.writer.ended:
            return
        self.writer.record([records.DRAIN, replica.name, reason])
        await self.inner.drain(replica, reason, timeout)
        if self.inner.get(replica.name) is None:
            self.writer.record([records.REMOVE, replica.name])


class ResyncListeners:
    """Resync listeners registered through a KV writer: they hear the index's own asks (registered on it) and
    the ones :meth:`remote_resync` passes on (another gateway's)."""

    inner: "KvIndex"
    _listeners: list[Callable[[str, str, str], None]]

    def add_resync_listener(self, listener: Callable[[str, str, str], None]) -> None:
        self._listeners.append(listener)
        self.inner.add_resync_listener(listener)

    def remove_resync_listener(self, listener: Callable[[str, str, str], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)
        self.inner.remove_resync_listener(listener)

    def close(self) -> None:
        """Every listener registered here stops hearing the index (a term's control plane, when it ends)."""
        for listener in list(self._listeners):
            self.remove_resync_listener(listener)

    def remote_resync(self, replica_id: str, mode: str, reason: str) -> None:
        tell_listeners(list(self._listeners), replica_id, mode, reason)


class PublishedKv(ResyncListeners):
    """A :class:`~llmgw.control.interfaces.KvWriter`: the local :class:`KvIndex`, each change recorded.

    Once the writer's term is over, changes are ignored (as :class:`PublishedReplicaTable`'s). Resync listeners
    registered here also hear the other gateways' asks (:meth:`remote_resync`): a follower's
    index that drifted asks the control plane, which owns the agents' streams.
    """

    def __init__(self, inner: "KvIndex", writer: LogWriter):
        self.inner = inner
        self.writer = writer
        self._listeners: list[Callable[[str, str, str], None]] = []
        self.remote_listeners: list[Callable[[str, str, str], None]] = []  # hear only the other gateways' asks

    def apply(self, replica_id: str, changes: ChangesFields) -> None:
        if self.writer.ended:
            return
        self.inner.apply(replica_id, changes)
        self.writer.record(records.kv_entry(replica_id, changes))

    def forget(self, replica_id: str) -> None:
        if self.writer.ended:
            return
        self.inner.forget(replica_id)
        self.writer.record([records.KV_FORGET, replica_id])

    def remove(self, replica_id: str) -> None:
        if self.writer.ended:
            return
        self.inner.remove(replica_id)
        self.writer.record([records.KV_DROP, replica_id])

    def remote_resync(self, replica_id: str, mode: str, reason: str) -> None:
        super().remote_resync(replica_id, mode, reason)
        tell_listeners(self.remote_listeners, replica_id, mode, reason)


def tell_listeners(listeners: list[Callable[[str, str, str], None]], replica_id: str, mode: str,
                   reason: str) -> None:
    """A resync ask, to each listener (one that fails is logged; the others still hear it)."""
    for listener in listeners:
        try:
            listener(replica_id, mode, reason)
        except Exception:
            log.exception("resync listener %r failed for replica %s", listener, replica_id)
