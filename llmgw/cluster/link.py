"""One gateway's connection to the cluster's Redis, and whether it is healthy or degraded.

:class:`RedisLink` keeps one coredis client open for the process's life
(:meth:`RedisLink.run`, in the gateway's nursery; the client's connection
pool lives in it). Every call goes through :meth:`RedisLink.call`, with a
deadline; a failure of any call marks the link *degraded* (one WARNING line,
``llmgw_cluster_backend_up`` 0, ``/health`` says why) and raises
:class:`Unavailable` to the caller, which keeps working on what it has (the
hot path never calls Redis at all). The first call that succeeds again marks
it healthy (one INFO line). Callers retry with :meth:`RedisLink.backoff`.
:meth:`RedisLink.add_to_stream` writes the short-lived streams (load, predictions;
:mod:`.streams` reads them).

A call that fails because this process is out of file descriptors is the
same degraded state, its reason saying so (and counted in
``llmgw_fd_exhaustion_total{where="redis"}``): Redis is not blamed.

coredis survives a Redis restart by itself (a failed command's connection is
dropped, the next one reconnects), so nothing here rebuilds the client
unless its own task group fails, or its pool has lost half its connection
slots: coredis (6.9) gives no slot back for a call cancelled while its
connection was being made (Redis stopped or cut off: the deadline fires
during the handshake) nor for a connection that died while leased (a blocking
read cut by its deadline, a Redis restart). Once every slot was gone, every
call would wait for a connection that never comes, and each waiter cancelled
by its deadline would stay in the pool's list of waiters for good. So after a
failed or cancelled call the link counts the lost slots and, past half, opens
a new client (one WARNING line, ``llmgw_cluster_redis_pool_recycles_total``).
"""

from __future__ import annotations

import logging
import os
import ssl
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Mapping, TypeVar
from urllib.parse import parse_qs, urlsplit

import trio

from ..fdpressure import capacity_errno, note_shortage
from ..tls import TlsClientOptions, client_context

if TYPE_CHECKING:
    import coredis

    from ..config.schema import StateConfig
    from .metrics import ClusterMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")


class Unavailable(Exception):
    """Redis did not answer (or answered with an error); the link is degraded."""


def client_options(settings: "StateConfig", environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """coredis.Redis keyword arguments for the data connections: to ``settings.url`` (host/port/db or a Unix
    socket), or, with ``settings.sentinel``, to whichever primary the sentinels name (db only); the password
    and TLS either way."""
    environ = os.environ if environ is None else environ
    options: dict[str, Any] = {"decode_responses": False, "connect_timeout": settings.timeout,
                               "stream_timeout": settings.timeout + BLOCK_MS / 1000}
    if settings.sentinel is not None:
        options["db"] = settings.sentinel.database
        use_tls = settings.sentinel.tls
    else:
        parts = urlsplit(settings.url or "")
        if parts.scheme == "unix":
            options["unix_socket_path"] = parts.path
            options["db"] = int(parse_qs(parts.query).get("db", ["0"])[0])
        else:
            options.update(host=parts.hostname, port=parts.port or 6379, db=int(parts.path.strip("/") or 0))
        use_tls = parts.scheme == "rediss"
    options.update(_credentials(settings.username, settings.password_env, "state.password_env", environ))
    if use_tls:
        options["ssl_context"] = _tls_context(settings)
    return options


def sentinel_options(settings: "StateConfig", environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The keyword arguments of the connections to the sentinels themselves (``settings.sentinel`` is set)."""
    sentinel = settings.sentinel
    assert sentinel is not None, "only with state.sentinel"
    environ = os.environ if environ is None else environ
    options: dict[str, Any] = {"connect_timeout": settings.timeout, "stream_timeout": settings.timeout}
    options.update(_credentials(sentinel.username, sentinel.password_env, "state.sentinel.password_env", environ))
    if sentinel.tls:
        options["ssl_context"] = _tls_context(settings)
    return options


def _credentials(username: str | None, password_env: str | None, key: str,
                 environ: Mapping[str, str]) -> dict[str, str]:
    options = {"username": username} if username else {}
    if password_env:
        password = environ.get(password_env)
        if password is None:
            raise ValueError(f"{key} names {password_env}, which is not set")
        options["password"] = password
    return options


def _tls_context(settings: "StateConfig") -> ssl.SSLContext:
    tls = settings.tls
    return client_context(TlsClientOptions(tls.ca_file, tls.cert_file, tls.key_file, tls.verify))


@asynccontextmanager
async def open_client(settings: "StateConfig", factory: Callable[..., "coredis.Redis[bytes]"] | None = None
                      ) -> AsyncIterator["coredis.Redis[bytes]"]:
    """A coredis client to the cluster's Redis, its connection pool open while in the block. With
    ``state.sentinel`` it asks the sentinels for the primary before each new connection, so that after a
    failover (the old primary closes its clients when it is demoted) the next connection reaches the new one."""
    import coredis

    if settings.sentinel is None:
        async with (factory or coredis.Redis)(**client_options(settings)) as client:
            yield client
        return
    from coredis.connection import TCPLocation

    sentinels = coredis.Sentinel([TCPLocation(a.host, a.port) for a in settings.sentinel.addresses],
                                 sentinel_kwargs=sentinel_options(settings), **client_options(settings))
    primary: coredis.Redis[bytes] = sentinels.primary_for(settings.sentinel.service)
    async with sentinels, primary:
        yield primary


def describe_backend(settings: "StateConfig") -> str:
    """Where Redis is, for logs and /admin/cluster, without credentials (they are never in the config)."""
    if settings.sentinel is not None:
        return (f"sentinel service {settings.sentinel.service} via "
                + ",".join(str(a) for a in settings.sentinel.addresses))
    return settings.url or "?"


MIN_SECRET_BYTES = 16


def cluster_secret(settings: "StateConfig", environ: Mapping[str, str] | None = None) -> bytes | None:
    """The secret that signs the cluster's records (``state.secret_env``), or None when none is configured."""
    return _secret_in(settings.secret_env, "state.secret_env", environ)


def previous_cluster_secret(settings: "StateConfig", environ: Mapping[str, str] | None = None) -> bytes | None:
    """The secret of a rotation's other side (``state.previous_secret_env``): accepted, never signed with; None
    when none is configured. The same length rule as the current one."""
    return _secret_in(settings.previous_secret_env, "state.previous_secret_env", environ)


def _secret_in(name: str | None, key: str, environ: Mapping[str, str] | None) -> bytes | None:
    if not name:
        return None
    environ = os.environ if environ is None else environ
    value = environ.get(name)
    if value is None:
        raise ValueError(f"{key} names {name}, which is not set")
    if len(value.encode()) < MIN_SECRET_BYTES:
        raise ValueError(f"the cluster secret in {name} must be at least {MIN_SECRET_BYTES} bytes")
    return value.encode()


BLOCK_MS = 1000  # how long a blocking stream read waits for news before it asks again


def lost_connection_slots(client: "coredis.Redis[bytes]") -> int:
    """How many of ``client``'s pool slots coredis lost: neither free in its queue (an open connection, or room
    for one) nor leased to a call. A connection being made right now counts too, for that moment. 0 for a
    pool not shaped like that (another coredis version): nothing is recycled then."""
    pool = client.connection_pool
    available = getattr(pool, "_available_connections", None)
    statistics = getattr(pool, "statistics", None)
    if available is None or statistics is None:
        return 0
    return max(0, pool.max_connections - len(available) - statistics.in_use_connections)


class RedisLink:
    def __init__(self, settings: "StateConfig", metrics: "ClusterMetrics",
                 factory: Callable[..., "coredis.Redis[bytes]"] | None = None):
        self.settings = settings
        self.metrics = metrics
        self._factory = factory
        self._client: coredis.Redis[bytes] | None = None
        self.healthy = False
        self.reason = "not connected yet"
        self.changed = trio.Event()  # set (and replaced) at every transition
        self._ready = trio.Event()
        self._recycle = trio.Event()  # set when the client's pool has lost half its slots: run() opens a new one
        self._refusals_logged: set[str] = set()

    @property
    def address(self) -> str:
        """Where Redis is, without credentials (they are never in the URL)."""
        return describe_backend(self.settings)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the client (and its connection pool) until cancelled; rebuild it if its task group fails."""
        started = False
        delay = 0.2
        while True:
            try:
                async with open_client(self.settings, self._factory) as client:
                    self._client = client
                    self._ready.set()
                    if not started:
                        started = True
                        task_status.started()
                    await self._recycle.wait()
                # the pool lost half its slots: its calls fail (the callers retry), a new client takes over at once
                self._client, self._ready, self._recycle = None, trio.Event(), trio.Event()
                delay = 0.2
                continue
            except* Exception as group:  # the pool's task group failed: start a new one (``except*``: a failure as
                # this task is cancelled comes in one group with the Cancelled, which goes on without it)
                self._client = None
                self._ready = trio.Event()
                self.mark_down(self._shortage(group) or describe_error(group))
                if not started:
                    started = True
                    task_status.started()
            await trio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def call(self, operation: str, command: Callable[["coredis.Redis[bytes]"], Awaitable[T]],
                   timeout: float | None = None) -> T:
        """``await command(client)`` within ``timeout`` (the configured one by default); :class:`Unavailable`
        when it fails, which marks the link degraded. ``operation`` labels the error counter."""
        deadline = self.settings.timeout if timeout is None else timeout
        with trio.move_on_after(deadline) as scope:
            await self._ready.wait()
        if scope.cancelled_caught or self._client is None:
            self.metrics.errors.labels(operation).inc()
            self.mark_down("no connection")
            raise Unavailable("no connection")
        client = self._client
        answered = False
        try:
            with trio.fail_after(deadline):
                result = await command(client)
            answered = True
        except trio.TooSlowError:
            self._failed(operation, f"no answer within {deadline:g}s")
        except Exception as exc:  # coredis' errors, OSError, and whatever else a broken connection raises
            if _is_refusal(exc):  # Redis answered, with an error: it is up, this call is wrong (logged once)
                self.metrics.errors.labels(operation).inc()
                if operation not in self._refusals_logged:
                    self._refusals_logged.add(operation)
                    log.error("cluster state: Redis refused %s: %s (logged once)", operation, describe_error(exc))
                raise Unavailable(describe_error(exc)) from None
            self._failed(operation, self._shortage(exc) or describe_error(exc))
        finally:
            if not answered:  # failed or cancelled: the only calls that lose a pool slot
                self._check_pool(client)
        self.mark_up()
        return result

    def _check_pool(self, client: "coredis.Redis[bytes]") -> None:
        """Have :meth:`run` open a new client when this one's pool lost half its slots (see the module's doc)."""
        if client is not self._client or self._recycle.is_set():
            return
        lost = lost_connection_slots(client)
        capacity = client.connection_pool.max_connections
        if lost * 2 >= capacity:
            log.warning("cluster state: the Redis client lost %d of its %d connection slots (calls cancelled while "
                        "connecting, connections that died in use); opening a new client", lost, capacity)
            self.metrics.pool_recycles.inc()
            self._recycle.set()

    @staticmethod
    def _shortage(exc: BaseException) -> str | None:
        """Why, when ``exc`` is this process running out of descriptors (counted, logged): Redis is not at fault,
        and the callers' back-off retries."""
        if capacity_errno(exc) is None:
            return None
        note_shortage("redis", exc)
        return "no socket for a Redis connection: this process is out of file descriptors"

    def _failed(self, operation: str, why: str) -> None:
        self.metrics.errors.labels(operation).inc()
        self.mark_down(why)
        raise Unavailable(why)

    def mark_up(self) -> None:
        if not self.healthy:
            self.healthy, self.reason = True, ""
            self.metrics.up.set(1)
            log.info("cluster state: Redis at %s is reachable; shared state is live", self.address)
            self._transition()

    def mark_down(self, why: str) -> None:
        if self.healthy or self.reason == "not connected yet":
            log.warning("cluster state degraded: Redis at %s failed (%s); routing goes on with the last known "
                        "state and recovers by itself when Redis is back", self.address, why)
        if self.healthy or self.reason != why:
            self.healthy, self.reason = False, why
            self.metrics.up.set(0)
            self._transition()

    def _transition(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def add_to_stream(self, operation: str, key: str, fields: dict[bytes, bytes], length: int) -> Any:
        """``XADD`` one entry to stream ``key``, trimmed to about ``length`` entries; its id. :meth:`call`'s rules."""

        async def add(client: Any) -> Any:
            from coredis.tokens import PureToken
            return await client.xadd(key, fields, trim_strategy=PureToken.MAXLEN, threshold=length,
                                     trim_operator=PureToken.APPROXIMATELY)

        return await self.call(operation, add)

    @staticmethod
    async def backoff(attempt: int) -> None:
        """Sleep before retry number ``attempt`` (0.1 s doubling to 2 s): Redis's return is noticed quickly."""
        await trio.sleep(min(0.1 * (2 ** min(attempt, 5)), 2.0))


def _is_refusal(exc: BaseException) -> bool:
    """An error answer from Redis (a wrong command, a full memory, a missing permission), not a lost connection."""
    from coredis.exceptions import ResponseError

    return isinstance(exc, ResponseError)


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` (a group's first), for logs and /health, at most 300 characters."""
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return describe_error(exc.exceptions[0])
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]
