"""Small helpers the tests share that are not fixtures (``tests`` is on ``pythonpath``: ``from helpers import
wait_for``); starting processes and reading metrics is :mod:`llmgw.testing`'s."""

from __future__ import annotations

import httpx
import trio

from llmgw import wire


async def next_error(ws) -> wire.ErrorMessage:
    """The next ErrorMessage on a raw agent websocket (heartbeats skipped)."""
    with trio.fail_after(5):
        while True:
            message = wire.decode(await ws.get_message())
            if isinstance(message, wire.ErrorMessage):
                return message


async def stats(upstream) -> dict:
    """A fake upstream's ``/stats`` (request counters by path)."""
    async with httpx.AsyncClient() as client:
        return (await client.get(upstream.url + "/stats")).json()


async def replicas(gw) -> dict[str, dict]:
    """The gateway's replicas by name, from its control API."""
    async with httpx.AsyncClient() as client:
        return {r["name"]: r for r in (await client.get(gw.control_url + "/admin/replicas")).json()}


async def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Poll the async ``predicate`` until it returns something true (its result), at most ``timeout`` s."""
    with trio.fail_after(timeout):
        while not (result := await predicate()):
            await trio.sleep(interval)
        return result


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    """An OpenAI-shaped error with this status (and code); its `error` object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


class RecordingHandler:
    """The control plane's part of an agent service, reduced to recording in the inventory."""

    def __init__(self, inventory):
        self.inventory = inventory
        self.messages: list[wire.Message] = []

    def on_register(self, session, register):
        return self.inventory.register(register, session)

    def on_message(self, session, message):
        self.messages.append(message)

    def on_end(self, session, reason):
        self.inventory.session_ended(session.node_id, session, reason)


async def read_to_eof(stream: trio.abc.ReceiveStream) -> bytes:
    """Everything a server sends on a raw connection until it closes it (a reset ends it too)."""
    out = b""
    try:
        while data := await stream.receive_some(65536):
            out += data
    except trio.BrokenResourceError:
        pass
    return out
