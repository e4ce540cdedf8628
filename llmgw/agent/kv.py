"""The agent's side of the KV-index tier: one engine subscription and mirror per shard, relayed up every stream.

:class:`AgentKv` belongs to an agent (one per node). For every shard whose
profile has ``kv_events: true`` (rank 0 of its replica: followers of a
multi-node replica serve no API and publish nothing the router can use), the
:class:`~llmgw.agent.shards.ShardManager` runs :meth:`AgentKv.run_shard` in
the nursery that owns the shard's supervisor, *before* the engine starts:

- an :class:`~llmgw.kv.subscriber.EngineSubscription` connects to the
  engine's ``ipc://`` sockets in the agent's private socket directory
  (:mod:`llmgw.agent.kv_sockets`: the engine binds them, the launch gets them
  as ``LaunchContext.kv_events_endpoint`` / ``kv_replay_endpoint``); it lives
  as long as the supervisor, across engine restarts (the supervisor calls
  :meth:`ShardKv.notify_engine_restart` before it relaunches a dead engine),
  and cancelling it closes the sockets;
- an :class:`~llmgw.kv.mirror.EngineMirror` keeps the engine's device blocks,
  keyed as the profile's ``kv_key_mode`` says (from the model's
  ``key_function``): by content (the default), or by the engine's hashes,
  checking their parity with the router's ``vllm`` keys (``sha256_cbor``, seed
  ``"0"``: what the engine plugins start the engine with).

Per stream connection (:meth:`AgentKv.session`, run in the agent's session
nursery) one :func:`~llmgw.kv.mirror.flush_loop` per shard sends a FULL copy,
then net changes every 25 ms; the loops are cancelled when the stream drops
(or the shard ends), so every reconnect starts with a FULL copy.

Adoption. Engines outlive the agent, and an adopted engine keeps its
sockets. So the endpoints are recorded in the ledger entry
(``kv_events_endpoint``, ``kv_replay_endpoint``) and a new agent connects to
the *same* ones; the subscription starts with no sequence, so the engine's
next batch is a gap from 0 that the replay fills (vLLM buffers the last
batches), or a RESET ``gap`` when it cannot: the index re-learns from then
on. An engine an older agent started with loopback TCP endpoints (a ledger
entry without them) is not followed until it restarts: logged.

Resync. When the router's index of a shard's replica drifts from what the
engine reports, the control plane sends :class:`llmgw.wire.KvResync`
(:meth:`AgentKv.resync`): ``full`` makes the next flush a FULL copy of the
mirror, ``reset`` drops the mirror (a RESET ``resync`` goes up) so the index
relearns from the engine's next events.

Only data-parallel rank 0 exists so far (profiles have no DP size); the rank
is carried in every message for when they do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Awaitable, Callable

import trio
from prometheus_client import CollectorRegistry

from .. import wire
from ..kv.changes import BlockChanges
from ..kv.keys import VllmBlockKeys
from ..kv.metrics import KvMetrics
from ..kv.mirror import DEFAULT_KEY_MODE, KEY_MODES, EngineMirror, flush_loop, resync
from ..kv.subscriber import DEFAULT_MAX_MESSAGE_BYTES, EngineSubscription
from ..plugins_manager import Registry
from .engine import KV_HASH_ALGO, KV_HASH_SEED, served_name
from .kv_sockets import KvEndpoints, KvSocketDir

log = logging.getLogger(__name__)

FLUSH_INTERVAL = 0.025


def wants_kv(spec: wire.StartShard) -> bool:
    """Whether the agent follows this shard's KV events: the profile asks, and it is rank 0 of its replica."""
    return bool(spec.profile.kv_events) and not (spec.node_count > 1 and spec.rank > 0)


@dataclass
class ShardKv:
    """One shard's subscription(s) and mirror(s) (index = data-parallel rank), and the relays of its changes."""

    spec: wire.StartShard
    endpoints: KvEndpoints
    subscriptions: list[EngineSubscription] = field(default_factory=list)
    mirrors: list[EngineMirror] = field(default_factory=list)
    _relays: set[trio.CancelScope] = field(default_factory=set)

    @property
    def shard_id(self) -> str:
        return self.spec.shard_id

    def notify_engine_restart(self) -> None:
        """The supervisor is about to relaunch the engine: its cache is empty, its sequence starts at 0."""
        for sub in self.subscriptions:
            sub.notify_engine_restart()

    def describe(self) -> dict:
        return {"shard_id": self.shard_id, "replica_id": self.spec.replica_id,
                "events_endpoint": self.endpoints.events, "replay_endpoint": self.endpoints.replay,
                "ranks": [{"rank": r, "blocks": len(m), "last_seq": s.last_seq, "resets": dict(s.resets),
                           "gaps": s.gaps, "key_mode": m.key_mode, "parity": m.parity, "problem": m.problem}
                          for r, (s, m) in
                          enumerate(zip(self.subscriptions, self.mirrors))]}

    async def relay(self, send: Callable[[wire.Message], Awaitable[None]]) -> None:
        """Send this shard's changes through ``send`` until cancelled (by the stream's end or the shard's)."""
        with trio.CancelScope() as scope:
            self._relays.add(scope)
            try:
                async with trio.open_nursery() as nursery:
                    for rank, mirror in enumerate(self.mirrors):
                        nursery.start_soon(partial(flush_loop, mirror, partial(self._send_changes, send, rank),
                                                   interval=FLUSH_INTERVAL))
            finally:
                self._relays.discard(scope)

    async def _send_changes(self, send: Callable[[wire.Message], Awaitable[None]], rank: int,
                            changes: BlockChanges) -> None:
        """One rank's changes up the stream, as the wire message naming this shard and replica."""
        await send(wire.KvChanges(shard_id=self.shard_id, replica_id=self.spec.replica_id, data_parallel_rank=rank,
                                  kind=changes.kind, block_size=changes.block_size, stored=changes.stored,
                                  removed=changes.removed, reason=changes.reason))

    def stop_relays(self) -> None:
        for scope in list(self._relays):
            scope.cancel()


class AgentKv:
    """Every KV-following shard of one agent, and the stream their changes go up (see the module docstring)."""

    def __init__(self, registry: Registry, node_id: str, *, sockets: KvSocketDir,
                 metrics_registry: CollectorRegistry | None = None, idle_probe: float | None = 2.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.registry = registry
        self.node_id = node_id
        self.sockets = sockets
        self.metrics = KvMetrics.for_registry(metrics_registry if metrics_registry is not None
                                              else CollectorRegistry())
        self.idle_probe = idle_probe
        self.max_message_bytes = max_message_bytes
        self.shards: dict[tuple[str, int], ShardKv] = {}  # by (shard id, generation)
        self._session: tuple[trio.Nursery, Callable[[wire.Message], Awaitable[None]]] | None = None

    def get(self, spec: wire.StartShard) -> ShardKv | None:
        return self.shards.get((spec.shard_id, spec.generation))

    # -- one shard -----------------------------------------------------------------------------------------------

    async def run_shard(self, spec: wire.StartShard, *, endpoints: KvEndpoints | None = None,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Connect the shard's subscription (to ``endpoints`` when adopting, else to new ones in the private socket
        directory), report the :class:`ShardKv`, and follow the engine until cancelled (the shard's supervisor
        ended)."""
        kv = ShardKv(spec, endpoints or self.sockets.endpoints(spec))
        source = self.metrics.source(self.node_id, spec.replica_id, served_name(spec))
        rank = 0
        mode = spec.profile.kv_key_mode if spec.profile.kv_key_mode in KEY_MODES else DEFAULT_KEY_MODE
        mirror = EngineMirror(key_mode=mode, verify_keys=VllmBlockKeys(KV_HASH_ALGO, KV_HASH_SEED),
                              on_ignored=source.ignored, on_parity=source.parity, name=spec.shard_id)
        sub = EngineSubscription(
            kv.endpoints.events, mode="connect", replay_endpoint=kv.endpoints.replay, topic=b"kv",
            data_parallel_rank=rank, decode=self.registry.get("event_decoders", "vllm")(), on_batch=mirror.apply,
            on_reset=mirror.reset, metrics=source, source=f"{spec.shard_id}/dp{rank}", idle_probe=self.idle_probe,
            max_message_bytes=self.max_message_bytes)
        key = (spec.shard_id, spec.generation)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(sub.run)
                kv.subscriptions.append(sub)
                kv.mirrors.append(mirror)
                self.shards[key] = kv
                if self._session is not None:
                    session_nursery, send = self._session
                    session_nursery.start_soon(kv.relay, send)
                log.debug("shard %s: KV events from %s, replay from %s", spec.shard_id, kv.endpoints.events,
                          kv.endpoints.replay)
                task_status.started(kv)
                await trio.sleep_forever()
        finally:
            kv.stop_relays()
            if self.shards.get(key) is kv:
                del self.shards[key]

    def resync(self, request: wire.KvResync) -> bool:
        """Answer the router's resync request for one of this agent's shards; False when no such shard or rank
        follows KV events here."""
        for kv in self.shards.values():
            rank = request.data_parallel_rank
            if kv.shard_id == request.shard_id and 0 <= rank < len(kv.mirrors):
                log.info("shard %s: the router asks for a %s KV resync (%s)", kv.shard_id, request.mode,
                         request.reason or "drift")
                resync(request.mode, kv.mirrors[rank], kv.subscriptions[rank])
                return True
        return False

    # -- one stream ----------------------------------------------------------------------------------------------

    async def session(self, send: Callable[[wire.Message], Awaitable[None]], *,
                      task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Relay every shard's changes through ``send`` (a FULL copy first) until cancelled (the stream ended)."""
        async with trio.open_nursery() as nursery:
            self._session = (nursery, send)
            try:
                for kv in list(self.shards.values()):
                    nursery.start_soon(kv.relay, send)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._session = None
