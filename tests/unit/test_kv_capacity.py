"""The capacity charge without vLLM's KV usage gauge: the KV index's stored blocks against the engine's capacity."""

from __future__ import annotations

from llmgw.engines.probe import VLLM_GAUGES, EngineLoad, parse_load
from llmgw.router.kv_capacity import free_tokens
from llmgw.router.replica import Replica

CAPACITY = 100  # blocks of 16 tokens: 1,600 tokens


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

    a = Replica(name="a", model="m", url="http://127.0.0.1:1")
    a.pool = Pool()  # type: ignore[assignment]
    load = await scrape_once(a, 1.0)
    assert load is not None and (load.num_blocks, load.block_size, load.kv_usage) == (CAPACITY, 16, None)
