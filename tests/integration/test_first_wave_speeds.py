"""The first wave on a mixed fleet of real simulators: one A100 among three H100s, each replica's configured
``prefill_tokens_per_s`` (what its GPU and model say), five new ~3,500-token prompts at once.

Every decision comes before any first token or engine report. With one prior for all (main, which has no such
key; here ``cost_configured_prefill: false``), the deal treats the A100 as any replica and gives it two of the five
at seed 2, the second queued behind the first's slow prefill (the routing benchmark's ``hetero --quick``: 3 of 5 runs).
With the configured rates, the A100 is never dealt a second one while an H100 can take it sooner.
"""

from __future__ import annotations

from collections import Counter
from random import Random

import httpx
import trio

from llmgw.bench.chat_workloads import new_client, send_chat, words
from llmgw.sim.profiles import profile
from llmgw.sim.timing import GpuTiming
from llmgw.testing.sims import KV_SIM_EXTRA, MODEL, gateway_config, kv_sources, start_sims

PROFILES = ("a100-40gb-llama-3.1-8b", "h100-llama-3.1-8b", "h100-llama-3.1-8b", "h100-llama-3.1-8b")


async def test_the_slow_gpu_is_dealt_at_most_one_of_the_first_waves_new_prompts(nursery, start_llmgw):
    sims = await start_sims(nursery, 4, num_blocks=None, time_scale=1, seed=0,
                            extra=("--output-tokens", "8:8", *KV_SIM_EXTRA[2:]),
                            per_replica=lambda i: {"extra": ("--profile", PROFILES[i], "--output-tokens", "8:8",
                                                             *KV_SIM_EXTRA[2:])})
    rates = [GpuTiming(profile(name)).prefill_tokens_per_s for name in PROFILES]
    for seed in range(3):
        gateway = await start_llmgw(gateway_config([s.url for s in sims], routing="kv_index",
                                                   routing_options={"seed": seed},
                                                   kv_sources=[kv_sources(s) for s in sims],
                                                   prefill_tokens_per_s=rates))
        async with httpx.AsyncClient(timeout=20) as http:
            with trio.fail_after(30):
                while not all(r.get("state") == "healthy" for r in
                              (await http.get(gateway.control_url + "/admin/kv")).json()["replicas"]):
                    await trio.sleep(0.05)
            explained = (await http.post(gateway.control_url + "/admin/explain", json={
                "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]})).json()
        learnt = {r["name"]: r["cost"]["learnt"]["configured_prefill_tokens_per_s"] for r in explained["replicas"]}
        assert learnt == {f"sim-{i}": round(rate, 1) for i, rate in enumerate(rates)}, explained
        rng = Random(seed)
        results: list = []
        async with new_client(8) as client:
            async def one(group: int) -> None:
                system = {"role": "system", "content": f"Seed {seed} team {group} charter. " + words(rng, 700)}
                results.append(await send_chat(client, gateway.url, MODEL,
                                               [system, {"role": "user", "content": "hello"}], 8))

            async with trio.open_nursery() as wave:
                for group in range(5):
                    wave.start_soon(one, group)
        assert all(r.status == 200 for r in results), results
        per_replica = Counter(r.replica for r in results)
        assert per_replica["sim-0"] <= 1, (seed, per_replica, learnt)
