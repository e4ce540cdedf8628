"""How to observe an engine over HTTP: its health, and its load and cache gauges on ``/metrics``.

One prober for everybody who looks at an engine: the agent's shard supervisor
(readiness, health, in-flight requests while draining), the router's health
prober and load scraper, and the data plane's "is the engine gone" check.
Every call goes through a connection pool the caller owns and has one deadline
for the whole exchange (connection, request, answer).

Which gauges to read is the engine plugin's word (:meth:`Engine.load_gauges
<llmgw.agent.engine.Engine.load_gauges>`): :class:`EngineGauges` names them.
``vllm`` and ``sim`` both expose vLLM's, :data:`VLLM_GAUGES`, which is also
what a replica no engine plugin describes (a static one) is read with.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import trio

from ..http.client import UpstreamError, UpstreamPool
from ..plugins_manager import PluginError, Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineGauges:
    """The names of an engine's ``/metrics`` series llmgw reads: each gauge is summed over all its samples
    (any labels: one per engine core), and ``cache_config``'s ``block_size_label`` is the KV block size."""

    running: tuple[str, ...] = ("vllm:num_requests_running",)
    waiting: tuple[str, ...] = ("vllm:num_requests_waiting",)
    cache_config: str = "vllm:cache_config_info"  # an info gauge ("" when the engine has none)
    block_size_label: str = "block_size"
    kv_usage: tuple[str, ...] = ("vllm:kv_cache_usage_perc",)  # KV blocks in use by requests, 0 to 1
    num_blocks_label: str = "num_gpu_blocks"  # the cache-config gauge's label with the KV capacity in blocks

    @property
    def inflight(self) -> tuple[str, ...]:
        """Gauges whose sum is the number of requests still in flight (none: the engine cannot tell)."""
        return self.running + self.waiting


VLLM_GAUGES = EngineGauges()
NO_GAUGES = EngineGauges(running=(), waiting=(), cache_config="", kv_usage=())


def engine_gauges(registry: Registry, engine: str) -> EngineGauges:
    """The gauges engine plugin ``engine`` names; vLLM's when no such plugin is installed."""
    try:
        factory = registry.get("engines", engine)
    except PluginError:
        return VLLM_GAUGES
    return factory().load_gauges()


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's own queue gauges (vLLM ``num_requests_running``/``num_requests_waiting``) at ``at``."""

    running: float
    waiting: float
    at: float  # time.monotonic() of the scrape (the clock tiers get in TierServices)
    block_size: int | None = None  # the cache_config gauge's block size label, when the engine exports it
    kv_usage: float | None = None  # the share of KV blocks running requests hold (vLLM kv_cache_usage_perc)
    num_blocks: int | None = None  # the KV cache's blocks (num_gpu_blocks x the engines that report a usage)

    @property
    def requests(self) -> float:
        return self.running + self.waiting

    @property
    def kv_free_tokens(self) -> float | None:
        """Tokens of KV cache no running request holds (cached-only blocks count as free, as vLLM's gauge says),
        None when the engine does not tell its usage and capacity."""
        if self.kv_usage is None or self.num_blocks is None or self.block_size is None:
            return None
        return (1.0 - self.kv_usage) * self.num_blocks * self.block_size


# -- reading Prometheus text ------------------------------------------------------------------------------------------


def parse_gauge_sum(text: str, names: Iterable[str]) -> float | None:
    """Sum of the samples of the metrics ``names`` in Prometheus text, or None when none has a sample.

    Uses ``str.find`` rather than a line-by-line parse: vLLM's exposition is
    large (histograms) and this runs on the event loop.
    """
    total, found = 0.0, False
    for name in names:
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


def parse_block_size(text: str, gauges: EngineGauges = VLLM_GAUGES) -> int | None:
    """The engine's KV block size from its cache-config gauge (vLLM: ``vllm:cache_config_info``), or None."""
    return _cache_config_count(text, gauges, gauges.block_size_label, 1 << 16)


def parse_num_blocks(text: str, gauges: EngineGauges = VLLM_GAUGES) -> int | None:
    """The engine's KV capacity in blocks from its cache-config gauge (vLLM's ``num_gpu_blocks``), or None."""
    return _cache_config_count(text, gauges, gauges.num_blocks_label, 1 << 40)


def _cache_config_count(text: str, gauges: EngineGauges, label: str, limit: int) -> int | None:
    if not gauges.cache_config or not label:
        return None
    value = parse_label(text, gauges.cache_config, label)
    return int(value) if value is not None and value.isdigit() and 0 < int(value) <= limit else None


def parse_kv_usage(text: str, gauges: EngineGauges = VLLM_GAUGES) -> tuple[float, int] | None:
    """The share of KV blocks running requests hold (vLLM's ``kv_cache_usage_perc``, 0 to 1; the mean over the
    engines of a data-parallel replica) and how many engines said it, or None."""
    total = parse_gauge_sum(text, gauges.kv_usage)
    if total is None:
        return None
    engines = sum(text.count("\n" + name + "{") + text.startswith(name + "{") for name in gauges.kv_usage) or 1
    usage = total / engines
    return (min(max(usage, 0.0), 1.0), engines) if math.isfinite(usage) else None


def parse_load(text: str, gauges: EngineGauges, at: float) -> EngineLoad | None:
    """The engine's queue gauges and block size read from ``/metrics`` text; None when it has neither gauge."""
    running, waiting = parse_gauge_sum(text, gauges.running), parse_gauge_sum(text, gauges.waiting)
    if running is None and waiting is None:
        return None
    usage, blocks = parse_kv_usage(text, gauges), parse_num_blocks(text, gauges)
    if usage is None:
        return EngineLoad(running or 0.0, waiting or 0.0, at, parse_block_size(text, gauges))
    return EngineLoad(running or 0.0, waiting or 0.0, at, parse_block_size(text, gauges), usage[0],
                      None if blocks is None else blocks * usage[1])  # every engine of the replica has its own


# -- asking the engine ------------------------------------------------------------------------------------------------


async def get(pool: UpstreamPool, path: str, timeout: float, headers: Sequence[tuple[bytes, bytes]] = ()
              ) -> tuple[int, bytes]:
    """``GET path`` and its whole answer within ``timeout``: (status, body). Raises :class:`UpstreamError` or
    :class:`trio.TooSlowError`."""
    with trio.fail_after(timeout):
        response = await pool.request("GET", path, list(headers), b"", first_byte_timeout=timeout,
                                      idle_timeout=timeout)
        return response.status, await response.read()


@dataclass(frozen=True, slots=True)
class Health:
    """One health probe: ``ok`` is a 200; ``reason`` says why not ("" when ok); ``definite`` failures (refused,
    reset, 5xx) say the server is broken, while a timeout may only mean it is busy; ``answered`` is any HTTP
    answer at all; ``inconclusive``: the probe could not even be sent (this process is out of descriptors), so
    it says nothing about the server and counts neither way."""

    ok: bool
    reason: str = ""
    definite: bool = False
    answered: bool = True
    inconclusive: bool = False


async def check_health(pool: UpstreamPool, path: str, timeout: float,
                       headers: Sequence[tuple[bytes, bytes]] = ()) -> Health:
    """``GET path`` (the engine's ``/health``) within ``timeout``: healthy when it answers 200."""
    try:
        status, _ = await get(pool, path, timeout, headers)
    except trio.TooSlowError:
        return Health(False, f"no answer within {timeout:g}s", definite=False, answered=False)
    except UpstreamError as exc:
        if exc.kind == "capacity":
            return Health(False, str(exc), answered=False, inconclusive=True)
        return Health(False, str(exc), definite=exc.kind != "timeout", answered=False)
    if status != 200:
        return Health(False, f"HTTP {status}", definite=status >= 500)
    return Health(True)


async def read_metrics(pool: UpstreamPool, path: str, timeout: float,
                       headers: Sequence[tuple[bytes, bytes]] = ()) -> str | None:
    """The engine's ``/metrics`` text, or None when it did not answer 200 within ``timeout``."""
    try:
        status, body = await get(pool, path, timeout, headers)
    except (UpstreamError, trio.TooSlowError) as exc:
        log.debug("reading %s of %s:%s failed: %s", path, pool.host, pool.port, exc or "timeout")
        return None
    if status != 200:
        return None
    return body.decode("utf-8", errors="replace")
