"""The Redis usage store against a real redis-server: a batch counts once, what a stranger wrote is skipped or
clamped, hashes expire."""

from __future__ import annotations

from llmgw.cluster.link import RedisLink
from llmgw.cluster.metrics import ClusterMetrics
from llmgw.cluster.records import Keys
from llmgw.config import parse_config
from llmgw.tenancy.usage import FIELDS, UsageRow
from llmgw.tenancy.usage_redis import RedisUsageStore, row_field
from llmgw.tenancy.usage_store import Batch
from llmgw.testing.shared_state import state_section

HOUR = 1_796_000_400


async def store_of(nursery, redis_url: str, cluster: str) -> RedisUsageStore:
    settings = parse_config(state_section(redis_url, cluster)).state
    link = RedisLink(settings, ClusterMetrics(None, "control", cluster, "usage"))
    await nursery.start(link.run)
    return RedisUsageStore(link, Keys(cluster), clock=lambda: HOUR + 10)


async def test_a_batch_counts_once_and_what_is_not_ours_is_skipped_or_clamped(nursery, redis_url, cluster_name):
    store = await store_of(nursery, redis_url, cluster_name)
    row = UsageRow("k-1", 'a "quoted"|name', "t", "tiny", HOUR)
    counts = [index + 1 for index in range(len(FIELDS))]
    assert await store.apply(Batch("seg-1", 100, {row: counts}))
    assert not await store.apply(Batch("seg-1", 100, {row: counts}))  # its answer was lost: sent again
    assert not await store.apply(Batch("seg-1", 50, {row: counts}))
    assert await store.shipped("seg-1") == 100
    assert await store.shipped("seg-2") is None
    assert await store.rows(HOUR, HOUR + 3600) == [(row, counts)]

    key = store.hour_key(HOUR)
    assert 0 < await store.link.call("test", lambda client: client.ttl(key)) <= store.retention
    other = UsageRow("k-2", "b", "", "tiny", HOUR)
    strangers = {"not ours": "1", "[1,2]|requests": "5", row_field(other, "bogus"): "1",
                 row_field(other, "requests"): "-5", row_field(other, "input_tokens"): "9" * 30,
                 row_field(other, "output_tokens"): "many"}
    await store.link.call("test", lambda client: client.hset(key, strangers))
    found = dict(await store.rows(HOUR, HOUR + 3600))
    assert found[row] == counts
    assert found[other][FIELDS.index("requests")] == 0
    assert found[other][FIELDS.index("input_tokens")] == 2**63 - 1
    assert found[other][FIELDS.index("output_tokens")] == 0
    assert len(found) == 2


async def test_hours_before_the_retention_are_not_read(nursery, redis_url, cluster_name):
    store = await store_of(nursery, redis_url, cluster_name)
    old = UsageRow("k-1", "a", "", "tiny", HOUR - store.retention - 3600)
    await store.apply(Batch("seg", 1, {old: [1] * len(FIELDS)}))
    assert await store.rows(0, HOUR + 3600) == []
