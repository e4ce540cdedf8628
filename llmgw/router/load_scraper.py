"""Scrape each replica's queue gauges from its ``/metrics`` on an interval, for load-aware tiers.

The gauges read are the replica's ``gauges``: its engine plugin's, vLLM's for
a static replica. vLLM exposes ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` (one sample per engine; summed), and its cache
configuration as labels of ``vllm:cache_config_info`` (the block size is kept,
for the ``kv_index`` tier); :mod:`llmgw.engines.probe` reads them. The same text's
prefill counters update the replica's engine-reported prefill rate
(:mod:`llmgw.router.engine_prefill`), the cost model's prior slope, and its
inter-token latency histogram the replica's ITL fit
(:mod:`llmgw.router.engine_itl`), the decode charge's slopes.
:func:`scrape_engine_load` runs as one task in the gateway's nursery and
scrapes the replicas of the models whose tier asks for it
(``engine_metrics_interval`` on the tier), and every model's at least as
often as ``Router.engine_metrics_demand`` says (overload control's room sets
it); each new load is told to ``Router.engine_load_listeners``. Every request has a deadline,
replicas are scraped concurrently, and a failed scrape leaves the last value
to age out (tiers ignore values older than their ``engine_metrics_max_age``).
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from typing import TYPE_CHECKING, Callable

import trio

from ..engines import probe
from ..engines.probe import EngineLoad
from . import engine_itl, engine_prefill
from .replica import Replica

if TYPE_CHECKING:
    from .router import EngineMetricsDemand, Router


async def scrape_once(replica: Replica, timeout: float, path: str = "/metrics",
                      clock: Callable[[], float] = time.monotonic) -> EngineLoad | None:
    """One ``GET /metrics`` through the replica's pool, within ``timeout``, read with the replica's gauges; None
    when it failed or has none of them. Its prefill counters go to ``replica.prefill_rate``, its inter-token
    latency to ``replica.engine_itl``."""
    if replica.pool is None:
        return None
    headers = [replica.auth_header] if replica.auth_header else []
    text = await probe.read_metrics(replica.pool, replica.base_path + path, timeout, headers)
    if text is None:
        return None
    at = clock()
    counters = engine_prefill.read_counters(text, at)
    if counters is not None:
        replica.prefill_rate.update(counters)
    load = probe.parse_load(text, replica.gauges, at)
    if load is not None and load.kv_usage is None and load.num_blocks is None:
        # no usage gauge: the capacity all the same, for the KV index's count of what is held (router.kv_capacity)
        load = dataclasses.replace(load, num_blocks=probe.parse_num_blocks(text, replica.gauges))
    replica.engine_itl.update(engine_itl.read_counters(text, load))
    return load


def schedule(tier: object, demand: EngineMetricsDemand | None) -> tuple[float | None, float]:
    """A model's scrape interval (None: not scraped) and timeout: its tier's, or the demand's when that is more
    often."""
    interval = getattr(tier, "engine_metrics_interval", None) or None
    timeout = getattr(tier, "engine_metrics_timeout", None)
    if demand is not None and (interval is None or demand.interval < interval):
        return demand.interval, timeout or demand.timeout
    if interval is None:
        return None, 0.0
    return interval, timeout or min(interval, 1.0)


async def scrape_engine_load(router: Router, clock: Callable[[], float] = time.monotonic,
                             idle_check: float = 1.0) -> None:
    """Until cancelled: scrape the routable replicas of every model whose tier asks for it (or all of them, when
    the router's ``engine_metrics_demand`` is set), each on its interval.

    A tier asks with an ``engine_metrics_interval`` attribute (seconds; None or
    absent: no scraping) and may set ``engine_metrics_timeout``. The router's
    models are re-read every round, so re-configured or reloaded models are
    followed; with no model asking, this wakes once every ``idle_check`` seconds.
    """
    last_started: weakref.WeakKeyDictionary[Replica, float] = weakref.WeakKeyDictionary()
    in_progress: weakref.WeakSet[Replica] = weakref.WeakSet()

    async def scrape(replica: Replica, timeout: float) -> None:
        try:
            load = await scrape_once(replica, timeout, clock=clock)
            if load is not None:
                replica.engine_load = load
                for listener in router.engine_load_listeners:
                    listener(replica)
        finally:
            in_progress.discard(replica)

    async with trio.open_nursery() as nursery:
        while True:
            now = clock()
            next_due = now + idle_check
            for route in list(router.models.values()):
                interval, timeout = schedule(route.tier, router.engine_metrics_demand)
                if interval is None:
                    continue
                for replica in list(route.replicas):
                    if not replica.routable:
                        continue
                    due = last_started.get(replica, -math.inf) + interval
                    if replica in in_progress:
                        due = max(due, now + interval)
                    elif due <= now:
                        last_started[replica] = now
                        in_progress.add(replica)
                        nursery.start_soon(scrape, replica, timeout)
                        due = now + interval
                    next_due = min(next_due, due)
            await trio.sleep(max(0.0, next_due - clock()))
