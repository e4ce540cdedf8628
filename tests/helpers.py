"""Helpers the tests share (``tests`` is on ``pythonpath``: ``from helpers import free_port``)."""

from __future__ import annotations

import trio

from llmgw import wire
from llmgw.processes import free_port  # noqa: F401 (the tests' import of it)


async def next_error(ws) -> wire.ErrorMessage:
    """The next ErrorMessage on a raw agent websocket (heartbeats skipped)."""
    with trio.fail_after(5):
        while True:
            message = wire.decode(await ws.get_message())
            if isinstance(message, wire.ErrorMessage):
                return message
