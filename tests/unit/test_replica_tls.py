"""Every connection to an ``https://`` replica uses its TLS settings: requests' pool, health probes,
``/metrics`` scrapes and ``/tokenize`` calls (which make a pool of their own when the replica has none).

The replica is a real TLS server on 127.0.0.1 with a certificate from a test CA (``trustme``).
"""

from __future__ import annotations

import json

import pytest
import trio
import trustme

from llmgw.http.messages import Response
from llmgw.http.server import HttpServer
from llmgw.kv.tokenize import TokenizeError
from llmgw.plugins.replica_tokenizer import TokenizeClient
from llmgw.router.health import HealthSettings, probe_once
from llmgw.router.load_scraper import scrape_once
from llmgw.router.replica import Replica
from llmgw.tls import TlsClientOptions, server_context

TOKENS = [1, 17, 42]


@pytest.fixture
async def https_engine(nursery, tmp_path):
    """(url, CA file, paths the engine was asked for) of a TLS server answering like an engine."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    asked: list[str] = []

    async def handler(request):
        asked.append(request.path)
        if request.path == "/health":
            return Response(200, [], b"")
        if request.path == "/metrics":
            return Response(200, [(b"content-type", b"text/plain")],
                            b"vllm:num_requests_running 3\nvllm:num_requests_waiting 2\n")
        return Response(200, [(b"content-type", b"application/json")], json.dumps({"tokens": TOKENS}).encode())

    server = HttpServer(handler, tls=server_context(str(tmp_path / "server.pem")))
    _, port = await nursery.start(server.serve, "127.0.0.1", 0)
    return f"https://127.0.0.1:{port}", str(tmp_path / "ca.pem"), asked


async def test_probes_scrapes_and_tokenize_calls_use_the_replicas_tls_settings(https_engine):
    url, ca_file, asked = https_engine
    trusted = Replica(name="r", model="m", url=url, tls=TlsClientOptions(ca_file=ca_file))
    trusted.pool = trusted.open_pool(2.0)
    with trio.fail_after(20):
        assert await probe_once(trusted, HealthSettings(timeout=5.0)) == (True, "ok")
        load = await scrape_once(trusted, 5.0)
        assert (load.running, load.waiting) == (3, 2)
        unpooled = Replica(name="t", model="m", url=url, tls=TlsClientOptions(ca_file=ca_file))
        assert await TokenizeClient(timeout=5.0).tokenize(unpooled, b'{"prompt": "x"}') == TOKENS
    assert asked == ["/health", "/metrics", "/tokenize"]
    await trusted.pool.aclose()


async def test_without_the_ca_every_kind_of_call_is_refused_with_the_reason(https_engine):
    url, _, asked = https_engine
    stranger = Replica(name="s", model="m", url=url)  # the system store does not know the test CA
    stranger.pool = stranger.open_pool(2.0)
    with trio.fail_after(20):
        ok, reason = await probe_once(stranger, HealthSettings(timeout=5.0))
        assert not ok and "certificate verification failed" in reason
        assert await scrape_once(stranger, 5.0) is None
        with pytest.raises(TokenizeError) as caught:
            await TokenizeClient(timeout=5.0).tokenize(Replica(name="u", model="m", url=url), b'{"prompt": "x"}')
    assert caught.value.kind == "connect" and "certificate verification failed" in str(caught.value)
    assert asked == []  # not one request reached the engine
