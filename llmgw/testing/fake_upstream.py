"""A fast fake OpenAI-compatible upstream (asyncio + httptools), for proxy benchmarks and data-plane tests.

It answers ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings``
with canned JSON (any other POST with the chat answer, ``/v1/audio/*`` with a
transcript without reading the form), or with ``--chunks`` SSE events when the body says
``"stream": true``; ``GET /v1/models``, ``GET /health`` and ``GET /stats``
(request and aborted-stream counters). Request bodies may steer it:
``x_status`` (answer with this HTTP status and an OpenAI-shaped JSON error),
``x_close`` (read the request, then close the connection without answering, as
an engine that dies on it), ``x_delay_ms`` (wait before the head), ``x_chunk_delay_ms`` (pace stream events),
``x_chunks`` (events per stream), ``x_break_after`` (drop the connection after this many events),
``x_end_delay_ms`` (wait between ``data: [DONE]`` and the chunked body's terminator).
``--status`` makes every POST fail with that status. Every response names
the server in ``x-served-by``.

Run: ``python -m llmgw.testing.fake_upstream --port 0 --name a`` (prints
``fake-upstream listening on http://HOST:PORT``). With ``--tls-cert`` (and
``--tls-key``) it serves HTTPS instead; ``--tls-client-ca`` then requires a
client certificate signed by that CA (mutual TLS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time

import httptools

from llmgw.tls import server_context

CHUNK = ('data: {"id":"chatcmpl-fake","object":"chat.completion.chunk","created":0,"model":"%s",'
         '"choices":[{"index":0,"delta":{"content":"tok%d "},"finish_reason":null}]}\n\n')
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error",
           502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


def _error(message: bytes, kind: bytes) -> bytes:
    """An OpenAI-shaped JSON error body."""
    return b'{"error":{"message":"%s","type":"%s","param":null,"code":null}}' % (message, kind)


class Stats:
    def __init__(self) -> None:
        self.requests = 0
        self.by_path: dict[str, int] = {}
        self.aborted_streams = 0
        self.completed_streams = 0
        self.active_streams = 0
        self.aborted_at: list[float] = []  # time.time() when an aborted stream was noticed


class FakeUpstream(asyncio.Protocol):
    def __init__(self, name: str, model: str, chunks: int, stats: Stats, status: int = 200):
        self.name = name.encode()
        self.status = status
        self.model = model
        self.chunks = chunks
        self.stats = stats
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport  # set by connection_made, before any data arrives
        self.url = b""
        self.body: list[bytes] = []
        self.closed = False
        self.queue: list[tuple[str, bytes, bytes, bool]] = []
        self.busy = False

    # asyncio.Protocol
    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.closed = True

    def data_received(self, data):
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    # httptools callbacks
    def on_message_begin(self):
        self.url = b""
        self.body = []

    def on_url(self, url):
        self.url += url

    def on_body(self, body):
        self.body.append(body)

    def on_message_complete(self):
        method = self.parser.get_method().decode()
        self.queue.append((method, self.url, b"".join(self.body), self.parser.should_keep_alive()))
        if not self.busy:
            self.busy = True
            asyncio.get_running_loop().create_task(self._serve_queue())

    async def _serve_queue(self):
        while self.queue and not self.closed:
            method, url, body, keep_alive = self.queue.pop(0)
            await self._answer(method, url.decode().split("?")[0], body)
            if not keep_alive:
                self.transport.close()
        self.busy = False

    def _send(self, status: int, body: bytes, content_type: bytes = b"application/json", extra: bytes = b""):
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nx-served-by: %s\r\n%s\r\n%s"
                             % (status, REASONS.get(status, "Status").encode(), content_type, len(body), self.name,
                                extra, body))

    async def _answer(self, method: str, path: str, raw: bytes):
        stats = self.stats
        stats.requests += 1
        stats.by_path[path] = stats.by_path.get(path, 0) + 1
        if method == "GET":
            if path == "/health":
                return self._send(200, b"")
            if path == "/v1/models":
                return self._send(200, json.dumps({"object": "list", "data": [
                    {"id": self.model, "object": "model", "created": 0, "owned_by": "fake"}]}).encode())
            if path == "/stats":
                return self._send(200, json.dumps(vars(stats)).encode())
            return self._send(404, _error(b"not found", b"not_found_error"))
        if path.startswith("/v1/audio/"):  # a multipart upload: not JSON, answered with a transcript
            return self._send(200, b'{"text":"hello from %s"}' % self.name)
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            return self._send(400, _error(b"bad json", b"invalid_request_error"))
        if body.get("x_delay_ms"):
            await asyncio.sleep(body["x_delay_ms"] / 1000)
            if self.closed:
                return
        if body.get("x_close"):
            self.transport.close()
            return
        status = int(body.get("x_status", self.status))
        if status != 200:
            return self._send(status, _error(b"forced by x_status", b"server_error"))
        if body.get("stream"):
            return await self._stream(body)
        if path == "/v1/embeddings":
            return self._send(200, b'{"object":"list","data":'
                                   b'[{"object":"embedding","index":0,"embedding":[0.1,0.2,0.3]}],'
                                   b'"model":"%s","usage":{"prompt_tokens":3,"total_tokens":3}}' % self.model.encode())
        if path == "/v1/completions":
            return self._send(200, b'{"id":"cmpl-fake","object":"text_completion","created":%d,"model":"%s","choices":'
                                   b'[{"index":0,"text":"hello from %s","finish_reason":"stop","logprobs":null}],'
                                   b'"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}'
                                   % (int(time.time()), self.model.encode(), self.name))
        return self._send(200, b'{"id":"chatcmpl-fake","object":"chat.completion","created":%d,"model":"%s","choices":'
                               b'[{"index":0,"message":{"role":"assistant","content":"hello from %s"},"finish_reason":'
                               b'"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}'
                               % (int(time.time()), self.model.encode(), self.name))

    async def _stream(self, body: dict):
        stats = self.stats
        chunks = int(body.get("x_chunks", self.chunks))
        delay = body.get("x_chunk_delay_ms", 0) / 1000
        break_after = body.get("x_break_after")
        write = self.transport.write
        write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
              b"x-served-by: %s\r\n\r\n" % self.name)
        stats.active_streams += 1
        try:
            for i in range(chunks):
                if delay:
                    await asyncio.sleep(delay)
                if self.closed:
                    stats.aborted_streams += 1
                    stats.aborted_at.append(time.time())
                    return
                if break_after is not None and i >= break_after:
                    self.transport.abort()
                    return
                event = (CHUNK % (self.model, i)).encode()
                write(b"%x\r\n%s\r\n" % (len(event), event))
            done = b"data: [DONE]\n\n"
            end_delay = body.get("x_end_delay_ms", 0) / 1000
            write(b"%x\r\n%s\r\n" % (len(done), done))
            if end_delay:  # a real server's terminator comes in a write of its own, later
                await asyncio.sleep(end_delay)
                if self.closed:
                    return
            write(b"0\r\n\r\n")
            stats.completed_streams += 1
        finally:
            stats.active_streams -= 1


async def serve(host: str, port: int, name: str, model: str, chunks: int, status: int = 200,
                tls_cert: str | None = None, tls_key: str | None = None, tls_client_ca: str | None = None) -> None:
    loop = asyncio.get_running_loop()
    stats = Stats()
    context = server_context(tls_cert, tls_key, client_ca_file=tls_client_ca) if tls_cert else None
    server = await loop.create_server(lambda: FakeUpstream(name, model, chunks, stats, status), host, port,
                                      backlog=1024, ssl=context)
    bound = server.sockets[0].getsockname()
    scheme = "https" if context else "http"
    print(f"fake-upstream {name} listening on {scheme}://{bound[0]}:{bound[1]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def command(name: str = "fake", *, port: int = 0, chunks: int = 50, model: str = "tiny", status: int = 200,
            extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The argv that starts this fake upstream in a child process (``extra``: more options, ``--tls-cert``...)."""
    return [sys.executable, "-m", "llmgw.testing.fake_upstream",
            "--name", name, "--port", str(port), "--chunks", str(chunks), "--model", model, "--status", str(status),
            *extra]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.testing.fake_upstream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--chunks", type=int, default=50, help="SSE events per streamed answer (default 50)")
    parser.add_argument("--status", type=int, default=200, help="answer every POST with this status (default 200)")
    parser.add_argument("--tls-cert", help="serve HTTPS with this PEM certificate chain")
    parser.add_argument("--tls-key", help="its private key (default: in --tls-cert)")
    parser.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mutual TLS)")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port, args.name, args.model, args.chunks, args.status, args.tls_cert,
                      args.tls_key, args.tls_client_ca))
    return 0


if __name__ == "__main__":
    sys.exit(main())
