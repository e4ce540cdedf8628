"""TLS end to end: `llmgw serve` and fake upstreams serving HTTPS as real processes, with a test CA (trustme).

A trusted ``https://`` replica serves the OpenAI client (also over an HTTPS
data listener); an untrusted one, one whose certificate names another host,
and an mTLS one without our certificate are refused with an error that names
the problem, and a recorder between llmgw and the replica shows that nothing
but TLS handshake records left llmgw: no request line, no API key.
"""

from __future__ import annotations

import functools
import ssl

import httpx
import openai
import pytest
import trio
import trustme

from helpers import read_to_eof, wait_for
from llmgw.testing.metrics import scrape_value

KEY = "sk-client"
UPSTREAM_SECRET = "sk-upstream-secret"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """PEM files: our CA, a server cert for 127.0.0.1, one for another name, one from a CA we do not trust,
    and a client certificate."""
    base = tmp_path_factory.mktemp("pki")
    ours, stranger = trustme.CA(), trustme.CA()
    ours.cert_pem.write_to_path(str(base / "ca.pem"))
    ours.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(base / "server.pem"))
    ours.issue_cert("other.example").private_key_and_cert_chain_pem.write_to_path(str(base / "other-name.pem"))
    stranger.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(base / "untrusted.pem"))
    ours.issue_cert("llmgw").private_key_and_cert_chain_pem.write_to_path(str(base / "client.pem"))
    return base


def model(name: str, url: str, extra: str = "") -> str:
    return f"""
  - name: {name}
    replicas:
      - url: {url}
        name: {name}
        api_key: {UPSTREAM_SECRET}
{extra}"""


def config(models: str, extra: str = "") -> str:
    return f"""
models:{models}
api_keys:
  - key: {KEY}
health:
  interval: 0.2s
limits:
  retries: 0
{extra}
"""


async def https_upstream(start_fake_upstream, name: str, cert, *more: str):
    upstream = await start_fake_upstream(name, extra=("--tls-cert", str(cert), *more))
    assert upstream.url.startswith("https://127.0.0.1:")
    return upstream


def chat(base_url: str, model_name: str, **client_options):
    """One plain and one streamed chat completion with the OpenAI client."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, **client_options)
    plain = client.chat.completions.create(model=model_name, messages=MESSAGES)
    streamed = client.chat.completions.create(model=model_name, messages=MESSAGES, stream=True,
                                              extra_body={"x_chunks": 5, "x_chunk_delay_ms": 20})
    return plain.choices[0].message.content, [chunk.choices[0].delta.content for chunk in streamed]


async def refusal(gw, model_name: str) -> str:
    """The error message of a chat request to a model whose only replica cannot be used (503)."""
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(gw.url + "/v1/chat/completions", json={"model": model_name, "messages": MESSAGES},
                                     headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 503, response.text
    return response.json()["error"]["message"]


async def down_reasons(gw, *names: str) -> dict[str, str]:
    """Once the named replicas are down: why, as ``/admin/replicas`` says."""
    async def reasons():
        async with httpx.AsyncClient() as client:
            listed = {r["name"]: r for r in (await client.get(gw.control_url + "/admin/replicas")).json()}
        if all(listed[name]["state"] == "down" for name in names):
            return {name: listed[name]["reason"] for name in names}

    return await wait_for(reasons)


class Recorder:
    """A TCP relay that forwards to ``target_port`` and keeps every byte the client side sent."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.sent_by_llmgw = bytearray()
        self.connections = 0

    async def handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        try:
            server = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        except OSError:
            return
        async with client, server, trio.open_nursery() as nursery:
            async def pipe(source, sink, record):
                try:
                    while data := await source.receive_some(65536):
                        if record:
                            self.sent_by_llmgw.extend(data)
                        await sink.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(pipe, client, server, True)
            nursery.start_soon(pipe, server, client, False)


async def start_recorder(nursery, target_url: str) -> tuple[Recorder, str]:
    recorder = Recorder(int(target_url.rsplit(":", 1)[1]))
    listeners = await nursery.start(functools.partial(trio.serve_tcp, recorder.handle, 0, host="127.0.0.1"))
    return recorder, f"https://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


def tls_records(data: bytes) -> list[int]:
    """The content types of the TLS records in ``data``; AssertionError if it is not a sequence of records."""
    types, at = [], 0
    while at < len(data):
        content_type, length = data[at], int.from_bytes(data[at + 3:at + 5], "big")
        assert content_type in (20, 21, 22, 23) and data[at + 1] == 3, f"not a TLS record at byte {at}"
        types.append(content_type)
        at += 5 + length
    return types


async def test_a_trusted_https_replica_through_an_https_data_listener(nursery, pki, start_fake_upstream,
                                                                      start_llmgw):
    upstream = await https_upstream(start_fake_upstream, "trusted", pki / "server.pem")
    gw = await start_llmgw(config(model("tiny", upstream.url), f"""
upstream_tls:
  ca_file: {pki / 'ca.pem'}
data_tls:
  cert_file: {pki / 'server.pem'}
"""))
    assert gw.url.startswith("https://127.0.0.1:")

    with httpx.Client(verify=ssl.create_default_context(cafile=str(pki / "ca.pem"))) as http:
        text, pieces = await trio.to_thread.run_sync(functools.partial(chat, gw.url, "tiny", http_client=http))
    assert text == "hello from trusted"
    assert pieces == [f"tok{i} " for i in range(5)]
    up = await wait_for(lambda: scrape_value(gw.control_url, "llmgw_replica_up", 'replica="tiny"'))
    assert up == 1  # the health probes pass over TLS too

    # A client that speaks plain HTTP to the HTTPS listener gets nothing and costs only its own connection.
    with trio.fail_after(10):
        plain = await trio.open_tcp_stream("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))
        await plain.send_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = await read_to_eof(plain)
    assert b"HTTP/1.1" not in answer
    assert await wait_for(lambda: scrape_value(gw.control_url, "llmgw_tls_handshake_failures_total",
                                               'listener="data"')) == 1
    with httpx.Client(verify=ssl.create_default_context(cafile=str(pki / "ca.pem"))) as http:
        assert await trio.to_thread.run_sync(functools.partial(chat, gw.url, "tiny", http_client=http))


async def test_untrusted_and_misnamed_replicas_are_refused_and_get_no_plaintext(nursery, pki, start_fake_upstream,
                                                                               start_llmgw):
    untrusted = await https_upstream(start_fake_upstream, "untrusted", pki / "untrusted.pem")
    misnamed = await https_upstream(start_fake_upstream, "misnamed", pki / "other-name.pem")
    recorder, relayed_url = await start_recorder(nursery, untrusted.url)
    gw = await start_llmgw(config(model("untrusted", relayed_url) + model("misnamed", misnamed.url), f"""
upstream_tls:
  ca_file: {pki / 'ca.pem'}
"""))

    down = await down_reasons(gw, "untrusted", "misnamed")  # the health probes found out first, and say why
    assert "TLS handshake with 127.0.0.1" in down["untrusted"]
    assert "certificate verification failed: unable to get local issuer certificate" in down["untrusted"]
    assert "certificate verification failed" in down["misnamed"]
    assert "mismatch" in down["misnamed"] and "127.0.0.1" in down["misnamed"]
    assert any("is now down" in line and "unable to get local issuer certificate" in line for line in gw.lines)
    for name in ("untrusted", "misnamed"):
        await refusal(gw, name)

    # Probes reached the recorder, and all it saw were TLS handshake and alert records.
    assert recorder.connections >= 1
    sent = bytes(recorder.sent_by_llmgw)
    assert set(tls_records(sent)) <= {21, 22}  # alert, handshake: no application data, no plaintext
    assert sent[5] == 1  # the first handshake message is a ClientHello
    for secret in (UPSTREAM_SECRET.encode(), KEY.encode(), b"GET", b"/health"):
        assert secret not in sent


async def test_tls_verify_false_accepts_any_certificate_says_so_and_reloads(nursery, pki, tmp_path,
                                                                           start_fake_upstream, start_llmgw):
    untrusted = await https_upstream(start_fake_upstream, "untrusted", pki / "untrusted.pem")
    path = tmp_path / "verify-off.yaml"
    path.write_text(config(model("tiny", untrusted.url, "        tls_verify: false")))
    gw = await start_llmgw(None, "--config", str(path))
    text, pieces = await trio.to_thread.run_sync(chat, gw.url, "tiny")
    assert text == "hello from untrusted" and len(pieces) == 5

    def warnings():
        return [line for line in gw.lines if "verification is OFF" in line]

    async def warned(times: int) -> bool:
        return len(warnings()) == times

    assert len(warnings()) == 1 and "WARNING" in warnings()[0] and "replica tiny" in warnings()[0]
    async with httpx.AsyncClient() as client:
        assert (await client.post(gw.control_url + "/admin/reload")).json()["reloaded"]
        await wait_for(lambda: warned(2))  # said again at every reload

        path.write_text(config(model("tiny", untrusted.url)))  # verification back on: the replica is replaced
        assert (await client.post(gw.control_url + "/admin/reload")).json()["reloaded"]
    down = await down_reasons(gw, "tiny")
    assert "unable to get local issuer certificate" in down["tiny"]
    assert len(warnings()) == 2


async def test_mutual_tls_with_and_without_a_client_certificate(nursery, pki, start_fake_upstream, start_llmgw):
    upstream = await https_upstream(start_fake_upstream, "mtls", pki / "server.pem", "--tls-client-ca",
                                    str(pki / "ca.pem"))
    gw = await start_llmgw(config(
        model("with-cert", upstream.url, f"        tls_cert_file: {pki / 'client.pem'}")
        + model("without-cert", upstream.url), f"""
upstream_tls:
  ca_file: {pki / 'ca.pem'}
"""))
    text, pieces = await trio.to_thread.run_sync(chat, gw.url, "with-cert")
    assert text == "hello from mtls" and len(pieces) == 5
    down = await down_reasons(gw, "without-cert")
    # uvicorn-like asyncio servers reset the connection with our request unread, which loses their alert
    reason = down["without-cert"]
    assert "CERTIFICATE_REQUIRED" in reason.upper() or "requires a client certificate" in reason
    await refusal(gw, "without-cert")

