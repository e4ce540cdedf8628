"""One shard's engine process: start it, probe it, restart it when it dies, drain and stop it when told.

States and what moves a shard between them (every transition is reported
through ``on_status`` with a reason):

- PENDING: accepted, no process yet, or waiting out the backoff before a restart.
- STARTING: the process was spawned.
- LOADING: the process is alive but not ready (``/health`` not 200 yet, or
  ``/v1/models`` does not list the served name); also a Ready shard whose
  health probes keep failing (it is out of routing until they pass again).
- READY: ``/health`` answers 200 and ``/v1/models`` lists the served name.
- SLEEPING: a Ready engine put to sleep when told (:meth:`ShardSupervisor.sleep`, vLLM's sleep mode through
  :mod:`llmgw.agent.sleep`): its process runs on, its GPU memory given up; health is still probed.
- WAKING: told to wake (:meth:`ShardSupervisor.wake`); READY once the engine says it is awake and is ready, else
  stopped (STOPPED, with why) so that it can be started cold.
- DRAINING: a stop or drain was asked for; the control plane takes the shard
  out of routing when it sees this report.
- STOPPED: the process exited after a stop or drain.
- FAILED: the command cannot be built; the engine crash-loops; it was not ready
  within the startup timeout; or it exited by itself while draining. After a
  crash loop or a startup timeout the supervisor keeps retrying slowly (every
  ``crash_loop_retry`` seconds; ``None`` gives up), so a fixed cause heals
  without a new StartShard.

Engines outlive the agent: cancelling :meth:`ShardSupervisor.run` stops the
watching and probing, never the engine. Only :meth:`stop` and :meth:`drain`
kill it (SIGTERM to its process group, SIGKILL after the grace period). The
engine's pid and start time are in the ledger, so a new agent adopts it
(``adopt=entry``): no spawn, the same probes, a normal restart if it dies later.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shlex
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import trio

from .. import wire
from ..engines import probe
from ..fdpressure import ShortageBackoff, capacity_errno, note_shortage
from ..http.client import UpstreamError, UpstreamPool
from ..logfields import log_fields
from ..procgroup import process_group_of, process_start_time, signal_group, terminate_group, wait_group_gone
from . import sleep as sleep_mode
from .engine import Engine, EngineError, Launch, LaunchContext, Readiness
from .ledger import Ledger, LedgerEntry
from .logs import ShardLog, redact_argv
from .ports import NoFreePort, PortAllocator

log = logging.getLogger(__name__)

State = wire.ShardState
# Steps on the way (pending, loading, draining) are debug; a spawned process, readiness and the end are news.
_LOG_LEVELS = {State.PENDING: logging.DEBUG, State.LOADING: logging.DEBUG, State.DRAINING: logging.DEBUG,
               State.FAILED: logging.WARNING}


@dataclass(frozen=True)
class SupervisorSettings:
    restart_backoff: tuple[float, float, float] = (1.0, 2.0, 60.0)  # first delay, factor, cap (seconds)
    crash_loop_after: int = 5  # this many restarts within crash_loop_window, then one more exit: crash loop
    crash_loop_window: float = 600.0
    crash_loop_retry: float | None = 60.0  # FAILED shards are retried this often; None: give up
    # While starting or loading, while ready. Loading is probed often: a replica serves (and a scale-up or a start
    # from zero ends) no sooner than its agent sees it ready; a probe of an engine not yet listening is a refused
    # connection, nothing for the engine to do.
    probe_interval: tuple[float, float] = (0.1, 2.0)
    probe_timeout: float = 2.0
    unhealthy_after: int = 3  # failed health probes in a row that take a Ready shard back to Loading
    restart_unhealthy_after: int = 10  # refused or 5xx health probes in a row that restart it (timeouts never do)
    restart_grace: float = 10.0  # SIGTERM -> SIGKILL when the supervisor itself restarts an engine
    kill_timeout: float = 30.0  # how long to wait for an exit after SIGKILL
    group_exit_timeout: float = 5.0  # how long to wait for the rest of the process group after the leader
    drain_poll_interval: float = 0.5
    log_max_bytes: int = 10 * 1024 * 1024
    log_keep: int = 3
    log_rotate_interval: float = 30.0
    log_tail_lines: int = 20


@dataclass
class _Outcome:
    """Why a running engine is no longer usable."""

    reason: str
    failed: bool = False  # straight to FAILED and the slow retries (startup timeout), no quick restarts
    terminal: bool = False  # FAILED for good: the command cannot be built, restarting cannot help


@dataclass
class _StopRequest:
    drain_timeout: float | None  # None: stop without waiting for in-flight requests
    grace: float
    reason: str


class EngineProcess:
    """A running engine: a child this agent spawned, or a process a previous agent left in the ledger."""

    def __init__(self, pid: int, pgid: int, start_time: int | None, child: trio.Process | None = None):
        self.pid = pid
        self.pgid = pgid
        self.start_time = start_time
        self.child = child
        self.exited = trio.Event()
        self.returncode: int | None = None

    @property
    def running(self) -> bool:
        return not self.exited.is_set()

    async def watch(self) -> None:
        """Set :attr:`exited` when the process ends (the one task that waits on it)."""
        if self.child is not None:
            self.returncode = await self.child.wait()
        else:
            await _wait_for_foreign_exit(self.pid, self.start_time)
        self.exited.set()

    def describe_exit(self) -> str:
        if self.returncode is None:
            return f"pid {self.pid} exited (status unknown: the process was adopted)"
        if self.returncode < 0:
            return f"pid {self.pid} was killed by {signal.Signals(-self.returncode).name}"
        return f"pid {self.pid} exited with code {self.returncode}"


def _asleep_or_why(answer: bool | str, wanted: bool) -> str | None:
    """None when ``GET /is_sleeping`` answered ``wanted``, else why not."""
    if isinstance(answer, str):
        return answer
    return None if answer is wanted else f"GET /is_sleeping says {str(answer).lower()}"


async def _wait_for_foreign_exit(pid: int, start_time: int | None) -> None:
    """Wait for a process that is not our child: a pidfd when the kernel has them, else polling ``/proc``."""
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        pidfd = None
    if pidfd is not None:
        try:
            if process_start_time(pid) == start_time:  # the fd names our process, not a successor
                await trio.lowlevel.wait_readable(pidfd)
        finally:
            os.close(pidfd)
    else:
        while process_start_time(pid) == start_time:
            await trio.sleep(0.5)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reap it if it happens to be our own child (an agent restarted in-process)


class _Prober:
    """Probes of one engine through one pooled connection (:mod:`llmgw.engines.probe`): readiness, health,
    in-flight requests."""

    def __init__(self, host: str, port: int, readiness: Readiness, timeout: float):
        self.readiness = readiness
        self.timeout = timeout
        self.pool = UpstreamPool(host, port, connect_timeout=timeout)
        self.auth = [(b"authorization", f"Bearer {readiness.api_key}".encode())] if readiness.api_key else []

    async def health(self) -> probe.Health:
        """The probe, its reason naming the path: ``definite`` failures (refused, 5xx) can restart an engine;
        timeouts cannot; ``inconclusive`` ones (no descriptor to send it) count neither way."""
        path = self.readiness.health_path
        health = await probe.check_health(self.pool, path, self.timeout)
        return dataclasses.replace(health, reason=f"{path} 200" if health.ok else f"{path}: {health.reason}")

    async def ready(self) -> probe.Health:
        """Healthy and listing the served model (``ok``), with the reason either way; ``inconclusive`` when a probe
        could not be sent (this process is out of descriptors)."""
        health = await self.health()
        if not health.ok:
            return health
        name, path = self.readiness.served_model_name, self.readiness.models_path
        try:
            status, body = await probe.get(self.pool, path, self.timeout, self.auth)
        except trio.TooSlowError:
            return probe.Health(False, f"{path}: no answer within {self.timeout:g}s")
        except UpstreamError as exc:
            return probe.Health(False, f"{path}: {exc}", inconclusive=exc.kind == "capacity")
        if status != 200:
            return probe.Health(False, f"{path}: HTTP {status}")
        try:
            listed = [card.get("id") for card in json.loads(body).get("data", [])]
        except (ValueError, AttributeError):
            return probe.Health(False, f"{path}: not an OpenAI model list")
        if name not in listed:
            return probe.Health(False, f"{path} does not list {name!r} yet")
        return probe.Health(True, f"{self.readiness.health_path} 200 and {path} lists {name!r}")

    async def inflight(self, names: tuple[str, ...]) -> int | None:
        """The sum of the engine's in-flight gauges, or None when ``/metrics`` cannot be read."""
        text = await probe.read_metrics(self.pool, self.readiness.metrics_path, self.timeout)
        if text is None:
            return None
        return int(probe.parse_gauge_sum(text, names) or 0)

    async def aclose(self) -> None:
        await self.pool.aclose()


class ShardSupervisor:
    """Runs one shard: ``await run()`` in the nursery that owns it; :meth:`stop`/:meth:`drain` from any task."""

    def __init__(self, spec: wire.StartShard, engine: Engine, *,
                 ctx_factory: Callable[[wire.StartShard, int], LaunchContext], ledger: Ledger,
                 on_status: Callable[[wire.ShardReport], None], adopt: LedgerEntry | None = None,
                 ports: PortAllocator | None = None, logs: ShardLog | None = None,
                 settings: SupervisorSettings | None = None, **overrides):
        self.spec = spec
        self.engine = engine
        self.settings = dataclasses.replace(settings or SupervisorSettings(), **overrides)
        self._ctx_factory = ctx_factory
        self._ledger = ledger
        self._on_status = on_status
        self._adopt = adopt
        self._ports = ports if ports is not None else PortAllocator()
        self.log = logs or ShardLog(ledger.path.parent, spec.shard_id, max_bytes=self.settings.log_max_bytes,
                                    keep=self.settings.log_keep)
        self._readiness = engine.readiness(spec)
        self.on_engine_restart: Callable[[], None] | None = None  # e.g. the KV-event subscription's reset
        self.state = State.PENDING
        self.reason = "accepted"
        self.http_port = 0
        self.endpoint = ""
        self.restarts = 0
        self.started_at = 0.0
        self._log_tail: list[str] = []
        self._proc: EngineProcess | None = None
        self._prober: _Prober | None = None
        self._port_reserved = False
        self._restart_times: deque[float] = deque()
        self._stop: _StopRequest | None = None
        self._phase: trio.CancelScope | None = None  # what a stop request interrupts
        self._idle_wait: trio.CancelScope | None = None  # a drain's wait for in-flight requests
        self._nursery: trio.Nursery | None = None
        self._final = False
        self._finished = trio.Event()
        self._sleep_lock = trio.Lock()  # one sleep or wake-up at a time

    # -- what others read ----------------------------------------------------------------------------------------

    @property
    def shard_id(self) -> str:
        return self.spec.shard_id

    @property
    def adopting(self) -> LedgerEntry | None:
        """The ledger entry of the engine this supervisor adopts (None: it launches its own)."""
        return self._adopt

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None and self._proc.running else 0

    @property
    def finished(self) -> bool:
        """The shard was stopped or failed for good (true from its final report on), or ``run`` was cancelled."""
        return self._final or self._finished.is_set()

    def report(self) -> wire.ShardReport:
        spec = self.spec
        return wire.ShardReport(
            shard_id=spec.shard_id, replica_id=spec.replica_id, rank=spec.rank, node_count=spec.node_count,
            state=self.state, reason=self.reason, pid=self.pid, http_port=self.http_port, endpoint=self.endpoint,
            fingerprint=spec.fingerprint, generation=spec.generation, gpu_indices=list(spec.gpu_indices),
            restarts=self.restarts, model=self._readiness.served_model_name, started_at=self.started_at,
            log_tail=list(self._log_tail), placement_proof=spec.placement_proof)

    # -- commands ------------------------------------------------------------------------------------------------

    async def stop(self, grace: float = 30.0, reason: str = "") -> None:
        """Stop the engine now: DRAINING, SIGTERM to its group, SIGKILL after ``grace``, STOPPED."""
        await self._request(_StopRequest(None, grace, reason or "stop requested"))

    async def drain(self, timeout: float = 600.0, grace: float = 30.0, reason: str = "") -> None:
        """DRAINING (out of routing), wait until in-flight requests reach 0 or ``timeout``, then stop."""
        await self._request(_StopRequest(timeout, grace, reason or "drain requested"))

    async def sleep(self, level: int = 1, timeout: float = 30.0, reason: str = "") -> None:
        """Put a Ready engine to sleep (``POST /sleep?level=N``, then ``GET /is_sleeping``, each within
        ``timeout``): SLEEPING; when it cannot be, it stays READY and the log says why."""
        why = reason or "sleep requested"
        async with self._sleep_lock:
            proc, prober = self._proc, self._prober
            refused = self._cannot_sleep_or_wake(State.READY)
            if refused is None:
                assert prober is not None  # _cannot_sleep_or_wake checked it
                refused = await sleep_mode.sleep(prober.pool, level, timeout, prober.auth)
                if refused is None:
                    refused = _asleep_or_why(await sleep_mode.is_sleeping(prober.pool, timeout, prober.auth), True)
            if refused is None and self._still(proc, State.READY):
                self._set(State.SLEEPING, f"{why}: asleep at level {level}, its GPU memory given up; a WakeShard "
                                          f"wakes it")
            elif refused is not None:
                log.warning("shard %s was not put to sleep (%s): %s; it stays as it is (%s)", self.shard_id, why,
                            refused, self.state.value, extra=self._log_fields())

    async def wake(self, timeout: float = 600.0, reason: str = "") -> None:
        """Wake a sleeping engine (``POST /wake_up``, then ``GET /is_sleeping`` and the readiness probe, all within
        ``timeout``): WAKING, then READY (a hot start); an engine that does not wake is stopped, so that the
        control plane starts it cold."""
        why = reason or "wake-up requested"
        async with self._sleep_lock:
            proc, prober = self._proc, self._prober
            if self._cannot_sleep_or_wake(State.SLEEPING) is not None:
                return  # awake already, or stopping: the report says what it is
            assert prober is not None  # _cannot_sleep_or_wake checked it
            self._set(State.WAKING, f"{why}: POST /wake_up")
            failed: str | None = None
            with trio.move_on_after(timeout) as deadline:
                failed = await sleep_mode.wake_up(prober.pool, timeout, prober.auth)
                if failed is None:
                    failed = _asleep_or_why(await sleep_mode.is_sleeping(prober.pool, timeout, prober.auth), False)
                while failed is None and not (probed := await prober.ready()).ok:
                    await trio.sleep(self.settings.probe_interval[0])
            if deadline.cancelled_caught:
                failed = f"not awake and ready within {timeout:g}s"
            if not self._still(proc, State.WAKING):
                return  # it exited, restarted or is being stopped meanwhile: that is reported on its own
            if failed is None:
                self._set(State.READY, f"{why}: awake (a hot start); {probed.reason}")
                return
            log.warning("shard %s did not wake (%s): %s; stopping it, to be started cold", self.shard_id, why,
                        failed, extra=self._log_fields())
        await self.stop(self.settings.restart_grace, f"did not wake: {failed}; stopped, to be started cold")

    def _cannot_sleep_or_wake(self, needed: State) -> str | None:
        """Why the shard cannot be put to sleep or woken now (``needed``: the state it must be in), or None."""
        if not self.spec.profile.sleep_mode:
            return f"profile {self.spec.profile.name or '?'} does not run the engine with sleep_mode"
        if self._stop is not None or self.finished:
            return "it is stopping"
        if self.state is not needed or self._proc is None or self._prober is None:
            return f"it is {self.state.value}, not {needed.value}"
        return None

    def _still(self, proc: EngineProcess | None, state: State) -> bool:
        """The same engine process is still running, in ``state``, and no stop was asked for."""
        return self._proc is proc and proc is not None and proc.running and self.state is state \
            and self._stop is None

    async def _request(self, request: _StopRequest) -> None:
        if self.finished:
            return
        current = self._stop
        if current is None:
            self._stop = request
        elif request.drain_timeout is None and current.drain_timeout is not None:
            # A stop during a drain: stop waiting for in-flight requests.
            self._stop = dataclasses.replace(request, grace=min(request.grace, current.grace))
            if self._idle_wait is not None:
                self._idle_wait.cancel()
        if self._phase is not None:
            self._phase.cancel()
        await self._finished.wait()

    # -- the lifecycle -------------------------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Supervise until stopped, failed for good, or cancelled (which leaves the engine running)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._rotate_logs_forever)
                if self._adopt is not None:
                    await self._take_over(self._adopt)
                task_status.started()
                await self._lifecycle()
                nursery.cancel_scope.cancel()
        finally:
            self._finished.set()
            with trio.CancelScope(shield=True):
                await self._close_prober()

    async def _lifecycle(self) -> None:
        while self._stop is None:
            outcome: _Outcome | None = None
            with self._interruptible():
                if self._proc is None:
                    outcome = await self._launch()
                if outcome is None:
                    assert self._proc is not None  # launched, or adopted
                    outcome = await self._supervise(self._proc)
            if self._stop is not None:
                break
            assert outcome is not None
            if outcome.terminal:
                self._finish(State.FAILED, outcome.reason)
                return
            await self._retire(self._proc)
            if self.on_engine_restart is not None:
                try:
                    self.on_engine_restart()
                except Exception:
                    log.exception("shard %s: the engine-restart callback failed", self.spec.shard_id)
            with self._interruptible():
                given_up = await self._wait_before_restart(outcome)
                if given_up is not None:
                    self._finish(State.FAILED, given_up, tail=True)
                    return
        await self._shut_down()

    @contextlib.contextmanager
    def _interruptible(self):
        """A phase that a stop request cancels (launching, supervising, waiting to restart)."""
        with trio.CancelScope() as scope:
            self._phase = scope
            if self._stop is not None:
                scope.cancel()
            try:
                yield
            finally:
                self._phase = None

    async def _launch(self) -> _Outcome | None:
        """Spawn the engine (STARTING); an outcome when that was impossible."""
        spec = self.spec
        try:
            port = self._port_for_launch()
            ctx = self._ctx_factory(spec, port)
            launch = self.engine.command(spec, ctx)
        except (EngineError, NoFreePort) as exc:
            return _Outcome(str(exc), terminal=True)
        self._use_endpoint(ctx)
        backoff = ShortageBackoff()
        while True:
            try:
                child = await self._spawn(launch)
                break
            except OSError as exc:
                if capacity_errno(exc) is None:
                    self._log_header(f"could not start: {exc}")
                    return _Outcome(f"could not start {launch.argv[0]!r}: {exc}")
                # Out of descriptors (the log file, the pipes of the spawn): not the engine's failure, no restart
                # counted; tried again until the process has them.
                note_shortage("engine_spawn", exc, spec.shard_id)
            await trio.sleep(backoff.next_delay())
        # No checkpoint from here to the ledger write: a stop or cancel must not lose track of the child.
        start_time = process_start_time(child.pid)
        self._proc = EngineProcess(child.pid, child.pid, start_time, child)
        assert self._nursery is not None  # run() opened it
        self._nursery.start_soon(self._proc.watch)
        self.started_at = time.time()
        self._ledger.put(LedgerEntry.for_process(
            spec, pid=child.pid, pid_start_time=start_time or 0, pgid=child.pid, http_port=self.http_port,
            endpoint=self.endpoint, model=self._readiness.served_model_name, started_at=self.started_at,
            restarts=self.restarts, kv_events_endpoint=ctx.kv_events_endpoint or "",
            kv_replay_endpoint=ctx.kv_replay_endpoint or ""))
        self._set(State.STARTING, f"spawned pid {child.pid}" + (f" on port {port}" if port else ""))
        return None

    async def _spawn(self, launch: Launch) -> trio.Process:
        """Start the engine writing to its log; ``OSError`` when the log or the process cannot be opened."""
        spec = self.spec
        self.log.write_header(f"starting shard {spec.shard_id} generation {spec.generation} (restart {self.restarts}):"
                              f" {shlex.join(redact_argv(launch.argv))}")
        fd = self.log.open_for_child()
        try:
            return await trio.lowlevel.open_process(
                launch.argv, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, env={**os.environ, **launch.env},
                start_new_session=True)
        finally:
            os.close(fd)

    def _log_header(self, text: str) -> None:
        """A line in the engine's log when it can be written (a log that cannot be opened is no reason to stop)."""
        try:
            self.log.write_header(text)
        except OSError as exc:
            if capacity_errno(exc) is not None:
                note_shortage("engine_log", exc, self.spec.shard_id)
            else:
                log.warning("shard %s: cannot write to %s: %s", self.spec.shard_id, self.log.path, exc)

    async def _take_over(self, entry: LedgerEntry) -> None:
        """Adopt the engine a previous agent started: watch it, probe it once, report what it is."""
        self.restarts = entry.restarts
        self.started_at = entry.started_at
        if entry.http_port:
            self._ports.reserve(entry.http_port)
            self._port_reserved = True
        self._use_endpoint(self._ctx_factory(self.spec, entry.http_port))
        self._proc = EngineProcess(entry.pid, entry.pgid or process_group_of(entry.pid) or entry.pid,
                                   entry.pid_start_time)
        assert self._nursery is not None  # run() opened it
        self._nursery.start_soon(self._proc.watch)
        self._log_header(f"agent pid {os.getpid()} adopted engine pid {entry.pid}")
        adopted = f"adopted running engine pid {entry.pid} from the ledger"
        if not self._readiness.serves_http:
            self._set(State.READY, f"{adopted}; runs headless (rank {self.spec.rank}): liveness only")
            return
        if self._prober is None:
            self._set(State.LOADING, f"{adopted}; the ledger has no HTTP port for it")
            return
        ready = await self._prober.ready()
        if ready.ok and self.spec.profile.sleep_mode and await sleep_mode.is_sleeping(
                self._prober.pool, self.settings.probe_timeout, self._prober.auth) is True:
            self._set(State.SLEEPING, f"{adopted}; it sleeps (GET /is_sleeping): a WakeShard wakes it")
        elif ready.ok:
            self._set(State.READY, f"{adopted}; {ready.reason}")
        else:
            self._set(State.LOADING, f"{adopted}; not ready: {ready.reason}")

    async def _supervise(self, proc: EngineProcess) -> _Outcome:
        """Watch and probe a running engine until it exits or must be replaced."""
        outcome: _Outcome | None = None
        async with trio.open_nursery() as nursery:
            async def until_exit():
                nonlocal outcome
                await proc.exited.wait()
                outcome = outcome or _Outcome(proc.describe_exit())
                nursery.cancel_scope.cancel()

            async def probing():
                nonlocal outcome
                found = await self._probe(proc)
                outcome = outcome or found
                nursery.cancel_scope.cancel()

            nursery.start_soon(until_exit)
            nursery.start_soon(probing)
        assert outcome is not None
        return outcome

    async def _probe(self, proc: EngineProcess) -> _Outcome:
        """Probe until Ready, then keep checking health; returns only when the engine must be replaced."""
        settings = self.settings
        loading_interval, ready_interval = settings.probe_interval
        timeout = self.spec.profile.startup_timeout
        deadline = trio.current_time() + max(0.0, self.started_at + timeout - time.time())
        if not self._readiness.serves_http:
            await trio.sleep(loading_interval)
            if self.state is not State.READY:
                self._set(State.READY, f"pid {proc.pid} running headless (rank {self.spec.rank}): liveness only")
            await trio.sleep_forever()
        # Asleep or waking (an adopted engine found asleep) is past readiness: only health is probed from here.
        ready = self.state in (State.READY, State.SLEEPING, State.WAKING)
        failures = definite_failures = 0
        while True:
            await trio.sleep(ready_interval if ready else loading_interval)
            if self.state is State.STARTING:
                self._set(State.LOADING, f"pid {proc.pid} is running; waiting for {self._readiness.health_path}")
            if not ready:
                assert self._prober is not None  # set with the endpoint, before supervising
                probed = await self._prober.ready()
                ready = probed.ok
                if ready:
                    self._set(State.READY, probed.reason)
                elif trio.current_time() > deadline and not probed.inconclusive:
                    # (a probe that could not be sent, for want of descriptors, is no verdict: the next one decides)
                    return _Outcome(f"startup timeout: not ready {timeout:g}s after the start (last probe: "
                                    f"{probed.reason})", failed=True)
                continue
            assert self._prober is not None  # set with the endpoint, before supervising
            health = await self._prober.health()
            why = health.reason
            if health.ok:
                failures = definite_failures = 0
                if self.state is State.LOADING:
                    self._set(State.READY, f"healthy again: {why}")
                continue
            if health.inconclusive:  # this process is out of descriptors (counted): the engine is not to blame
                continue
            failures += 1
            definite_failures = definite_failures + 1 if health.definite else 0
            if failures >= settings.unhealthy_after and self.state is State.READY:
                self._set(State.LOADING, f"unhealthy: {failures} health probes failed in a row, last: {why}")
            if definite_failures >= settings.restart_unhealthy_after:
                return _Outcome(f"unhealthy: {definite_failures} health probes failed in a row ({why})")

    async def _retire(self, proc: EngineProcess | None) -> None:
        """Make sure a replaced engine and every helper process of its group are gone."""
        if proc is not None:
            await self._terminate(proc, self.settings.restart_grace)
        self._proc = None

    async def _wait_before_restart(self, outcome: _Outcome) -> str | None:
        """Report why and wait the backoff (PENDING) or the slow retry (FAILED); the reason when giving up."""
        settings = self.settings
        now = trio.current_time()
        while self._restart_times and now - self._restart_times[0] > settings.crash_loop_window:
            self._restart_times.popleft()
        recent = len(self._restart_times)
        first, factor, cap = settings.restart_backoff
        reason = outcome.reason
        if outcome.failed or recent >= settings.crash_loop_after:
            if not outcome.failed:
                reason = f"crash loop: {recent} restarts in the last {settings.crash_loop_window:g}s, then {reason}"
            if settings.crash_loop_retry is None:
                return reason
            delay = settings.crash_loop_retry
            self._set(State.FAILED, f"{reason}; retrying in {delay:g}s", tail=True)
        else:
            delay = min(cap, first * factor ** recent)
            self._set(State.PENDING, f"{reason}; restart {self.restarts + 1} in {delay:g}s", tail=True)
        await trio.sleep(delay)
        self._restart_times.append(trio.current_time())
        self.restarts += 1
        return None

    async def _shut_down(self) -> None:
        """Carry out the stop request: drain if asked and the engine was serving, then terminate."""
        request = self._stop
        assert request is not None  # called to carry one out
        proc = self._proc
        if proc is None or not proc.running:
            self._finish(State.STOPPED, f"{request.reason}; no engine process was running")
            return
        was_serving = self.state in (State.READY, State.LOADING)
        if request.drain_timeout is not None and was_serving and self._readiness.serves_http:
            self._set(State.DRAINING, f"{request.reason}; waiting up to {request.drain_timeout:g}s "
                                      f"for in-flight requests")
            waited = await self._wait_until_idle(proc, request.drain_timeout)
            if not proc.running:
                self._finish(State.FAILED, f"{proc.describe_exit()} while draining", tail=True)
                return
            request = self._stop  # a stop may have cut the drain short
            assert request is not None
            how = f"{waited}; "
        else:
            self._set(State.DRAINING, f"{request.reason}; stopping")
            how = ""
        killed = await self._terminate(proc, request.grace)
        if proc.running:
            self._finish(State.FAILED, f"{how}pid {proc.pid} did not exit even after SIGKILL", tail=True)
        elif killed:
            self._finish(State.STOPPED, f"{request.reason}; {how}killed with SIGKILL after a {request.grace:g}s grace")
        else:
            self._finish(State.STOPPED, f"{request.reason}; {how}{proc.describe_exit()} after SIGTERM")

    async def _wait_until_idle(self, proc: EngineProcess, timeout: float) -> str:
        """Wait until the engine's in-flight gauges read 0 twice in a row, it exits, or ``timeout``; says which."""
        names = self.engine.load_gauges().inflight
        if not names:
            return "the engine exposes no in-flight gauges"
        zero_reads = unreadable = 0
        last: int | None = None
        with trio.move_on_after(timeout) as deadline, trio.CancelScope() as cut_short:
            self._idle_wait = cut_short
            try:
                while proc.running:
                    assert self._prober is not None  # set with the endpoint, before supervising
                    last = await self._prober.inflight(names)
                    if last is None:
                        unreadable += 1
                        if unreadable >= 3:
                            return "in-flight requests unknown (metrics unreadable)"
                    else:
                        unreadable = 0
                        zero_reads = zero_reads + 1 if last == 0 else 0
                        if zero_reads >= 2:
                            return "no requests in flight"
                    with trio.move_on_after(self.settings.drain_poll_interval):
                        await proc.exited.wait()
                return "the engine exited"
            finally:
                self._idle_wait = None
        if deadline.cancelled_caught:
            return f"drain timeout after {timeout:g}s with {last} requests still in flight"
        return "the drain was cut short by a stop"

    async def _terminate(self, proc: EngineProcess, grace: float) -> bool:
        """SIGTERM the group, SIGKILL after ``grace``, then SIGKILL whatever is left of the group; True if killed."""
        killed = False
        with trio.move_on_after(grace + self.settings.kill_timeout):
            killed = await terminate_group(proc.pgid, wait=proc.exited.wait, running=lambda: proc.running,
                                           grace=grace)
        if not proc.running and signal_group(proc.pgid, signal.SIGKILL):
            # Helpers that outlived the leader (vLLM's engine core and workers hold GPU memory): the next
            # engine must not start before they are gone.
            if not await wait_group_gone(proc.pgid, self.settings.group_exit_timeout):
                log.warning("shard %s: processes of group %d are still there %gs after SIGKILL", self.shard_id,
                            proc.pgid, self.settings.group_exit_timeout, extra=self._log_fields())
        return killed

    def _finish(self, state: State, reason: str, *, tail: bool = False) -> None:
        """The end of this supervisor's shard: final report, ledger entry gone, port given back."""
        if self._proc is not None:
            self._ledger.remove(self.spec.shard_id, pid=self._proc.pid)
        if self._port_reserved:
            self._ports.release(self.http_port)
            self._port_reserved = False
        self._final = True
        self._set(state, reason, tail=tail)

    # -- helpers -------------------------------------------------------------------------------------------------

    def _port_for_launch(self) -> int:
        """The shard's HTTP port: the fixed one, the one it had before a restart (if still free), or a new one."""
        if not self._readiness.serves_http:
            return 0
        if self.spec.http_port:
            if not self._port_reserved:
                self._ports.reserve(self.spec.http_port)
                self._port_reserved = True
            return self.spec.http_port
        if self._port_reserved and self._ports.is_free(self.http_port):
            return self.http_port
        if self._port_reserved:
            self._ports.release(self.http_port)
            self._port_reserved = False
        port = self._ports.allocate()
        self._port_reserved = True
        return port

    def _use_endpoint(self, ctx: LaunchContext) -> None:
        """Point the endpoint and the probes at the port ``ctx`` launches on."""
        self.http_port = ctx.http_port
        if not ctx.http_port:
            self.endpoint = ""
            return
        address = f"[{ctx.node_address}]" if ":" in ctx.node_address else ctx.node_address
        self.endpoint = f"http://{address}:{ctx.http_port}"
        if self._prober is None or self._prober.pool.port != ctx.http_port:
            if self._prober is not None:
                assert self._nursery is not None  # run() opened it
                self._nursery.start_soon(self._prober.aclose)
            probe_host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(ctx.host, ctx.host)
            self._prober = _Prober(probe_host, ctx.http_port, self._readiness, self.settings.probe_timeout)

    async def _close_prober(self) -> None:
        if self._prober is not None:
            await self._prober.aclose()

    def _log_fields(self) -> dict:
        spec = self.spec
        return log_fields(shard=spec.shard_id, replica=spec.replica_id, generation=spec.generation,
                          pid=self.pid or None, port=self.http_port or None, state=self.state.value)

    def _set(self, state: State, reason: str, *, tail: bool = False) -> None:
        if state is self.state and reason == self.reason:
            return
        self.state = state
        self.reason = reason
        self._log_tail = self.log.tail(self.settings.log_tail_lines) if tail else []
        log.log(_LOG_LEVELS.get(state, logging.INFO), "shard %s (generation %d) is %s: %s", self.spec.shard_id,
                self.spec.generation, state.value, reason, extra=self._log_fields())
        try:
            self._on_status(self.report())
        except Exception:  # a broken listener must not leave the engine unsupervised
            log.exception("shard %s: the status callback failed", self.spec.shard_id)

    async def _rotate_logs_forever(self) -> None:
        while True:
            await trio.sleep(self.settings.log_rotate_interval)
            try:
                await trio.to_thread.run_sync(self.log.rotate_if_needed)
            except OSError as exc:
                log.warning("shard %s: could not rotate %s: %s", self.spec.shard_id, self.log.path, exc)
