"""A gateway's Redis calls keep nothing once warm, and its client keeps working after any number of them failed.

Every gateway calls Redis tens of times a second (load reports, the outbox, the lease), through
:meth:`RedisLink.call` and coredis's pool under anyio on Trio; a few bytes kept per call would be megabytes an
hour (docs/benchmarks/faults.md's soak once suspected 11 MiB/h there; it was cache entries that tracemalloc's freelist
bookkeeping blamed on anyio's ``fail_after``). This counts the traced heap across many calls against a real
``redis-server``, after a warm-up that fills the interpreter's freelists and the pool: calls that answer (``XADD``,
``GET``) and calls whose deadline fires while Redis is still busy with them (coredis keeps such a request queued
on its connection until the late answer, then lets it go).

coredis (6.9) loses a connection slot of its pool for each call cancelled while its connection is being made (the
TCP connect) and for each connection that dies while leased (a blocking read cut by its deadline, a Redis restart);
with all 64 gone every later call waits for a connection until its deadline, for good, and each such waiter stays in
the pool's list. :class:`RedisLink` opens a new client once half are lost; the second test cuts off as many blocking
reads (what a gateway's stream readers do, when Redis stalls) as the pool has slots, and asks for one more answer.
"""

from __future__ import annotations

import gc
import logging
import tracemalloc

import pytest
import trio

from llmgw.cluster.link import RedisLink, Unavailable
from llmgw.cluster.metrics import ClusterMetrics
from llmgw.config.loading import parse_config
from llmgw.testing.shared_state import state_section

WARM_UP = 200
ROUNDS = 800  # of three calls each: 2,400 calls
# the traced heap moves by up to about 35 KiB either way between two points (the allocator's and Trio's own
# bookkeeping, requests in flight); one retained float per call would be 77 KiB, one small dict's key table 280 KiB
KEPT_LIMIT = 64 * 1024
# Redis busy for 2 ms, far past the 0.2 ms deadline below: the call gives up, the answer comes later
BUSY = ("local t = redis.call('TIME'); local s = t[1] * 1e6 + t[2]; "
        "repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] - s > 2000; return 1")


async def test_redis_calls_keep_nothing_once_warm_whether_they_answer_or_time_out(nursery, redis_url,
                                                                                 cluster_name):
    settings = parse_config(state_section(redis_url, cluster_name)).state
    metrics = ClusterMetrics(None, "gateway", cluster_name, "memory")
    link = RedisLink(settings, metrics)
    await nursery.start(link.run)
    stream, key = f"{cluster_name}:memory:stream", f"{cluster_name}:memory:key"

    async def calls(count: int) -> int:
        timed_out = 0
        for _ in range(count):
            await link.add_to_stream("load_report", stream, {b"o": b"memory"}, 100)
            await link.call("lease_read", lambda client: client.get(key))
            try:
                await link.call("busy", lambda client: client.eval(BUSY, keys=[], args=[]), timeout=0.0002)
            except Unavailable:
                timed_out += 1
        return timed_out

    logging.disable(logging.WARNING)  # each timeout is a degraded/healthy transition, one log line each
    try:
        await calls(WARM_UP)
        tracemalloc.start()
        try:
            # measured between two points of a traced run: what the first leg freed that was allocated before
            # tracemalloc started is not counted, so the first leg's churn would look like growth
            timed_out = await calls(WARM_UP)
            gc.collect()
            before, _ = tracemalloc.get_traced_memory()
            timed_out += await calls(ROUNDS)
            gc.collect()
            after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        logging.disable(logging.NOTSET)
    assert timed_out > 0, "no call's deadline fired: the test did not exercise what it names"
    assert after - before < KEPT_LIMIT, f"{ROUNDS} rounds of calls ({timed_out} timed out) kept {after - before} bytes"



async def test_a_link_whose_blocking_reads_were_cut_off_keeps_reaching_redis(nursery, redis_url, cluster_name):
    settings = parse_config(state_section(redis_url, cluster_name)).state
    metrics = ClusterMetrics(None, "gateway", cluster_name, "slots")
    link = RedisLink(settings, metrics)
    await nursery.start(link.run)
    key, stream = f"{cluster_name}:slots", f"{cluster_name}:slots:stream"
    await link.call("lease_read", lambda client: client.set(key, b"here"))
    first = link._client
    assert first is not None
    capacity = first.connection_pool.max_connections
    logging.disable(logging.WARNING)
    try:
        for _ in range(capacity):  # each one's deadline fires while Redis holds the read: its connection is dropped
            with pytest.raises(Unavailable):
                await link.call("load_read", lambda client: client.xread({stream: b"$"}, block=0), timeout=0.05)
    finally:
        logging.disable(logging.NOTSET)

    with trio.fail_after(10):
        assert await link.call("lease_read", lambda client: client.get(key)) == b"here"
    assert link._client is not first
    assert 1 <= metrics.pool_recycles._value.get() <= 2  # one new client per half of the slots lost, not per call
