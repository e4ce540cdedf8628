"""An engine that dies in the middle of a streamed answer: the client reads why, as vLLM tells a failed stream
(``data: {"error": {...}}`` then ``data: [DONE]``), and the request is counted as the 200 the client saw, with
``outcome="stream_error"``."""

from __future__ import annotations

import json
import signal

import httpx
import openai
import pytest
import trio

from llmgw.testing.metrics import metric_value, scrape, scrape_value
from llmgw.testing.sims import start_sims

MESSAGES = [{"role": "user", "content": "hello"}]


def config(url: str) -> str:
    return f"access_log: true\nmodels:\n  - name: tiny\n    replicas:\n      - url: {url}\n        name: a\n"


async def test_a_stream_cut_by_its_engine_ends_with_an_openai_error_event(start_fake_upstream, start_llmgw):
    upstream = await start_fake_upstream("a")
    gw = await start_llmgw(config(upstream.url))
    async with httpx.AsyncClient(base_url=gw.url) as client:
        body = {"model": "tiny", "messages": MESSAGES, "stream": True, "x_break_after": 3}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = [line async for line in response.aiter_lines() if line]
    assert len(events) == 5, events  # three relayed chunks, the error, [DONE]; the body ended cleanly
    assert all(json.loads(e.removeprefix("data: "))["object"] == "chat.completion.chunk" for e in events[:3])
    error = json.loads(events[3].removeprefix("data: "))["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 502
    assert "replica a broke off this answer" in error["message"]
    assert events[4] == "data: [DONE]"

    def with_the_sdk():
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True,
                                                extra_body={"x_break_after": 2})
        chunks = []
        with pytest.raises(openai.APIError) as caught:
            for chunk in stream:
                chunks.append(chunk)
        return chunks, caught.value

    chunks, error_seen = await trio.to_thread.run_sync(with_the_sdk)
    assert len(chunks) == 2 and not isinstance(error_seen, openai.APIConnectionError)
    assert "replica a broke off this answer" in error_seen.message

    text = await scrape(gw.control_url)
    assert metric_value(text, "llmgw_requests_total", 'model="tiny",code="200",outcome="stream_error"') == 2
    assert metric_value(text, "llmgw_requests_total", 'model="tiny",code="502"') == 0
    streamed = [line for line in gw.lines if "llmgw.access" in line and "stream_error=1" in line]
    assert len(streamed) == 2 and all(" status=200 " in line for line in streamed), streamed


async def test_a_simulator_killed_mid_stream_gives_the_client_an_error_event(start_llmgw, nursery):
    """A real engine process (the simulator) killed while it streams."""
    [sim] = await start_sims(nursery, 1, num_blocks=256,
                             extra=("--decode-ms-per-step", "20", "--output-tokens", "500:500"))
    gw = await start_llmgw(config(sim.url))
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        body = {"model": "tiny", "messages": MESSAGES, "stream": True, "max_tokens": 500}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = []
            async for line in response.aiter_lines():
                if line:
                    events.append(line)
                if len(events) == 3:
                    sim.kill(signal.SIGKILL)
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-3:]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 502
    assert await scrape_value(gw.control_url, "llmgw_requests_total", 'code="200",outcome="stream_error"') == 1
