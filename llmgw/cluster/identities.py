"""Node identities in the cluster's Redis: a new leader checks the same node secrets as the old one.

What is kept is what :class:`~llmgw.control.identity.NodeIdentities` keeps
on disk, less the placement key: per node id, the SHA-256 of its secret, when
and from where it joined (``llmgw:CLUSTER:nodes``, a hash of signed msgpack
records). Node secrets themselves never leave the agents; the placement key
is derived from the cluster secret (:func:`placement_key`) by every candidate
and never stored anywhere.

The leader writes each binding as it is made or forgotten, under its term's
fence (:class:`~.election.Fence`: a stale leader cannot bind a node id); a new
leader merges what Redis holds into its own store before it serves agents, and
writes back what only it knew.

Every candidate also keeps a copy of the hash as it last read it
(:meth:`SharedIdentities.follow`, every ``snapshot_interval``): a Redis that
restarts empty loses the hash, and a candidate elected then that never led
would not know any node (a node whose join token was rotated since would be
refused, its replicas lost). The leader keeps a marker field (``""``, never a
node id) in the hash, so that a hash that is gone (Redis lost it: the copy is
kept) is told from one whose last node was forgotten (the copy follows it).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import TYPE_CHECKING, Any

import trio

from ..control.identity import Identity
from . import records
from .link import Unavailable

if TYPE_CHECKING:
    from ..control.identity import NodeIdentities
    from .election import Fence
    from .link import RedisLink
    from .metrics import ClusterMetrics
    from .records import Keys

log = logging.getLogger(__name__)

MAX_PENDING = 10_000
MARKER = b""  # a field of the hash that is no node id: the hash exists while a leader keeps it
PLACEMENT_CONTEXT = b"llmgw placement key v1"


def placement_key(cluster_secret: bytes | None) -> bytes | None:
    """The placement key every candidate of a cluster derives from its secret (``state.secret_env``); None
    without one (each control plane then keeps a key of its own on disk, and a new leader cannot adopt engines
    another one placed)."""
    if cluster_secret is None:
        return None
    return hmac.new(cluster_secret, PLACEMENT_CONTEXT, hashlib.sha256).digest()


def encode(node_id: str, identity: Identity, signer: records.Signer) -> bytes:
    body = records.pack([node_id, identity.secret_sha256, identity.joined_at, identity.peer])
    return records.pack([body, signer.sign(body)])


def decode(node_id: str, raw: Any, signer: records.Signer) -> Identity:
    """A binding read from Redis; :class:`~.records.RecordError` when it is not one of this cluster's."""
    return decode_signed(node_id, raw, signer)[0]


def decode_signed(node_id: str, raw: Any, signer: records.Signer) -> tuple[Identity, records.Signed]:
    """A binding read from Redis and which secret signed it (the previous one: a leader writes it again at its
    next term's start); :class:`~.records.RecordError` when it is not one of this cluster's."""
    try:
        body, signature = records.unpack(raw)
        signed = signer.verify(signature, body)
        if signed is records.Signed.NOT:
            raise records.RecordError("not signed with the cluster secret")
        named, digest, joined_at, peer = records.unpack(body)
        if named != node_id or not isinstance(digest, str) or len(digest) != 64 or not isinstance(peer, str):
            raise records.RecordError("not a node identity")
        int(digest, 16)
        return Identity(digest, float(joined_at), peer[:300]), signed
    except (ValueError, TypeError) as exc:
        raise records.RecordError(str(exc)) from None


class SharedIdentities:
    """Loads the cluster's bindings into a leader's store, and writes the leader's new ones back."""

    def __init__(self, link: "RedisLink", keys: "Keys", signer: records.Signer, metrics: "ClusterMetrics",
                 max_nodes: int = MAX_PENDING):
        self.link = link
        self.keys = keys
        self.signer = signer
        self.metrics = metrics
        self.max_nodes = max_nodes
        self.known: dict[str, Identity] = {}  # the bindings as last read from Redis
        self._raw: dict[bytes, bytes] = {}  # their records as read (an unchanged one is not checked again)
        self._previous: set[str] = set()  # the node ids of those only the previous cluster secret signed

    async def follow(self, every: float, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep :attr:`known` as Redis holds it, read every ``every`` seconds, until cancelled."""
        task_status.started()
        while True:
            try:
                await self._read()
            except Unavailable:
                pass  # what was last read is kept
            await trio.sleep(every)

    async def _read(self) -> bool:
        """Read the hash into :attr:`known`; False when it is gone from Redis (then :attr:`known` is kept)."""
        key = self.keys.nodes
        raw = await self.link.call("identities_read", lambda client: client.hgetall(key)) or {}
        if not raw:
            return False
        known: dict[str, Identity] = {}
        previous: set[str] = set()
        for name, value in list(raw.items())[:self.max_nodes + 1]:
            name = name if isinstance(name, bytes) else str(name).encode()
            if name == MARKER:
                continue
            node_id = name.decode("utf-8", "replace")
            if self._raw.get(name) == value and node_id in self.known:
                known[node_id] = self.known[node_id]
                if node_id in self._previous:
                    previous.add(node_id)
                continue
            try:
                known[node_id], signed = decode_signed(node_id, value, self.signer)
            except records.RecordError:
                self.metrics.bad_records.labels("nodes").inc()
                continue
            if signed is records.Signed.PREVIOUS:
                previous.add(node_id)
        self.known, self._previous = known, previous
        self.metrics.previous_secret_nodes.set(len(previous))
        self._raw = {name if isinstance(name, bytes) else str(name).encode(): value for name, value in raw.items()
                     if isinstance(value, bytes)}
        return True

    async def load_into(self, store: "NodeIdentities") -> None:
        """Merge the bindings in Redis into ``store`` (a new term, before any agent is served); when the hash is
        gone (Redis restarted empty) or Redis fails, the copy this process last read."""
        try:
            present = await self._read()
        except Unavailable:
            present = False
            log.warning("cluster leader: the node identities in Redis could not be read; using the %d this process "
                        "last read (an agent that joined since must join again)", len(self.known))
        else:
            if not present and self.known:
                log.warning("cluster leader: the node identities are gone from Redis (it restarted empty?): the %d "
                            "this process last read are used, and written back", len(self.known))
        changed = store.merge(dict(list(self.known.items())[:store.max_nodes]))
        log.info("cluster leader: %d node identities in the cluster, %d new here", len(self.known), changed)

    async def write_from(self, store: "NodeIdentities", fence: "Fence") -> None:
        """For the term: every binding ``store`` has that Redis lacks, then each change as it is made."""
        pending: dict[str, Identity | None] = dict(store.identities())
        wake = trio.Event()

        def changed(node_id: str, identity: Identity | None) -> None:
            nonlocal wake
            if len(pending) < MAX_PENDING or node_id in pending:
                pending[node_id] = identity
                wake.set()

        store.on_change = changed
        failures = 0
        marked = False
        try:
            while True:
                batch = dict(pending)
                pending.clear()
                # The marker first (once a term): the hash then exists even with no node in it.
                commands: list[list[Any]] = [] if marked else [[b"HSET", self.keys.nodes, MARKER, b"1"]]
                for node_id, identity in batch.items():
                    if identity is None:
                        commands.append([b"HDEL", self.keys.nodes, node_id])
                    else:
                        commands.append([b"HSET", self.keys.nodes, node_id, encode(node_id, identity, self.signer)])
                try:
                    if commands:
                        await fence.run("identities_write", commands)
                    marked = True
                    failures = 0
                except Unavailable:
                    for node_id, identity in batch.items():
                        pending.setdefault(node_id, identity)  # tried again: newer changes win
                    failures += 1
                    await self.link.backoff(failures)
                    continue
                if not pending:
                    wake = trio.Event()
                    await wake.wait()
        finally:
            store.on_change = None
