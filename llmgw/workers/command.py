"""``llmgw serve --workers N`` around its :class:`~.supervisor.Supervisor`: the data port held, the state dir
locked, the private redis-server.

:func:`run_workers` (from ``llmgw serve``) does, in one Trio run:

1. holds the data address: a socket bound with ``SO_REUSEPORT`` that never listens takes no connection but
   keeps the port, so port 0 becomes one concrete port that every worker (and every restarted one) binds too;
2. locks its state dir (``workers.lock``; one per port by default) and, without ``state.backend: redis`` in the
   config, runs a private redis-server on ``STATE_DIR/redis.sock``
   (:func:`~llmgw.redis_server.supervise_redis_server`), which the workers get with ``--worker-state``; a
   redis-server a killed supervisor left there is stopped first;
3. runs the supervisor, then stops the private redis-server; with the private Redis, the workers get its
   cluster's secret (:func:`~.plan.private_secret`) in their environment.
"""

from __future__ import annotations

import logging
import shutil
import signal
from dataclasses import replace
from functools import partial
from pathlib import Path

import trio

from ..agent.statelock import StateDirLock
from ..config import Config, HostPort
from ..http.listeners import bind_tcp, bound_port
from ..listening import host_port, listening_on
from ..procgroup import process_start_time, terminate_group
from ..redis_server import LOG_NAME, RedisServer, answering_pid, find_redis_server, supervise_redis_server
from .plan import LOCK_NAME, SECRET_ENV, Plan, check_roles, default_state_dir, private_secret, redis_socket
from .supervisor import KILL_GRACE, STOP_SIGNALS, Supervisor

log = logging.getLogger("llmgw.workers")


async def supervise(config: Config, count: int, listen: HostPort | None, control_listen: HostPort | None,
                    role: str, state_dir: Path | None, stop_engines: bool = False, log_level: str | None = None,
                    log_format: str | None = None) -> int:
    """``llmgw serve --workers COUNT``: hold the data port and the state dir, run the private Redis if needed, run
    the workers; the exit code."""
    check_roles(role, config.state.shared)
    if not config.state.shared:
        find_redis_server()  # missing: one line naming the package, before anything starts
    data = listen or config.listen
    with trio.open_signal_receiver(*STOP_SIGNALS, signal.SIGHUP) as signals:
        with listening_on(host_port(data.host, data.port)):
            reservation = await bind_tcp(data.host, data.port, reuse_port=True, listen=False)
        try:
            plan = Plan(count=count, config_path=str(Path(config.source).absolute()),
                        listen=HostPort(data.host, bound_port(reservation)), control_listen=control_listen,
                        role=role, redis_url=None, stop_engines=stop_engines, log_level=log_level,
                        log_format=log_format)
            directory = state_dir or default_state_dir(plan.listen.port)
            socket_path = None if config.state.shared else redis_socket(directory)
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            # One supervisor per state dir, hence per port by default: SO_REUSEPORT would let a second one of the
            # same user share the port silently.
            with StateDirLock(directory, LOCK_NAME):
                if socket_path is None:
                    log.info("%d workers on %s, sharing the state in the config's Redis", count, plan.listen)
                    code = await Supervisor(plan, config.limits.shutdown_grace, signals).run()
                else:
                    code = await _with_private_redis(plan, directory, socket_path, config.limits.shutdown_grace,
                                                     signals)
                if state_dir is None and data.port == 0 and code == 0:
                    # Named after a port picked for this run only: runs on port 0 (tests) would leave one each.
                    shutil.rmtree(directory, ignore_errors=True)
            return code
        finally:
            for sock in reservation:
                sock.close()


async def _with_private_redis(plan: Plan, state_dir: Path, socket_path: Path, shutdown_grace: float,
                              signals) -> int:
    await _stop_leftover_redis(socket_path)
    async with trio.open_nursery() as nursery:
        redis = await nursery.start(partial(supervise_redis_server, state_dir, unix_socket=socket_path))
        print(f"llmgw workers on {plan.listen} share their state in a private redis-server (pid {redis.pid}) "
              f"at {redis.url}", flush=True)
        code = await Supervisor(replace(plan, redis_url=redis.url), shutdown_grace, signals,
                                {SECRET_ENV: private_secret(state_dir)}).run()
        nursery.cancel_scope.cancel()
    return code


async def _stop_leftover_redis(socket_path: Path) -> None:
    """A redis-server answering on our socket while we hold the state dir's lock was left by a supervisor that
    was killed (SIGKILL leaves its children running; the workers stop on their own, see :mod:`.worker`): stop
    it, SIGTERM then SIGKILL, before starting ours."""
    pid = await answering_pid(RedisServer(0, None, socket_path, socket_path.with_name(LOG_NAME)))
    if pid is None:
        return
    log.warning("stopping the redis-server (pid %d) a killed supervisor left on %s", pid, socket_path)
    await terminate_group(pid, wait=partial(_until_gone, pid), running=lambda: process_start_time(pid) is not None,
                          grace=KILL_GRACE)


async def _until_gone(pid: int) -> None:
    """Until ``pid`` (not our child: init reaps it) has exited."""
    with trio.move_on_after(KILL_GRACE + 5):
        while process_start_time(pid) is not None:
            await trio.sleep(0.05)


def run_workers(config: Config, count: int, listen: HostPort | None, control_listen: HostPort | None, role: str,
                state_dir: Path | None, stop_engines: bool, log_level: str | None, log_format: str | None) -> int:
    """Run :func:`supervise`; its exit code (a :class:`~llmgw.usererrors.UserError` is the caller's to report)."""
    return trio.run(partial(supervise, config, count, listen, control_listen, role, state_dir,
                            stop_engines=stop_engines, log_level=log_level, log_format=log_format))
