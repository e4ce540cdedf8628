"""The control port of a real ``llmgw serve``: hostile connections are contained, ``/admin`` needs an admin token,
errors are OpenAI-shaped JSON, the CLI passes the token, and the listener can serve TLS."""

from __future__ import annotations

import json
import os
import ssl

import httpx
import pytest
import trio
import trio_websocket

from llmgw import wire
from llmgw.testing.processes import llmgw_command
from llmgw.wire.channel import AgentCredentials

ADMIN = "adm-0123456789abcdef"
JOIN = "join-secret-123"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
NEW_TOKEN = "adm-new-token-0001"
NEW = {"Authorization": f"Bearer {NEW_TOKEN}"}


def config(extra: str = "", tokens: tuple[str, ...] = (ADMIN,)) -> str:
    admin = "admin_tokens:\n" + "".join(f"  - token: {t}\n    name: ops-{i}\n" for i, t in enumerate(tokens))
    return f"models: []\nagents:\n  token: {JOIN}\n{admin if tokens else ''}{extra}"


async def get(url: str, headers: dict | None = None, **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10, **kwargs) as client:
        return await client.get(url, headers=headers)


async def post(url: str, content: bytes = b"", headers: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(url, content=content, headers=headers)


async def metric(gw, name: str, labels: str = "") -> float:
    text = (await get(gw.control_url + "/metrics")).text
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {" and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


async def half_closed_short_body(control_url: str, path: str = "/admin/whatever") -> None:
    """The request of the issue: a body one byte short of its Content-Length, then a half-close."""
    host, port = control_url.split("//")[1].rsplit(":", 1)
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n".encode()
                                  + b"x" * 4999)
            await stream.send_eof()
            try:
                while await stream.receive_some(65536):
                    pass
            except trio.BrokenResourceError:
                pass


async def test_half_closed_short_bodies_end_neither_the_process_nor_an_agent_session(start_llmgw):
    gw = await start_llmgw(config())
    with trio.fail_after(120):  # without containment the gateway dies and a wait here would hang
        await provoke_and_survive(gw)


async def provoke_and_survive(gw) -> None:
    url = gw.control_url.replace("http://", "ws://") + "/agent"
    async with trio_websocket.open_websocket_url(url, extra_headers=AgentCredentials(JOIN.encode()).headers()) as ws:
        await ws.send_message(wire.encode(wire.Register(node_id="bystander", token=JOIN, address="127.0.0.1")))
        assert wire.decode(await ws.get_message()).accepted

        # Before containment one such request in a few ended `llmgw serve` (BusyResourceError out of Hypercorn).
        for _ in range(300):
            await half_closed_short_body(gw.control_url)
            if await metric(gw, "llmgw_control_connection_failures_total") >= 3:
                break
        assert await metric(gw, "llmgw_control_connection_failures_total") >= 3, "the failure was never provoked"
        assert gw.process.returncode is None
        assert (await get(gw.control_url + "/health")).json()["status"] == "ok"
        assert await metric(gw, "llmgw_control_server_restarts_total") == 0

        # The agent's websocket lived through it: it still hears heartbeats and is still connected.
        with trio.fail_after(15):
            while not isinstance(wire.decode(await ws.get_message()), wire.Heartbeat):
                pass
        await ws.send_message(wire.encode(wire.Heartbeat(seq=1)))
        nodes = {n["node_id"]: n for n in (await get(gw.control_url + "/admin/nodes", AUTH)).json()}
        assert nodes["bystander"]["state"] == "connected"
    assert (await get(gw.url + "/health")).status_code == 200  # and the data plane, of course


async def test_admin_needs_a_token_health_and_metrics_stay_open(start_llmgw):
    gw = await start_llmgw(config())
    for method, path in (("GET", "/admin/replicas"), ("GET", "/admin/nodes"), ("POST", "/admin/reload"),
                         ("POST", "/admin/explain"), ("GET", "/admin/no-such-thing"), ("GET", "/admin")):
        async with httpx.AsyncClient(timeout=10) as client:
            missing = await client.request(method, gw.control_url + path)
            wrong = await client.request(method, gw.control_url + path, headers={"Authorization": "Bearer nope"})
            basic = await client.request(method, gw.control_url + path, headers={"Authorization": f"Basic {ADMIN}"})
        for response in (missing, wrong, basic):
            assert_openai_error(response, 401, "invalid_admin_token")
            assert response.headers["www-authenticate"].startswith("Bearer")
    assert await metric(gw, "llmgw_admin_auth_failures_total", 'reason="missing"') == 6
    assert await metric(gw, "llmgw_admin_auth_failures_total", 'reason="invalid"') == 12

    assert (await get(gw.control_url + "/admin/replicas", AUTH)).json() == []
    assert_openai_error(await get(gw.control_url + "/admin/no-such-thing", AUTH), 404, "not_found")
    assert (await get(gw.control_url + "/health")).status_code == 200
    assert (await get(gw.control_url + "/metrics")).status_code == 200
    assert ADMIN not in "\n".join(gw.lines)  # a token is never logged


async def test_metrics_need_the_token_when_asked(start_llmgw):
    gw = await start_llmgw(config("metrics:\n  require_auth: true\n"))
    assert_openai_error(await get(gw.control_url + "/metrics"), 401)
    assert "llmgw_admin_auth_failures_total" in (await get(gw.control_url + "/metrics", AUTH)).text
    assert (await get(gw.control_url + "/health")).status_code == 200


async def test_a_reload_rotates_the_admin_tokens(start_llmgw, tmp_path):
    gw = await start_llmgw(config())
    path = next(tmp_path.glob("llmgw-*.yaml"))
    path.write_text(config(tokens=(NEW_TOKEN, ADMIN)))
    assert (await post(gw.control_url + "/admin/reload", headers=AUTH)).json()["reloaded"] is True
    assert (await get(gw.control_url + "/admin/nodes", NEW)).status_code == 200
    path.write_text(config(tokens=(NEW_TOKEN,)))
    assert (await post(gw.control_url + "/admin/reload", headers=AUTH)).json()["reloaded"] is True
    assert_openai_error(await get(gw.control_url + "/admin/nodes", AUTH), 401)  # the old token is gone at once
    assert (await get(gw.control_url + "/admin/nodes", NEW)).status_code == 200


@pytest.mark.parametrize("body, status, code, fragment", [
    (b"{not json", 400, "invalid_json", "not valid JSON"),
    (b'{"model": "\xff\xfe"}', 400, "invalid_json", "not valid JSON"),
    (b"[" * 200_000 + b"]" * 200_000, 413, "request_too_complex", "arrays and objects"),
    (b'{"model": ' + b"[" * 101 + b"]" * 101 + b"}", 400, "invalid_json", "deeper than 100"),
    (b"[1, 2]", 400, "invalid_json", "must be a JSON object"),
    (b"", 400, "invalid_json", "not valid JSON"),
    # The data plane's parser and limits (explain had its own, which took these and sent them to the tiers):
    (b'{"model": "tiny", "temperature": NaN}', 400, "invalid_json", "NaN is not a JSON number"),
    (b'{"model": "tiny", "temperature": 1e400}', 400, "invalid_json", "1e400"),
    (b'{"model": "tiny", "temperature": -1E+999}', 400, "invalid_json", "-1E+999"),
])
async def test_explain_answers_bad_bodies_with_json_errors(start_llmgw, body, status, code, fragment):
    gw = await start_llmgw(config())
    error = assert_openai_error(await post(gw.control_url + "/admin/explain", body, AUTH), status, code)
    assert fragment in error["message"]
    assert_openai_error(await post(gw.control_url + "/admin/explain", b'{"model": "none"}', AUTH), 404,
                        "model_not_found")
    assert gw.process.returncode is None


async def run_cli(*args: str, env: dict | None = None, timeout: float = 30) -> tuple[int, str, str]:
    with trio.fail_after(timeout):
        done = await trio.run_process(llmgw_command(*args), capture_stdout=True, capture_stderr=True, check=False,
                                      env=dict(os.environ, **(env or {})))
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_status_and_plan_take_the_token_from_a_flag_or_the_environment(start_llmgw, tmp_path):
    gw = await start_llmgw(config())
    env = {"LLMGW_ADMIN_TOKEN": ""}
    code, _, err = await run_cli("status", "--control", gw.control_url, env=env)
    assert code == 1 and "401" in err and "LLMGW_ADMIN_TOKEN" in err
    code, out, _ = await run_cli("status", "--control", gw.control_url, "--admin-token", ADMIN, "--json", env=env)
    assert code == 0 and json.loads(out) == {"nodes": [], "replicas": [],
                                              "kv": {"agent_subscriptions": [], "predicted_keys": 0, "replicas": []},
                                              "autoscale": {"leading": True, "interval_s": 1.0, "deployments": {},
                                                            "move": None}}
    code, out, _ = await run_cli("status", "--control", gw.control_url, env={"LLMGW_ADMIN_TOKEN": ADMIN})
    assert code == 0 and out.startswith("NODES (0)")
    code, _, err = await run_cli("status", "--control", gw.control_url, "--admin-token", "wrong", env=env)
    assert code == 1 and "refused" in err

    plan_config = tmp_path / "plan.yaml"
    plan_config.write_text("models: []\n")
    code, _, err = await run_cli("plan", "--config", str(plan_config), "--control", gw.control_url, env=env)
    assert code == 2 and "401" in err
    code, out, _ = await run_cli("plan", "--config", str(plan_config), "--control", gw.control_url, "--json",
                                 env={"LLMGW_ADMIN_TOKEN": ADMIN})
    assert code == 0 and json.loads(out)["ok"] is True


async def test_an_open_non_loopback_control_port_is_refused_at_start_up(tmp_path):
    path = tmp_path / "open.yaml"
    path.write_text("models: []\ncontrol_listen: 0.0.0.0:8001\n")
    code, out, err = await run_cli("serve", "--config", str(path), "--listen", "127.0.0.1:0",
                                   "--control-listen", "0.0.0.0:0")
    assert code == 2 and "listening on" not in out
    assert err.count("\n") == 1 and "admin_tokens" in err and "allow_unauthenticated_admin" in err
    code, _, err = await run_cli("config", "check", str(path))
    assert code == 1 and f"{path}:2: control_listen:" in err


async def test_allow_unauthenticated_admin_overrides_the_refusal(start_llmgw):
    gw = await start_llmgw("models: []\nallow_unauthenticated_admin: true\n", "--control-listen", "0.0.0.0:0")
    assert (await get(gw.control_url.replace("0.0.0.0", "127.0.0.1") + "/admin/nodes")).json() == []


async def test_the_control_listener_serves_tls(start_llmgw, tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "control.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    gw = await start_llmgw(config(f"control_tls:\n  cert_file: {tmp_path / 'control.pem'}\n"))
    assert gw.control_url.startswith("https://")
    trusted = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    assert (await get(gw.control_url + "/admin/nodes", AUTH, verify=trusted)).json() == []
    with pytest.raises(httpx.ConnectError):
        await get(gw.control_url + "/health")  # not trusted by the system store
    plain = gw.control_url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        await get(plain + "/health")  # plain HTTP is not served
    code, out, _ = await run_cli("status", "--control", gw.control_url, "--control-ca", str(tmp_path / "ca.pem"),
                                 "--json", env={"LLMGW_ADMIN_TOKEN": ADMIN})
    assert code == 0 and json.loads(out)["nodes"] == []

    # An agent joins over wss:// (the websocket shares the listener).
    url = gw.control_url.replace("https://", "wss://") + "/agent"
    async with trio_websocket.open_websocket_url(url, ssl_context=trusted,
                                                 extra_headers=AgentCredentials(JOIN.encode()).headers()) as ws:
        await ws.send_message(wire.encode(wire.Register(node_id="secure", token=JOIN, address="127.0.0.1")))
        assert wire.decode(await ws.get_message()).accepted
    assert gw.process.returncode is None


async def test_an_unusable_control_certificate_stops_the_start_with_one_line(tmp_path):
    (tmp_path / "bad.pem").write_text("not a certificate\n")
    path = tmp_path / "tls.yaml"
    path.write_text(f"models: []\ncontrol_tls:\n  cert_file: {tmp_path / 'bad.pem'}\n")
    code, out, err = await run_cli("serve", "--config", str(path), "--listen", "127.0.0.1:0",
                                   "--control-listen", "127.0.0.1:0")
    assert code == 2 and "listening on" not in out
    assert err.count("\n") == 1 and f"{path}:3: control_tls.cert_file: cannot be used" in err
