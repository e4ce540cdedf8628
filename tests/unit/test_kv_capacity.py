"""The capacity charge without vLLM's KV usage gauge: the KV index's stored blocks against the engine's capacity."""

from __future__ import annotations

import random

from test_kv_tier import TEXT, hold, keys_of, make, prompt

from llmgw.engines.probe import VLLM_GAUGES, EngineLoad, parse_load
from llmgw.router.kv_capacity import INDEX, free_tokens

CAPACITY = 100  # blocks of 16 tokens: 1,600 tokens


def taught(tier) -> None:
    """40 ms a step, 10,000 prompt tokens/s, nothing per request in flight."""
    rng = random.Random(1)
    for i in range(200):
        tokens, requests = rng.randint(50, 4000), rng.randint(0, 12)
        tier.tree.cost.observe("ab"[i % 2], tokens, requests, 0.04 + tokens / 10_000)


def setting(stored_filler: int):
    router, tier, _, (a, b) = make({"cost_decode_weight": 1, "engine_metrics_interval": "250ms"}, names=("a", "b"))
    taught(tier)
    keys = keys_of(TEXT)
    hold(tier, "a", keys + [10**6 + i for i in range(stored_filler)])  # the prompt's 20 blocks and others
    hold(tier, "b", [])
    now = tier.clock()
    # An engine exporting its cache config but no vllm:kv_cache_usage_perc (the scraper keeps its capacity).
    a.engine_load = EngineLoad(6, 0, now, block_size=16, num_blocks=CAPACITY)
    b.engine_load = EngineLoad(0, 0, now, block_size=16, num_blocks=CAPACITY)
    a.local_inflight, a.local_inflight_tokens = 6, 6 * 250  # six answers decoding under 250-token prompts
    return router, tier, a, b


async def test_a_holder_whose_cache_the_index_shows_full_is_charged_the_preemption_and_loses_the_request():
    """No usage gauge: the index holds 95 of the holder's 100 blocks and its six requests in flight 1,500 tokens,
    so 100 tokens are free for a 324-token request: it would preempt, and goes to the idle replica. On main (no
    usage gauge, no charge) it stayed on the holder."""
    router, tier, a, b = setting(stored_filler=75)
    explained = await router.explain(prompt(TEXT))
    costs = {e["name"]: e["cost"] for e in explained["replicas"]}
    assert costs["a"]["decode"]["kv_free_tokens"] == 100 and costs["a"]["capacity_charge_s"] > 0.1, costs["a"]
    assert costs["b"]["decode"]["kv_free_tokens"] == 1600 and costs["b"]["capacity_charge_s"] == 0
    assert free_tokens(a.engine_load, tier.index.blocks, "a", a.inflight_tokens) == (100.0, INDEX)
    decision = await router.pick(prompt(TEXT))
    assert decision.replica is b and decision.outcome == "cost_override", decision.detail
    assert tier.tree.decode.moved["capacity"] == 1


async def test_cached_blocks_the_index_counts_but_no_request_holds_are_free():
    """The same holder's cache full of blocks finished requests left (vLLM evicts them on demand) but with one
    short request in flight: the request stays with its cache."""
    router, tier, a, b = setting(stored_filler=75)
    a.local_inflight, a.local_inflight_tokens = 1, 200
    decision = await router.pick(prompt(TEXT))
    assert decision.replica is a and decision.outcome == "hit", decision.detail


def test_the_free_tokens_come_from_the_gauge_when_the_engine_exports_it():
    gauge = EngineLoad(0, 0, 0.0, block_size=16, kv_usage=0.5, num_blocks=CAPACITY)
    assert free_tokens(gauge, lambda name: 99, "a", 10_000) == (800.0, "gauge")
    unknown = EngineLoad(0, 0, 0.0, block_size=16)
    assert free_tokens(unknown, lambda name: 99, "a", 10_000) == (None, None)
    assert free_tokens(EngineLoad(0, 0, 0.0, block_size=16, num_blocks=CAPACITY), None, "a", 0) == (None, None)


async def test_the_scraper_keeps_the_capacity_of_an_engine_without_the_usage_gauge():
    from llmgw.router.load_scraper import scrape_once
    text = ('vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_waiting{engine="0"} 0\n'
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n')
    assert parse_load(text, VLLM_GAUGES, 1.0).num_blocks is None  # type: ignore[union-attr]  # as parsed

    class Pool:  # a replica's pool answering /metrics with ``text``
        host, port = "127.0.0.1", 1

        async def request(self, *args, **kwargs):
            class Answer:
                status = 200

                async def read(self):
                    return text.encode()
            return Answer()

    _, _, _, (a, _b) = make(names=("a", "b"))
    a.pool = Pool()  # type: ignore[assignment]
    load = await scrape_once(a, 1.0)
    assert load is not None and (load.num_blocks, load.block_size, load.kv_usage) == (CAPACITY, 16, None)
