"""``llmgw serve --workers N``: several gateway processes on one data port, routing as one, from one command.

Real processes on loopback: two ``llmgw sim`` replicas of a static model, a config with no Redis (so the
supervisor runs its private redis-server on a Unix socket), and the supervisor with its workers. What is
checked is what an operator sees: the banner, the supervisor's log lines (each worker's pid, role and control
URL), each worker's own ``/metrics`` and ``/admin/cluster``, the processes and the socket file.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio

from llmgw.config import parse_config
from llmgw.gateway.app import Gateway
from llmgw.procgroup import process_start_time
from llmgw.testing.metrics import scrape, series_sum
from llmgw.testing.processes import Child, llmgw_command
from llmgw.testing.shared_state import state_section
from llmgw.testing.sims import MODEL, gateway_config, start_sims
from llmgw.workers.plan import SECRET_ENV
from llmgw.workers.worker import with_private_state

WORKER_LINE = re.compile(r"^llmgw worker (\d+) \(pid (\d+), role (\w+)\) (?:ready|restarted): control (\S+)$")
REDIS_LINE = re.compile(r"^llmgw workers on \S+ share their state in a private redis-server \(pid (\d+)\) "
                        r"at unix://(\S+)$")
BODY = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
MISSING = "llmgw serve: redis-server was not found: install it (Debian/Ubuntu: apt-get install redis-server)"
# `llmgw serve` as a user runs it, on a machine where no redis-server can be found: PATH has none, and the
# folders searched besides PATH (/usr/sbin, /usr/bin, where this machine has one) are emptied first.
WITHOUT_REDIS = ("import sys, llmgw.redis_server as r; r.SEARCH_DIRECTORIES = (); from llmgw.cli import main; "
                 "sys.exit(main())")


@dataclass(frozen=True)
class Seen:
    pid: int
    role: str
    control_url: str


def workers_of(supervisor: Child) -> dict[int, Seen]:
    """Each worker's latest process, from the supervisor's lines (on stdout, whatever the log level)."""
    seen = {}
    for line in supervisor.lines:
        if match := WORKER_LINE.search(line):
            seen[int(match.group(1))] = Seen(int(match.group(2)), match.group(3), match.group(4))
    return seen


def private_redis(supervisor: Child) -> tuple[int, Path]:
    """The private redis-server's pid and socket, from the supervisor's line."""
    for line in supervisor.lines:
        if match := REDIS_LINE.search(line):
            return int(match.group(1)), Path(match.group(2))
    raise AssertionError(f"no private redis-server line:\n{supervisor.output()}")


async def wait_for(condition, timeout: float, poll: float = 0.05) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(poll)


async def served(http: httpx.AsyncClient, worker: Seen) -> float:
    """The requests ``worker`` answered, from its own /metrics."""
    return series_sum(await scrape(worker.control_url, http), "llmgw_requests_total")


def fresh_connections() -> httpx.AsyncClient:
    """A client that opens a new connection for every request (SO_REUSEPORT spreads connections, not requests)."""
    return httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_keepalive_connections=0))


async def start_workers(nursery, start_llmgw, *extra: str) -> Child:
    sims = await start_sims(nursery, 2, num_blocks=64, time_scale=0, seed=0)
    return await start_llmgw(gateway_config([s.url for s in sims], routing="round_robin"), "--workers", "2", *extra)


@pytest.mark.slow
async def test_two_workers_share_one_port_and_route_as_one_then_stop_on_sigint(nursery, start_llmgw):
    supervisor = await start_workers(nursery, start_llmgw)
    workers = workers_of(supervisor)
    assert {index: worker.role for index, worker in workers.items()} == {0: "control", 1: "gateway"}
    assert supervisor.control_url == workers[0].control_url != workers[1].control_url
    redis_pid, socket_path = private_redis(supervisor)
    assert stat.S_ISSOCK(socket_path.stat().st_mode)
    async with fresh_connections() as http:
        for _ in range(20):
            answer = await http.post(supervisor.url + "/v1/chat/completions", json=BODY)
            assert answer.status_code == 200, answer.text
        counts = [await served(http, workers[index]) for index in (0, 1)]
        assert sum(counts) == 20 and min(counts) >= 1, counts  # the kernel gave each worker connections
        for index, role in ((0, "control"), (1, "gateway")):
            cluster = (await http.get(workers[index].control_url + "/admin/cluster")).json()
            assert (cluster["role"], cluster["backend"], cluster["cluster"]) == (role, "redis", "workers")
            assert cluster["redis"] == f"unix://{socket_path}" and cluster["degraded"] is False
    children = [worker.pid for worker in workers.values()] + [redis_pid]
    supervisor.kill(signal.SIGINT)
    assert await supervisor.wait_exit(timeout=30) == 0, supervisor.output()
    assert [pid for pid in children if process_start_time(pid) is not None] == []
    assert not socket_path.exists()
    assert not any("Traceback" in line for line in supervisor.lines), supervisor.output()


@pytest.mark.slow
async def test_a_killed_worker_is_started_again_and_serves_and_sighup_reaches_every_worker(nursery, start_llmgw,
                                                                                          tmp_path):
    supervisor = await start_workers(nursery, start_llmgw, "--state-dir", str(tmp_path / "w"), "--log-level", "info")
    killed = workers_of(supervisor)[1]
    os.kill(killed.pid, signal.SIGKILL)
    await wait_for(lambda: workers_of(supervisor)[1].pid != killed.pid, timeout=30)
    restarted = workers_of(supervisor)[1]
    warning = [line for line in supervisor.lines if f"worker 1 (pid {killed.pid}) was killed by SIGKILL" in line]
    assert len(warning) == 1 and " WARNING " in warning[0], supervisor.output()
    assert process_start_time(killed.pid) is None  # reaped by the supervisor
    async with fresh_connections() as http:
        with trio.fail_after(20):
            while await served(http, restarted) < 1:  # new connections reach the new process too
                answer = await http.post(supervisor.url + "/v1/chat/completions", json=BODY)
                assert answer.status_code == 200, answer.text
        cluster = (await http.get(restarted.control_url + "/admin/cluster")).json()
        assert cluster["role"] == "gateway" and cluster["log"]["loaded"] is True
    supervisor.kill(signal.SIGHUP)
    for index in (0, 1):
        await wait_for(lambda: any(f"[worker {index}] llmgw.gateway.app: reloaded" in line
                                   for line in supervisor.lines), timeout=10)
    assert workers_of(supervisor)[1] == restarted  # a reload is no restart


@pytest.mark.slow
async def test_a_killed_supervisors_workers_and_redis_stop_and_a_redis_left_anyway_goes_at_the_next_start(
        nursery, start_llmgw, tmp_path):
    state_dir = tmp_path / "w"
    first = await start_workers(nursery, start_llmgw, "--state-dir", str(state_dir))
    orphans = [worker.pid for worker in workers_of(first).values()]
    redis_pid, socket_path = private_redis(first)
    first.kill(signal.SIGKILL)  # no goodbye: the workers notice their lifeline's end; worker 0 stops the redis
    await wait_for(lambda: all(process_start_time(pid) is None for pid in [*orphans, redis_pid]), timeout=20)
    assert not socket_path.exists()

    second = await start_workers(nursery, start_llmgw, "--state-dir", str(state_dir))
    redis_pid, _ = private_redis(second)
    try:
        os.kill(workers_of(second)[0].pid, signal.SIGKILL)  # first the worker that would stop the redis-server
        second.kill(signal.SIGKILL)  # then the supervisor, before it restarts that worker
        await wait_for(lambda: process_start_time(workers_of(second)[1].pid) is None, timeout=20)
        assert process_start_time(redis_pid) is not None  # left running: nothing told it
        third = await start_workers(nursery, start_llmgw, "--state-dir", str(state_dir))
        assert any(f"stopping the redis-server (pid {redis_pid}) a killed supervisor left" in line
                   for line in third.lines), third.output()
        await wait_for(lambda: process_start_time(redis_pid) is None, timeout=10)
        assert private_redis(third)[0] != redis_pid
    finally:
        if process_start_time(redis_pid) is not None:
            os.kill(redis_pid, signal.SIGKILL)


@pytest.mark.slow
async def test_with_redis_in_the_config_the_workers_use_it_and_a_second_supervisor_on_the_port_is_refused(
        nursery, start_llmgw, redis_url, cluster_name, tmp_path):
    sims = await start_sims(nursery, 2, num_blocks=64, time_scale=0, seed=0)
    config = gateway_config([s.url for s in sims], routing="round_robin") + (
        state_section(redis_url, cluster_name))
    supervisor = await start_llmgw(config, "--workers", "2")
    assert not any(REDIS_LINE.search(line) for line in supervisor.lines)
    async with fresh_connections() as http:
        for index, role in ((0, "control"), (1, "gateway")):
            cluster = (await http.get(workers_of(supervisor)[index].control_url + "/admin/cluster")).json()
            assert (cluster["role"], cluster["cluster"], cluster["degraded"]) == (role, cluster_name, False)
            assert cluster["redis"].startswith(redis_url)
        answer = await http.post(supervisor.url + "/v1/chat/completions", json=BODY)
        assert answer.status_code == 200, answer.text
    # A second supervisor on the same port would join it through SO_REUSEPORT: its state dir's lock refuses it.
    config_path = next(tmp_path.glob("llmgw-*.yaml"))
    second = await trio.run_process(llmgw_command("serve", "--workers", "2", "--config", str(config_path), "--listen",
                                                  supervisor.url.removeprefix("http://"), "--control-listen",
                                                  "127.0.0.1:0"), capture_stderr=True, check=False)
    assert second.returncode == 2
    assert f"is in use by pid {supervisor.pid} (llmgw serve)" in second.stderr.decode()


@pytest.mark.slow
async def test_when_worker_0_cannot_start_the_supervisor_stops_and_says_so(tmp_path):
    config = tmp_path / "llmgw.yaml"
    config.write_text("log_level: warning\n")
    with trio.socket.socket() as squatter:
        await squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        busy = squatter.getsockname()[1]
        result = await trio.run_process(llmgw_command("serve", "--workers", "2", "--config", str(config),
                                                      "--listen", "127.0.0.1:0", "--control-listen",
                                                      f"127.0.0.1:{busy}"),
                                        capture_stdout=True, capture_stderr=True, check=False)
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert f"llmgw serve: cannot listen on 127.0.0.1:{busy}: address already in use" in stderr
    assert "worker 0 (pid" in stderr and "exited with code 2 before it was ready: stopping" in stderr
    assert b"llmgw listening on" not in result.stdout


def test_without_redis_server_one_line_names_the_package(tmp_path):
    config = tmp_path / "llmgw.yaml"
    config.write_text("log_level: info\n")
    result = subprocess.run([sys.executable, "-c", WITHOUT_REDIS, "serve", "--workers", "2", "--config", str(config),
                             "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0"],
                            env={**os.environ, "PATH": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == MISSING
    assert result.stdout == ""


def test_workers_zero_and_workers_without_a_config_are_refused(tmp_path):
    config = tmp_path / "llmgw.yaml"
    config.write_text("log_level: info\n")
    zero = subprocess.run(llmgw_command("serve", "--workers", "0", "--config", str(config)), capture_output=True,
                          text=True, timeout=60)
    assert zero.returncode == 2
    assert "llmgw serve: error: argument --workers: must be at least 1 (got 0)" in zero.stderr
    demo = subprocess.run(llmgw_command("serve", "--workers", "2"), capture_output=True, text=True, timeout=60)
    assert demo.returncode == 2
    assert demo.stderr.strip() == "llmgw serve: --workers needs --config (the demo runs as one process)"


async def test_a_workers_reload_keeps_it_on_the_private_redis(nursery, tmp_path, redis_url, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "the private cluster's secret, as the supervisor hands it over")
    path = tmp_path / "llmgw.yaml"
    path.write_text("log_level: warning\n")

    def adjust(config):
        return with_private_state(config, redis_url)

    gateway = Gateway(adjust(parse_config(path.read_text(), filename=str(path))), adjust_config=adjust)
    await nursery.start(gateway.run, ("127.0.0.1", 0), ("127.0.0.1", 0))
    path.write_text("log_level: info\n")
    assert (await gateway.reload()).applied
    assert gateway.config.log_level == "info"  # the file was read again...
    assert gateway.config.state == adjust(gateway.config).state and gateway.config.state.shared  # ...and adjusted
