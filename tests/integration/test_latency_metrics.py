"""Latency truth through ``llmgw serve``: time to first token is not time to first byte, token counters match usage.

The simulator runs with ``--stream-head-first``, so its stream head leaves at
once and the first token only after the modelled prefill (at least
``PREFILL_SECONDS``), as a real vLLM does. The gateway's time-to-first-byte
then measures the head and its time-to-first-token the first token; the
latter lies inside the client's own measurement (the gateway starts its clock
after the client sent and sees the token before the client does).
"""

from __future__ import annotations

import time

import httpx
import pytest

from llmgw.testing.metrics import samples as parse_samples, scrape, series_sum
from llmgw.testing.processes import llmgw_command, start_child

pytestmark = pytest.mark.slow

PREFILL_TOKENS_PER_S = 2000.0
PROMPT = "the quick brown fox jumps over the lazy dog " * 120  # about 1,000 simulator tokens
PREFILL_SECONDS = 0.4  # below the modelled prefill of PROMPT: the first token cannot come sooner


async def start_sim(nursery):
    argv = llmgw_command("sim", "--port", "0", "--served-model-name", "tiny", "--stream-head-first", "--profile",
                         "constant", "--prefill-tokens-per-s", str(PREFILL_TOKENS_PER_S), "--decode-ms-per-step", "5",
                         "--output-tokens", "8:8", "--no-enable-prefix-caching")
    return await start_child(nursery, argv, name="sim")


async def scrape_samples(gw) -> dict[str, float]:
    return parse_samples(await scrape(gw.control_url))


async def test_ttft_is_the_first_token_and_tokens_are_counted(nursery, start_llmgw):
    sim = await start_sim(nursery)
    gw = await start_llmgw(f"access_log: true\nmodels:\n  - name: tiny\n    replicas:\n      - url: {sim.url}\n")
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    usage = None
    async with httpx.AsyncClient(timeout=30) as client:
        sent = time.perf_counter()
        client_ttft = None
        async with client.stream("POST", gw.url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if client_ttft is None and '"content":"' in line and '"content":""' not in line:
                    client_ttft = time.perf_counter() - sent
                if '"usage":{' in line:
                    usage = httpx.Response(200, content=line[len("data: "):]).json()["usage"]
        streamed = await scrape_samples(gw)
        plain = await client.post(gw.url + "/v1/chat/completions", json={"model": "tiny", "messages": body["messages"],
                                                                       "max_tokens": 8})
        assert plain.status_code == 200

    samples = await scrape_samples(gw)
    assert client_ttft is not None and usage is not None
    stream_ttft = series_sum(streamed, "llmgw_time_to_first_token_seconds_sum")
    assert PREFILL_SECONDS <= stream_ttft <= client_ttft
    # The head came before the first token was computed: time to first byte is no measure of time to first token.
    assert series_sum(streamed, "llmgw_time_to_first_byte_seconds_sum") < stream_ttft - PREFILL_SECONDS
    # The plain answer's body is no first token: eight tokens were decoded before it came.
    assert series_sum(samples, "llmgw_time_to_first_token_seconds_count") == 1
    assert series_sum(samples, "llmgw_time_to_first_token_seconds_sum") == stream_ttft
    plain_usage = plain.json()["usage"]
    assert series_sum(samples, "llmgw_prompt_tokens_total") == usage["prompt_tokens"] + plain_usage["prompt_tokens"]
    assert series_sum(samples, "llmgw_completion_tokens_total") == \
        usage["completion_tokens"] + plain_usage["completion_tokens"] == 16
    # One gap per token after the first (the usage chunk and [DONE] are none), streams only: vLLM's count.
    assert series_sum(samples, "llmgw_inter_token_latency_seconds_count") == usage["completion_tokens"] - 1 == 7
    stream_gaps = series_sum(streamed, "llmgw_inter_token_latency_seconds_sum")
    assert 0 < stream_gaps == series_sum(samples, "llmgw_inter_token_latency_seconds_sum")
    assert stream_gaps < series_sum(streamed, "llmgw_e2e_request_latency_seconds_sum") - stream_ttft
    assert series_sum(samples, "llmgw_e2e_request_latency_seconds_count") == 2
    access = [line for line in gw.lines if "request_id=" in line and "llmgw.access" in line]
    assert len(access) == 2, gw.lines
    assert all("model=tiny" in line and "status=200" in line and "completion_tokens=8" in line for line in access)
    assert "ttft_ms=-" not in access[0] and "ttft_ms=-" in access[1]  # the plain body is no first token


async def test_ttft_metric_lies_within_the_clients_measurement(nursery, start_llmgw):
    sim = await start_sim(nursery)
    gw = await start_llmgw(f"models:\n  - name: tiny\n    replicas:\n      - url: {sim.url}\n")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True}
    async with httpx.AsyncClient(timeout=30) as client:
        sent = time.perf_counter()
        client_ttft = None
        async with client.stream("POST", gw.url + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if client_ttft is None and '"text":"' in line and '"text":""' not in line:
                    client_ttft = time.perf_counter() - sent
    samples = await scrape_samples(gw)
    gateway_ttft = series_sum(samples, "llmgw_time_to_first_token_seconds_sum")
    assert PREFILL_SECONDS <= gateway_ttft <= client_ttft


async def test_a_one_token_body_is_its_first_token(nursery, start_llmgw):
    """A non-streamed answer of one output token arrives with it: observed as the router learns it."""
    sim = await start_sim(nursery)
    gw = await start_llmgw(f"models:\n  - name: tiny\n    replicas:\n      - url: {sim.url}\n")
    async with httpx.AsyncClient(timeout=30) as client:
        plain = await client.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                                   "max_tokens": 1})
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 1
    samples = await scrape_samples(gw)
    assert series_sum(samples, "llmgw_time_to_first_token_seconds_count") == 1
    assert series_sum(samples, "llmgw_time_to_first_token_seconds_sum") >= PREFILL_SECONDS
    assert series_sum(samples, "llmgw_inter_token_latency_seconds_count") == 0


async def test_every_gap_of_a_paced_stream_is_observed(nursery, start_fake_upstream, start_llmgw):
    """An upstream that sends its events ``DELAY`` apart: one observation per token after the first, adding up
    to the time from the first token to the last: not one mean per stream."""
    upstream = await start_fake_upstream("paced")
    gw = await start_llmgw(f"models:\n  - name: tiny\n    replicas:\n      - url: {upstream.url}\n")
    events, delay = 6, 0.06
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "x_chunks": events, "x_chunk_delay_ms": delay * 1000}
    async with httpx.AsyncClient(timeout=30) as client:
        arrivals = []
        async with client.stream("POST", gw.url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())
    assert len(arrivals) == events
    samples = await scrape_samples(gw)
    assert series_sum(samples, "llmgw_inter_token_latency_seconds_count") == events - 1
    gaps = series_sum(samples, "llmgw_inter_token_latency_seconds_sum")
    # The upstream sleeps DELAY before each event; the gateway's first read may come late, its last not early.
    assert (events - 2) * delay <= gaps <= arrivals[-1] - arrivals[0] + delay
