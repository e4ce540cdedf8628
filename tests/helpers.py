"""Helpers the tests share (``tests`` is on ``pythonpath``: ``from helpers import free_port``)."""

from __future__ import annotations

import socket

import trio

from llmgw import wire


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a child that must be told its port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def next_error(ws) -> wire.ErrorMessage:
    """The next ErrorMessage on a raw agent websocket (heartbeats skipped)."""
    with trio.fail_after(5):
        while True:
            message = wire.decode(await ws.get_message())
            if isinstance(message, wire.ErrorMessage):
                return message
