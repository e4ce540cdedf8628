"""Process groups and process identity: signal a whole group, stop it gracefully, tell a live pid from a reused one.

Shared by :mod:`llmgw.testing.processes` (the children of tests and benchmarks) and the
agent's shard supervisor (engines that must outlive the agent). Every child
started here runs in its own session (``start_new_session=True``), so its pid
is also its process-group id and a signal to the group reaches the engine's
own helper processes too.
"""

from __future__ import annotations

import os
import signal
from typing import Awaitable, Callable

import trio


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to every process in group ``pgid``; False when the group no longer exists."""
    if pgid <= 1:  # never signal init's group or "every process" by accident
        raise ValueError(f"refusing to signal process group {pgid}")
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


async def terminate_group(pgid: int, *, wait: Callable[[], Awaitable[object]], running: Callable[[], bool],
                          grace: float) -> bool:
    """SIGTERM group ``pgid``, then SIGKILL it if its leader has not exited within ``grace`` seconds.

    ``wait`` returns once the leader has exited and ``running`` says whether it
    still runs. Returns True when SIGKILL was needed. The caller bounds the
    final wait after SIGKILL (a process stuck in the kernel cannot be killed).
    """
    if running():
        signal_group(pgid, signal.SIGTERM)
        with trio.move_on_after(grace):
            await wait()
    if not running():
        return False
    signal_group(pgid, signal.SIGKILL)
    await wait()
    return True


def group_exists(pgid: int) -> bool:
    """Whether any process (zombies included) is still in group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def wait_group_gone(pgid: int, timeout: float, poll: float = 0.05) -> bool:
    """Wait up to ``timeout`` seconds for every member of group ``pgid`` to be gone; False if some remain."""
    with trio.move_on_after(timeout):
        while group_exists(pgid):
            await trio.sleep(poll)
        return True
    return False


def group_has_running_members(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, which only wait to be reaped, do not count).

    Unlike :func:`group_exists` this holds for processes that are not our children, whose zombies someone
    else reaps (or, when they are ours, that nobody reaps yet)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22).

    ``None`` when the process does not exist or is a zombie (it has exited and
    waits to be reaped). Together with the pid this names one process: a pid
    the kernel reused for another process has another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces and parentheses.
    fields = stat[stat.rindex(b")") + 2:].split()
    state, start_time = fields[0], fields[19]
    if state in (b"Z", b"X"):
        return None
    return int(start_time)


def process_group_of(pid: int) -> int | None:
    """The process-group id of ``pid``, or ``None`` when it does not exist."""
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
