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
from prometheus_client import CollectorRegistry

from ..config import Config
from ..tenancy.directory import build_prices
from ..tenancy.interfaces import KeyDirectory, Limiter, Tenancy
from ..tenancy.limiter_metrics import LimiterMetrics
from ..tenancy.local_limiter import LocalLimiter
from ..tenancy.usage import UsageAggregator
from .tenant_gate import TenancyGate

if TYPE_CHECKING:
    from ..cluster.state import SharedState

log = logging.getLogger(__name__)


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
        self.limiter: Limiter = LocalLimiter(settings, metrics=self.limiter_metrics)
        self.usage = UsageAggregator()
        self.directory = directory
        self.gate = self._gate(config)

    def _gate(self, config: Config) -> TenancyGate:
        tenancy = Tenancy(self.directory, self.limiter, self.usage, build_prices(config), config.tenancy.settings())
        return TenancyGate(tenancy, context_lengths(config))

    def apply(self, config: Config) -> TenancyGate:
        """A reload's prices, settings and context lengths: the new gate (the caller hands it to the data plane)."""
        self.gate = self._gate(config)
        settings = self.gate.tenancy.settings
        if isinstance(self.limiter, LocalLimiter):
            self.limiter.settings = settings
        return self.gate

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The limiter's and the usage sink's background tasks, in the gateway's nursery."""
        task_status.started()
        await trio.sleep_forever()
