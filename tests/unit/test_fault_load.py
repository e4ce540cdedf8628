"""The fault benchmark's load driver tells a request that never started (retried) from one lost in flight, a cut
stream and an HTTP error, against a raw TCP server on loopback that misbehaves on purpose."""

from __future__ import annotations

import re

import pytest
import trio

from llmgw.bench.fault_load import LoadSettings, SteadyLoad
from llmgw.testing.processes import free_port

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"
UNAVAILABLE = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"
STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
               b"connection: close\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


ANSWERS = {  # (non-streamed, streamed) answer of each mode; None closes the connection without a byte
    "ok": (OK, STREAM_HEAD + chunk(b"data: {}\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"),
    "close": (None, None),
    "503": (UNAVAILABLE, UNAVAILABLE),
    "cut": (OK, STREAM_HEAD + chunk(b"data: {}\n\n")),
}


async def serve(port: int, mode: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async def handle(stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        head, _, body = request.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        while len(body) < length:
            body += await stream.receive_some(65536)
        answer = ANSWERS[mode][b'"stream": true' in body or b'"stream":true' in body]
        if answer is not None:
            await stream.send_all(answer)
        await stream.aclose()

    await trio.serve_tcp(handle, port, host="127.0.0.1", task_status=task_status)


async def one_request_of_each_kind(port: int, mode: str) -> dict:
    """At least one non-streamed request, then a streamed one (perhaps one more before the load paused)."""
    load = SteadyLoad(f"http://127.0.0.1:{port}", LoadSettings(concurrency=1, rate=50, stream_every=2,
                                                                retry_backoff=0.05, request_timeout=5))
    async with load.running():
        await load.wait_finished(2)
        await load.pause()
    return load.phases["warmup"].as_dict()


@pytest.mark.parametrize("mode, plain, stream", [
    ("ok", "ok", "ok"), ("close", "in_flight", "in_flight"), ("503", "http_503", "http_503"),
    ("cut", "ok", "stream_cut")])
async def test_each_outcome_is_told_apart(nursery, mode, plain, stream):
    port = free_port()
    await nursery.start(serve, port, mode)
    counts = await one_request_of_each_kind(port, mode)
    assert (set(counts["plain"]), set(counts["stream"]), counts["not_started_retries"]) == ({plain}, {stream}, 0)


async def test_a_refused_connection_is_a_request_not_started_and_is_sent_again(nursery):
    port = free_port()  # nothing listens there yet: connections are refused

    async def listen_later():
        await trio.sleep(0.3)
        await nursery.start(serve, port, "ok")

    nursery.start_soon(listen_later)
    counts = await one_request_of_each_kind(port, "ok")
    assert set(counts["plain"]) == set(counts["stream"]) == {"ok"}
    assert counts["not_started_retries"] >= 1


async def test_several_data_planes_take_turns_and_a_refused_request_goes_to_the_next(nursery):
    live, dead = free_port(), free_port()  # nothing listens on `dead`: its connections are refused
    await nursery.start(serve, live, "ok")
    urls = [f"http://127.0.0.1:{dead}", f"http://127.0.0.1:{live}"]
    load = SteadyLoad(urls, LoadSettings(concurrency=1, rate=50, stream_every=2, retry_backoff=0.01,
                                         request_timeout=5))
    async with load.running():
        await load.wait_finished(4)
        await load.pause()
    counts = load.phases["warmup"]
    assert counts.failed("plain") == counts.failed("stream") == {}
    assert set(counts.by_target) == {urls[1]}  # every request ended on the live one
    assert counts.refused_by_target[urls[0]] >= 2 and urls[1] not in counts.refused_by_target
    assert counts.as_dict()["by_target"][urls[1]]["ok"] == counts.sent()
