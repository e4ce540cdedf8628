"""The decode charge learns each replica's line from its engine's own reported ITL, not the host's delays.

Two ``llmgw sim --profile h100-llama-3.1-8b`` replicas behind ``llmgw serve``
with ``prefix_tree`` scraping their ``/metrics`` every 100 ms. Streams under
two long prompts (one a replica) come and go: batches of 1 to 8. The
simulators export vLLM's ``vllm:inter_token_latency_seconds`` on their
modelled clock, so the line learnt from it predicts the H100 profile's step
at a batch of 8 (its fixed cost, the weights, each sequence's overhead and the
KV bytes and attention of its context), whatever this loaded host adds to the
streams' gaps as the gateway sees them. On main the charge had only those
gaps to learn from.
"""

from __future__ import annotations

from random import Random

import trio

from llmgw.bench.chat_workloads import new_client, send_chat, words
from llmgw.sim.profiles import profile
from llmgw.sim.timing import GpuTiming, StepWork
from llmgw.testing.sims import MODEL, gateway_config, start_sims

PROFILE = "h100-llama-3.1-8b"
OUTPUT = 200
BATCH = 8


async def test_the_itl_line_charged_is_the_engines_reported_one(nursery, start_llmgw):
    sims = await start_sims(nursery, 2, num_blocks=None, time_scale=1, seed=0,
                            extra=("--profile", PROFILE, "--output-tokens", f"{OUTPUT}:{OUTPUT}"))
    gateway = await start_llmgw(gateway_config([s.url for s in sims], routing="prefix_tree", routing_options={
        "seed": 1, "cost_decode_weight": 1, "engine_metrics_interval": "100ms"}))
    rng = Random(3)
    systems = [{"role": "system", "content": f"You summarise meeting notes, team {i}. " + words(rng, 600)}
               for i in range(2)]
    prompt_tokens: list[int] = []
    async with new_client(32) as client:
        async def one(i: int) -> None:
            messages = [systems[i % 2], {"role": "user", "content": f"q {i}"}]
            result = await send_chat(client, gateway.url, MODEL, messages, OUTPUT)
            assert result.status == 200
            prompt_tokens.append(result.prompt_tokens)

        with trio.fail_after(60):
            async with trio.open_nursery() as streams:
                for i in range(32):  # the batches grow and shrink as streams start and end
                    streams.start_soon(one, i)
                    await trio.sleep(0.05 + 0.4 * (i % 8 == 7))
        explained = (await client.post(gateway.control_url + "/admin/explain", json={
            "model": MODEL, "max_tokens": OUTPUT, "messages": [systems[0], {"role": "user", "content": "q"}]})).json()
        metrics = (await client.get(gateway.control_url + "/metrics")).text
    timing = GpuTiming(profile(PROFILE))
    prompt = sum(prompt_tokens) / len(prompt_tokens)
    context = BATCH * (prompt + OUTPUT / 2)  # the KV the step's attention reads: each sequence's whole context
    true_itl = timing.step_seconds(StepWork(decode_tokens=BATCH, context_tokens=int(context),
                                            attention_pairs=int(context), sequences=BATCH))
    held = prompt + BATCH * OUTPUT / 2  # the KV cache held: the shared prompt's blocks once (what usage tells)
    for replica in explained["replicas"]:
        learnt = replica["cost"]["learnt"]
        assert learnt["itl_source"] == "engine" and learnt["engine_itl_windows"] >= 5, learnt
        predicted = (learnt["itl_base_s"] + BATCH * learnt["itl_per_sequence_s"]
                     + held * learnt["itl_per_context_token_s"])
        assert abs(predicted / true_itl - 1) < 0.2, (replica["name"], predicted, true_itl, learnt)
    assert 'llmgw_routing_itl_source{model="tiny",source="engine"} 1.0' in metrics
