"""A failure inside the control app's ``/agent`` websocket is logged as what it is (issue 18, finding 10): the error
handler used to name ``request.method``, which raised ``RuntimeError: Not within a request context`` instead."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from types import SimpleNamespace

import trio
import trio_websocket
from prometheus_client import CollectorRegistry

from llmgw.gateway.admin import create_control_app
from llmgw.http.control_server import ControlServer, ControlServerMetrics


class BrokenAgents:
    """An agent service whose session fails with a bug once the upgrade is admitted."""

    @contextmanager
    def upgrade(self, credentials, peer):
        yield None

    async def serve(self, channel) -> None:
        raise RuntimeError("a bug in the agent session")


def stub_gateway() -> SimpleNamespace:
    agents = BrokenAgents()
    control = SimpleNamespace(agents=agents)
    return SimpleNamespace(control=control, agent_control=lambda: control, config=SimpleNamespace(admin_tokens=[]))


async def test_a_failing_agent_websocket_is_logged_with_its_own_error(nursery, caplog):
    caplog.set_level(logging.INFO)
    registry = CollectorRegistry()
    metrics = ControlServerMetrics(registry)
    server = ControlServer(lambda: create_control_app(stub_gateway(), metrics), metrics)  # type: ignore[arg-type]
    shutdown = trio.Event()
    _, port = await nursery.start(lambda task_status: server.serve("127.0.0.1", 0, shutdown=shutdown,
                                                                   task_status=task_status))
    try:
        with trio.fail_after(10):
            async with trio_websocket.open_websocket_url(f"ws://127.0.0.1:{port}/agent") as ws:
                await ws.get_message()
    except (trio_websocket.ConnectionClosed, trio_websocket.HandshakeError):
        pass
    shutdown.set()
    failures = [r for r in caplog.records if "websocket /agent failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert str(failures[0].exc_info[1]) == "a bug in the agent session"
    assert not any("Not within a request context" in (r.exc_text or "") + r.getMessage() for r in caplog.records)
