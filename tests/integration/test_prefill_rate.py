"""A cold prefill estimated from what the engines report: their prefill rate on ``/metrics``, their tokens in usage.

Two ``llmgw sim`` replicas prefill 4,000 tokens a second (a fifth of the cost
model's 20,000 prior) with a byte tokenizer (a token a character, not the
characters / 4 the prefix tree assumed). They served cold prompts before the
gateway started, as engines do that a gateway is restarted or added in front
of. ``llmgw serve`` with ``prefix_tree`` scrapes their ``/metrics`` and sends
three short questions; then a 3,000-character prompt none holds is estimated
within 25% of the time to first token it gets. On main (the prior's rate
and characters / 4) it was estimated at 0.16 s and took 0.78 s.
"""

from __future__ import annotations

from random import Random

import trio

from llmgw.bench.chat_workloads import new_client, send_chat, words
from llmgw.testing.sims import MODEL, gateway_config, start_sims

RATE = 4000  # the simulators' prefill tokens per second


def prompt(rng: Random, chars: int, tag: str) -> list[dict]:
    return [{"role": "system", "content": (tag + " " + words(rng, chars // 4))[:chars]},
            {"role": "user", "content": "question"}]


async def test_a_cold_prompt_is_estimated_with_the_engines_rate_and_tokens(nursery, start_llmgw):
    sims = await start_sims(nursery, 2, num_blocks=None, time_scale=1, seed=0,
                            extra=("--profile", "constant", "--prefill-tokens-per-s", str(RATE),
                                   "--decode-ms-per-step", "10"))
    rng = Random(5)
    async with new_client(4) as client:
        for sim in sims:  # their history before the gateway: one cold prefill after another
            for i in range(2):
                result = await send_chat(client, sim.url, MODEL, prompt(rng, 2000, f"history {sim.url} {i}"), 4)
                assert result.status == 200
        gateway = await start_llmgw(gateway_config(
            [s.url for s in sims], routing="prefix_tree",
            routing_options={"seed": 1, "engine_metrics_interval": "0.1s", "cost_engine_prefill": True}))
        for i in range(3):  # their usage shows the tokens a character makes
            assert (await send_chat(client, gateway.url, MODEL, prompt(rng, 400, f"short {i}"), 4)).status == 200
        cold = prompt(rng, 3000, "cold")
        explain = {"model": MODEL, "max_tokens": 4, "messages": cold}
        with trio.fail_after(10):
            while True:
                explained = (await client.post(gateway.control_url + "/admin/explain", json=explain)).json()
                rates = [r["cost"]["learnt"].get("engine_prefill_tokens_per_s") for r in explained["replicas"]]
                if all(rates):
                    break
                await trio.sleep(0.1)
        assert all(abs(rate - RATE) / RATE < 0.25 for rate in rates), rates
        estimates = {r["name"]: r["cost"]["estimated_ttft_s"] for r in explained["replicas"]}
        result = await send_chat(client, gateway.url, MODEL, cold, 4)
        metrics = (await client.get(gateway.control_url + "/metrics")).text
    assert result.status == 200 and result.cached_tokens == 0
    estimated = estimates[result.replica]
    assert 0.75 < result.ttft / estimated < 1.33, (result.ttft, estimates, explained["prompt_tokens_estimate"])
    assert 'llmgw_routing_engine_prefill_tokens_per_second{model="' in metrics
    ratio = [line for line in metrics.splitlines() if line.startswith("llmgw_routing_tokens_per_char{")]
    assert ratio and 0.9 < float(ratio[0].rsplit(" ", 1)[1]) < 1.3, ratio
