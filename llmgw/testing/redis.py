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
from typing import Any

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
    config_file: Path | None = None  # and extra: see run_redis_server (a replica's or a sentinel's options)
    extra: tuple[str, ...] = ()
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
                await run_redis_server(self.directory, port=port, config_file=self.config_file, extra=self.extra,
                                       task_status=task_status)
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


SENTINEL_SERVICE = "llmgw"


@dataclass(eq=False)
class SentinelGroup:
    """A primary, its replica and one sentinel watching them (quorum 1), each a :class:`PrivateRedis` of the test:
    what ``state.sentinel`` talks to. :meth:`failover` swaps the roles as a real failover does."""

    servers: list[PrivateRedis]  # the primary first, as started
    sentinel: PrivateRedis
    service: str = SENTINEL_SERVICE

    @property
    def url(self) -> str:
        """What :func:`llmgw.testing.shared_state.cluster_config` takes for a cluster behind this sentinel."""
        return f"sentinel:{self.sentinel.port}"

    def server_on(self, port: int) -> PrivateRedis:
        return next(server for server in self.servers if server.port == port)

    def _sentinel_client(self) -> Any:
        import coredis

        return coredis.Redis("127.0.0.1", self.sentinel.port, decode_responses=True, connect_timeout=2,
                             stream_timeout=5)

    async def primary_port(self) -> int:
        """The port of the server the sentinel names as the primary now."""
        async with self._sentinel_client() as client:
            _host, port = await client.sentinel_get_master_addr_by_name(self.service)
        return int(port)

    async def wait_replica_known(self, timeout: float = 15.0) -> None:
        """Until the sentinel lists a replica it could promote (connected, in sync, not down)."""
        with trio.fail_after(timeout):
            while True:
                async with self._sentinel_client() as client:
                    replicas = await client.sentinel_replicas(self.service)
                if any(entry.get("flags") == "slave" and entry.get("master-link-status") == "ok"
                       for entry in replicas):
                    return
                await trio.sleep(0.1)

    async def failover(self, timeout: float = 20.0) -> int:
        """Ask the sentinel for a failover and wait until it names the other server, and that one is a primary
        that accepts writes; its port."""
        before = await self.primary_port()
        await self.wait_replica_known()
        async with self._sentinel_client() as client:
            await client.sentinel_failover(self.service)
        with trio.fail_after(timeout):
            while (after := await self.primary_port()) == before:
                await trio.sleep(0.1)
        return after


async def start_sentinel_group(nursery: trio.Nursery, directory: Path,
                               down_after_ms: int = 1000) -> SentinelGroup:
    """:class:`SentinelGroup` in ``directory`` (a folder per server), started on ephemeral ports; once the sentinel
    knows the replica."""
    primary = await start_private_redis(nursery, directory / "primary")
    replica = PrivateRedis(nursery, directory / "replica", extra=("--replicaof", "127.0.0.1", str(primary.port)))
    await replica.start()
    sentinel_directory = directory / "sentinel"
    sentinel_directory.mkdir(parents=True, exist_ok=True)
    config_file = sentinel_directory / "sentinel.conf"  # the sentinel rewrites it: its own copy, writable
    config_file.write_text(
        f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {primary.port} 1\n"
        f"sentinel down-after-milliseconds {SENTINEL_SERVICE} {down_after_ms}\n"
        f"sentinel failover-timeout {SENTINEL_SERVICE} 10000\n")
    sentinel = PrivateRedis(nursery, sentinel_directory, config_file=config_file, extra=("--sentinel",))
    await sentinel.start()
    group = SentinelGroup([primary, replica], sentinel)
    await group.wait_replica_known()
    return group
