"""Idle sockets cannot starve ``llmgw serve`` of file descriptors, and running out of them never ends it.

A real gateway starts with ``RLIMIT_NOFILE`` soft 200, hard 256 (``prlimit``; it raises the soft one to 256 and
says so), in front of a simulator replica. More idle connections than it can hold are opened to both ports: the
ones over each port's cap are answered 503 at once, the others are closed after the header timeout; meanwhile a
keep-alive connection opened before still gets its requests through to the engine, and once the idle ones are
gone a new connection does too.

The caps cannot help when descriptors run out anyway (the system's table is full, the limit is lowered under a
running process): a gateway whose embedded agent follows two simulators' KV events has its soft limit lowered to
just above what it holds and both ports are flooded until no descriptor is left. Chats sent then are answered
(200, or 503 to retry) without blaming a replica; one engine pauses, so that its subscription's replay times out
and a new replay socket must be opened with none left (on main: ``ZMQError: Too many open files`` ends the
process with exit 1). The gateway stays up, counts and logs the shortage, kills no engine, and once the idle
connections go it routes again with a healthy KV index.
"""

from __future__ import annotations

import os
import re
import resource
import signal

import httpx
import pytest
import trio

from helpers import read_to_eof
from llmgw.testing.cluster import all_up, embedded, kv_where, shard_pids
from llmgw.testing.metrics import metric_value, scrape, series_sum
from llmgw.testing.processes import SERVE_READY, llmgw_command, start_child
from llmgw.testing.sims import MODEL, kv_sim_profile, start_sims

LIMIT = 256  # the hard limit; the soft one starts lower and llmgw raises it
SOFT = 200
IDLE_PER_PORT = 120  # the two ports together hold far fewer (48 + 16 at 256 open files)
HEADER_TIMEOUT = 2.0
CHAT = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello there"}]}


def config(sim_url: str) -> str:
    return (f"models:\n  - name: {MODEL}\n    routing: round_robin\n    replicas:\n      - url: {sim_url}\n"
            f"limits:\n  client_header_timeout: {HEADER_TIMEOUT}s\n  client_body_timeout: 2s\n"
            "  keepalive_timeout: 60s\nlog_level: info\n")


async def open_idle(url: str, count: int) -> list[trio.SocketStream]:
    host, port = url.split("//")[1].rsplit(":", 1)
    return [await trio.open_tcp_stream(host, int(port)) for _ in range(count)]


async def answer_of(stream: trio.SocketStream) -> bytes:
    """What the gateway sends an idle connection before it closes it (b"" for a quiet close)."""
    async with stream:
        return await read_to_eof(stream)


async def chat(client: httpx.AsyncClient, url: str) -> httpx.Response:
    return await client.post(url + "/v1/chat/completions", json=CHAT)


async def metric(control_url: str, name: str, labels: str) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(control_url + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and labels in line)


async def test_idle_sockets_on_both_ports_neither_starve_engines_nor_outlast_the_header_timeout(nursery, tmp_path):
    (sim,) = await start_sims(nursery, 1, num_blocks=256)
    path = tmp_path / "llmgw.yaml"
    path.write_text(config(sim.url))
    argv = ["prlimit", f"--nofile={SOFT}:{LIMIT}", *llmgw_command(
        "serve", "--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0", "--config", str(path))]
    gw = await start_child(nursery, argv, name="llmgw", ready=SERVE_READY)
    output = gw.output()
    assert f"open files: raised the soft limit from {SOFT} to {LIMIT} (hard limit {LIMIT})" in output, output
    caps = re.search(r"connection caps: data port (\d+) .*control port (\d+) .*of the (\d+) open files", output)
    assert caps is not None, output
    data_cap, control_cap = int(caps.group(1)), int(caps.group(2))
    assert int(caps.group(3)) == LIMIT and data_cap + control_cap < LIMIT // 2

    async with httpx.AsyncClient(timeout=10) as kept:
        assert (await chat(kept, gw.url)).status_code == 200  # this connection is kept alive throughout
        with trio.fail_after(60):
            idle = await open_idle(gw.url, IDLE_PER_PORT) + await open_idle(gw.control_url, IDLE_PER_PORT)
            opened = trio.current_time()
            # every port full of idle connections: the one kept alive still reaches the engine
            answer = await chat(kept, gw.url)
            assert answer.status_code == 200, answer.text
            async with httpx.AsyncClient(timeout=10) as fresh:  # a new one is refused at once, not left waiting
                refused = await chat(fresh, gw.url)
            assert refused.status_code in (200, 503), refused.text
            answers: list[bytes] = [b""] * len(idle)

            async def read(i: int) -> None:
                answers[i] = await answer_of(idle[i])

            async with trio.open_nursery() as reading:
                for i in range(len(idle)):
                    reading.start_soon(read, i)
            closed_after = trio.current_time() - opened
        # the held ones were closed quietly after the header timeout (they sent nothing), the others refused
        assert closed_after < HEADER_TIMEOUT + 20  # not the 60 s keep-alive timeout, nor never
        busy = [a for a in answers if a.startswith(b"HTTP/1.1 503 ")]
        assert len(busy) >= 2 * IDLE_PER_PORT - data_cap - control_cap
        assert all(a == b"" for a in answers if a not in busy)
        assert (await chat(kept, gw.url)).status_code == 200
    async with httpx.AsyncClient(timeout=10) as fresh:
        assert (await chat(fresh, gw.url)).status_code == 200
        assert (await fresh.get(gw.control_url + "/health")).status_code == 200
    assert await metric(gw.control_url, "llmgw_connections_refused_total", 'port="data"') >= 1
    assert await metric(gw.control_url, "llmgw_connections_refused_total", 'port="control"') >= 1
    assert await metric(gw.control_url, "llmgw_connection_timeouts_total", 'phase="header"') >= data_cap
    assert gw.returncode is None
    assert "Too many open files" not in gw.output(last=2000)


FLOOD_PER_PORT = 100  # far more than the few descriptors left: both ports stay flooded, the rest in the backlog
HEADROOM = 12  # descriptors left above what the gateway holds when its limit is lowered
CONCURRENT = 8  # chats sent at once while no descriptor is left
CHAT_TINY = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hello there"}]}


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def flood(url: str, count: int) -> list[trio.SocketStream]:
    """Up to ``count`` idle connections to ``url`` (a connection the backlog cannot queue any more ends it)."""
    host, port = url.split("//")[1].rsplit(":", 1)
    streams = []
    for _ in range(count):
        with trio.move_on_after(2):
            streams.append(await trio.open_tcp_stream(host, int(port)))
            continue
        break
    return streams


@pytest.mark.slow
async def test_running_out_of_descriptors_under_kv_events_neither_ends_the_gateway_nor_kills_engines(cluster):
    # the test's own sockets: far more than the flood needs
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    cluster.write_config(embedded(cluster.tmp_path / "state")
                         + "limits:\n  client_header_timeout: 120s\n  keepalive_timeout: 120s\n"
                         + kv_sim_profile('"--num-blocks", "512", "--time-scale", "0"', replicas=2))
    gw = await cluster.start_serve()
    engines = shard_pids(await cluster.replicas_where("both replicas up", all_up(2), timeout=60))
    await kv_where(cluster, "both KV indexes healthy",
                   lambda s: len(s) == 2 and all(r["state"] == "healthy" for r in s.values()), timeout=60)

    # Connections opened now and kept alive: one reads /metrics, CONCURRENT send chats, while no new one can be
    # accepted. Their chats went one at a time so far: the gateway holds few engine connections.
    kept = httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=1, keepalive_expiry=300))
    clients = httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=CONCURRENT, keepalive_expiry=300))
    paused = next(iter(engines.values()))
    try:
        assert (await kept.get(cluster.control_url + "/metrics")).status_code == 200
        async with trio.open_nursery() as opening:
            for _ in range(CONCURRENT):
                opening.start_soon(clients.get, cluster.data_url + "/health")
        _, hard = resource.prlimit(gw.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(gw.pid, resource.RLIMIT_NOFILE, (open_files(gw.pid) + HEADROOM, hard))
        idle = await flood(cluster.data_url, FLOOD_PER_PORT) + await flood(cluster.control_url, FLOOD_PER_PORT)

        # Chats at once need engine connections the gateway cannot open: each is a 200, or a 503 to retry; no
        # replica is blamed (no connect error counted, both still up), and the shortage is counted.
        answers: list[httpx.Response] = []

        async def chat() -> None:
            answers.append(await clients.post(cluster.data_url + "/v1/chat/completions", json=CHAT_TINY))

        async with trio.open_nursery() as chatting:
            for _ in range(CONCURRENT):
                chatting.start_soon(chat)
        assert {a.status_code for a in answers} <= {200, 503}, [a.text for a in answers]
        assert all(a.json()["error"]["code"] == "no_healthy_replica" for a in answers if a.status_code == 503)
        during = await scrape(cluster.control_url, kept)
        assert series_sum(during, "llmgw_upstream_errors_total", 'kind="connect"') == 0
        assert all_up(2)({r["name"]: r for r in (await kept.get(cluster.control_url + "/admin/replicas")).json()})
        assert metric_value(during, "llmgw_fd_exhaustion_total", 'where="upstream_connect"') >= 1
        # The paused engine does not answer its replay probe: the subscription closes that socket and must
        # open a new one for the next probe, with every descriptor taken by the flood.
        os.kill(paused, signal.SIGSTOP)
        try:
            with trio.fail_after(60):
                while True:
                    try:
                        text = await scrape(cluster.control_url, kept)
                    except httpx.HTTPError:
                        await gw.process.wait()  # the gateway ended (it did on main): say how
                        raise AssertionError(f"llmgw serve exited {gw.returncode}:\n{gw.output(last=40)}") from None
                    if metric_value(text, "llmgw_fd_exhaustion_total", 'where="kv_replay"') >= 1:
                        break
                    await trio.sleep(0.5)
        finally:
            os.kill(paused, signal.SIGCONT)
        exhausted = await scrape(cluster.control_url, kept)
        assert metric_value(exhausted, "llmgw_fd_exhaustion_total", 'where="data_accept"') >= 1
        for stream in idle:
            await stream.aclose()
    finally:
        await kept.aclose()
        await clients.aclose()

    # The idle connections gone: a new connection routes, the index is healthy, and the engines are the same.
    after = await cluster.replicas_where("both replicas up again", all_up(2), timeout=60)
    assert shard_pids(after) == engines
    await kv_where(cluster, "both KV indexes healthy again",
                   lambda s: len(s) == 2 and all(r["state"] == "healthy" for r in s.values()), timeout=60)
    for _ in range(4):
        await cluster.chat()
    assert gw.returncode is None
    output = "\n".join(gw.lines)
    assert "out of file descriptors (EMFILE) at kv_replay" in output, output[-3000:]
    assert "Traceback" not in output
