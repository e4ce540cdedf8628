"""Fuzz the control port of a live ``llmgw serve``: random request heads, bodies, lengths, split writes and
half-closes over real sockets. Whatever a connection does, the process stays up and ``/health`` answers."""

from __future__ import annotations

import re
import socket
import subprocess
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from llmgw.testing.processes import llmgw_command

ADMIN = "adm-fuzz-0123456789"
PATHS = ["/health", "/metrics", "/admin/replicas", "/admin/nodes", "/admin/kv", "/admin/models", "/admin/explain",
         "/admin/reload", "/admin/whatever", "/agent", "/", "*", "/admin/%ff", "//admin/nodes", "/admin/explain?path=x",
         "/ui", "/ui?token=x", "/admin/stats", "/admin/decisions"]
METHODS = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "CONNECT", "G\x00T", ""]


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    """(host, port) of a running ``llmgw serve``'s control listener, and its process."""
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "llmgw.yaml").write_text(f"models: []\nagents:\n  token: join-fuzz-123\n"
                                       f"admin_tokens:\n  - token: {ADMIN}\n")
    log_path = folder / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(llmgw_command("serve", "--config", str(folder / "llmgw.yaml"), "--listen",
                                                 "127.0.0.1:0", "--control-listen", "127.0.0.1:0"),
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (found := re.search(r"\(control: http://127\.0\.0\.1:(\d+)\)", log_path.read_text())):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        yield ("127.0.0.1", int(found.group(1))), process, log_path
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def header_lines() -> st.SearchStrategy[list[str]]:
    length = st.one_of(st.integers(-2, 70_000).map(str), st.sampled_from(["", "abc", "1e3", "0x10", " 5", "5,5",
                                                                           "99999999999999999999"]))
    header = st.one_of(
        length.map(lambda v: f"Content-Length: {v}"),
        st.sampled_from(["Transfer-Encoding: chunked", "Transfer-Encoding: gzip, chunked", "Expect: 100-continue",
                         "Connection: close", "Connection: Upgrade", "Upgrade: websocket", "Upgrade: h2c",
                         "Sec-WebSocket-Version: 13", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
                         f"Authorization: Bearer {ADMIN}", "Authorization: Bearer", "Authorization: Basic x",
                         "Content-Type: application/json", "Host:", "Host: a, b", ": empty", "X: \x01\x7f"]),
        st.text(min_size=0, max_size=40).map(lambda t: f"X-Fuzz: {t}"),
        st.text(min_size=0, max_size=60),
    )
    return st.lists(header, max_size=8)


@st.composite
def raw_requests(draw) -> tuple[bytes, list[int], bool, bool]:
    """(bytes to send, where to split the writes, half-close at the end, read the answer)."""
    if draw(st.booleans()):
        head = f"{draw(st.sampled_from(METHODS))} {draw(st.sampled_from(PATHS) | st.text(max_size=30))} " \
               f"{draw(st.sampled_from(['HTTP/1.1', 'HTTP/1.0', 'HTTP/2.0', 'HTTP/1.1 x', '']))}\r\n"
        head += "".join(f"{line}\r\n" for line in draw(header_lines()))
        data = head.encode("utf-8", "surrogateescape") + (b"\r\n" if draw(st.booleans()) else b"")
    else:
        data = draw(st.binary(max_size=300))
    body = draw(st.one_of(st.binary(max_size=200), st.integers(0, 80_000).map(lambda n: b"{" * n),
                          st.sampled_from([b'{"model": "x"}', b"\xff\xfe", b"0\r\n\r\n", b"5\r\nab", b"[" * 5000])))
    data += body
    splits = sorted(draw(st.lists(st.integers(0, max(len(data), 1)), max_size=4)))
    return data, splits, draw(st.booleans()), draw(st.booleans())


def health(address) -> int:
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = sock.recv(65536)  # the status line comes first (Hypercorn may keep the socket open after it)
    return int(answer.split(b" ", 2)[1])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=raw_requests())
def test_no_request_on_the_control_port_ends_the_process(control, request):
    address, process, log_path = control
    data, splits, half_close, read_answer = request
    with socket.create_connection(address, timeout=5) as sock:
        try:
            start = 0
            for end in [*splits, len(data)]:
                sock.sendall(data[start:end])
                start = max(start, end)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            if read_answer:
                sock.recv(65536)
        except OSError:  # the server may answer and close before everything was sent, or time us out
            pass
    assert process.poll() is None, log_path.read_text()[-5000:]
    assert health(address) == 200
