"""The agent link over TLS: ``wss://`` to a real trio-websocket TLS server running the agent service (CA: trustme)."""

from __future__ import annotations

import ssl

import pytest
import trio
import trustme
from prometheus_client import CollectorRegistry
from trio_websocket import serve_websocket

from helpers import RecordingHandler
from llmgw import wire
from llmgw.commands.agent import build_parser, tls_options
from llmgw.control.agent_service import AgentService, SessionSettings
from llmgw.control.identity import NodeIdentities
from llmgw.control.inventory import Inventory
from llmgw.control.metrics import ControlMetrics
from llmgw.tls import TlsClientOptions
from llmgw.wire.channel import AgentCredentials, WebSocketConnector, websocket_channel

TOKEN = "join-me"


@pytest.fixture
def ca():
    return trustme.CA()


@pytest.fixture
async def wss_control_plane(nursery, tmp_path, ca):
    """A TLS websocket server on 127.0.0.1 whose connections are served by a real AgentService; its wss URL."""
    inventory = Inventory()
    service = AgentService(inventory, RecordingHandler(inventory), SessionSettings(token=TOKEN),
                           identities=NodeIdentities(tmp_path / "control"), metrics=ControlMetrics(CollectorRegistry()))
    await nursery.start(service.run)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)

    async def handler(request):
        ws = await request.accept()
        await service.serve(websocket_channel(ws, "agent over wss"))

    server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, server_context)
    return f"wss://127.0.0.1:{server.port}", service


async def register_over(connector: WebSocketConnector, node_id: str) -> wire.Registered:
    async with connector.connect(AgentCredentials(TOKEN.encode())) as channel:
        await channel.send(wire.Register(node_id=node_id, token=TOKEN))
        with trio.fail_after(10):
            return await channel.receive()


async def test_an_agent_joins_over_wss_trusting_the_ca_file(wss_control_plane, ca, tmp_path):
    url, service = wss_control_plane
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    reply = await register_over(WebSocketConnector(url, tls=TlsClientOptions(ca_file=str(ca_file))), "a")
    assert reply.accepted and len(reply.node_secret) == 64
    assert "a" in service.inventory.nodes


async def test_an_unknown_ca_fails_the_handshake_and_nothing_is_sent(wss_control_plane):
    url, service = wss_control_plane
    connector = WebSocketConnector(url, connect_timeout=2.0)
    with pytest.raises(ssl.SSLError, match="certificate verification failed"):  # the system store lacks the test CA
        await register_over(connector, "b")
    assert "b" not in service.inventory.nodes


async def test_insecure_skip_verify_connects_without_checking(wss_control_plane):
    url, _ = wss_control_plane
    reply = await register_over(WebSocketConnector(url, tls=TlsClientOptions(verify=False)), "c")
    assert reply.accepted


def test_the_cli_builds_tls_options_only_for_wss(tmp_path):
    args = build_parser().parse_args(["--join", "wss://cp:8001", "--ca-file", "ca.pem", "--client-cert", "c.pem",
                                      "--client-key", "k.pem"])
    assert tls_options(args) == TlsClientOptions(ca_file="ca.pem", cert_file="c.pem", key_file="k.pem")
    assert tls_options(build_parser().parse_args(["--join", "ws://cp:8001"])) is None
    insecure = build_parser().parse_args(["--join", "wss://cp", "--insecure-skip-verify"])
    assert tls_options(insecure).verify is False
    with pytest.raises(ValueError, match="--client-key needs --client-cert"):
        tls_options(build_parser().parse_args(["--join", "wss://cp", "--client-key", "k.pem"]))
    with pytest.raises(ValueError, match="need a wss://"):
        WebSocketConnector("ws://cp:8001", tls=TlsClientOptions(ca_file=None))
