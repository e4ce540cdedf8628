"""The confirmed block index: which replicas' engines hold which block keys, and how many leading blocks of a prompt.

One part of the router's :class:`~llmgw.kv.index.KvIndex` (the other two: the prediction overlay,
:mod:`llmgw.kv.predictions`, and the health tracker, :mod:`llmgw.kv.health`). It knows nothing of states,
predictions nor time: it stores what the engines reported, and walks a prompt's keys over it.

Layout: one dict ``key -> bitmask of replica slots`` for every confirmed
block, plus per replica the set of its keys (for FULL replacement, RESET and
the size gauges). Each replica has a *slot* (one bit) from :meth:`BlockIndex.bit`, freed by
:meth:`BlockIndex.remove` for the next replica; the prediction overlay keys its masks by the same bits, so
that one walk reads both. Matching a prompt walks its keys from block 0 with one dict
lookup per block, AND-ing the candidates' bits; a replica's leading run ends
at the first block it lacks, and the walk stops as soon as no candidate is
left. So a miss costs one lookup, and a 2048-block (32k-token) prompt held
entirely costs 2048 lookups (about 100 µs; ``llmgw/bench/kv_index_ops.py``).

Threads: only the Trio thread writes; the readers (``blocks``, ``keys``, ``sizes``...) may run in a worker thread
(the ``/metrics`` scrape) and copy what they iterate in one step.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence


class _Holdings:
    """One replica's slot and confirmed keys."""

    __slots__ = ("name", "bit", "keys", "block_size", "changes")

    def __init__(self, name: str, bit: int):
        self.name = name
        self.bit = bit
        self.keys: set[int] = set()
        self.block_size = 0
        self.changes = 0  # block changes applied (stored + removed + FULL sizes)


class BlockIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # key -> bitmask of the replica slots holding it
        self._replicas: dict[str, _Holdings] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0

    # -- replicas -------------------------------------------------------------------------------------------------

    def _join(self, replica_id: str) -> _Holdings:
        holdings = self._replicas.get(replica_id)
        if holdings is None:
            slot = heapq.heappop(self._free_slots) if self._free_slots else self._next_slot
            if slot == self._next_slot:
                self._next_slot += 1
            holdings = self._replicas[replica_id] = _Holdings(replica_id, 1 << slot)
        return holdings

    def bit(self, replica_id: str) -> int:
        """The replica's slot bit, given it (with no keys) if it had none."""
        return self._join(replica_id).bit

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self._replicas

    def replicas(self) -> list[str]:
        return list(self._replicas)

    def block_size(self, replica_id: str) -> int | None:
        holdings = self._replicas.get(replica_id)
        return holdings.block_size or None if holdings is not None else None

    def blocks(self, replica_id: str) -> int:
        holdings = self._replicas.get(replica_id)
        return len(holdings.keys) if holdings is not None else 0

    def changes(self, replica_id: str) -> int:
        """Block changes applied to the replica so far (each stored or removed key of a DELTA, a FULL's size)."""
        holdings = self._replicas.get(replica_id)
        return holdings.changes if holdings is not None else 0

    def holds(self, replica_id: str, key: int) -> bool:
        holdings = self._replicas.get(replica_id)
        return holdings is not None and key in holdings.keys

    def keys(self, replica_id: str) -> set[int]:
        holdings = self._replicas.get(replica_id)
        return set(holdings.keys) if holdings is not None else set()

    def sizes(self) -> dict[str, int]:
        """``{replica: blocks}`` (the replicas copied in one step: a reader in another thread may call it)."""
        return {name: len(holdings.keys) for name, holdings in list(self._replicas.items())}

    # -- writing --------------------------------------------------------------------------------------------------

    def update(self, replica_id: str, stored: Sequence[int], removed: Sequence[int], block_size: int = 0) -> None:
        """A DELTA: ``removed`` dropped, then ``stored`` added."""
        holdings = self._join(replica_id)
        if block_size:
            holdings.block_size = block_size
        self._remove_keys(holdings, removed)
        self._add_keys(holdings, stored)
        holdings.changes += len(stored) + len(removed)

    def replace(self, replica_id: str, keys: Iterable[int], block_size: int = 0) -> list[int]:
        """A FULL copy: the replica holds exactly ``keys`` now; the keys it held and no longer does."""
        holdings = self._join(replica_id)
        if block_size:
            holdings.block_size = block_size
        new = set(keys)
        old = holdings.keys
        gone = [k for k in old if k not in new]
        self._remove_keys(holdings, gone)
        self._add_keys(holdings, [k for k in new if k not in old])
        holdings.changes += len(new)
        return gone

    def clear(self, replica_id: str, block_size: int = 0) -> None:
        """A RESET: the replica holds nothing (it keeps its slot)."""
        holdings = self._join(replica_id)
        if block_size:
            holdings.block_size = block_size
        self._remove_keys(holdings, list(holdings.keys))

    def remove(self, replica_id: str) -> None:
        """The replica left: drop its keys and free its slot."""
        holdings = self._replicas.pop(replica_id, None)
        if holdings is not None:
            self._remove_keys(holdings, list(holdings.keys))
            heapq.heappush(self._free_slots, holdings.bit.bit_length() - 1)

    def _add_keys(self, holdings: _Holdings, keys: Iterable[int]) -> None:
        holders, bit, mine = self._holders, holdings.bit, holdings.keys
        for key in keys:
            if key not in mine:
                mine.add(key)
                holders[key] = holders.get(key, 0) | bit

    def _remove_keys(self, holdings: _Holdings, keys: Iterable[int]) -> None:
        holders, bit, mine = self._holders, holdings.bit, holdings.keys
        for key in keys:
            if key in mine:
                mine.discard(key)
                mask = holders[key] & ~bit
                if mask:
                    holders[key] = mask
                else:
                    del holders[key]

    # -- matching -------------------------------------------------------------------------------------------------

    def match_detail(self, keys: Sequence[int], replica_ids: Iterable[str],
                     predicted: Mapping[int, int] | None = None) -> dict[str, tuple[int, int]]:
        """Per replica ``(confirmed, with_predicted)`` leading blocks of ``keys``; ``with_predicted >= confirmed``.

        ``predicted`` maps keys to the bits of the replicas predicted to hold them (the prediction overlay's
        masks); without it both figures are the confirmed run. One walk from block 0 with one or two dict lookups
        per block, ending at the first block no candidate holds (confirmed or predicted).
        """
        ids = list(replica_ids)
        confirmed = dict.fromkeys(ids, 0)
        total = dict.fromkeys(ids, 0)
        bits: list[tuple[str, int]] = []
        alive = 0
        for rid in ids:
            holdings = self._replicas.get(rid)
            if holdings is not None:
                bits.append((rid, holdings.bit))
                alive |= holdings.bit
        if alive:
            holders = self._holders.get
            guesses = predicted.get if predicted else None
            alive_c = alive_t = alive
            end = len(keys)
            for index, key in enumerate(keys):
                held = holders(key, 0)
                if alive_c and alive_c & held != alive_c:
                    still = alive_c & held
                    for rid, bit in bits:
                        if (alive_c ^ still) & bit:
                            confirmed[rid] = index
                    alive_c = still
                if guesses is not None:
                    held |= guesses(key, 0)
                if alive_t & held != alive_t:
                    still = alive_t & held
                    for rid, bit in bits:
                        if (alive_t ^ still) & bit:
                            total[rid] = index
                    alive_t = still
                    if not alive_t:
                        break
            else:
                for rid, bit in bits:
                    if alive_c & bit:
                        confirmed[rid] = end
                    if alive_t & bit:
                        total[rid] = end
        return {rid: (confirmed[rid], total[rid]) for rid in ids}
