"""A private redis-server that llmgw starts itself: find the binary, run it, keep it running.

Gateway processes share state through Redis. Without a configured one, ``llmgw serve --workers N`` runs a
private server on a Unix socket in its state folder (:func:`supervise_redis_server`); the tests run one on an
ephemeral 127.0.0.1 port (:func:`run_redis_server`, and ``llmgw.testing.redis``). Either way the server keeps
nothing on disk (no RDB snapshot, no append-only file: the shared state is rebuilt by the gateways, never read
back), has no ``maxmemory`` (evicting shared state would lose it silently), listens on loopback or a Unix
socket only (mode 0700), and logs warnings to ``redis-server.log`` in its folder.

Like :mod:`llmgw.testing.processes`, the server runs in its own session (its pid is its process-group id);
cancellation stops the group (SIGTERM, then SIGKILL) and removes the socket file. It is ready once it answers
PING, asked over a plain socket (RESP needs no client library for that).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from .backoff import RestartBackoff
from .procgroup import signal_group, terminate_group
from .usererrors import UserError

log = logging.getLogger(__name__)

SEARCH_DIRECTORIES = ("/usr/sbin", "/usr/bin")  # Debian's package installs it in /usr/bin, outside some PATHs
MISSING = "redis-server was not found: install it (Debian/Ubuntu: apt-get install redis-server)"
LOG_NAME = "redis-server.log"
SOCKET_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes with the NUL; redis truncates a longer path silently
BIND_ATTEMPTS = 3  # an ephemeral port picked here may be taken before redis binds it: pick another
STARTUP_TIMEOUT = 10.0
STOP_GRACE = 3.0
STABLE_AFTER = 60.0  # a server that ran this long starts the supervisor's backoff over
PROBE = b"PING\r\nINFO server\r\nQUIT\r\n"  # INFO says which process answered (see wait_until_ready)


class RedisServerFailed(RuntimeError):
    """redis-server exited before it answered PING, or did not answer in time; the message ends with its log."""


class RedisPortTaken(RedisServerFailed):
    """redis-server could not bind its TCP port (another process holds it)."""


@dataclass(eq=False)
class RedisServer:
    """A running redis-server (or one that exited: ``returncode``)."""

    pid: int
    port: int | None  # its 127.0.0.1 port, or None when it listens on a Unix socket only
    unix_socket: Path | None
    log_path: Path
    returncode: int | None = None  # set once it exited
    restarts: int = 0  # how many times :func:`supervise_redis_server` started it again

    @property
    def url(self) -> str:
        """``unix:///path/to/sock`` when it has a Unix socket, else ``redis://127.0.0.1:PORT``."""
        if self.unix_socket is not None:
            return f"unix://{self.unix_socket}"
        return f"redis://127.0.0.1:{self.port}"

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the server (fault tests: SIGKILL it and see what recovers)."""
        os.kill(self.pid, sig)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def find_redis_server(directories: Iterable[str | os.PathLike[str]] | None = None) -> str:
    """The redis-server executable: from ``PATH``, else from ``directories`` (default :data:`SEARCH_DIRECTORIES`,
    read at each call); a :class:`UserError` when absent."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    for directory in SEARCH_DIRECTORIES if directories is None else directories:
        candidate = Path(directory) / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise UserError(MISSING)


def redis_argv(binary: str, directory: Path, *, port: int = 0, unix_socket: Path | None = None,
               config_file: Path | None = None, extra: Sequence[str] = ()) -> list[str]:
    """redis-server's command line: every option of the servers llmgw runs, in this one place; ``config_file``
    (first, as redis-server wants it) and ``extra`` for the tests' replicas and sentinels
    (``--replicaof HOST PORT``, ``--sentinel`` with a writable file of ``sentinel monitor`` lines)."""
    argv = [binary, *([str(config_file)] if config_file is not None else []),
            "--save", "", "--appendonly", "no", "--dir", str(directory), "--port", str(port),
            "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning", *extra]
    if port:
        argv += ["--bind", "127.0.0.1"]
    if unix_socket is not None:
        argv += ["--unixsocket", str(unix_socket), "--unixsocketperm", "700"]
    return argv


def _free_port() -> int:
    """A 127.0.0.1 TCP port that was free a moment ago (redis cannot listen on port 0 and say which it got)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def answering_pid(server: RedisServer) -> int | None:
    """The pid of the redis-server that answers PING at ``server``'s address, or None when none answers."""
    try:
        with trio.fail_after(1):
            if server.unix_socket is not None:
                stream = await trio.open_unix_socket(str(server.unix_socket))
            else:
                assert server.port is not None, "a server without a Unix socket has a port"
                stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            async with stream:
                await stream.send_all(PROBE)
                reply = b""
                while not _has_info_reply(reply) and (data := await stream.receive_some()):
                    reply += data  # until the INFO answer is whole (a sentinel does not close on QUIT)
    except (OSError, trio.TooSlowError, trio.BrokenResourceError):
        return None
    found = re.search(rb"^process_id:(\d+)\r?$", reply, re.MULTILINE)
    return int(found.group(1)) if reply.startswith(b"+PONG\r\n") and found else None


def _has_info_reply(reply: bytes) -> bool:
    """True once ``reply`` holds the answers to PING and the whole of INFO's bulk string."""
    head, sep, rest = reply.partition(b"\r\n")  # "+PONG"
    length, sep2, body = rest.partition(b"\r\n")  # "$N"
    return bool(sep and sep2) and length.startswith(b"$") and length[1:].isdigit() and len(body) >= int(length[1:])


async def wait_until_ready(server: RedisServer, returncode: Callable[[], int | None],
                           timeout: float = STARTUP_TIMEOUT) -> None:
    """Return once ``server`` answers PING; :class:`RedisServerFailed` (:class:`RedisPortTaken` when its port
    was taken) when it exits first (``returncode()`` is not None) or has not answered within ``timeout``.

    The answer counts only when it comes from ``server.pid``: on a taken port another redis could answer."""
    with trio.move_on_after(timeout):
        while returncode() is None:
            if await answering_pid(server) == server.pid:
                return
            await trio.sleep(0.05)
        tail = server.log_tail()
        failure = RedisPortTaken if server.port and "Address already in use" in tail else RedisServerFailed
        raise failure(f"redis-server exited with code {returncode()} before it was ready; "
                      f"the end of {server.log_path}:\n{tail}")
    raise RedisServerFailed(f"redis-server did not answer PING within {timeout:g} s; "
                            f"the end of {server.log_path}:\n{server.log_tail()}")


async def run_redis_server(directory: Path, *, unix_socket: Path | None = None, port: int | None = None,
                           startup_timeout: float = STARTUP_TIMEOUT, stop_grace: float = STOP_GRACE,
                           config_file: Path | None = None, extra: Sequence[str] = (),
                           task_status: trio.TaskStatus[RedisServer] = trio.TASK_STATUS_IGNORED) -> None:
    """Run redis-server in ``directory`` until cancelled; ``task_status.started(RedisServer)`` once it answers.

    It listens on ``unix_socket``, on 127.0.0.1:``port``, or both (``port=0``: an ephemeral port, picked again
    up to 3 times when another process takes it first). Returns when the server exits by itself (its code in
    ``returncode``); cancelling stops it."""
    if unix_socket is None and port is None:
        raise ValueError("run_redis_server needs a unix_socket, a port, or both")
    directory = directory.absolute()  # redis-server resolves a relative socket path in its own folder, not ours
    if unix_socket is not None:
        unix_socket = unix_socket.absolute()
        if len(os.fsencode(unix_socket)) > SOCKET_PATH_MAX:
            raise UserError(f"the Unix socket path for redis-server is too long ({len(os.fsencode(unix_socket))} "
                            f"bytes, at most {SOCKET_PATH_MAX}): {unix_socket}")
    binary = find_redis_server()
    directory.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, BIND_ATTEMPTS + 1):
        chosen = _free_port() if port == 0 else port
        try:
            argv = redis_argv(binary, directory, port=chosen or 0, unix_socket=unix_socket, config_file=config_file,
                              extra=extra)
            return await _run_once(argv, directory, unix_socket, chosen, startup_timeout, stop_grace, task_status)
        except RedisPortTaken:
            if port != 0 or attempt == BIND_ATTEMPTS:
                raise
            log.info("redis-server could not bind port %d (taken meanwhile): trying another", chosen)


async def _run_once(argv: list[str], directory: Path, unix_socket: Path | None, port: int | None,
                    startup_timeout: float, stop_grace: float, task_status: trio.TaskStatus[RedisServer]) -> None:
    if unix_socket is not None:
        unix_socket.parent.mkdir(parents=True, exist_ok=True)
        unix_socket.unlink(missing_ok=True)  # left by a server that was killed
    log_path = directory / LOG_NAME
    # Its log on stdout, with stderr: a bad option is reported on stderr, before any log file would be opened.
    with open(log_path, "ab") as output:
        process = await trio.lowlevel.open_process(argv, stdin=subprocess.DEVNULL, stdout=output,
                                                   stderr=subprocess.STDOUT, cwd=directory, start_new_session=True)
    server = RedisServer(process.pid, port, unix_socket, log_path)
    try:
        await wait_until_ready(server, lambda: process.returncode, startup_timeout)
        task_status.started(server)
        server.returncode = await process.wait()
    finally:
        with trio.CancelScope(shield=True):
            await _stop(process, stop_grace)
            server.returncode = process.returncode
            if unix_socket is not None:
                unix_socket.unlink(missing_ok=True)


async def _stop(process: trio.Process, grace: float) -> None:
    """SIGTERM the server's group, SIGKILL after ``grace`` seconds; then whatever is left of the group."""
    with trio.move_on_after(grace + 5):  # after SIGKILL: a process stuck in the kernel cannot be waited for
        await terminate_group(process.pid, wait=process.wait, running=lambda: process.returncode is None,
                              grace=grace)
    signal_group(process.pid, signal.SIGKILL)  # a child it forked (BGSAVE) would outlive it


@dataclass(eq=False)
class _Restarts:
    """The ``task_status`` of each server the supervisor starts: the first one's ``started`` is the supervisor's;
    each later one's updates that same :class:`RedisServer` (pid, ``restarts``)."""

    task_status: trio.TaskStatus[RedisServer]
    server: RedisServer | None = None  # what the supervisor's caller holds
    current: RedisServer | None = None  # the latest server started

    def started(self, value: RedisServer | None = None) -> None:
        assert value is not None, "run_redis_server starts with its server"
        self.current = value
        if self.server is None:
            self.server = value
            self.task_status.started(value)
        else:
            self.server.pid, self.server.returncode = value.pid, None
            self.server.restarts += 1


async def supervise_redis_server(directory: Path, *, unix_socket: Path,
                                 restart_backoff: tuple[float, float] = (0.5, 5.0),
                                 startup_timeout: float = STARTUP_TIMEOUT,
                                 task_status: trio.TaskStatus[RedisServer] = trio.TASK_STATUS_IGNORED) -> None:
    """:func:`run_redis_server` on ``unix_socket``, started again whenever it exits, until cancelled.

    ``task_status.started(server)`` once the first server answers; a failure to start that one is raised. The
    same ``server`` follows the restarts: ``server.pid`` is the running server's once it answers (until then, the
    exited one's, with its ``returncode``), ``server.restarts`` counts them. Between restarts the supervisor waits
    ``restart_backoff[0]`` seconds, doubled after each restart up to ``restart_backoff[1]``, and from the start
    again once a server ran for a minute. Each exit is logged at WARNING with its code."""
    backoff = RestartBackoff(*restart_backoff, stable_after=STABLE_AFTER)
    restarts = _Restarts(task_status)
    while True:
        began = trio.current_time()
        try:
            await run_redis_server(directory, unix_socket=unix_socket, startup_timeout=startup_timeout,
                                   task_status=restarts)
        except RedisServerFailed as failure:
            if restarts.server is None:
                raise
            delay = backoff.next_delay(None)
            log.error("redis-server did not start again (next try in %g s): %s", delay, failure)
        else:
            assert restarts.server is not None and restarts.current is not None, "it returns once it started"
            restarts.server.returncode = restarts.current.returncode
            delay = backoff.next_delay(trio.current_time() - began)
            log.warning("redis-server (pid %d) exited with code %s; starting it again in %g s",
                        restarts.current.pid, restarts.current.returncode, delay)
        await trio.sleep(delay)
