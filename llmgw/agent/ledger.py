"""The agent's ledger: a JSON file of the engine processes it runs, so a restarted agent can adopt them.

One entry per shard: who the process is (pid, its start time, process group),
where it serves, what it serves, and the whole StartShard, so that an adopted
shard that dies later can be restarted exactly as it was first started. The
StartShard is kept in its wire form (the plain map ``wire.encode`` sends), so
it is read back with the same forgiving decoder as a message off the network.

Writes are atomic (a temporary file in the same folder, fsync, rename, fsync of
the folder): a crash leaves the old ledger or the new one, never half of one.
The file is private (mode 0600): a StartShard carries the engine's API key.
The file is tiny and written only when a shard starts, restarts or stops, so
the writes are synchronous. A write that fails for want of file descriptors
(:mod:`llmgw.fdpressure`) raises nothing: the entries are kept, and
:meth:`Ledger.save_when_possible` (the shard manager runs it) writes them as
soon as a descriptor is free.

A process is the same one the ledger names only if its pid exists *and* its
start time (``/proc/PID/stat``) matches: pids are reused.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import msgpack
import trio

from .. import wire
from ..fdpressure import ShortageBackoff, capacity_errno, note_shortage
from ..private_file import write_private
from ..procgroup import process_start_time

log = logging.getLogger(__name__)

LEDGER_VERSION = 1


@dataclass
class LedgerEntry:
    shard_id: str
    pid: int
    pid_start_time: int  # clock ticks since boot, from /proc/PID/stat: tells a reused pid from ours
    pgid: int
    spec: wire.StartShard
    http_port: int = 0
    endpoint: str = ""
    started_at: float = 0.0  # wall-clock time the process was started
    restarts: int = 0
    replica_id: str = ""
    rank: int = 0
    fingerprint: str = ""
    generation: int = 0
    gpu_indices: list[int] = field(default_factory=list)
    model: str = ""
    kv_events_endpoint: str = ""  # the ipc:// endpoint the engine's KV-event PUB is bound to ("": none)
    kv_replay_endpoint: str = ""  # the one its replay socket is bound to ("": none)

    @classmethod
    def for_process(cls, spec: wire.StartShard, *, pid: int, pid_start_time: int, pgid: int, http_port: int,
                    endpoint: str, model: str, started_at: float | None = None, restarts: int = 0,
                    kv_events_endpoint: str = "", kv_replay_endpoint: str = "") -> "LedgerEntry":
        return cls(shard_id=spec.shard_id, pid=pid, pid_start_time=pid_start_time, pgid=pgid, spec=spec,
                   http_port=http_port, endpoint=endpoint, started_at=time.time() if started_at is None else started_at,
                   restarts=restarts, replica_id=spec.replica_id, rank=spec.rank, fingerprint=spec.fingerprint,
                   generation=spec.generation, gpu_indices=list(spec.gpu_indices), model=model,
                   kv_events_endpoint=kv_events_endpoint, kv_replay_endpoint=kv_replay_endpoint)

    def to_json(self) -> dict:
        plain = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "spec"}
        plain["gpu_indices"] = list(self.gpu_indices)
        plain["spec"] = msgpack.unpackb(wire.encode(self.spec), raw=False)
        return plain

    @classmethod
    def from_json(cls, raw: dict) -> "LedgerEntry":
        spec = wire.decode(msgpack.packb(raw["spec"], use_bin_type=True))
        if not isinstance(spec, wire.StartShard):
            raise ValueError(f"the stored spec is a {type(spec).__name__}, not a StartShard")
        known = {f.name for f in fields(cls)} - {"spec"}
        return cls(spec=spec, **{k: v for k, v in raw.items() if k in known})


class Ledger:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._entries: dict[str, LedgerEntry] = self._load()
        self._unsaved = trio.Event()  # set while the file lacks the last change (no descriptor to write it)

    def reload(self) -> None:
        """Read the file again (the agent does once it holds the state dir's lock: until then another agent
        may have been writing it)."""
        self._entries = self._load()

    def entries(self) -> list[LedgerEntry]:
        return list(self._entries.values())

    def get(self, shard_id: str) -> LedgerEntry | None:
        return self._entries.get(shard_id)

    def put(self, entry: LedgerEntry) -> None:
        self._entries[entry.shard_id] = entry
        self._save()

    def remove(self, shard_id: str, *, pid: int | None = None) -> None:
        """Forget a shard; with ``pid``, only if the entry still names that process (not a successor's)."""
        entry = self._entries.get(shard_id)
        if entry is None or (pid is not None and entry.pid != pid):
            return
        del self._entries[shard_id]
        self._save()

    @staticmethod
    def alive(entry: LedgerEntry) -> bool:
        """The entry's process still runs: its pid exists, is not a zombie, and started when the ledger says."""
        return entry.pid > 0 and process_start_time(entry.pid) == entry.pid_start_time

    def _load(self) -> dict[str, LedgerEntry]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            raw = json.loads(text)
            if raw.get("version") != LEDGER_VERSION:
                raise ValueError(f"ledger version {raw.get('version')!r} is not {LEDGER_VERSION}")
            items = raw["shards"]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self._set_aside(f"unreadable ({exc})")
            return {}
        entries = {}
        for shard_id, item in items.items():
            try:
                entries[shard_id] = LedgerEntry.from_json(item)
            except (ValueError, KeyError, TypeError, wire.WireError) as exc:
                log.error("ledger %s: dropping the entry of shard %s, which cannot be read: %s",
                          self.path, shard_id, exc)
        return entries

    def _set_aside(self, why: str) -> None:
        """Keep a broken ledger for a human to look at, and start an empty one."""
        aside = self.path.with_name(f"{self.path.name}.broken-{int(time.time())}")
        log.error("ledger %s is %s; moved it to %s and starting empty (its engines, if any, are not adopted)",
                  self.path, why, aside)
        os.replace(self.path, aside)

    async def save_when_possible(self) -> None:
        """Until cancelled: write the ledger again, with a back-off, after a write that found no descriptor."""
        backoff = ShortageBackoff()
        while True:
            await self._unsaved.wait()
            await trio.sleep(backoff.next_delay())
            if self._save():
                backoff.succeeded()

    def _save(self) -> bool:
        """Write the file; False when no descriptor was free (retried by :meth:`save_when_possible`)."""
        body = {"version": LEDGER_VERSION, "shards": {sid: e.to_json() for sid, e in self._entries.items()}}
        try:
            write_private(self.path, json.dumps(body, indent=1, sort_keys=True).encode())
        except OSError as exc:
            if capacity_errno(exc) is None:
                raise
            note_shortage("ledger", exc, str(self.path))
            self._unsaved.set()
            return False
        if self._unsaved.is_set():
            self._unsaved = trio.Event()
        return True
