"""The seats a profile's engine declares: ``--max-num-seqs`` in its ``args`` (vLLM's flag, the simulator's too).

The busy signal (:mod:`.signals`) divides each replica's requests in flight by its engine's seats. The flow room
learns them, but only once an engine has queued on two scrapes in a row, which a lightly loaded engine may not do
until the load saturates it: too late to step up ahead of it. A profile that states the flag gives them from the
first request; what the room learns takes over when it knows.
"""

from __future__ import annotations

from collections.abc import Sequence

FLAG = "--max-num-seqs"
MAX_SEATS = 100_000  # the flow room's bound on a replica's capacity: a larger figure is no figure


def declared_seats(args: Sequence[str]) -> int | None:
    """The last ``--max-num-seqs N`` (or ``--max-num-seqs=N``) of ``args`` as a count of seats; None when absent
    or not a whole number from 1 to :data:`MAX_SEATS`."""
    found: str | None = None
    for index, arg in enumerate(args):
        if arg == FLAG and index + 1 < len(args):
            found = args[index + 1]
        elif arg.startswith(FLAG + "="):
            found = arg[len(FLAG) + 1:]
    if found is None or not (found.isascii() and found.strip().isdigit()):
        return None
    seats = int(found)
    return seats if 1 <= seats <= MAX_SEATS else None
