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


class ChangesFields(Protocol):
    """What :meth:`KvIndex.apply <llmgw.kv.index.KvIndex.apply>` reads: a :class:`BlockChanges`, or the wire's
    ``KvChanges`` (the same fields)."""

    kind: KvChangeKind
    block_size: int
    stored: list[int]
    removed: list[int]
    reason: str
