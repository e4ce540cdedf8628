"""A gateway's tenancy, built from its config: the limiter of its state backend, the usage sink, and the data
plane's :class:`~.tenant_gate.TenancyGate` over them and the key directory; their background tasks; a reload.

One limiter and one usage sink live as long as the process (what they hold, reservations in flight and usage
not yet flushed, must outlive a reload); a reload swaps the gate whole, with the config's new prices, settings and
models' context lengths, and hands the new settings to the limiter.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, Counter

from ..config import Config
from ..tenancy.directory import build_prices
from ..tenancy.interfaces import KeyDirectory, Tenancy
from ..tenancy.limiter_metrics import LimiterMetrics
from ..tenancy.local_limiter import LocalLimiter
from ..tenancy.pool_limiter import Spent
from ..tenancy.redis_limiter import RedisLimiter, cluster_limiter
from ..tenancy.usage_store import StoreUnavailable
from .tenant_gate import SETTLE_BASES, TenancyGate
from .usage_setup import build_usage

if TYPE_CHECKING:
    from ..cluster.state import SharedState

log = logging.getLogger(__name__)

SEED_SECONDS = 10.0  # the longest a start waits for the usage store's budget spend


def context_lengths(config: Config) -> dict[str, int]:
    """The ``max_model_len`` the config gives its static models, under each name a client may ask (a LoRA
    adapter's too)."""
    lengths: dict[str, int] = {}
    for model in config.models:
        if model.max_model_len is not None:
            lengths[model.name] = model.max_model_len
            for adapter in model.lora_adapters:
                lengths[adapter.name] = model.max_model_len
    return lengths


class GatewayTenancy:
    """What one gateway process runs of tenancy (``Gateway.tenancy``); ``gate`` is what its data plane reads."""

    def __init__(self, config: Config, directory: KeyDirectory, registry: CollectorRegistry,
                 shared: SharedState | None = None) -> None:
        settings = config.tenancy.settings()
        self.limiter_metrics = LimiterMetrics(registry)
        self.usage_service = build_usage(config, registry, shared)
        self.usage = self.usage_service.sink
        # One process alone: exact in memory. A cluster, or --workers: leased shares of every limit in Redis, its
        # budgets' counters raised to the usage store's sums at start and whenever Redis lost them.
        self.limiter: LocalLimiter | RedisLimiter = LocalLimiter(settings, metrics=self.limiter_metrics) \
            if shared is None else cluster_limiter(shared, settings, self.limiter_metrics, spent=self._spent)
        self._scope = trio.CancelScope()
        self._stopped = trio.Event()
        self.seeds_budgets = shared is None  # one process: its limiter's budgets start from the SQLite store's sums
        self.directory = directory
        settled = Counter("llmgw_tenant_settled", "Requests of known keys settled, by what they were charged: "
                          "usage (the engine's), sent (no usage came: the estimate's prompt and the tokens "
                          "relayed), nothing (no engine answered; the reservation went back).", ["basis"],
                          registry=registry)
        by_basis = {basis: settled.labels(basis).inc for basis in SETTLE_BASES}
        self._count_settled = lambda basis: by_basis[basis]()
        self.gate = self._gate(config)

    def _gate(self, config: Config) -> TenancyGate:
        tenancy = Tenancy(self.directory, self.limiter, self.usage, build_prices(config), config.tenancy.settings())
        return TenancyGate(tenancy, context_lengths(config), self._count_settled)

    def apply(self, config: Config) -> TenancyGate:
        """A reload's prices, settings and context lengths: the new gate (the caller hands it to the data plane)."""
        self.gate = self._gate(config)
        settings = self.gate.tenancy.settings
        self.limiter.settings = settings
        self.usage_service.interval = settings.usage_flush_interval
        return self.gate

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The limiter's and the usage sink's background tasks, in the gateway's nursery: the budgets' spend so
        far read from the usage store first (before the data plane admits anything)."""
        try:
            with self._scope:
                if isinstance(self.limiter, LocalLimiter) and self.seeds_budgets:
                    await self._seed(self.limiter)
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.usage_service.run)
                    if isinstance(self.limiter, RedisLimiter):
                        await nursery.start(self.limiter.run)
                    task_status.started()
        finally:
            self._stopped.set()

    async def stop(self, timeout: float = 5.0) -> None:
        """End the background tasks before the rest of the gateway (the Redis limiter gives its shares back over
        a link that is still up; the usage service flushes what it holds)."""
        self._scope.cancel()
        with trio.move_on_after(timeout):
            await self._stopped.wait()

    async def _spent(self) -> list[Spent]:
        """What every key and team spent in its budgets' current periods, from the usage store."""
        return await self.usage_service.budget_spent(self.limiter.settings)

    async def _seed(self, limiter: LocalLimiter) -> None:
        with trio.move_on_after(SEED_SECONDS):
            try:
                limiter.seed(await self.usage_service.budget_spent(limiter.settings))
            except StoreUnavailable as exc:
                log.error("tenancy: the budgets' spend so far could not be read from the usage store (%s): budgets "
                          "count from zero in this process", exc)
            return
        log.error("tenancy: the usage store did not answer within %gs: budgets count from zero in this process",
                  SEED_SECONDS)
