"""The issue-19 burst on real simulators: 40 streams at once under one short prompt spread over every replica.

Four ``llmgw sim --profile h100-llama-3.1-8b`` replicas with KV events behind ``llmgw serve`` with ``kv_index``
(default options). Forty streamed questions sharing a ~190-token system prompt are sent at once: every one is
decided before any first token, on the cost model's priors. The holder of the prompt queues them; once its queue
costs more than computing the prompt elsewhere in every term, the others take them. (On main the priors'
uncertainty gated every such override: 5/18/17/0 and 0/20/20/0 in the routing benchmark.)
"""

from __future__ import annotations

from collections import Counter
from random import Random

import httpx
import trio

from llmgw.bench.chat_workloads import new_client, send_chat, words
from llmgw.testing.sims import KV_SIM_EXTRA, MODEL, gateway_config, kv_sources, start_sims

PROFILE = "h100-llama-3.1-8b"


async def test_forty_streams_under_one_short_prompt_spread_over_every_replica(nursery, start_llmgw):
    sims = await start_sims(nursery, 4, num_blocks=None, time_scale=1, seed=0,
                            extra=("--profile", PROFILE, "--output-tokens", "64:64", *KV_SIM_EXTRA[2:]))
    gateway = await start_llmgw(gateway_config([s.url for s in sims], routing="kv_index",
                                               routing_options={"seed": 1},
                                               kv_sources=[kv_sources(s) for s in sims]))
    async with httpx.AsyncClient(timeout=20) as http:
        with trio.fail_after(30):
            while not all(r.get("state") == "healthy" for r in
                          (await http.get(gateway.control_url + "/admin/kv")).json()["replicas"]):
                await trio.sleep(0.05)
    rng = Random(5)
    system = {"role": "system", "content": "You are the support assistant. " + words(rng, 30)[:160]}
    results: list = []
    async with new_client(48) as client:
        async def one(i: int) -> None:
            results.append(await send_chat(client, gateway.url, MODEL,
                                           [system, {"role": "user", "content": f"ticket {i}: " + words(rng, 12)}],
                                           64))

        async with trio.open_nursery() as burst:
            for i in range(40):
                burst.start_soon(one, i)
    assert all(r.status == 200 for r in results), results
    per_replica = Counter(r.replica for r in results)
    assert len(per_replica) == 4 and min(per_replica.values()) >= 4, per_replica
