"""A request never passes through the same gateway twice: real ``llmgw serve`` processes whose static replica
leads back to themselves (their own data port, or a pair of gateways pointing at each other) answer one
``508 Loop Detected`` per request instead of sending it round until connections run out."""

from __future__ import annotations

import httpx
import trio

from llmgw.testing.metrics import metric_value, scrape
from llmgw.testing.processes import free_port

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def static_model(url: str) -> str:
    return (f"models:\n  - name: tiny\n    replicas:\n      - url: {url}\n"
            "health:\n  interval: 0.2s\n  failures_to_down: 1\nlimits:\n  retries: 0\n")


async def wait_up(gateway, http: httpx.AsyncClient) -> None:
    """Its replica is up (the first probe may run before its own data port listens)."""
    with trio.fail_after(10):
        while not all(r["state"] == "up" for r in (await http.get(gateway.control_url + "/admin/replicas")).json()):
            await trio.sleep(0.1)


async def metrics_of(gateway, http: httpx.AsyncClient) -> str:
    return await scrape(gateway.control_url, http)


async def test_a_static_replica_on_the_gateways_own_data_port_answers_508_once(start_llmgw):
    port = free_port()
    gateway = await start_llmgw(static_model(f"http://127.0.0.1:{port}"), "--listen", f"127.0.0.1:{port}")
    async with httpx.AsyncClient(timeout=10) as http:
        await wait_up(gateway, http)
        with trio.fail_after(30):
            for _ in range(5):
                response = await http.post(gateway.url + "/v1/chat/completions", json=CHAT)
                assert response.status_code == 508, response.text
                assert response.json()["error"]["code"] == "loop_detected"
        text = await metrics_of(gateway, http)
    # Each client request went round once: it came back once (refused there), and nothing more.
    assert metric_value(text, "llmgw_loops_detected_total") == 5
    assert metric_value(text, "llmgw_requests_total", 'model="unknown",code="508"') == 5  # refused when it came back
    assert metric_value(text, "llmgw_requests_total", 'model="tiny",code="508"') == 5  # the clients' requests


async def test_two_gateways_pointing_at_each_other_stop_the_request_when_it_comes_back(start_llmgw):
    port_a, port_b = free_port(), free_port()
    a = await start_llmgw(static_model(f"http://127.0.0.1:{port_b}"), "--listen", f"127.0.0.1:{port_a}")
    b = await start_llmgw(static_model(f"http://127.0.0.1:{port_a}"), "--listen", f"127.0.0.1:{port_b}")
    async with httpx.AsyncClient(timeout=10) as http:
        await wait_up(a, http)
        await wait_up(b, http)
        with trio.fail_after(30):
            response = await http.post(a.url + "/v1/chat/completions", json=CHAT)
        assert response.status_code == 508 and response.json()["error"]["code"] == "loop_detected", response.text
        text_a, text_b = await metrics_of(a, http), await metrics_of(b, http)
    assert metric_value(text_a, "llmgw_loops_detected_total") == 1  # it came back to a, once
    assert metric_value(text_b, "llmgw_loops_detected_total") == 0
    assert metric_value(text_b, "llmgw_requests_total", 'model="tiny"') == 1  # b relayed it once: no ping-pong
    assert metric_value(text_a, "llmgw_requests_total", 'model="tiny"') == 1
