"""Prefix-tree routing on four simulator replicas: more engine cache hits than round-robin, and no hot spot.

Real processes on loopback: ``llmgw sim`` replicas (fresh ones for every
run) behind ``llmgw serve``. Hit rates are what the engines report
(``usage.prompt_tokens_details.cached_tokens`` over ``prompt_tokens``).
"""

from __future__ import annotations

from random import Random

import httpx
import trio

from llmgw.bench.chat_workloads import new_client, run_multi_turn, send_chat, summarize, words
from llmgw.testing.sims import MODEL, gateway_config, start_sims

REPLICAS = 4


async def multi_turn_hit_rate(nursery, start_llmgw, routing: str, options: dict) -> dict:
    # 16 conversations of 4 turns (up to ~75 blocks each); 300 blocks per replica hold the 4 conversations
    # each replica gets when every conversation stays on one, not the 16 that round-robin sends everywhere.
    sims = await start_sims(nursery, REPLICAS, num_blocks=300, time_scale=0, seed=0)
    gateway = await start_llmgw(gateway_config([s.url for s in sims], routing=routing, routing_options=options))
    results = await run_multi_turn(gateway.url, MODEL, conversations=16, turns=4, system_words=100, user_words=20,
                                   max_tokens=24, concurrency=1, seed=1)
    return summarize(results)


async def test_multi_turn_chat_gets_more_engine_cache_hits_than_round_robin(nursery, start_llmgw):
    summaries = {}

    async def arm(routing: str, options: dict) -> None:
        summaries[routing] = await multi_turn_hit_rate(nursery, start_llmgw, routing, options)

    async with trio.open_nursery() as arms:  # each on its own replicas: running side by side changes nothing
        arms.start_soon(arm, "prefix_tree", {"seed": 1})
        arms.start_soon(arm, "round_robin", {})
    tree, round_robin = summaries["prefix_tree"], summaries["round_robin"]
    assert tree["errors"] == round_robin["errors"] == 0
    assert tree["prompt_tokens"] == round_robin["prompt_tokens"]  # the very same prompts, replies included
    # Every turn after the first finds its conversation cached: close to the 3/4 ceiling of 4 turns.
    assert tree["hit_rate"] > 0.6, tree
    assert tree["hit_rate"] > round_robin["hit_rate"] + 0.25, (tree, round_robin)
    assert tree["per_replica"] == {f"sim-{i}": 16 for i in range(REPLICAS)}  # new conversations spread evenly


async def test_one_shared_system_prompt_keeps_in_flight_load_within_max_imbalance(nursery, start_llmgw):
    max_imbalance = 3
    # Every answer is 400 tokens long (no early EOS): each request stays in flight for 8 s of 20 ms decode steps,
    # however slowly a loaded machine gets to the measurement.
    sims = await start_sims(nursery, REPLICAS, num_blocks=1024, time_scale=1, seed=0,
                            extra=("--output-tokens", "400:400"))
    gateway = await start_llmgw(gateway_config([s.url for s in sims], routing="prefix_tree",
                                               routing_options={"max_imbalance": max_imbalance, "seed": 1}))
    requests = 40
    system = {"role": "system", "content": "You answer questions about our product. " + words(Random(2), 300)}
    heads = 0
    all_started = trio.Event()

    def head_received():
        nonlocal heads
        heads += 1
        if heads == requests:
            all_started.set()

    async with new_client(requests) as client, trio.open_nursery() as burst:
        for i in range(requests):
            burst.start_soon(send_chat, client, gateway.url, MODEL,
                             [system, {"role": "user", "content": f"question {i}"}], 400, head_received)
        with trio.fail_after(10):
            await all_started.wait()
        replicas = (await client.get(gateway.control_url + "/admin/replicas")).json()
        metrics = (await client.get(gateway.control_url + "/metrics")).text
        burst.cancel_scope.cancel()  # measured: no need to wait for the answers

    inflight = [r["inflight"] for r in replicas]
    assert sum(inflight) == requests, replicas  # all of them in flight at once, as the decisions saw them
    assert max(inflight) - min(inflight) <= max_imbalance, inflight
    # It was the load guard at work: prefix affinity alone would have put them all on one replica.
    overrides = [line for line in metrics.splitlines()
                 if line.startswith("llmgw_routing_decisions_total") and 'outcome="load_override"' in line]
    assert overrides and float(overrides[0].rsplit(" ", 1)[1]) >= REPLICAS - 1, metrics


async def test_explain_shows_the_cost_engine_load_and_the_pick_without_routing(nursery, start_llmgw):
    sims = await start_sims(nursery, 2, num_blocks=256, time_scale=0, seed=0)
    gateway = await start_llmgw(gateway_config([s.url for s in sims], routing="prefix_tree",
                                               routing_options={"seed": 3, "engine_metrics_interval": "100ms"}))
    messages = [{"role": "system", "content": "Be precise. " * 40}, {"role": "user", "content": "hello"}]
    async with httpx.AsyncClient() as client:
        first = await send_chat(client, gateway.url, MODEL, messages, 8)
        body = {"model": MODEL, "messages": messages + [{"role": "assistant", "content": first.reply},
                                                        {"role": "user", "content": "and then?"}]}
        with trio.fail_after(5):  # the engines' /metrics are scraped every 100 ms
            while not all(r["engine_load"] for r in (await client.get(gateway.control_url + "/admin/replicas")).json()):
                await trio.sleep(0.05)
        explained = (await client.post(gateway.control_url + "/admin/explain", json=body)).json()
        again = (await client.post(gateway.control_url + "/admin/explain", json=body)).json()
        unknown = await client.post(gateway.control_url + "/admin/explain", json={"model": "nope"})
        replicas = (await client.get(gateway.control_url + "/admin/replicas")).json()
    for answer in (explained, again):  # engine gauges are re-scraped in between: compare the rest
        for entry in answer["replicas"]:
            assert entry.pop("engine_load")["waiting"] == 0
    assert explained == again  # nothing was learnt or sent
    assert explained["pick"] == first.replica and explained["outcome"] == "hit"
    by_name = {r["name"]: r for r in explained["replicas"]}
    assert set(by_name) == {"sim-0", "sim-1"}
    cost = by_name[first.replica]["cost"]  # the estimates of the cost model, the default rule
    assert cost["cached_tokens"] > 100 and cost["queued_tokens"] == 0
    assert cost["estimated_ttft_s"] == min(r["cost"]["estimated_ttft_s"] for r in explained["replicas"])
    assert cost["learnt"]["observations"] == 1  # the first answer's time to first token, learnt from its stream
    assert cost["learnt"]["awaiting_first_token"] == 0  # and off its queue since
    assert {r["name"]: r for r in replicas}[first.replica]["queued_requests"] == 0
    assert by_name[first.replica]["state"] in ("up", "unknown")
    assert sum(r["served"] for r in replicas) == 1
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
