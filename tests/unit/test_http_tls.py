"""TLS in the thin HTTP layer: ``HttpServer(tls=...)`` and ``UpstreamPool(tls=...)`` talking to each other.

Both sides drive :class:`llmgw.http.tls_socket.TlsSocket` over real sockets on
127.0.0.1, with certificates from a test CA (``trustme``): bodies far larger
than a TLS record and than a socket buffer go both ways, streams arrive piece
by piece, connections are reused, and every handshake problem is a clear,
typed error that sends no request byte.
"""

from __future__ import annotations

import functools
import socket
import ssl

import pytest
import trio
import trustme
from hypothesis import given, settings, strategies as st

from llmgw.http.client import UpstreamError, UpstreamPool
from llmgw.http.messages import Response
from llmgw.http.server import HttpServer, ServerLimits
from llmgw.http.tls_socket import TlsSocket
from llmgw.tls import TlsClientOptions, client_context, server_context

BIG = bytes(range(256)) * 12_000  # ~3 MB: many records, several socket buffers


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture(scope="module")
def files(ca, tmp_path_factory):
    """PEM files: the CA, a server certificate for 127.0.0.1 and one for another name."""
    base = tmp_path_factory.mktemp("tls")
    ca.cert_pem.write_to_path(str(base / "ca.pem"))
    for name, hosts in (("server", ["127.0.0.1"]), ("other", ["other.example"])):
        cert = ca.issue_cert(*hosts)
        cert.private_key_and_cert_chain_pem.write_to_path(str(base / f"{name}.pem"))
    return base


async def handler(request):
    if request.path == "/stream":
        async def pieces():
            for i in range(200):
                yield b"data: %d\n\n" % i
                if i % 50 == 0:
                    await trio.sleep(0.01)
        return Response(200, [(b"content-type", b"text/event-stream")], pieces())
    if request.path == "/big":
        return Response(200, [(b"content-type", b"application/octet-stream")], BIG)
    return Response(200, [(b"content-type", b"application/octet-stream")], request.body)


async def start_server(nursery, files, **limits) -> tuple[HttpServer, int]:
    server = HttpServer(handler, ServerLimits(**limits), tls=server_context(str(files / "server.pem")))
    _, port = await nursery.start(server.serve, "127.0.0.1", 0)
    return server, port


def tls_pool(files, port: int, host: str = "127.0.0.1", **options) -> UpstreamPool:
    context = client_context(TlsClientOptions(ca_file=str(files / "ca.pem"), **options))
    return UpstreamPool(host, port, tls=context, connect_timeout=5.0)


async def call(pool, target="/echo", body=b"", method="POST"):
    return await pool.request(method, target, [(b"content-type", b"application/octet-stream")], body,
                              first_byte_timeout=10.0, idle_timeout=10.0)


async def test_large_bodies_both_ways_and_keep_alive_over_tls(nursery, files):
    server, port = await start_server(nursery, files)
    pool = tls_pool(files, port)
    with trio.fail_after(30):
        for body in (b"small", BIG, b"", BIG[:70_000]):
            response = await call(pool, body=body)
            assert response.status == 200
            assert await response.read() == body
        response = await call(pool, "/big", method="GET")
        assert await response.read() == BIG
    assert pool.open_connections == 1  # one TLS connection served all five
    await pool.aclose()


async def test_an_idle_tls_connection_has_nothing_waiting_and_a_peek_sees_its_end(nursery, files):
    """What a pool may check before reusing a connection (``recv(1, MSG_PEEK)``): the session tickets a TLS 1.3
    server sends after the handshake were read with the first answer, and a closed connection shows its end."""
    server, port = await start_server(nursery, files, keepalive_timeout=1.0)
    pool = tls_pool(files, port)
    response = await call(pool, body=b"x")
    assert await response.read() == b"x"
    (idle,) = pool._idle
    with pytest.raises(BlockingIOError):
        idle.sock.recv(1, socket.MSG_PEEK)
    with trio.fail_after(10):
        await trio.lowlevel.wait_readable(idle.sock)  # the server closes it after its keep-alive timeout
    assert idle.sock.recv(1, socket.MSG_PEEK) in (b"", b"\x15")  # the end, or the close_notify alert before it
    await pool.aclose()


async def test_a_stream_arrives_in_pieces_over_tls(nursery, files):
    _, port = await start_server(nursery, files)
    pool = tls_pool(files, port)
    with trio.fail_after(30):
        response = await call(pool, "/stream", method="GET")
        pieces = []
        while piece := await response.receive_piece():
            pieces.append(piece)
    assert b"".join(pieces) == b"".join(b"data: %d\n\n" % i for i in range(200))
    assert len(pieces) > 1
    await pool.aclose()


async def test_concurrent_requests_over_separate_tls_connections(nursery, files):
    _, port = await start_server(nursery, files)
    pool = tls_pool(files, port)
    results = []

    async def one(i):
        response = await call(pool, body=b"%d" % i * 50_000)
        results.append(await response.read() == b"%d" % i * 50_000)

    with trio.fail_after(30):
        async with trio.open_nursery() as inner:
            for i in range(8):
                inner.start_soon(one, i)
    assert results == [True] * 8
    await pool.aclose()


async def test_an_error_answer_reaches_a_client_that_is_still_uploading(nursery, files):
    """A body over the limit: the 413 goes out, close_notify follows, and the rest of the upload is drained."""
    _, port = await start_server(nursery, files, max_body_bytes=100_000)
    pool = tls_pool(files, port)
    with trio.fail_after(30):
        response = await call(pool, body=BIG[:600_000])  # within what the server drains after answering
        assert response.status == 413
        assert b"larger than the limit" in await response.read()
    await pool.aclose()


async def test_an_untrusted_certificate_is_refused_naming_the_problem(nursery, files):
    _, port = await start_server(nursery, files)
    pool = UpstreamPool("127.0.0.1", port, tls=client_context(), connect_timeout=5.0)  # system store only
    with pytest.raises(UpstreamError) as caught:
        await call(pool, body=b"secret")
    assert caught.value.kind == "tls"
    assert "certificate verification failed" in str(caught.value)
    assert "unable to get local issuer certificate" in str(caught.value)
    assert pool.open_connections == 0


async def test_a_certificate_for_another_name_is_refused(nursery, files):
    server = HttpServer(handler, tls=server_context(str(files / "other.pem")))
    _, port = await nursery.start(server.serve, "127.0.0.1", 0)
    pool = tls_pool(files, port)
    with pytest.raises(UpstreamError) as caught:
        await call(pool)
    assert caught.value.kind == "tls"
    assert "mismatch" in str(caught.value) and "127.0.0.1" in str(caught.value)


async def test_verify_off_accepts_any_certificate(nursery, files):
    _, port = await start_server(nursery, files)
    pool = UpstreamPool("127.0.0.1", port, tls=client_context(TlsClientOptions(verify=False)))
    response = await call(pool, body=b"hello")
    assert await response.read() == b"hello"
    await pool.aclose()


async def test_a_plaintext_peer_gets_only_a_client_hello(nursery, files):
    """A server that does not speak TLS: the handshake stalls until the connect timeout; what it received
    is one TLS handshake record and nothing of the request."""
    received = bytearray()
    done = trio.Event()

    async def plaintext_server(stream):
        try:
            while data := await stream.receive_some(65536):
                received.extend(data)
        except trio.BrokenResourceError:
            pass
        done.set()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, plaintext_server, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    pool = UpstreamPool("127.0.0.1", port, tls=client_context(), connect_timeout=0.5)
    with pytest.raises(UpstreamError) as caught:
        await pool.request("POST", "/v1/chat/completions", [(b"authorization", b"Bearer sk-upstream-secret")],
                           b'{"prompt": "private"}', first_byte_timeout=5.0, idle_timeout=5.0)
    assert caught.value.kind == "connect" and "with TLS took longer" in str(caught.value)
    with trio.fail_after(5):
        await done.wait()
    assert received[:1] == b"\x16" and received[5:6] == b"\x01"  # a handshake record holding a ClientHello
    assert b"sk-upstream-secret" not in received and b"POST" not in received and b"private" not in received


async def test_a_failed_handshake_closes_only_that_connection_and_is_counted(nursery, files):
    failures = []
    server = HttpServer(handler, ServerLimits(header_timeout=0.5), tls=server_context(str(files / "server.pem")),
                        on_tls_failure=lambda: failures.append(1))
    _, port = await nursery.start(server.serve, "127.0.0.1", 0)
    pool = tls_pool(files, port)
    first = await call(pool, body=b"before")  # a connection that stays open across the failures
    assert await first.read() == b"before"

    with trio.fail_after(10):
        plain = await trio.open_tcp_stream("127.0.0.1", port)  # plaintext HTTP on the TLS port
        await plain.send_all(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
        silent = await trio.open_tcp_stream("127.0.0.1", port)  # never starts a handshake
        answered = b""
        while data := await receive_or_reset(plain):
            answered += data
        assert b"HTTP/1.1" not in answered  # at most a TLS alert, then the server closed it
        assert await receive_or_reset(silent) == b""  # closed when the handshake timeout passed
    assert server.tls_failures == 2 and len(failures) == 2
    again = await call(pool, body=b"after")  # the kept-alive connection still works
    assert await again.read() == b"after"
    assert pool.open_connections == 1
    await pool.aclose()
    await plain.aclose()
    await silent.aclose()


async def test_a_plaintext_client_fails_the_handshake_with_a_tls_error_not_a_wait(files):
    """Plain HTTP is not a record header to wait 8 KiB behind (b"GET /" would announce 0x202f bytes)."""
    a, b = socket.socketpair()
    for sock in (a, b):
        sock.setblocking(False)
    server = TlsSocket(b, server_context(str(files / "server.pem")), server_side=True)
    a.send(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    try:
        with trio.fail_after(10), pytest.raises(ssl.SSLError) as caught:
            await server.handshake()
    finally:
        a.close()
        b.close()
    assert "HTTP_REQUEST" in str(caught.value).upper() or "WRONG_VERSION" in str(caught.value).upper()


async def receive_or_reset(stream) -> bytes:
    try:
        return await stream.receive_some(65536)
    except trio.BrokenResourceError:  # a reset counts as closed
        return b""


async def test_a_client_certificate_is_sent_when_the_server_requires_one(nursery, files, ca, tmp_path):
    client_cert = ca.issue_cert("llmgw-client")
    client_cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "client.pem"))
    context = server_context(str(files / "server.pem"), client_ca_file=str(files / "ca.pem"))
    server = HttpServer(handler, tls=context)
    _, port = await nursery.start(server.serve, "127.0.0.1", 0)

    with_cert = tls_pool(files, port, cert_file=str(tmp_path / "client.pem"))
    response = await call(with_cert, body=b"mutual")
    assert await response.read() == b"mutual"
    await with_cert.aclose()

    without = tls_pool(files, port)
    with pytest.raises(UpstreamError) as caught:
        await call(without, body=b"x")
    assert caught.value.kind == "tls" and "CERTIFICATE_REQUIRED" in str(caught.value).upper()


# -- the adapter itself, under any pattern of writes -------------------------------------------------------------------

def _payload(size: int, seed: int) -> bytes:
    return bytes((seed + i * 7) & 0xFF for i in range(size)) if size < 4096 else (bytes([seed & 0xFF]) * size)


async def _send_all(sock: TlsSocket, data: bytes) -> None:
    """The loop the server and the client use: send what the socket takes, wait for writability, send the rest."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            pass
        if view:
            await trio.lowlevel.wait_writable(sock)


async def _receive_exactly(sock: TlsSocket, size: int) -> bytes:
    received = bytearray()
    while len(received) < size:
        await trio.lowlevel.wait_readable(sock)
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            continue
        assert data, "the peer's stream ended early"
        received += data
    return bytes(received)


async def _duplex(files, client_sizes: list[int], server_sizes: list[int]) -> None:
    a, b = socket.socketpair()
    for sock in (a, b):
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # partial writes all the time
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client = TlsSocket(a, client_context(TlsClientOptions(ca_file=str(files / "ca.pem"))), server_side=False,
                       server_hostname="127.0.0.1")
    server = TlsSocket(b, server_context(str(files / "server.pem")), server_side=True)
    client_data = b"".join(_payload(size, i) for i, size in enumerate(client_sizes))
    server_data = b"".join(_payload(size, i + 99) for i, size in enumerate(server_sizes))
    got: dict[str, bytes] = {}
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.handshake)
                nursery.start_soon(server.handshake)

            async def side(name, sock, sizes, seed, expect):
                async def receive():
                    got[name] = await _receive_exactly(sock, expect)

                async with trio.open_nursery() as inner:
                    inner.start_soon(receive)
                    for i, size in enumerate(sizes):
                        await _send_all(sock, _payload(size, i + seed))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(side, "server", server, server_sizes, 99, len(client_data))
                nursery.start_soon(side, "client", client, client_sizes, 0, len(server_data))
    finally:
        a.close()
        b.close()
    assert got["server"] == client_data
    assert got["client"] == server_data


@settings(max_examples=25, deadline=None)
@given(client_sizes=st.lists(st.integers(0, 200_000), max_size=6),
       server_sizes=st.lists(st.integers(0, 200_000), max_size=6))
def test_any_pattern_of_writes_arrives_whole_and_in_order_both_ways(files, client_sizes, server_sizes):
    trio.run(_duplex, files, client_sizes, server_sizes)
