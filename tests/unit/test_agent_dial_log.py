"""An agent with several ``--join`` URLs says which one it dialled and why that failed (issue 29, item 4): it used
to name the URL it would dial next, and a handshake that timed out as a bare ``ConnectionTimeout``."""

from __future__ import annotations

import logging

import trio

from llmgw.agent.agent import Agent
from llmgw.testing.processes import free_port
from llmgw.wire.channel import FailoverConnector, WebSocketConnector


async def test_each_failed_dial_names_the_url_it_tried_why_and_where_the_next_goes(nursery, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="llmgw.agent.agent")
    # A frozen control plane: the kernel completes the TCP handshake, nobody ever answers the upgrade.
    (frozen,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    frozen_url = f"ws://127.0.0.1:{frozen.socket.getsockname()[1]}/agent"
    closed_url = f"ws://127.0.0.1:{free_port()}/agent"  # nothing listens
    connector = FailoverConnector([WebSocketConnector(frozen_url, connect_timeout=0.3),
                                   WebSocketConnector(closed_url, connect_timeout=0.3)])
    agent = Agent(connector, token="t", node_id="n", discovery="cpu", state_dir=tmp_path, address="127.0.0.1")
    await nursery.start(agent.run)
    with trio.fail_after(10):
        while len(dials := [r.getMessage() for r in caplog.records if r.getMessage().startswith("cannot reach")]) < 2:
            await trio.sleep(0.05)
    nursery.cancel_scope.cancel()
    assert dials[0].startswith(f"cannot reach {frozen_url} ({frozen_url}: no answer to the websocket upgrade within "
                               f"0.3s"), dials[0]
    assert dials[0].endswith(f"; trying {closed_url} in 0.05s"), dials[0]
    assert dials[1].startswith(f"cannot reach {closed_url} ({closed_url}: "), dials[1]
    assert "Connect call failed" in dials[1] or "connect" in dials[1].lower(), dials[1]
    assert dials[1].endswith(f"; trying {frozen_url} in 0.1s"), dials[1]
