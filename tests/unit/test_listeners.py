"""One data address for several processes: sockets bound with SO_REUSEPORT, and a bound socket that holds the port."""

from __future__ import annotations

import socket

import pytest
import trio

from llmgw.http.listeners import bind_tcp, bound_port


def accepted(sock: socket.socket) -> int:
    """How many connections wait in ``sock``'s queue (accepted and closed here)."""
    count = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


async def test_listeners_with_reuse_port_share_a_port_that_a_bound_socket_holds():
    held = await bind_tcp("127.0.0.1", 0, reuse_port=True, listen=False)
    port = bound_port(held)
    first = await bind_tcp("127.0.0.1", port, reuse_port=True)
    second = await bind_tcp("127.0.0.1", port, reuse_port=True)
    try:
        with pytest.raises(OSError, match="in use"):  # a program that does not ask to share cannot take it
            await bind_tcp("127.0.0.1", port)
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        await trio.sleep(0.1)
        counts = [accepted(first[0]), accepted(second[0])]
        assert sum(counts) == 40 and min(counts) > 0  # the kernel spread them; none went to the held socket
        for client in clients:
            client.close()
        for sock in first + second:
            sock.close()
        with pytest.raises(ConnectionRefusedError):  # bound, not listening: it takes no connection
            socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        for sock in held + first + second:
            sock.close()


async def test_without_reuse_port_a_second_listener_is_refused():
    first = await bind_tcp("127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match="in use"):
            await bind_tcp("127.0.0.1", bound_port(first))
    finally:
        first[0].close()


async def test_port_zero_gives_every_address_of_a_name_the_same_port():
    try:
        sockets = await bind_tcp("localhost", 0, reuse_port=True)
    except OSError as exc:  # a machine without IPv6 on loopback: localhost may still resolve to ::1
        pytest.skip(f"localhost cannot be bound here: {exc}")
    try:
        assert len({sock.getsockname()[1] for sock in sockets}) == 1
    finally:
        for sock in sockets:
            sock.close()
