"""Which key and team records of the Redis key store are current, so that a revoked key stays revoked.

Every record the store writes carries a revision (signed with it), taken from a counter in Redis that only grows;
every deletion leaves a signed tombstone of the field with its revision. Someone who can write to Redis cannot
forge either, but could put back an older signed record (a revoked key's, or a key's before its limits were
lowered). :class:`Revisions` refuses it: a record whose revision is not above its field's tombstone, or below the
newest this gateway has seen of the field (it remembers them, bounded), is a replay.
"""

from __future__ import annotations

from collections import OrderedDict

LEGACY = 0  # the revision of a record written before records carried one


class Revisions:
    """The newest revision seen of each field (``kind:field``), at most ``bound`` of them (the oldest noted
    forgotten first), and the highest of all (a writer's next revision is above it)."""

    def __init__(self, bound: int):
        self.bound = max(1, bound)
        self.highest = LEGACY
        self._newest: OrderedDict[str, int] = OrderedDict()

    def current(self, field: str, revision: int, tombstone: int | None) -> bool:
        """A record of ``field`` at ``revision`` is current (not a replay); notes it when it is."""
        if tombstone is not None and revision <= tombstone:
            return False
        if revision < self._newest.get(field, LEGACY):
            return False
        self.note(field, revision)
        return True

    def note(self, field: str, revision: int) -> None:
        """``field`` was seen at ``revision`` (a record, or a tombstone)."""
        self.highest = max(self.highest, revision)
        if revision <= self._newest.get(field, -1):
            return
        self._newest[field] = revision
        self._newest.move_to_end(field)
        while len(self._newest) > self.bound:
            self._newest.popitem(last=False)
