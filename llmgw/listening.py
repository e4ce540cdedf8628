"""Addresses a command cannot listen on, as one line a user can act on instead of a traceback.

Listeners are opened inside nurseries, so a busy port surfaces as an
``OSError`` several exception groups deep. :func:`listening_on` wraps the
opening of one listener and turns its ``OSError`` (or ``zmq.ZMQError``) into a
:class:`CannotListen` naming the address, a :class:`~llmgw.usererrors.UserError`
the command prints as one line (exit code 2).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

from .usererrors import UserError


class CannotListen(UserError):
    """``cannot listen on ADDRESS: REASON``."""

    def __init__(self, address: str, reason: str):
        super().__init__(f"cannot listen on {address}: {reason}")
        self.address = address
        self.reason = reason


def host_port(host: str, port: int | str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def reason_of(exc: BaseException) -> str:
    """``address already in use`` from ``OSError(98, 'Address already in use')`` (and zmq's errors alike)."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    text = text.split(" (addr=", 1)[0]  # pyzmq appends the endpoint, which the message names already
    return text[:1].lower() + text[1:]


@contextmanager
def listening_on(address: str) -> Iterator[None]:
    """Around the start of one listener: its failure to bind becomes :class:`CannotListen`."""
    import zmq

    bind_errors = (OSError, zmq.ZMQError)
    try:
        yield
    except bind_errors as exc:
        raise CannotListen(address, reason_of(exc)) from exc
    except BaseExceptionGroup as group:  # a server that binds inside its own nursery (Hypercorn)
        failed = group.subgroup(lambda exc: isinstance(exc, bind_errors))
        if failed is None:
            raise
        raise CannotListen(address, reason_of(_first_leaf(failed))) from group


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def check_bindable(host: str) -> None:
    """:class:`CannotListen` unless a listener can bind ``host`` (any port) on this machine right now."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.bind(sockaddr)
    except OSError as exc:
        raise CannotListen(host, reason_of(exc)) from None
