"""The supervisor of ``llmgw serve --workers N``: it serves no request; it keeps N worker processes serving.

:class:`Supervisor` (run by :mod:`.command`, which holds the data port and the state dir first):

1. starts worker 0 (the control process), once it is ready the others (followers), and prints the banner
   ``llmgw listening on URL (control: URL)`` when all are; before it, and at each restart, a line per worker
   on stdout: ``llmgw worker I (pid P, role R) ready: control URL`` (its own /metrics and /admin);
2. restarts a worker that exits (WARNING with its exit code; 0.5 s backoff doubling to 10 s, from 0.5 s again
   after a minute of running). If worker 0's very first start fails, everything stops and the supervisor
   exits with its code;
3. passes SIGINT/SIGTERM on to every worker (they drain, as a lone ``llmgw serve`` does; a second signal, passed
   on too, stops them at once) and waits for them (at most ``shutdown_grace`` + 10 s); SIGHUP is passed on to
   the workers that serve (each reloads the config file).

Workers run in their own process groups (a Ctrl-C in the terminal reaches the supervisor alone, which passes
it on once), with stdin a pipe only the supervisor holds (:func:`~llmgw.workers.worker.watch_lifeline`),
stderr shared (their log lines say ``[worker I]``) and stdout read here: the banner is parsed, other lines
are printed with a ``[worker I]`` prefix.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from dataclasses import dataclass, field

import trio

from ..backoff import RestartBackoff
from ..gateway.hops import INSTANCE_ENV, new_instance_id
from ..procgroup import signal_group, terminate_group
from .plan import Plan

log = logging.getLogger("llmgw.workers")
BANNER = re.compile(r"^llmgw listening on (\S+) \(control: (\S+)\)$")
RESTART_BACKOFF = (0.5, 10.0)  # first delay, longest (seconds)
STOP_MARGIN = 10.0  # after limits.shutdown_grace: how long workers get to exit before they are stopped
KILL_GRACE = 5.0  # SIGTERM, then SIGKILL after this long (a worker that is cancelled rather than signalled)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(eq=False)
class Worker:
    """One worker slot: the process running in it now (a restart replaces it), and what it announced."""

    index: int
    role: str
    argv: list[str]
    process: trio.Process | None = None
    serving: bool = False  # this process printed its banner (its signal handlers are in place)
    data_url: str | None = None
    control_url: str | None = None
    ready: trio.Event = field(default_factory=trio.Event)  # set at the first banner of any of its processes

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.returncode is None:
            try:
                os.kill(self.process.pid, signum)
            except ProcessLookupError:
                pass


class Supervisor:
    """Runs the workers of a :class:`Plan` until a stop signal (or worker 0's failure to start); :meth:`run`."""

    def __init__(self, plan: Plan, shutdown_grace: float, signals, environment: dict[str, str] | None = None):
        """``environment``: variables the workers get beside this process's (the private cluster's secret)."""
        self.plan = plan
        self.shutdown_grace = shutdown_grace
        self.signals = signals  # a trio signal receiver for SIGINT, SIGTERM, SIGHUP, opened by the caller
        self.workers = [Worker(i, plan.role_of(i), plan.argv(i)) for i in range(plan.count)]
        self.stopping = trio.Event()
        self.stop_signals = 0
        # One gateway to the requests' hop headers (llmgw.gateway.hops), however many workers serve its port.
        self._environment = {**os.environ, INSTANCE_ENV: os.environ.get(INSTANCE_ENV) or new_instance_id(),
                             **(environment or {})}
        self.failure: int | None = None  # worker 0's exit code when its first start failed
        self._workers_scope = trio.CancelScope()

    async def run(self) -> int:
        """The exit code: 0 after a stop signal, worker 0's code (at least 1) when it could not start."""
        async with trio.open_nursery() as outer:
            outer.start_soon(self._handle_signals, outer)
            with self._workers_scope:
                async with trio.open_nursery() as workers:
                    workers.start_soon(self._keep_running, self.workers[0])
                    workers.start_soon(self._start_followers_and_announce, workers)
            outer.cancel_scope.cancel()
        return self.failure or 0

    async def _start_followers_and_announce(self, workers: trio.Nursery) -> None:
        if not await self._ready_unless_stopping(self.workers[0]):
            return
        for worker in self.workers[1:]:
            workers.start_soon(self._keep_running, worker)
        for worker in self.workers[1:]:
            if not await self._ready_unless_stopping(worker):
                return
        first = self.workers[0]
        print(f"llmgw listening on {first.data_url} (control: {first.control_url})", flush=True)

    async def _ready_unless_stopping(self, worker: Worker) -> bool:
        """Wait until ``worker`` is ready (True) or the supervisor stops (False)."""
        async with trio.open_nursery() as race:
            async def finish_when(event: trio.Event) -> None:
                await event.wait()
                race.cancel_scope.cancel()

            race.start_soon(finish_when, worker.ready)
            race.start_soon(finish_when, self.stopping)
        return worker.ready.is_set() and not self.stopping.is_set()

    # -- one worker slot ---------------------------------------------------------------------------------------------

    async def _keep_running(self, worker: Worker) -> None:
        backoff = RestartBackoff(*RESTART_BACKOFF)
        while not self.stopping.is_set():
            began = trio.current_time()
            code = await self._run_once(worker)
            if self.stopping.is_set():
                return
            if worker.index == 0 and not worker.ready.is_set():
                log.error("worker 0 (pid %s) %s before it was ready: stopping", _pid(worker), _how_it_ended(code))
                self.failure = code if code > 0 else 1
                self._stop()
                return
            delay = backoff.next_delay(trio.current_time() - began)
            log.warning("worker %d (pid %s) %s; starting it again in %g s", worker.index, _pid(worker),
                        _how_it_ended(code), delay)
            with trio.move_on_after(delay):
                await self.stopping.wait()

    async def _run_once(self, worker: Worker) -> int:
        """Start ``worker``'s process and follow it until it exits; its exit code (``-N``: killed by signal N).
        Cancelled, it stops the process's group (SIGTERM, then SIGKILL)."""
        process = await trio.lowlevel.open_process(worker.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                   start_new_session=True, env=self._environment)
        worker.process, worker.serving = process, False
        log.debug("worker %d (pid %d): %s", worker.index, process.pid, " ".join(worker.argv))
        try:
            if self.stopping.is_set():  # a stop signal came while it was being started
                worker.signal(signal.SIGTERM)
            async with trio.open_nursery() as nursery:
                output_done = trio.Event()
                nursery.start_soon(self._read_output, worker, process, output_done)
                await process.wait()
                with trio.move_on_after(1.0):  # its last lines (a process it started may hold the pipe open)
                    await output_done.wait()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await _stop(process)
            worker.serving = False
        assert process.returncode is not None
        return process.returncode

    async def _read_output(self, worker: Worker, process: trio.Process, done: trio.Event) -> None:
        assert process.stdout is not None
        buffer = b""
        try:
            async for data in process.stdout:
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    self._on_line(worker, raw.decode(errors="replace"))
        finally:
            done.set()

    def _on_line(self, worker: Worker, line: str) -> None:
        banner = BANNER.match(line.strip()) if not worker.serving else None
        if banner is None:
            if line.strip():
                print(f"[worker {worker.index}] {line}", flush=True)
            return
        worker.data_url, worker.control_url = banner.groups()
        worker.serving = True
        # On stdout, as the banner (whatever the log level): where to reach this worker's /metrics and /admin.
        print(f"llmgw worker {worker.index} (pid {_pid(worker)}, role {worker.role}) "
              f"{'restarted' if worker.ready.is_set() else 'ready'}: control {worker.control_url}", flush=True)
        worker.ready.set()

    # -- signals ------------------------------------------------------------------------------------------------------

    async def _handle_signals(self, outer: trio.Nursery) -> None:
        async for signum in self.signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                serving = [worker for worker in self.workers if worker.serving]
                log.info("SIGHUP: passing it to %d workers (each reloads %s)", len(serving), self.plan.config_path)
                for worker in serving:
                    worker.signal(signum)
                continue
            self.stop_signals += 1
            if self.stop_signals == 1:
                log.info("%s: passing it to the workers: they drain (send it again to stop them at once)", name)
                self._stop()
                outer.start_soon(self._stop_after, self.shutdown_grace + STOP_MARGIN)
            else:
                log.warning("second %s: the workers stop now", name)
            for worker in self.workers:  # one still starting has no handler yet: SIGTERM ends it quietly
                worker.signal(signum if worker.serving else signal.SIGTERM)

    def _stop(self) -> None:
        """No more restarts; the workers' slots end as their processes exit."""
        self.stopping.set()

    async def _stop_after(self, seconds: float) -> None:
        await trio.sleep(seconds)
        left = [worker.index for worker in self.workers if worker.running]
        log.warning("workers %s still run %g s after the signal: stopping them", left, seconds)
        self._workers_scope.cancel()


def _pid(worker: Worker) -> int | str:
    return worker.process.pid if worker.process is not None else "?"


def _how_it_ended(code: int) -> str:
    """``exited with code 2``, ``was killed by SIGKILL (code -9)``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (code {code})"
        except ValueError:
            pass
    return f"exited with code {code}"


async def _stop(process: trio.Process) -> None:
    """SIGTERM ``process``'s group, SIGKILL after :data:`KILL_GRACE`; close its pipes."""
    with trio.move_on_after(KILL_GRACE + 5):  # after SIGKILL: a process stuck in the kernel cannot be waited for
        await terminate_group(process.pid, wait=process.wait, running=lambda: process.returncode is None,
                              grace=KILL_GRACE)
    signal_group(process.pid, signal.SIGKILL)  # whatever it left in its group
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            await pipe.aclose()
