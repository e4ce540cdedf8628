"""The simulator's decode metrics as vLLM exports them, on its modelled step times: a real ``llmgw sim`` process.

One request alone on the H100 profile at ``--time-scale 2``: every token after its first is one decode step
of ``GpuTiming.step_seconds`` (its context one token longer each step) x the time scale, so
``vllm:inter_token_latency_seconds`` must sum those steps exactly, and ``vllm:request_decode_time_seconds``
too; a host as loaded as this one adds its own delays to the wall clock, never to them. On main the
simulator exported neither.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from llmgw.sim.profiles import profile
from llmgw.sim.timing import GpuTiming, StepWork
from llmgw.testing.metrics import metric_value
from llmgw.testing.sims import start_sims

pytestmark = pytest.mark.slow

PROFILE, SCALE = "h100-llama-3.1-8b", 2.0


async def test_the_exported_inter_token_latency_is_the_modelled_step_times(nursery):
    sim, = await start_sims(nursery, 1, num_blocks=None, time_scale=SCALE, extra=("--profile", PROFILE))
    async with httpx.AsyncClient(base_url=sim.url, timeout=30) as http:
        with trio.fail_after(30):
            answer = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 300,
                                                              "max_tokens": 64, "ignore_eos": True})
            metrics = (await http.get("/metrics")).text
    assert answer.status_code == 200
    usage = answer.json()["usage"]
    prompt, output = usage["prompt_tokens"], usage["completion_tokens"]
    assert output > 8
    timing = GpuTiming(profile(PROFILE))
    # the step sampling output token k + 1 reads the prompt and k tokens (its new one included)
    steps = [timing.step_seconds(StepWork(decode_tokens=1, context_tokens=prompt + k, attention_pairs=prompt + k,
                                          sequences=1)) * SCALE for k in range(1, output)]
    def value(name: str, labels: str = "") -> float | None:
        return metric_value(metrics, name, 'engine="0",model_name="tiny"' + labels, default=None)

    assert value("vllm:inter_token_latency_seconds_count") == output - 1
    assert value("vllm:inter_token_latency_seconds_sum") == pytest.approx(sum(steps), rel=1e-9)
    assert value("vllm:request_decode_time_seconds_count") == 1
    assert value("vllm:request_decode_time_seconds_sum") == pytest.approx(sum(steps), rel=1e-9)
    # vLLM's buckets: every gap (~15 ms) is within 25 ms, none within 10 ms
    assert value("vllm:inter_token_latency_seconds_bucket", ',le="0.01"') == 0
    assert value("vllm:inter_token_latency_seconds_bucket", ',le="0.025"') == output - 1
    assert value("vllm:inter_token_latency_seconds_bucket", ',le="+Inf"') == output - 1
    assert "# TYPE vllm:inter_token_latency_seconds histogram" in metrics
    assert "# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds." in metrics
