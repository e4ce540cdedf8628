"""The vocabulary of KV-cache block changes: what an engine mirror emits and the router's index applies.

:class:`BlockChanges` is one change of one engine rank's held blocks; the
mirror (:mod:`llmgw.kv.mirror`) produces them and :meth:`KvIndex.apply
<llmgw.kv.index.KvIndex.apply>` takes anything with these fields. The agent's
wire message :class:`llmgw.wire.KvChanges` carries the same fields (plus the
shard and replica they are about) and uses :class:`KvChangeKind` as its
``kind``: wire depends on these types, never the other way round.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol


class KvChangeKind(str, enum.Enum):
    DELTA = "delta"  # net stored/removed blocks since the last message
    FULL = "full"  # the whole mirror: replaces what the control plane knew
    RESET = "reset"  # the engine's cache is empty (restart, AllBlocksCleared, unfillable gap)

    @classmethod
    def _missing_(cls, value: object) -> KvChangeKind:
        return cls.RESET  # unknown: forget what we knew rather than trust it


@dataclass
class BlockChanges:
    """One change of one engine rank's held block keys: DELTA (``stored``/``removed``), FULL (``stored`` is all
    of them) or RESET (none held; ``reason`` says why)."""

    kind: KvChangeKind = KvChangeKind.DELTA
    block_size: int = 0
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    reason: str = ""


def sliced(changes: "ChangesFields", size: int) -> list["ChangesFields"]:
    """``changes`` as changes of at most ``size`` keys each, applied in order to the same effect: a FULL's first
    slice a FULL (with its reason), the rest DELTAs storing; a DELTA's stored and removed keys a slice at a time."""
    kind, stored, removed = changes.kind, changes.stored, changes.removed
    if kind is KvChangeKind.RESET or len(stored) + len(removed) <= size:
        return [changes]
    out: list[ChangesFields] = []
    for start in range(0, max(len(stored), len(removed)), size):
        first = kind is KvChangeKind.FULL and start == 0
        out.append(BlockChanges(KvChangeKind.FULL if first else KvChangeKind.DELTA, changes.block_size,
                                list(stored[start:start + size]), list(removed[start:start + size]),
                                changes.reason if first or kind is KvChangeKind.DELTA else ""))
    return out


UNUSABLE_KEYS = "unusable keys: "  # the reason of a FULL whose keys cannot match the router's, then what to do


def unusable_keys_reason(problem: str) -> str:
    """The ``reason`` of a FULL copy from a mirror whose keys can never match the router's (a hash-parity
    failure, or content keys without the events' ``token_ids``): the index state turns ``unusable_keys`` and
    shows ``problem``, the fix in words. Carried in the reason so that the agent's wire message and the
    cluster's Redis records pass it on unchanged."""
    return UNUSABLE_KEYS + problem


def unusable_keys_problem(reason: str) -> str | None:
    """What :func:`unusable_keys_reason` put in a FULL's reason, or None when the copy's keys are usable."""
    return reason[len(UNUSABLE_KEYS):] if reason.startswith(UNUSABLE_KEYS) else None


class ChangesFields(Protocol):
    """What :meth:`KvIndex.apply <llmgw.kv.index.KvIndex.apply>` reads: a :class:`BlockChanges`, or the wire's
    ``KvChanges`` (the same fields)."""

    kind: KvChangeKind
    block_size: int
    stored: list[int]
    removed: list[int]
    reason: str
