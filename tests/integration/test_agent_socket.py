"""The agent websocket of a real `llmgw serve` under hostile peers (issue 18, findings 2 and 10).

No frame of a peer that does not prove a join token (or a node secret) in its upgrade request is ever read: the
upgrade is answered 401/403 before the websocket is accepted, and the gateway's memory does not move. A peer
with the token gets 256 KiB for its first frame, ``agents.register_timeout`` to send it, and one of
``agents.max_sessions`` places. Refusals are counted and logged once per interval, not once each.
"""

from __future__ import annotations

import httpx
import pytest
import trio
import trio_websocket

from llmgw import wire
from llmgw.bench.agent_socket import agent_url, hostile_register, rss_bytes
from llmgw.testing import metric_value

JOIN = "join-s3cret-agents"
RIGHT = [(b"authorization", f"Bearer {JOIN}".encode())]  # what llmgw.wire.channel.AgentCredentials sends
WRONG = [(b"authorization", b"Bearer not-the-token")]
MiB = 1 << 20


def config(extra: str = "") -> str:
    return f"models: []\nagents:\n  token: {JOIN}\n{extra}"


async def metric(gw, name: str, labels: str = "") -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(gw.control_url + "/metrics")).text
    return metric_value(text, name, labels)


async def health(gw) -> int:
    async with httpx.AsyncClient(timeout=30) as client:
        return (await client.get(gw.url + "/health")).status_code


async def first_frame(gw, frame: bytes, headers) -> wire.Registered | trio_websocket.ConnectionRejected:
    """Open /agent with ``headers`` and send ``frame`` first: the refused upgrade, or the answer to the frame."""
    try:
        async with trio_websocket.open_websocket_url(agent_url(gw.control_url), extra_headers=headers) as ws:
            await ws.send_message(frame)
            with trio.fail_after(60):
                answer = wire.decode(await ws.get_message())
            assert isinstance(answer, wire.Registered)
            return answer
    except trio_websocket.ConnectionRejected as exc:
        return exc


async def registered(gw, node_id: str, nursery: trio.Nursery) -> trio.CancelScope:
    """An agent's session on a raw websocket, kept (heartbeating) until the returned scope is cancelled."""
    scope = trio.CancelScope()

    async def session(task_status=trio.TASK_STATUS_IGNORED):
        with scope:
            async with trio_websocket.open_websocket_url(agent_url(gw.control_url), extra_headers=RIGHT) as ws:
                await ws.send_message(wire.encode(wire.Register(node_id=node_id, token=JOIN, address="127.0.0.1")))
                assert wire.decode(await ws.get_message()).accepted
                task_status.started()
                while True:
                    await ws.send_message(wire.encode(wire.Heartbeat()))
                    await trio.sleep(0.5)

    await nursery.start(session)
    return scope


async def test_a_hostile_first_frame_without_the_token_is_refused_at_the_upgrade_unread(start_llmgw, nursery):
    gw = await start_llmgw(config())
    frame = hostile_register(MiB)  # decoded, it cost ~575 MB and froze the loop for seconds
    before = rss_bytes(gw.process.pid)
    answers = {}
    async with trio.open_nursery() as senders:
        async def send(kind, headers):
            answers[kind] = await first_frame(gw, frame, headers)

        for kind, headers in (("wrong", WRONG), ("missing", [])):
            senders.start_soon(send, kind, headers)
        assert await health(gw) == 200  # the data plane answers meanwhile
    for answer in answers.values():
        assert isinstance(answer, trio_websocket.ConnectionRejected) and answer.status_code == 401
    # an agent of the version before (no header) is told what to do, in what it logs: the error's text
    assert b"upgrade llmgw-agent" in answers["missing"].body and b"upgrade llmgw-agent" in str(answers["missing"])\
        .encode()
    assert await metric(gw, "llmgw_agent_upgrades_refused_total", 'reason="bad_token"') == 1
    assert await metric(gw, "llmgw_agent_upgrades_refused_total", 'reason="missing_token"') == 1
    assert await metric(gw, "llmgw_agent_refused_total", 'reason="protocol"') == 0  # nothing was decoded
    assert await metric(gw, "llmgw_agent_websockets") == 0
    assert rss_bytes(gw.process.pid) - before < 32 * MiB
    assert gw.process.returncode is None and await health(gw) == 200


async def test_the_first_frame_of_a_token_holder_is_bounded_before_it_is_decoded(start_llmgw):
    gw = await start_llmgw(config())
    before = rss_bytes(gw.process.pid)
    answer = await first_frame(gw, hostile_register(MiB // 2, JOIN), RIGHT)
    assert isinstance(answer, wire.Registered) and not answer.accepted
    assert answer.reason.startswith("frame_too_large")
    # under the first-frame limit, the same shape is refused by the decoder's container budget, in O(bytes)
    answer = await first_frame(gw, hostile_register(200_000, JOIN), RIGHT)
    assert isinstance(answer, wire.Registered) and not answer.accepted and "maps and arrays" in answer.reason
    assert await metric(gw, "llmgw_agent_refused_total", 'reason="frame_too_large"') == 1
    assert await metric(gw, "llmgw_agent_refused_total", 'reason="protocol"') == 1
    assert rss_bytes(gw.process.pid) - before < 32 * MiB
    # a real Register still joins
    answer = await first_frame(gw, wire.encode(wire.Register(node_id="fine", token=JOIN)), RIGHT)
    assert isinstance(answer, wire.Registered) and answer.accepted


async def test_agent_sessions_are_capped_and_refused_upgrades_take_no_place(start_llmgw, nursery):
    gw = await start_llmgw(config("  max_sessions: 2\n"))
    first = await registered(gw, "one", nursery)
    await registered(gw, "two", nursery)
    for _ in range(5):  # refused at the door: they never count against the cap
        refused = await first_frame(gw, b"", WRONG)
        assert isinstance(refused, trio_websocket.ConnectionRejected) and refused.status_code == 401
    third = await first_frame(gw, wire.encode(wire.Register(node_id="three", token=JOIN)), RIGHT)
    assert isinstance(third, trio_websocket.ConnectionRejected) and third.status_code == 503
    assert b"agents.max_sessions" in third.body
    assert await metric(gw, "llmgw_agent_upgrades_refused_total", 'reason="session_limit"') == 1
    assert await metric(gw, "llmgw_agent_websockets") == 2
    first.cancel()
    with trio.fail_after(20):
        while await metric(gw, "llmgw_agent_websockets") != 1:
            await trio.sleep(0.05)
    await registered(gw, "three", nursery)


async def test_a_socket_that_upgrades_and_never_registers_is_closed(start_llmgw):
    gw = await start_llmgw(config("  register_timeout: 500ms\n"))
    async with trio_websocket.open_websocket_url(agent_url(gw.control_url), extra_headers=RIGHT) as ws:
        with trio.fail_after(20):  # a guard against a hang, not a measure
            answer = wire.decode(await ws.get_message())
            with pytest.raises(trio_websocket.ConnectionClosed):
                await ws.get_message()
    assert isinstance(answer, wire.Registered) and answer.reason.startswith("register_timeout")
    assert await metric(gw, "llmgw_agent_refused_total", 'reason="register_timeout"') == 1
    assert await metric(gw, "llmgw_agent_websockets") == 0


async def test_many_refused_upgrades_are_counted_each_and_logged_once(start_llmgw):
    gw = await start_llmgw(config())
    async with trio.open_nursery() as senders:
        for _ in range(200):
            senders.start_soon(first_frame, gw, b"", [])
    assert await metric(gw, "llmgw_agent_upgrades_refused_total", 'reason="missing_token"') == 200
    lines = [line for line in gw.lines if "refused an agent's websocket upgrade" in line]
    assert 1 <= len(lines) <= 2, lines
    assert await health(gw) == 200
