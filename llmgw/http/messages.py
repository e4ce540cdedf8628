"""Request and response objects of the thin HTTP layer, and OpenAI-style errors.

A handler is ``async def handler(request: Request) -> Response``. A response
body is either ``bytes`` (sent with Content-Length) or an async iterator of
``bytes`` (sent chunked, each piece flushed as it is produced; the head goes
out with the first piece, or at once when the first piece is empty). When the
client goes away while a handler runs, the server cancels the handler.

A response's ``after_send`` (if any) is called once by the server as soon as
the answer is in the client's socket as far as the kernel took it at once
(before waiting on a client that reads slowly), or when sending it failed or
was cancelled: work that must not delay the answer (accounting, metrics).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Awaitable, Callable, Union

Body = Union[bytes, AsyncIterator[bytes]]


class Request:
    """One request as the handler gets it. A plain class, not a dataclass: ``dataclasses`` writes a dataclass's
    ``__init__`` at run time, which stays interpreted in the compiled build (``llmgw/compiled.py``), and the server
    makes one of these per request."""

    __slots__ = ("method", "target", "headers", "body", "client", "http_version")

    def __init__(self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes = b"",
                 client: tuple[str, int] | None = None, http_version: str = "1.1") -> None:
        self.method = method
        self.target = target  # path and query as sent, e.g. "/v1/models?x=1"
        self.headers = headers  # names lower-cased, values as sent
        self.body = body
        self.client = client
        self.http_version = http_version

    def __repr__(self) -> str:
        return f"Request({self.method!r}, {self.target!r}, {len(self.headers)} headers, {len(self.body)} bytes)"

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def query(self) -> str:
        parts = self.target.split("?", 1)
        return parts[1] if len(parts) == 2 else ""

    def header(self, name: str, default: str | None = None) -> str | None:
        key = name.lower().encode("latin-1")
        for k, v in self.headers:
            if k == key:
                return v.decode("latin-1")
        return default

    def json(self) -> Any:
        return json.loads(self.body)


class Response:
    """One answer (a plain class, as :class:`Request` is, for the same reason)."""

    __slots__ = ("status", "headers", "body", "after_send")

    def __init__(self, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None, body: Body = b"",
                 after_send: Callable[[], None] | None = None) -> None:
        self.status = status
        self.headers: list[tuple[bytes, bytes]] = [] if headers is None else headers
        self.body = body
        self.after_send = after_send  # see the module docstring

    def __repr__(self) -> str:
        return f"Response({self.status}, {self.headers!r})"

    @classmethod
    def json(cls, obj: Any, status: int = 200, headers: list[tuple[bytes, bytes]] | None = None) -> "Response":
        payload = json.dumps(obj, separators=(",", ":")).encode()
        return cls(status, [(b"content-type", b"application/json")] + (headers or []), payload)

    @classmethod
    def text(cls, text: str, status: int = 200, content_type: bytes = b"text/plain; charset=utf-8") -> "Response":
        return cls(status, [(b"content-type", content_type)], text.encode())


Handler = Callable[[Request], Awaitable[Response]]

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    501: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
    505: "invalid_request_error",
}


def error_body(status: int, message: str, *, param: str | None = None, code: str | int | None = None,
               type_: str | None = None) -> bytes:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return json.dumps(
        {"error": {"message": message, "type": type_ or ERROR_TYPES.get(status, "server_error"),
                   "param": param, "code": code}},
        separators=(",", ":"),
    ).encode()


def error_response(status: int, message: str, *, param: str | None = None, code: str | int | None = None,
                   type_: str | None = None, headers: list[tuple[bytes, bytes]] | None = None) -> Response:
    return Response(status, [(b"content-type", b"application/json")] + (headers or []),
                    error_body(status, message, param=param, code=code, type_=type_))


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value (the scheme in any case), or None."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token
