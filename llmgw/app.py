"""The gateway process: one root nursery owning the data plane, the control app, health probes and the router.

:class:`Gateway` is built from a :class:`llmgw.config.Config`; :meth:`Gateway.run`
serves until cancelled or until :meth:`Gateway.shutdown` has drained it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import trio

from .config import Config
from .http.client import UpstreamPool
from .http.control import create_control_app, serve_control
from .http.dataplane import DataPlane, DataPlaneSettings
from .http.server import HttpServer, ServerLimits
from .metrics import Metrics
from .plugins_manager import Registry, check_config_plugins, default_registry
from .router.health import HealthSettings, HealthTracker, probe_forever
from .router.replica import Replica
from .router.router import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Addresses:
    data: tuple[str, int]
    control: tuple[str, int]

    @property
    def data_url(self) -> str:
        return f"http://{self.data[0]}:{self.data[1]}"

    @property
    def control_url(self) -> str:
        return f"http://{self.control[0]}:{self.control[1]}"


class Gateway:
    def __init__(self, config: Config, registry: Registry | None = None):
        self.config = config
        self.registry = registry or default_registry()
        check_config_plugins(config, self.registry)
        self.metrics = Metrics()
        self.router = Router(self.registry, self.metrics)
        h = config.health
        self.health = HealthTracker(HealthSettings(
            interval=h.interval, timeout=h.timeout, failures_to_down=h.failures_to_down,
            successes_to_up=h.successes_to_up, passive_failures_to_down=h.passive_failures_to_down, path=h.path,
        ), self.metrics)
        lim = config.limits
        self.dataplane = DataPlane(self.router, self.health, self.metrics, DataPlaneSettings(
            connect_timeout=lim.connect_timeout, first_byte_timeout=lim.first_byte_timeout,
            idle_timeout=lim.idle_timeout, retries=lim.retries,
        ), api_keys=[k.key for k in config.api_keys])
        self.data_server = HttpServer(self.dataplane.handle, ServerLimits(
            max_header_bytes=lim.max_header_bytes, max_body_bytes=lim.max_body_bytes,
            header_timeout=lim.client_header_timeout, body_timeout=lim.client_body_timeout,
            keepalive_timeout=lim.keepalive_timeout, max_connections=lim.max_connections,
        ))
        self.draining = False
        self._nursery: trio.Nursery | None = None
        self._probes: dict[Replica, trio.CancelScope] = {}
        self._control_shutdown = trio.Event()
        self.addresses: Addresses | None = None

    async def run(self, listen: tuple[str, int] | None = None, control_listen: tuple[str, int] | None = None, *,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        data_host, data_port = listen or (self.config.listen.host, self.config.listen.port)
        control_host, control_port = control_listen or (self.config.control_listen.host,
                                                        self.config.control_listen.port)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._configure_static_models()
            data = await nursery.start(self.data_server.serve, data_host, data_port)
            control = await nursery.start(functools.partial(serve_control, create_control_app(self), control_host,
                                                            control_port, shutdown=self._control_shutdown))
            self.addresses = Addresses(data, control)
            log.info("llmgw serving the OpenAI API on %s and the control API on %s",
                     self.addresses.data_url, self.addresses.control_url)
            task_status.started(self.addresses)

    def _configure_static_models(self) -> None:
        for model in self.config.models:
            self.router.configure_model(model.name, model.routing, model.routing_options, model)
            for index, spec in enumerate(model.replicas):
                name = spec.name or f"{model.name}-{index}"
                self.add_replica(Replica(name=name, model=model.name, url=spec.url, api_key=spec.api_key,
                                         weight=spec.weight))

    def add_replica(self, replica: Replica) -> None:
        """Put a replica into routing and start probing it."""
        assert self._nursery is not None, "the gateway is not running"
        replica.pool = UpstreamPool(replica.host, replica.port, connect_timeout=self.config.limits.connect_timeout)
        self.router.add_replica(replica)
        self.metrics.for_replica(replica.name).up.set(1 if replica.routable else 0)
        scope = trio.CancelScope()
        self._probes[replica] = scope
        self._nursery.start_soon(self._probe, replica, scope)

    async def remove_replica(self, replica: Replica) -> None:
        self.router.remove_replica(replica)
        scope = self._probes.pop(replica, None)
        if scope is not None:
            scope.cancel()
        self.health.forget(replica)
        self.metrics.forget_replica(replica.name)
        if replica.pool is not None:
            await replica.pool.aclose()

    async def _probe(self, replica: Replica, scope: trio.CancelScope) -> None:
        with scope:
            await probe_forever(replica, self.health)

    async def shutdown(self, grace: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish for up to ``grace`` seconds, then stop everything."""
        grace = self.config.limits.shutdown_grace if grace is None else grace
        self.draining = True
        log.info("draining: no new connections; waiting up to %gs for %d in-flight requests", grace,
                 self.data_server.active_requests)
        await self.data_server.drain(grace)
        self._control_shutdown.set()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
