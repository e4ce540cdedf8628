"""Idle sockets cannot starve ``llmgw serve`` of file descriptors.

A real gateway starts with ``RLIMIT_NOFILE`` soft 200, hard 256 (``prlimit``; it raises the soft one to 256 and
says so), in front of a simulator replica. More idle connections than it can hold are opened to both ports: the
ones over each port's cap are answered 503 at once, the others are closed after the header timeout; meanwhile a
keep-alive connection opened before still gets its requests through to the engine, and once the idle ones are
gone a new connection does too.
"""

from __future__ import annotations

import re

import httpx
import trio

from helpers import read_to_eof
from llmgw.testing.processes import SERVE_READY, llmgw_command, start_child
from llmgw.testing.sims import MODEL, start_sims

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
