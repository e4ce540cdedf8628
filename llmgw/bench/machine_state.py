"""The machine's state around a measurement: its load average, a core's frequency governor, and which other
processes ran on that core meanwhile (what a number measured on a shared machine has to be read beside).

Everything comes from ``/proc`` and ``/sys`` and is best effort: what cannot be read is reported as unknown,
never guessed. A process counts as "on the core" when the kernel last ran it there (``/proc/PID/stat``'s
``processor``) and its CPU time grew over the measurement: a process that moved between cores may be missed or
counted on the wrong one, which is why the core's own busy share (from ``/proc/stat``) is reported beside it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PROC = Path("/proc")
MAX_PROCESSES = 20_000  # a bound on the scan: a machine with more processes than this is reported as such
TOP = 5  # the busiest other processes named per measurement


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where ``/proc/loadavg`` is not readable."""
    try:
        return [float(value) for value in (PROC / "loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def cpu_governor(cpu: int) -> str | None:
    """The frequency governor of ``cpu`` (``performance``, ``powersave``, ...), or None where the kernel does not
    say (no cpufreq driver: many virtual machines)."""
    try:
        return Path(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor").read_text().strip() or None
    except OSError:
        return None


Snapshot = dict[int, tuple[str, float, int]]  # pid -> (name, CPU seconds so far, the core it last ran on)


def process_stat(pid: int) -> tuple[str, float, int] | None:
    """Process ``pid``'s name, CPU time (user + system, seconds) and last core, from ``/proc/PID/stat``; None
    when it exited or the line is not one this parser knows."""
    try:
        return parse_stat((PROC / str(pid) / "stat").read_bytes().decode(errors="replace"))
    except OSError:
        return None


def parse_stat(stat: str) -> tuple[str, float, int] | None:
    """A ``/proc/PID/stat`` line's name (which may hold spaces and parentheses), CPU seconds (utime + stime) and
    last core; None for a line that is not one."""
    try:
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # fields[0] is the state, field 3 of stat(5)
        ticks, core = int(fields[11]) + int(fields[12]), int(fields[36])
    except (ValueError, IndexError):
        return None
    return (name, ticks / os.sysconf("SC_CLK_TCK"), core) if ticks >= 0 and core >= 0 else None


def processes() -> Snapshot:
    """Every process's :func:`process_stat` (at most :data:`MAX_PROCESSES` of them)."""
    snapshot: Snapshot = {}
    for entry in os.scandir(PROC):
        if entry.name.isdigit() and len(snapshot) < MAX_PROCESSES:
            stat = process_stat(int(entry.name))
            if stat is not None:
                snapshot[int(entry.name)] = stat
    return snapshot


def busy_on_core(before: Snapshot, after: Snapshot, cpu: int, exclude: set[int]) -> list[dict]:
    """The processes (but ``exclude``) last run on ``cpu`` whose CPU time grew from ``before`` to ``after``, the
    busiest first, at most :data:`TOP`: ``{"pid", "name", "cpu_s"}``."""
    busy: list[tuple[float, int, str]] = []
    for pid, (name, seconds, last_cpu) in after.items():
        grew = seconds - before.get(pid, (name, 0.0, -1))[1]
        if pid not in exclude and last_cpu == cpu and grew > 0:
            busy.append((grew, pid, name))
    return [{"pid": pid, "name": name, "cpu_s": round(grew, 3)} for grew, pid, name in sorted(busy, reverse=True)[:TOP]]


def busiest_by_name(runs: list[list[dict]]) -> list[dict]:
    """The processes of several measurements' :func:`busy_on_core`, their CPU summed by name, the busiest first."""
    totals: dict[str, float] = {}
    for busy in runs:
        for process in busy:
            totals[process["name"]] = totals.get(process["name"], 0.0) + process["cpu_s"]
    return [{"name": name, "cpu_s": round(seconds, 3)}
            for name, seconds in sorted(totals.items(), key=lambda item: -item[1])[:TOP]]


def cpu_times(name: str) -> tuple[float, float, float] | None:
    """``/proc/stat``'s line ``name`` (``cpu``: all CPUs together; ``cpu1``: one) as (busy, steal, total) CPU
    seconds since boot (busy without steal; total with it); None where it is not readable."""
    try:
        lines = (PROC / "stat").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(name + " "):
            try:
                ticks = [int(x) for x in line.split()[1:9]]
            except ValueError:
                return None
            user, nice, system, idle, iowait, irq, softirq, steal = (ticks + [0] * 8)[:8]
            busy, tick = user + nice + system + irq + softirq, os.sysconf("SC_CLK_TCK")
            return busy / tick, steal / tick, (busy + idle + iowait + steal) / tick
    return None


def machine_busy() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of every CPU together since boot, steal counted busy; None where not readable."""
    times = cpu_times("cpu")
    return None if times is None else (times[0] + times[1], times[2])


def busy_share(seconds: float) -> float | None:
    """The share of all CPUs busy (steal included) over the next ``seconds``: what the machine does right now,
    unlike the load average, which still holds the last minute's work (a previous run's)."""
    first = machine_busy()
    time.sleep(seconds)
    second = machine_busy()
    if first is None or second is None or second[1] <= first[1]:
        return None
    return round((second[0] - first[0]) / (second[1] - first[1]), 3)


def describe(cpu: int, sample: float = 0.0) -> dict:
    """The state to record beside a measurement on ``cpu``: load average and governor (None: not readable); with
    ``sample`` > 0, the share of the machine's CPUs busy over that many seconds (``busy``)."""
    state: dict = {"loadavg": load_average(), "cpus": os.cpu_count(), "governor": cpu_governor(cpu)}
    if sample > 0:
        state["busy"] = busy_share(sample)
    return state
