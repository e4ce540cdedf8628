"""Node identities: which node ids have joined, each bound to a secret of its own, and proofs of placement.

The join token admits a *new* node id once. On that first registration the
control plane issues the node a secret (32 random bytes, hex), which the agent
keeps in its state dir and presents on every reconnect; from then on the node
id belongs to whoever proves that secret, and the join token alone no longer
opens it. Only the secret's SHA-256 is kept here, compared in constant time.

A *placement proof* binds a shard to the node it was placed on:
``HMAC-SHA256(placement key, node id, shard id, replica id, rank, generation,
fingerprint)``. The control plane puts it in every StartShard; the agent keeps
the StartShard in its ledger and reports the proof with the shard. After a
control-plane restart, an agent's report of a running shard is adopted only
when its proof checks out for the node that reports it, so a node can never
claim a shard it was not given. The placement key never leaves this process
and this file.

Both live in ``nodes.json`` in ``agents.control_state_dir`` (mode 0600),
written atomically, so a control-plane restart keeps identities and proofs.
In a cluster with a shared state the placement key is derived from the
cluster secret instead (the same in every candidate, never stored), and the
bindings are also kept in Redis (:mod:`llmgw.cluster.identities`), so a new
leader on another host checks the same secrets and proofs.
A missing file is an empty store; an unreadable one is an error at start
(starting empty would re-open every node id to the join token).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import wire
from ..private_file import write_private

log = logging.getLogger(__name__)

STORE_VERSION = 1
STORE_NAME = "nodes.json"
MAX_NODES = 10_000  # identities kept: a join-token holder cannot grow the file (and its rewrites) without bound
MAX_NODE_ID = 253  # characters (a DNS name's)


class IdentityStoreError(Exception):
    """The identity file exists but cannot be used."""


def default_control_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "llmgw" / "control"


def new_secret() -> str:
    return secrets.token_hex(32)


def _proof(key: bytes, node_id: str, shard: wire.StartShard | wire.ShardReport) -> str:
    fields = (node_id, shard.shard_id, shard.replica_id, str(shard.rank), str(shard.generation), shard.fingerprint)
    return hmac.new(key, "\0".join(fields).encode(), hashlib.sha256).hexdigest()


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass
class Identity:
    secret_sha256: str
    joined_at: float  # wall clock of the first registration
    peer: str = ""  # where it first joined from, for operators


class NodeIdentities:
    """The node id -> secret bindings and the placement key, persisted in ``directory/nodes.json``."""

    def __init__(self, directory: Path | str, max_nodes: int = MAX_NODES, placement_key: bytes | None = None,
                 previous_placement_key: bytes | None = None):
        """``placement_key``: given (a cluster's, derived from its secret: the same in every candidate), it is
        used instead of the one in the file, and never stored. ``previous_placement_key``: the one derived from
        the cluster's previous secret during a rotation: proofs made with it are accepted too (and issued anew)."""
        self._previous_key = previous_placement_key if placement_key is not None else None
        self.path = Path(directory) / STORE_NAME
        self.max_nodes = max_nodes
        self._nodes: dict[str, Identity] = {}
        self._placement_key: bytes | None = None
        self.on_change: Callable[[str, Identity | None], None] | None = None  # after bind and forget
        self._load()
        self._fixed_key = placement_key is not None
        if placement_key is not None:
            self._placement_key = placement_key

    # -- identities ----------------------------------------------------------------------------------------------

    def known(self, node_id: str) -> bool:
        return node_id in self._nodes

    def node_ids(self) -> list[str]:
        return sorted(self._nodes)

    @property
    def full(self) -> bool:
        return len(self._nodes) >= self.max_nodes

    def verify(self, node_id: str, secret: str) -> bool:
        """``secret`` is the one issued to ``node_id`` (constant time; False for an unknown node)."""
        identity = self._nodes.get(node_id)
        if identity is None or not secret:
            return False
        return hmac.compare_digest(_digest(secret), identity.secret_sha256)

    def bind(self, node_id: str, secret: str, peer: str = "") -> None:
        """Bind ``node_id`` to ``secret`` (its first join, or after :meth:`forget`); persisted before returning."""
        identity = self._nodes[node_id] = Identity(_digest(secret), time.time(), peer)
        if self.on_change is not None:
            self.on_change(node_id, identity)
        self._save()

    def forget(self, node_id: str) -> bool:
        """Drop a node's binding: its id can join again with a join token (and gets a new secret)."""
        if self._nodes.pop(node_id, None) is None:
            return False
        if self.on_change is not None:
            self.on_change(node_id, None)
        self._save()
        return True

    def identities(self) -> dict[str, Identity]:
        return dict(self._nodes)

    def merge(self, known: dict[str, Identity]) -> int:
        """Take the bindings another control plane of the cluster made (a new leader's start); how many changed
        here. A node id bound here and there takes the newer binding."""
        changed = 0
        for node_id, identity in known.items():
            mine = self._nodes.get(node_id)
            if mine is None and len(self._nodes) >= self.max_nodes:
                break
            if mine is None or (mine != identity and identity.joined_at >= mine.joined_at):
                self._nodes[node_id] = identity
                changed += 1
        if changed:
            try:
                self._save()
            except OSError as exc:
                log.error("cannot store the cluster's node identities in %s (%s)", self.path, exc)
        return changed

    # -- placement proofs ----------------------------------------------------------------------------------------

    def placement_proof(self, node_id: str, shard: wire.StartShard | wire.ShardReport) -> str:
        """The proof that ``shard`` (its id, replica, rank, generation, fingerprint) was placed on ``node_id``."""
        if self._placement_key is None:
            self._placement_key = secrets.token_bytes(32)
            try:
                self._save()
            except OSError as exc:  # proofs still work until a restart; engines are then restarted, not adopted
                log.error("cannot store the placement key in %s (%s): after a restart of the control plane, the "
                          "engines it starts now cannot be adopted", self.path, exc)
        return _proof(self._placement_key, node_id, shard)

    def proven(self, node_id: str, report: wire.ShardReport) -> bool:
        """The report carries a valid proof that its shard was placed on ``node_id``."""
        if self._placement_key is None or not report.placement_proof:
            return False
        return hmac.compare_digest(self.placement_proof(node_id, report), report.placement_proof) \
            or self.proven_by_previous(node_id, report)

    def proven_by_previous(self, node_id: str, report: wire.ShardReport) -> bool:
        """The report's proof was made with the previous cluster secret's key (a rotation): valid, to issue anew."""
        if self._previous_key is None or not report.placement_proof:
            return False
        return hmac.compare_digest(_proof(self._previous_key, node_id, report), report.placement_proof)

    # -- the file ------------------------------------------------------------------------------------------------

    def _load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise IdentityStoreError(f"{self.path}: {exc}") from None
        try:
            raw = json.loads(data.decode("utf-8"))
            if raw.get("version") != STORE_VERSION:
                raise ValueError(f"version {raw.get('version')!r} is not {STORE_VERSION}")
            key = raw.get("placement_key")
            self._placement_key = bytes.fromhex(key) if key else None
            self._nodes = {str(node_id): Identity(str(item["secret_sha256"]), float(item.get("joined_at", 0.0)),
                                                  str(item.get("peer", "")))
                           for node_id, item in raw["nodes"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise IdentityStoreError(f"{self.path} cannot be read ({exc}); fix it, or move it away to make every "
                                     "node join again with the join token") from None

    def _save(self) -> None:
        key = None if self._fixed_key else self._placement_key
        body = {"version": STORE_VERSION,
                "placement_key": key.hex() if key else None,
                "nodes": {node_id: {"secret_sha256": i.secret_sha256, "joined_at": i.joined_at, "peer": i.peer}
                          for node_id, i in sorted(self._nodes.items())}}
        write_private(self.path, json.dumps(body, indent=1).encode())
