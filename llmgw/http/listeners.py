"""TCP sockets on one HOST:PORT that several processes may share (``SO_REUSEPORT``), listening or only bound.

``llmgw serve --workers N`` runs N processes that each listen on the same data
address; the kernel spreads new connections across them. Every socket of the
group must set ``SO_REUSEPORT`` before it binds, and all belong to one user.
:func:`bind_tcp` opens them as :func:`trio.open_tcp_listeners` does (one socket
per address ``host`` resolves to, ``SO_REUSEADDR``, IPv6 sockets IPv6-only, the
largest backlog), plus ``SO_REUSEPORT`` when asked, and can stop short of
``listen``: a bound socket that does not listen takes no connection but holds
the port, so a supervisor can pick one free port (port 0), keep it from other
programs for as long as it runs, and hand it to its workers.
"""

from __future__ import annotations

import errno
import socket

import trio

BACKLOG = 0xFFFF  # trio's default: the kernel caps it at net.core.somaxconn


async def bind_tcp(host: str, port: int, *, reuse_port: bool = False, listen: bool = True) -> list[socket.socket]:
    """Non-blocking sockets bound to every address of ``host`` on ``port``, listening unless ``listen=False``.

    With port 0 and several addresses, every socket gets the port the first one was given. ``OSError`` when one
    cannot be bound (the sockets opened so far are closed)."""
    addresses = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    unsupported: OSError | None = None
    try:
        for family, kind, proto, _, sockaddr in addresses:
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as exc:
                if exc.errno != errno.EAFNOSUPPORT:  # an address family this system lacks: try the others
                    raise
                unsupported = exc
                continue
            sockets.append(sock)
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                sockaddr = (sockaddr[0], sockets[0].getsockname()[1], *sockaddr[2:])
            sock.bind(sockaddr)
            if listen:
                sock.listen(BACKLOG)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    if not sockets:
        raise unsupported or OSError(errno.EADDRNOTAVAIL, f"{host} resolves to no address")
    return sockets


def bound_port(sockets: list[socket.socket]) -> int:
    """The port ``sockets`` (from :func:`bind_tcp`) are bound to."""
    port: int = sockets[0].getsockname()[1]
    return port


def close_sockets(sockets: list[socket.socket]) -> None:
    """Close ``sockets`` (from :func:`bind_tcp`), waking any task that waits on one."""
    for sock in sockets:
        if sock.fileno() >= 0:
            trio.lowlevel.notify_closing(sock)
            sock.close()
