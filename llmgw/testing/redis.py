"""redis-servers for tests: one for a whole test session, and private ones a test may kill and start again.

Both are the server :mod:`llmgw.redis_server` runs, with the same options (:func:`~llmgw.redis_server.redis_argv`)
and the same readiness check, on an ephemeral 127.0.0.1 port. The session's server is started without trio
(:func:`start_session_redis`): pytest-trio runs each test in a trio run of its own, so a session-scoped fixture
cannot be async. A private one (:func:`start_private_redis`) runs in the test's nursery.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import trio

from ..procgroup import signal_group
from ..redis_server import (
    BIND_ATTEMPTS,
    LOG_NAME,
    STARTUP_TIMEOUT,
    STOP_GRACE,
    RedisPortTaken,
    RedisServer,
    find_redis_server,
    redis_argv,
    run_redis_server,
    wait_until_ready,
)
from .processes import free_port

PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child calls it between fork and exec


def _killed_with_its_parent() -> None:
    # Linux's PR_SET_PDEATHSIG: the server gets SIGKILL when the thread that started it (the session's main
    # thread) ends, so a session that dies without cleaning up (pytest-timeout's os._exit) leaves no server behind.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(eq=False)
class SessionRedis:
    """A redis-server started with :func:`start_session_redis`; :meth:`stop` it at the session's end."""

    server: RedisServer
    process: subprocess.Popen

    def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM its group, SIGKILL after ``grace`` seconds."""
        signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait(5)


def start_session_redis(directory: Path, startup_timeout: float = STARTUP_TIMEOUT) -> SessionRedis:
    """A redis-server on an ephemeral 127.0.0.1 port, in its own session, started without trio; once it answers."""
    binary = find_redis_server()
    for attempt in range(1, BIND_ATTEMPTS + 1):
        port = free_port()
        with open(directory / LOG_NAME, "ab") as output:
            process = subprocess.Popen(redis_argv(binary, directory, port=port), stdin=subprocess.DEVNULL,
                                       stdout=output, stderr=subprocess.STDOUT, cwd=directory,
                                       start_new_session=True, preexec_fn=_killed_with_its_parent)
        redis = SessionRedis(RedisServer(process.pid, port, None, directory / LOG_NAME), process)
        try:
            trio.run(wait_until_ready, redis.server, process.poll, startup_timeout)
            return redis
        except RedisPortTaken:
            redis.stop()
            if attempt == BIND_ATTEMPTS:
                raise
        except BaseException:
            redis.stop()
            raise
    raise AssertionError("every attempt returned or raised")


@dataclass(eq=False)
class PrivateRedis:
    """A redis-server of one test, run in its nursery, on a 127.0.0.1 port it keeps: the test may kill it
    (:meth:`kill`) and start it again on the same port (:meth:`restart`), as a crashed server comes back."""

    nursery: trio.Nursery
    directory: Path
    server: RedisServer | None = None
    _scope: trio.CancelScope | None = None
    _exited: trio.Event | None = None

    @property
    def running(self) -> RedisServer:
        assert self.server is not None, "start() it first"
        return self.server

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def port(self) -> int:
        port = self.running.port
        assert port is not None, "a private server listens on TCP"
        return port

    @property
    def pid(self) -> int:
        return self.running.pid

    async def start(self, port: int = 0) -> RedisServer:
        """Start it on ``port`` (0: an ephemeral one); once it answers PING."""
        self.server = await self.nursery.start(self._run, port)
        return self.server

    async def _run(self, port: int, task_status: trio.TaskStatus[RedisServer]) -> None:
        exited = self._exited = trio.Event()
        try:
            with trio.CancelScope() as self._scope:
                await run_redis_server(self.directory, port=port, task_status=task_status)
        finally:
            exited.set()

    async def kill(self, sig: int = signal.SIGKILL, timeout: float = 10.0) -> int | None:
        """Send ``sig`` (one that ends it) to the server and wait until it exited; its exit code."""
        self.running.kill(sig)
        await self._wait_exited(timeout)
        return self.running.returncode

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop it as the test's end would (SIGTERM, then SIGKILL); nothing when it is not running."""
        if self._scope is not None:
            self._scope.cancel()
        await self._wait_exited(timeout)

    async def restart(self) -> RedisServer:
        """Stop it if it still runs, then start a new server on the same port; once that one answers PING."""
        await self.stop()
        return await self.start(self.port)

    async def _wait_exited(self, timeout: float) -> None:
        if self._exited is not None:
            with trio.fail_after(timeout):
                await self._exited.wait()


async def start_private_redis(nursery: trio.Nursery, directory: Path) -> PrivateRedis:
    """A :class:`PrivateRedis` in ``directory``, started on an ephemeral port, in ``nursery``."""
    redis = PrivateRedis(nursery, directory)
    await redis.start()
    return redis
