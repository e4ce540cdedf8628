"""pyzmq sockets under Trio: wait on ``ZMQ_FD``, trust ``ZMQ_EVENTS``, drain until ``zmq.Again``.

Rules (see docs/vllm-notes.md, "pyzmq under Trio"): one task owns a socket
(POLLIN and POLLOUT share one FD, and Trio allows one waiter per FD); always
check ``EVENTS`` before sleeping on the edge-triggered FD; call
:func:`close` (which notifies Trio first) instead of ``socket.close``; make
contexts with :func:`open_context`, which cannot abort the process.
"""

from __future__ import annotations

import os

import trio
import zmq

# Descriptors a new context's first socket needs free, with room: its own mailbox, and the reaper's and the I/O
# thread's epoll and mailbox that libzmq (4.3) creates then: 5.
CONTEXT_HEADROOM = 16


def open_context() -> zmq.Context[zmq.Socket[bytes]]:
    """A new context with its threads already started; ``OSError`` (``EMFILE``) when too few descriptors are free.

    libzmq starts a context's reaper and I/O threads at its first socket and aborts the whole process when it
    cannot get their descriptors (``errno_assert`` in epoll.cpp). So the headroom is proven first (opened and
    closed) and the threads started here, while a shortage is still an exception; sockets of a started context
    that cannot get a descriptor raise ``zmq.ZMQError`` (``EMFILE``) instead."""
    spare: list[int] = []
    try:
        for _ in range(CONTEXT_HEADROOM):
            spare.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    finally:
        for fd in spare:
            os.close(fd)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        ctx.socket(zmq.PAIR).close(linger=0)
    except BaseException:
        ctx.term()
        raise
    return ctx


def _int_option(sock: zmq.Socket[bytes], option: int) -> int:
    value = sock.getsockopt(option)
    assert isinstance(value, int)  # FD and EVENTS are int options (only identities and the like are bytes)
    return value


async def wait_for(sock: zmq.Socket[bytes], flag: int) -> None:
    """Wait until ``sock`` is ready for ``flag`` (``zmq.POLLIN`` or ``zmq.POLLOUT``)."""
    fd = _int_option(sock, zmq.FD)
    while not (_int_option(sock, zmq.EVENTS) & flag):
        await trio.lowlevel.wait_readable(fd)


async def recv_multipart(sock: zmq.Socket[bytes]) -> list[bytes]:
    """Receive one multipart message without blocking the Trio loop."""
    while True:
        try:
            msg = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            await wait_for(sock, zmq.POLLIN)
        else:
            await trio.lowlevel.checkpoint()
            return msg


def drain(sock: zmq.Socket[bytes], limit: int = 256) -> list[list[bytes]]:
    """Every message already queued on ``sock`` (up to ``limit``), without waiting."""
    out: list[list[bytes]] = []
    while len(out) < limit:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            break
    return out


async def recv_batch(sock: zmq.Socket[bytes], limit: int = 256) -> list[list[bytes]]:
    """Wait for at least one message, then return all queued ones (up to ``limit``)."""
    while True:
        batch = drain(sock, limit)
        if batch:
            await trio.lowlevel.checkpoint()
            return batch
        await wait_for(sock, zmq.POLLIN)


async def send_multipart(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
    """Send one multipart message; waits while the high-water mark is reached."""
    while True:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            await wait_for(sock, zmq.POLLOUT)
        else:
            await trio.lowlevel.checkpoint()
            return


def close(sock: zmq.Socket[bytes]) -> None:
    """Wake any Trio task waiting on the socket, then close it without lingering."""
    if sock.closed:
        return
    trio.lowlevel.notify_closing(_int_option(sock, zmq.FD))
    sock.close(linger=0)
