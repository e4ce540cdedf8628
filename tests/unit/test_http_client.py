"""The pooled upstream client (``llmgw.http.client``) against scripted upstreams on 127.0.0.1.

Each upstream here is a few lines of Trio that read requests and answer exactly what the
test needs (a clean keep-alive answer, a stall, a close mid-body, garbage), so that
reuse, retries of stale connections, timeouts and error kinds are checked on the wire.
"""

from __future__ import annotations

import functools
import socket
import struct

import httptools
import pytest
import trio

from llmgw.http.client import YIELD_EVERY, UpstreamError, UpstreamPool

OK_BODY = b'{"ok":true}'


class Upstream:
    """Counts connections and requests; ``script(upstream, stream, request_number)`` answers each request."""

    def __init__(self, script):
        self.script = script
        self.connections = 0
        self.requests: list[tuple[str, bytes, list[tuple[bytes, bytes]], bytes]] = []
        self.closed_by_peer = trio.Event()
        self.port = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        parsed: list = []
        state: dict = {}

        class Callbacks:
            def on_message_begin(self):
                state.update(url=b"", headers=[], body=b"")

            def on_url(self, url):
                state["url"] += url

            def on_header(self, name, value):
                state["headers"].append((name.lower(), value))

            def on_body(self, body):
                state["body"] += body

            def on_message_complete(self):
                parsed.append((parser.get_method().decode(), state["url"], state["headers"], state["body"]))

        parser = httptools.HttpRequestParser(Callbacks())
        try:
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    self.closed_by_peer.set()
                    return
                parser.feed_data(data)
                while parsed:
                    request = parsed.pop(0)
                    self.requests.append(request)
                    if await self.script(self, stream, len(self.requests)) == "close":
                        await stream.aclose()
                        return
                    # None: answered (or, on purpose, not), and the connection stays open
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed_by_peer.set()


def answer(body: bytes = OK_BODY, status: int = 200, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status, len(body), extra, body)


async def ok(upstream, stream, n):
    await stream.send_all(answer())


@pytest.fixture
async def upstream(nursery):
    """``await upstream(script)`` -> a running :class:`Upstream` on 127.0.0.1 and a free port."""

    async def start(script=ok) -> Upstream:
        up = Upstream(script)
        listeners = await nursery.start(functools.partial(trio.serve_tcp, up.handle, 0, host="127.0.0.1"))
        up.port = listeners[0].socket.getsockname()[1]
        return up

    return start


async def call(pool: UpstreamPool, method: str = "POST", body: bytes = b"{}", headers=None, *,
               first_byte_timeout: float = 5.0, idle_timeout: float = 5.0):
    return await pool.request(method, "/v1/chat/completions", headers or [(b"content-type", b"application/json")],
                              body, first_byte_timeout=first_byte_timeout, idle_timeout=idle_timeout)


# -- keep-alive and the request on the wire ----------------------------------------------------------------------------

async def test_a_connection_is_reused_once_its_answer_was_read(upstream):
    up = await upstream()
    pool = UpstreamPool("127.0.0.1", up.port)
    with trio.fail_after(5):
        for _ in range(3):
            response = await call(pool)
            assert response.status == 200 and await response.read() == OK_BODY
    assert up.connections == 1 and len(up.requests) == 3
    assert pool.open_connections == 1
    await pool.aclose()
    assert pool.open_connections == 0


async def test_the_request_carries_host_and_length_but_no_hop_by_hop_headers(upstream):
    up = await upstream()
    pool = UpstreamPool("127.0.0.1", up.port)
    body = b"x" * 200_000  # larger than one write: head and body go separately
    headers = [(b"content-type", b"application/json"), (b"connection", b"keep-alive"),
               (b"transfer-encoding", b"chunked"), (b"host", b"client.example"), (b"x-request-id", b"abc")]
    with trio.fail_after(5):
        await (await call(pool, body=body, headers=headers)).read()
    method, target, sent_headers, sent_body = up.requests[0]
    names = [name for name, _ in sent_headers]
    assert method == "POST" and target == b"/v1/chat/completions" and sent_body == body
    assert dict(sent_headers)[b"host"] == b"127.0.0.1:%d" % up.port and names.count(b"host") == 1
    assert dict(sent_headers)[b"content-length"] == b"200000"
    assert b"connection" not in names and b"transfer-encoding" not in names
    assert dict(sent_headers)[b"x-request-id"] == b"abc"


async def test_a_chunked_answer_comes_piece_by_piece_as_it_arrives(upstream):
    go_on = trio.Event()

    async def script(up, stream, n):
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n")
        await go_on.wait()  # set by the test only after it received "one"
        await stream.send_all(b"3\r\ntwo\r\n0\r\n\r\n")

    up = await upstream(script)
    pool = UpstreamPool("127.0.0.1", up.port)
    with trio.fail_after(5):
        response = await call(pool)
        assert await response.receive_piece() == b"one"
        go_on.set()
        assert await response.receive_piece() == b"two"
        assert await response.receive_piece() == b""
    assert pool.open_connections == 1 and len(pool._idle) == 1  # back in the pool, reusable


async def test_a_head_answer_ends_at_its_head_and_keeps_the_connection(upstream):
    async def script(up, stream, n):
        if up.requests[-1][0] == "HEAD":
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n")
        else:
            await stream.send_all(answer())

    up = await upstream(script)
    pool = UpstreamPool("127.0.0.1", up.port)
    with trio.fail_after(5):
        response = await call(pool, "HEAD", b"")
        assert await response.read() == b""
        assert await (await call(pool, "GET", b"")).read() == OK_BODY
    assert up.connections == 1


# -- what closes a connection, and the one retry -----------------------------------------------------------------------

async def test_an_answer_closed_before_its_end_closes_the_connection(upstream):
    async def script(up, stream, n):
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000\r\n\r\n" + b"x" * 1000)

    up = await upstream(script)
    pool = UpstreamPool("127.0.0.1", up.port)
    with trio.fail_after(5):
        response = await call(pool)
        assert await response.receive_piece()
        await response.aclose()  # how a client that went away cancels the upstream request
        await up.closed_by_peer.wait()
    assert pool.open_connections == 0


async def test_cancelling_a_request_closes_its_upstream_connection(upstream):
    async def never(up, stream, n):
        pass  # no answer; the upstream goes on reading, so it sees the close

    up = await upstream(never)
    pool = UpstreamPool("127.0.0.1", up.port)

    async def cancel_once_the_upstream_has_it(scope):
        with trio.fail_after(5):
            while not up.requests:
                await trio.sleep(0.005)
        scope.cancel()

    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as request_scope:
            nursery.start_soon(cancel_once_the_upstream_has_it, request_scope)
            await call(pool)
    assert request_scope.cancelled_caught
    with trio.fail_after(1):
        await up.closed_by_peer.wait()
    assert pool.open_connections == 0


async def test_a_pooled_connection_the_upstream_closed_is_not_reused(upstream):
    async def answer_then_close(up, stream, n):
        await stream.send_all(answer())  # keep-alive as far as the client knows...
        return "close"  # ...but the upstream closes it (as idle servers do)

    up = await upstream(answer_then_close)
    pool = UpstreamPool("127.0.0.1", up.port)
    with trio.fail_after(5):
        assert await (await call(pool)).read() == OK_BODY
        await trio.sleep(0.05)
        assert await (await call(pool)).read() == OK_BODY  # no error: the closed one was seen and dropped
    assert up.connections == 2 and len(up.requests) == 2


@pytest.mark.parametrize("then", ["reset", "stray bytes"])
async def test_a_pooled_connection_reset_or_sent_stray_bytes_while_idle_is_not_reused(upstream, then):
    """What the pool checks before reusing a connection: anything waiting on an idle one (a reset, bytes nobody asked
    for) says it is no longer a clean keep-alive connection, like the end of it."""
    async def answer_then_misbehave(up, stream, n):
        await stream.send_all(answer())
        await trio.sleep(0.01)
        if then == "reset":
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return "close"
        await stream.send_all(answer(b'{"unasked":1}'))  # would pass for the next request's answer
        return None

    up = await upstream(answer_then_misbehave)
    pool = UpstreamPool("127.0.0.1", up.port)
    with trio.fail_after(5):
        assert await (await call(pool)).read() == OK_BODY
        await trio.sleep(0.1)
        assert await (await call(pool)).read() == OK_BODY
    assert up.connections == 2 and len(up.requests) == 2 and pool.open_connections == 1
    await pool.aclose()


async def test_a_fresh_connection_closed_without_an_answer_is_an_error_not_a_retry(upstream):
    async def close(up, stream, n):
        return "close"

    up = await upstream(close)
    pool = UpstreamPool("127.0.0.1", up.port)
    with trio.fail_after(5), pytest.raises(UpstreamError) as info:
        await call(pool)
    assert info.value.kind == "closed_after_request" and info.value.before_head
    assert up.connections == 1


async def test_a_request_the_upstream_took_is_never_sent_again(upstream):
    """The upstream read request 2 and closed: maybe the request made it fail. The pool does not resend it."""
    async def answer_then_close_on_the_next(up, stream, n):
        if n == 1:
            await stream.send_all(answer())
            return None
        return "close"

    up = await upstream(answer_then_close_on_the_next)
    pool = UpstreamPool("127.0.0.1", up.port)
    with trio.fail_after(5):
        assert await (await call(pool)).read() == OK_BODY
        with pytest.raises(UpstreamError) as info:
            await call(pool)
    assert info.value.kind == "closed_after_request"
    assert len(up.requests) == 2 and up.connections == 1


async def test_a_connection_reset_before_the_first_byte_is_closed_before_request():
    """The first write fails: the upstream cannot have seen any of the request."""
    from llmgw.http.client import _Connection

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        peer, _ = listener.accept()
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.close()  # linger 0: a reset, not a FIN
        client.setblocking(False)
        conn = _Connection(client)
        with trio.fail_after(5):
            await trio.lowlevel.wait_readable(client)  # the reset has arrived
            with pytest.raises(UpstreamError) as info:
                await conn.send_all(b"POST / HTTP/1.1\r\n\r\n", 1.0, first=True)
        conn.close()
    assert info.value.kind == "closed_before_request"


# -- errors and timeouts -----------------------------------------------------------------------------------------------

async def test_nothing_listening_is_a_connect_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        pool = UpstreamPool("127.0.0.1", port)
        with trio.fail_after(5), pytest.raises(UpstreamError) as info:
            await call(pool)
    assert info.value.kind == "connect" and info.value.before_head
    assert pool.open_connections == 0


async def test_no_head_within_the_first_byte_timeout_is_a_timeout_before_the_head(upstream):
    async def stall(up, stream, n):
        pass  # no answer; the upstream goes on reading, so it sees the close

    up = await upstream(stall)
    pool = UpstreamPool("127.0.0.1", up.port)
    start = trio.current_time()
    with trio.fail_after(5), pytest.raises(UpstreamError) as info:
        await call(pool, first_byte_timeout=0.3)
    assert info.value.kind == "timeout" and info.value.before_head
    assert 0.28 <= trio.current_time() - start < 1.5
    with trio.fail_after(1):
        await up.closed_by_peer.wait()  # the timed-out connection is closed, never reused


async def test_a_body_that_stops_coming_is_an_idle_timeout_after_the_head(upstream):
    async def stall_mid_body(up, stream, n):
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n")
        await trio.sleep_forever()

    up = await upstream(stall_mid_body)
    pool = UpstreamPool("127.0.0.1", up.port)
    with trio.fail_after(5):
        response = await call(pool, idle_timeout=0.3)
        assert await response.receive_piece() == b"one"
        start = trio.current_time()
        with pytest.raises(UpstreamError) as info:
            await response.receive_piece()
        assert 0.28 <= trio.current_time() - start < 1.5
    assert info.value.kind == "timeout" and not info.value.before_head
    assert pool.open_connections == 0


async def test_an_upstream_that_closes_mid_body_is_a_closed_error_after_the_head(upstream):
    async def short_body(up, stream, n):
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b")
        return "close"

    up = await upstream(short_body)
    pool = UpstreamPool("127.0.0.1", up.port)
    with trio.fail_after(5):
        response = await call(pool)
        with pytest.raises(UpstreamError) as info:
            await response.read()
    assert info.value.kind == "closed" and not info.value.before_head
    assert pool.open_connections == 0


async def test_a_malformed_answer_is_a_protocol_error(upstream):
    async def garbage(up, stream, n):
        await stream.send_all(b"NOT HTTP AT ALL\r\n\r\n")

    up = await upstream(garbage)
    pool = UpstreamPool("127.0.0.1", up.port)
    with trio.fail_after(5), pytest.raises(UpstreamError) as info:
        await call(pool)
    assert info.value.kind == "protocol"
    assert pool.open_connections == 0


async def test_an_answer_without_length_ends_with_the_connection(upstream):
    async def http10(up, stream, n):
        await stream.send_all(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
        return "close"

    up = await upstream(http10)
    pool = UpstreamPool("127.0.0.1", up.port)
    with trio.fail_after(5):
        response = await call(pool)
        assert await response.read() == b"until the end"
    assert pool.open_connections == 0  # not reusable


async def test_a_stream_that_is_always_ready_still_lets_other_tasks_run(upstream, nursery, monkeypatch):
    monkeypatch.setattr("llmgw.http.client.READ_SIZE", 4096)  # many reads find data waiting in the socket
    chunks = b"".join(b"400\r\n" + b"x" * 1024 + b"\r\n" for _ in range(4000))  # 4 MB, sent at once

    async def blast(up, stream, n):
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")

    up = await upstream(blast)
    pool = UpstreamPool("127.0.0.1", up.port)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await trio.lowlevel.checkpoint()
            ticks += 1

    with trio.fail_after(10):
        response = await call(pool)
        await trio.sleep(0.3)  # let the socket buffers fill: from here on most reads find data waiting
        nursery.start_soon(ticker)
        await trio.sleep(0.01)
        received, longest_run, run, last = 0, 0, 0, ticks
        while piece := await response.receive_piece():
            received += len(piece)
            run = run + 1 if ticks == last else 0
            last = ticks
            longest_run = max(longest_run, run)
    assert received == 4000 * 1024
    # Never more than a few pieces without giving other tasks a turn (a yield is seen one batch late at worst).
    assert longest_run <= 2 * YIELD_EVERY + 2
