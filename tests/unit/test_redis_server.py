"""The private redis-server llmgw runs (llmgw.redis_server) and the tests' redis fixtures: real redis-server
processes, asked with the coredis client the product uses."""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
from functools import partial

import coredis
import pytest
import trio

from llmgw import redis_server as redis_module
from llmgw.procgroup import process_start_time
from llmgw.redis_server import (
    LOG_NAME,
    RedisServer,
    RedisServerFailed,
    find_redis_server,
    run_redis_server,
    supervise_redis_server,
)
from llmgw.usererrors import UserError


def client(url: str) -> coredis.Redis:
    return coredis.Redis.from_url(url, connect_timeout=1, stream_timeout=2)


async def ping(url: str) -> bool:
    async with client(url) as redis:
        return await redis.ping() == b"PONG"


async def config(url: str, name: str) -> str:
    async with client(url) as redis:
        return (await redis.config_get([name]))[name.encode()].decode()


async def wait_for_new_pid(server: RedisServer, old_pid: int, timeout: float = 15.0) -> None:
    with trio.fail_after(timeout):
        while server.pid == old_pid:
            await trio.sleep(0.05)


async def test_a_server_on_an_ephemeral_port_answers_ping_and_keeps_nothing_on_disk(nursery, tmp_path):
    server = await nursery.start(partial(run_redis_server, tmp_path, port=0))
    assert server.url == f"redis://127.0.0.1:{server.port}" and server.unix_socket is None
    assert await ping(server.url)
    for name, value in [("save", ""), ("appendonly", "no"), ("maxmemory", "0"), ("protected-mode", "yes"),
                        ("bind", "127.0.0.1"), ("dir", str(tmp_path)), ("loglevel", "warning")]:
        assert await config(server.url, name) == value, name
    assert (tmp_path / LOG_NAME).is_file()


async def test_a_server_on_a_unix_socket_answers_ping_and_only_its_owner_may_connect(nursery, tmp_path):
    path = tmp_path / "redis.sock"
    server = await nursery.start(partial(run_redis_server, tmp_path, unix_socket=path))
    assert server.url == f"unix://{path}" and server.port is None
    assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o700
    assert await ping(server.url)
    assert await config(server.url, "port") == "0"  # no TCP listener at all


async def test_cancelling_stops_the_server_and_removes_its_socket(tmp_path):
    path = tmp_path / "redis.sock"
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(run_redis_server, tmp_path, unix_socket=path))
        assert process_start_time(server.pid) is not None and path.exists()
        nursery.cancel_scope.cancel()
    assert process_start_time(server.pid) is None  # gone, and reaped
    assert not path.exists()
    assert server.returncode is not None


async def test_a_killed_server_is_started_again_by_its_supervisor(nursery, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="llmgw.redis_server")
    path = tmp_path / "redis.sock"
    server = await nursery.start(partial(supervise_redis_server, tmp_path, unix_socket=path,
                                         restart_backoff=(0.1, 1.0)))
    assert await ping(server.url)
    first_pid = server.pid
    server.kill(signal.SIGKILL)
    await wait_for_new_pid(server, first_pid)
    assert await ping(server.url)
    assert server.restarts == 1 and server.returncode is None and process_start_time(first_pid) is None
    (exit_record,) = [r for r in caplog.records if "exited with code" in r.getMessage()]
    assert exit_record.levelno == logging.WARNING
    assert f"pid {first_pid}" in exit_record.getMessage() and "code -9" in exit_record.getMessage()


async def test_a_fixed_port_that_is_taken_fails_with_the_servers_log(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RedisServerFailed, match="Address already in use"):
            await run_redis_server(tmp_path, port=taken.getsockname()[1])


async def test_an_ephemeral_port_taken_before_redis_binds_it_is_replaced_by_another(nursery, tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        pick = redis_module._free_port
        monkeypatch.setattr(redis_module, "_free_port", lambda: next(ports, None) or pick())
        server = await nursery.start(partial(run_redis_server, tmp_path, port=0))
        assert server.port != taken.getsockname()[1]
        assert await ping(server.url)
    assert "Address already in use" in (tmp_path / LOG_NAME).read_text()


async def test_a_unix_socket_path_too_long_for_the_kernel_is_refused(tmp_path):
    with pytest.raises(UserError, match="too long"):
        await run_redis_server(tmp_path, unix_socket=tmp_path / ("s" * 120))


def test_a_missing_redis_server_names_the_package_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(UserError, match="install it") as failure:
        find_redis_server(directories=[tmp_path])
    assert str(failure.value) == "redis-server was not found: install it (Debian/Ubuntu: apt-get install redis-server)"
    executable = tmp_path / "redis-server"
    executable.write_text("#!/bin/sh\n")
    executable.chmod(0o755)
    assert find_redis_server(directories=[tmp_path / "missing", tmp_path]) == str(executable)


async def test_the_session_server_answers_ping(redis_server, redis_url, cluster_name):
    assert redis_url == redis_server.url and redis_url.startswith("redis://127.0.0.1:")
    assert await ping(redis_url)
    assert cluster_name.startswith("test-")
    async with client(redis_url) as redis:
        await redis.set(f"{cluster_name}:probe", b"1")
        assert await redis.get(f"{cluster_name}:probe") == b"1"


async def test_a_private_server_can_be_killed_and_started_again_on_the_same_port(private_redis):
    port, first_pid = private_redis.port, private_redis.pid
    assert await ping(private_redis.url)
    assert await private_redis.kill() == -signal.SIGKILL
    with pytest.RaisesGroup(coredis.exceptions.ConnectionError):  # the client's errors come in its nursery's group
        await ping(private_redis.url)
    await private_redis.restart()
    assert private_redis.port == port and private_redis.pid != first_pid
    assert await ping(private_redis.url)
    assert os.getpgid(private_redis.pid) == private_redis.pid  # in its own process group
