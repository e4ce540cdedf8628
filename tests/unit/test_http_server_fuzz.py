"""Property-based fuzzing of the HTTP request parser through a live ``HttpServer`` on a real socket.

Hypothesis runs in a worker thread with blocking sockets while the server runs in the test's Trio loop. Each
example sends random request heads and bodies (mostly almost-valid HTTP: known methods, versions, header names
and transfer codings mixed with garbage), half-closes, and reads to the end: what comes back must be zero or
more well-formed HTTP/1.1 responses, each a success or an error in OpenAI's JSON shape, and the server must
still serve a normal request afterwards, with no connection having failed unexpectedly.
"""

from __future__ import annotations

import json
import socket

import httptools
import trio
from hypothesis import HealthCheck, example, given, settings, strategies as st

from llmgw.http.messages import Request, Response
from llmgw.http.server import HttpServer, ServerLimits

ERROR_STATUSES = {400, 404, 408, 413, 431, 501, 505}


async def echo(request: Request) -> Response:
    if request.path == "/missing":
        return Response.json({"error": {"message": "no", "type": "not_found_error", "param": None,
                                         "code": None}}, status=404)
    return Response.json({"method": request.method, "length": len(request.body)})


class Responses:
    """httptools callbacks collecting every response in a byte stream."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[tuple[int, bytes]] = []
        self.body = b""

    def on_message_begin(self):
        self.body = b""

    def on_body(self, body):
        self.body += body

    def on_message_complete(self):
        self.done.append((self.parser.get_status_code(), self.body))


methods = st.sampled_from(["GET", "POST", "PUT", "HEAD", "DELETE", "OPTIONS", "CONNECT", "PRI", "get", "G\x00T"])
versions = st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/0.9", "HTTP/2.0", "HTTP/1.2", "HTTP/11", "", "HTTX/1.1"])
targets = st.one_of(st.sampled_from(["/", "/missing", "/v1/chat/completions", "*", "http://h/x", "/a?b=c#d"]),
                    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=255), max_size=30))
header_names = st.one_of(
    st.sampled_from(["Host", "Content-Length", "Transfer-Encoding", "Expect", "Connection", "Upgrade",
                     "content-length", "X-Any"]),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=255), max_size=12))
header_values = st.one_of(
    st.sampled_from(["chunked", "gzip, chunked", "chunked, gzip", "identity", "100-continue", "close",
                     "keep-alive", "websocket", "0", "5", "-1", "99999999999999999999", "h"]),
    st.integers(0, 200).map(str),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=255), max_size=20))
newlines = st.sampled_from(["\r\n", "\n", "\r"])


@st.composite
def requests(draw) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=300))
    newline = draw(newlines) if draw(st.integers(0, 4)) == 0 else "\r\n"
    line = " ".join(part for part in (draw(methods), draw(targets), draw(versions)) if part)
    headers = draw(st.lists(st.tuples(header_names, header_values), max_size=6))
    head = newline.join([line, *(f"{name}: {value}" for name, value in headers)]) + newline + newline
    body = draw(st.one_of(st.binary(max_size=200), st.sampled_from([b"0\r\n\r\n", b"5\r\nhello\r\n0\r\n\r\n",
                                                                      b"zz\r\n", b"ffffffffffff\r\n"])))
    return head.encode("latin-1") + body


def exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server answered and closed before taking everything: read what it said
            pass
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
    return received


def check_responses(received: bytes) -> list[int]:
    responses = Responses()
    responses.parser.feed_data(received)  # raises if what came back is not well-formed HTTP
    statuses = []
    for status, body in responses.done:
        statuses.append(status)
        if status != 200:
            assert status in ERROR_STATUSES, status
            error = json.loads(body)["error"]
            assert set(error) == {"message", "type", "param", "code"}
    return statuses


async def test_fuzzed_requests_get_well_formed_answers_and_the_server_lives(nursery):
    failures: list[BaseException] = []
    server = HttpServer(echo, ServerLimits(max_header_bytes=2048, max_body_bytes=4096, header_timeout=2.0,
                                           body_timeout=2.0), on_error=failures.append)
    _, port = await nursery.start(server.serve, "127.0.0.1", 0)
    seen: set[int] = set()
    examples = []

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(requests())
    @example(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello")  # 200
    @example(b"GET / HTTP/1.1\r\n\r\n")  # 400: no Host
    @example(b"GET / HTTP/2.0\r\nHost: t\r\n\r\n")  # 505
    def fuzz(data: bytes) -> None:
        examples.append(data)
        seen.update(check_responses(exchange(port, data)))

    await trio.to_thread.run_sync(fuzz)
    assert len(examples) >= 400
    assert {200, 400, 505} <= seen, seen
    assert not failures, failures
    ok = await trio.to_thread.run_sync(exchange, port, b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    assert check_responses(ok) == [200]


@given(major=st.integers(0, 9), minor=st.integers(0, 9), method=st.sampled_from(["GET", "POST", "HEAD"]))
def test_every_http_version_but_1_0_and_1_1_is_refused_505_by_the_parser(major, minor, method):
    from llmgw.http.server import _ProtocolError, _RequestReader

    reader = _RequestReader(ServerLimits())
    try:
        reader.feed(f"{method} /health HTTP/{major}.{minor}\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
    except _ProtocolError as exc:
        assert (major, minor) not in ((1, 0), (1, 1)) and exc.status == 505, (major, minor, exc.status)
    else:
        assert (major, minor) in ((1, 0), (1, 1)) and len(reader.complete) == 1
