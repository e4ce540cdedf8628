"""Scrape each replica's queue gauges from its ``/metrics`` on an interval, for load-aware tiers.

vLLM exposes ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``
(one sample per engine; summed here), and its cache configuration as labels of
``vllm:cache_config_info`` (the block size is kept, for the ``kv_index`` tier). :func:`scrape_engine_load` runs as one
task in the gateway's nursery and scrapes the replicas of the models whose
tier asks for it (``engine_metrics_interval`` on the tier); every request has
a deadline, replicas are scraped concurrently, and a failed scrape leaves the
last value to age out (tiers ignore values older than their
``engine_metrics_max_age``).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from typing import TYPE_CHECKING, Callable

import trio

from ..http.client import UpstreamError
from .replica import EngineLoad, Replica

if TYPE_CHECKING:
    from .router import Router

log = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
CACHE_CONFIG = "vllm:cache_config_info"


def parse_gauge_sum(text: str, name: str) -> float | None:
    """Sum of the samples of metric ``name`` in Prometheus text, or None when it has none.

    Uses ``str.find`` rather than a line-by-line parse: vLLM's exposition is
    large (histograms) and this runs on the event loop.
    """
    total, found = 0.0, False
    start = 0
    while (at := text.find(name, start)) != -1:
        start = at + len(name)
        if at and text[at - 1] != "\n":
            continue  # inside a comment or another metric's name
        following = text[start:start + 1]
        if following not in ("{", " "):
            continue  # a longer name with this prefix
        line_end = text.find("\n", start)
        line = text[start:line_end if line_end != -1 else len(text)]
        value = line.rsplit("}", 1)[-1].split()
        try:
            total += float(value[0])
            found = True
        except (IndexError, ValueError):
            continue
    return total if found else None


def parse_label(text: str, name: str, label: str, limit: int = 64) -> str | None:
    """The value of ``label`` on the first sample of metric ``name`` (e.g. an ``_info`` gauge), or None."""
    start = 0
    while (at := text.find(name + "{", start)) != -1:
        start = at + len(name) + 1
        if at and text[at - 1] != "\n":
            continue
        end = text.find("}", start)
        labels = text[start:end if end != -1 else len(text)]
        key = f'{label}="'
        found = labels.find(key)
        if found == -1 or (found and labels[found - 1] not in ", "):
            return None
        value_start = found + len(key)
        value_end = labels.find('"', value_start)
        return labels[value_start:value_end][:limit] if value_end != -1 else None
    return None


def parse_block_size(text: str) -> int | None:
    """The engine's KV block size from ``vllm:cache_config_info``, or None."""
    value = parse_label(text, CACHE_CONFIG, "block_size")
    return int(value) if value is not None and value.isdigit() and 0 < int(value) <= 1 << 16 else None


async def scrape_once(replica: Replica, timeout: float, path: str = "/metrics",
                      clock: Callable[[], float] = time.monotonic) -> EngineLoad | None:
    """One ``GET /metrics`` through the replica's pool, within ``timeout``; None when it failed."""
    if replica.pool is None:
        return None
    headers = [replica.auth_header] if replica.auth_header else []
    try:
        with trio.fail_after(timeout):
            response = await replica.pool.request("GET", replica.base_path + path, headers, b"",
                                                  first_byte_timeout=timeout, idle_timeout=timeout)
            body = await response.read()
    except (UpstreamError, trio.TooSlowError) as exc:
        log.debug("scraping %s of %s failed: %s", path, replica.name, exc)
        return None
    if response.status != 200:
        return None
    text = body.decode("utf-8", errors="replace")
    running, waiting = parse_gauge_sum(text, RUNNING), parse_gauge_sum(text, WAITING)
    if running is None and waiting is None:
        return None
    return EngineLoad(running or 0.0, waiting or 0.0, clock(), parse_block_size(text))


async def scrape_engine_load(router: Router, clock: Callable[[], float] = time.monotonic,
                             idle_check: float = 1.0) -> None:
    """Until cancelled: scrape the routable replicas of every model whose tier asks for it, each on its interval.

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
        finally:
            in_progress.discard(replica)

    async with trio.open_nursery() as nursery:
        while True:
            now = clock()
            next_due = now + idle_check
            for route in list(router.models.values()):
                interval = getattr(route.tier, "engine_metrics_interval", None)
                if not interval:
                    continue
                timeout = getattr(route.tier, "engine_metrics_timeout", None) or min(interval, 1.0)
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
