"""The engines an agent leaves running when it exits: count them, and stop them for good (``llmgw down``).

An agent's engines outlive it on purpose, so the next agent over the same
state dir adopts them. :func:`running_engines` says how many are left (from the
ledger, checking each pid and its start time). :func:`stop_engines` is the way
to end them without an agent: it takes the state dir's lock (so no agent can
adopt or restart them meanwhile), sends SIGTERM to each engine's process
group, waits up to ``grace`` seconds, then SIGKILLs what is left, and removes
each stopped engine from the ledger.
"""

from __future__ import annotations

import functools
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import trio

from ..procgroup import group_has_running_members, process_group_of, signal_group, terminate_group
from .ledger import Ledger, LedgerEntry
from .shards import LEDGER_FILE
from .statelock import StateDirLock

POLL = 0.05
AFTER_KILL = 10.0  # how long a SIGKILLed group may take to be gone (a process stuck in the kernel never goes)


@dataclass(frozen=True)
class Stopped:
    entry: LedgerEntry
    outcome: str  # "terminated", "killed", "not running", "left alone: ...", "still there after SIGKILL"

    @property
    def stopped_now(self) -> bool:
        return self.outcome in ("terminated", "killed")

    @property
    def gone(self) -> bool:
        """The engine no longer runs (it was stopped now or had exited before)."""
        return self.stopped_now or self.outcome == "not running"

    def describe(self) -> str:
        return f"shard {self.entry.shard_id} (pid {self.entry.pid}): {self.outcome}"


def running_engines(state_dir: Path | str) -> list[LedgerEntry]:
    """The engines the ledger in ``state_dir`` lists whose process still runs."""
    path = Path(state_dir) / LEDGER_FILE
    if not path.exists():
        return []
    return [entry for entry in Ledger(path).entries() if _well_formed(entry) and Ledger.alive(entry)]


def _well_formed(entry: LedgerEntry) -> bool:
    """Pids that are ints (the ledger is a file: never pass what it holds to a signal unchecked)."""
    return all(type(value) is int for value in (entry.pid, entry.pgid, entry.pid_start_time))


async def stop_engines(state_dir: Path | str, grace: float = 30.0,
                       on_stopped: Callable[[Stopped], None] = lambda stopped: None) -> list[Stopped]:
    """Stop every engine the ledger in ``state_dir`` lists; :class:`~llmgw.agent.statelock.StateDirBusy` when an
    agent holds the dir (it would restart them)."""
    results: list[Stopped] = []
    with StateDirLock(state_dir):
        ledger = Ledger(Path(state_dir) / LEDGER_FILE)

        async def stop(entry: LedgerEntry) -> None:
            stopped = Stopped(entry, await _stop_one(entry, grace))
            if stopped.gone:
                ledger.remove(entry.shard_id, pid=entry.pid)
            results.append(stopped)
            on_stopped(stopped)

        async with trio.open_nursery() as nursery:
            for entry in ledger.entries():
                nursery.start_soon(stop, entry)
    return results


async def _stop_one(entry: LedgerEntry, grace: float) -> str:
    if not _well_formed(entry):
        return "left alone: its ledger entry does not name a process"
    if not Ledger.alive(entry):
        return "not running"
    if entry.pgid <= 1 or process_group_of(entry.pid) != entry.pgid:
        return f"left alone: pid {entry.pid} is not the leader of process group {entry.pgid} the ledger names"
    running = functools.partial(Ledger.alive, entry)

    async def exited() -> None:
        while running():
            await trio.sleep(POLL)

    async def group_gone(timeout: float) -> bool:
        with trio.move_on_after(timeout):
            while group_has_running_members(entry.pgid):
                await trio.sleep(POLL)
            return True
        return False

    with trio.move_on_after(grace + AFTER_KILL):
        killed = await terminate_group(entry.pgid, wait=exited, running=running, grace=grace)
        # The engine's helpers are in its group too: none may outlive it.
        if not await group_gone(grace if not killed else AFTER_KILL):
            signal_group(entry.pgid, signal.SIGKILL)
            killed = True
            if not await group_gone(AFTER_KILL):
                return "still there after SIGKILL"
        return "killed" if killed else "terminated"
    return "still there after SIGKILL"
