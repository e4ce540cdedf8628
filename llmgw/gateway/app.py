"""The gateway process: the composition of its parts, in one root nursery.

The parts: the :class:`~llmgw.router.replicas.ReplicaSet` (every replica, with its
pool and health prober) fed by two sources, the config's static models
(:class:`~llmgw.control.static.StaticReplicas`) and the control plane's deployed
replicas (:class:`~llmgw.control.plane.ControlPlane`); the router and the KV
index reading it; the data plane, the control app and, when configured, the
embedded agent.

:class:`Gateway` is built from a :class:`llmgw.config.Config`; :meth:`Gateway.run`
serves until cancelled or until :meth:`Gateway.shutdown` has drained it;
:meth:`Gateway.reload` re-reads the config file (SIGHUP, ``POST /admin/reload``).
"""

from __future__ import annotations

import functools
import logging
import ssl
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import trio

from ..cluster.link import client_options, cluster_secret, previous_cluster_secret, sentinel_options
from ..cluster.state import CONTROL, SharedState
from ..cluster.term_sources import TermKv, TermTable
from ..config import Config, ConfigError
from ..config.fields import Located, issue_at
from ..config.loading import is_blank, read_config_text
from ..config.schema import REDIS_NEEDS_SECRET
from ..control.interfaces import KvWriter, ReplicaTable
from ..control.plane import ControlPlane
from ..control.static import StaticReplicas
from ..fdlimit import connection_budget, current_soft_limit
from ..http.connslots import ConnectionMetrics
from ..http.control_server import ControlServer, ControlServerMetrics
from ..http.jsonbody import JsonLimits
from ..http.server import HttpServer, ServerLimits
from ..kv.index import IndexState, KvIndex
from ..listening import host_port, listening_on
from ..metrics import Metrics
from ..plugins_manager import Registry, check_config_plugins, default_registry, load_checked_config
from ..router.health import HealthSettings, HealthTracker
from ..router.load_scraper import scrape_engine_load
from ..router.replicas import ReplicaSet
from ..router.router import Router
from ..tenancy.directory import build_directory, config_entries
from ..tls import describe_tls_error
from .admin import create_control_app
from .admin_guard import exposure_problem
from .admin_tenants import build_key_admin
from .autoscale_setup import GatewayAutoscale, ScalerOf, SettingsOf, configured_settings, target_scaler
from .capacity_history import CapacityHistory, gateway_counts
from .dataplane import DataPlane, DataPlaneSettings
from .explain_shared import SharedOutcomes
from .flow_setup import GatewayFlow
from .health_report import HealthReport
from .readiness import Readiness
from .reload_guard import Refusal, ReloadMetrics, ReloadOutcome, refusal, restart_required, summarize
from .tenancy_setup import GatewayTenancy

if TYPE_CHECKING:
    from ..agent.agent import Agent
    from ..cluster.term import LeaderTerm

log = logging.getLogger(__name__)
SETTLE_SECONDS = 2.0  # the least a control process waits after its start before it publishes the shared state
KV_SETTLE_SECONDS = 10.0  # the most it waits for its KV feeds' first copies


def dataplane_settings(config: Config) -> DataPlaneSettings:
    """The data plane's settings in ``config`` (applied at start and by every reload)."""
    lim = config.limits
    return DataPlaneSettings(
        connect_timeout=lim.connect_timeout, first_byte_timeout=lim.first_byte_timeout,
        idle_timeout=lim.idle_timeout, retries=lim.retries, access_log=config.access_log,
        json_limits=JsonLimits(lim.max_json_depth, lim.max_json_values, lim.max_json_containers))


@dataclass(frozen=True)
class Addresses:
    data: tuple[str, int]
    control: tuple[str, int]
    data_scheme: str = "http"
    control_scheme: str = "http"

    @property
    def data_url(self) -> str:
        return f"{self.data_scheme}://{self.data[0]}:{self.data[1]}"

    @property
    def control_url(self) -> str:
        return f"{self.control_scheme}://{self.control[0]}:{self.control[1]}"


class Gateway:
    def __init__(self, config: Config, registry: Registry | None = None, *, embedded_discovery: str = "auto",
                 stop_engines_on_exit: bool = False, role: str = CONTROL,
                 adjust_config: Callable[[Config], Config] | None = None, scaler: ScalerOf = target_scaler,
                 autoscale_settings: SettingsOf = configured_settings):
        """``stop_engines_on_exit``: the embedded agent's engines stop with the gateway (the demo); by default
        they outlive it, to be adopted by the next start. ``role``: ``control`` runs the control plane (and, with
        a shared state backend, writes the cluster's state); ``gateway`` only follows a cluster's shared state
        (docs/scaling.md). ``adjust_config``: applied to the config each :meth:`reload` reads, as it was to
        ``config`` (a worker of ``llmgw serve --workers`` puts its supervisor's private Redis in ``state``).
        ``scaler(config)``: the autoscaler's decision core, new for each control plane this process runs, and
        ``autoscale_settings(deployment)`` each deployment's bounds and targets (None: its fixed ``replicas``);
        by default llmgw's, from the config (tests hand in their own)."""
        self.config = config
        self.started_config = config  # what a restart would change from: reload_guard.restart_required
        self.adjust_config = adjust_config
        self.embedded_discovery = embedded_discovery
        self.stop_engines_on_exit = stop_engines_on_exit
        self._own_agent: Agent | None = None  # the embedded agent of a process without a shared state
        self.registry = registry or default_registry()
        check_config_plugins(config, self.registry)
        self.metrics = Metrics()
        h = config.health
        self.health = HealthTracker(HealthSettings(
            interval=h.interval, timeout=h.timeout, failures_to_down=h.failures_to_down,
            successes_to_up=h.successes_to_up, passive_failures_to_down=h.passive_failures_to_down, path=h.path,
        ), self.metrics)
        lim = config.limits
        self.replicas = ReplicaSet(self.health, self.metrics, lim.connect_timeout)
        self.kv_index = KvIndex(clock=time.monotonic)
        self.router = Router(self.registry, self.metrics, self.replicas, self.kv_index)
        self.directory = build_directory(config)  # the config's keys; the key store adds its own
        self.dataplane = DataPlane(self.router, self.health, self.metrics, dataplane_settings(config),
                                   directory=self.directory)
        self.connection_budget = connection_budget(current_soft_limit(), lim.max_connections,
                                                   lim.control_max_connections)
        self.connection_metrics = ConnectionMetrics(self.metrics.registry)
        self.data_server = HttpServer(self.dataplane.handle, self._server_limits(self.connection_budget.data),
                                      error_headers=self.dataplane.error_headers,
                                      on_refused=self.dataplane.refused,
                                      tls=config.data_tls.context() if config.data_tls else None,
                                      on_tls_failure=self.metrics.tls_handshake_failures.labels("data").inc,
                                      connection_metrics=self.connection_metrics)
        self.draining = False
        self._nursery: trio.Nursery | None = None
        self._control_shutdown = trio.Event()
        self._control_host = config.control_listen.host  # the one served (run's control_listen may override it)
        self.control_metrics = ControlServerMetrics(self.metrics.registry)
        self.addresses: Addresses | None = None
        self.role = role
        self.shared: SharedState | None = None
        if config.state.shared:
            self._check_state_settings(config)
            self.shared = SharedState(config, role, self.replicas, self.kv_index, self.registry,
                                      self.metrics.registry)
            self.router.learning = self.shared.tier_learning  # before any model is declared
        elif role != CONTROL:
            raise ConfigError([issue_at(config.state, "backend", "--role gateway follows a cluster's shared state: "
                                        "it needs backend: redis")])
        # Overload control: the room (every model's engines scraped, their capacity learnt, shared with the cluster:
        # with a shared state, a cluster's or --workers', it counts every process's requests) and the queue.
        self.flow = GatewayFlow(config, self.router, self.metrics.registry,
                                self.shared.load if self.shared is not None else None,
                                SharedOutcomes(self.shared.link, self.shared.keys, self.shared.signer,
                                               self.shared.origin, self.metrics.registry)
                                if self.shared is not None else None)
        self.room = self.flow.room
        self.autoscale = GatewayAutoscale(config, self.router, self.flow,
                                          self.shared.load if self.shared is not None else None,
                                          self.metrics.registry, scaler, autoscale_settings)
        # With a shared state, a control process is a candidate: its control plane runs (built anew) in each term
        # it leads the cluster (_lead), and is reached through that term; without one, for the process's life.
        self.static: StaticReplicas | None = None
        self._own_control: ControlPlane | None = None
        self._listening: list[tuple[str, int]] = []
        self.term_kv: TermKv | None = None
        if role == CONTROL and self.shared is None:
            self.static = StaticReplicas(self.replicas, self.kv_index, self.registry, self.metrics.registry)
            self._own_control = self._build_control(self.replicas, self.kv_index)
        elif self.shared is not None:  # a candidate, whose config's replicas are followed always, or a gateway
            self.term_kv = TermKv(self.kv_index, self.shared)
            # Until its first copy of the cluster's state, it routes its config's replicas (fail-static).
            self.static = StaticReplicas(TermTable(self.replicas, self.shared, self.shared.followed,
                                                   self.shared.follower.loaded.is_set),
                                         self.term_kv, self.registry, self.metrics.registry,
                                         follow_kv=role == CONTROL)
        if self.shared is not None:
            self.dataplane.wait_for_replica = self._wait_for_replica
            self.dataplane.wait_for_models = self.shared.wait_for_models
        else:
            assert self.control is not None
            self.dataplane.wait_for_replica = self.control.wait_for_replica
        self.tenancy = GatewayTenancy(config, self.directory, self.metrics.registry, self.shared)
        self.dataplane.tenancy = self.tenancy.gate
        self.dataplane.flow = self.flow.gate
        self.dataplane.holds = self.autoscale.holds
        self._reload_lock = trio.Lock()
        self._reload_metrics = ReloadMetrics(self.metrics.registry)
        self.health_report = HealthReport(self.shared, self.metrics.registry)
        # A worker of --workers on its supervisor's private Redis keeps keys where a lone serve does (SQLite in the
        # state dir, one file for every worker): the private Redis keeps nothing across a restart.
        self.key_admin = build_key_admin(config, self.shared if adjust_config is None else None, self.directory,
                                         self.metrics.registry)
        self.readiness = self.dataplane.readiness = Readiness(self.router, lambda: self.draining,
                                                              self._state_loaded, self.health_report.sentences)
        self.readiness.holds = self.autoscale.holds
        self.capacity = CapacityHistory(lambda: gateway_counts(self, self.autoscale.models))

    @property
    def control(self) -> ControlPlane | None:
        """The control plane: this process's own without a shared state; with one, the one of the term this
        process leads (None while it follows, and from the moment its term is over)."""
        if self.shared is None:
            return self._own_control
        term = self.shared.term
        return term.control if term is not None else None

    @property
    def embedded_agent(self) -> "Agent | None":
        """The in-process agent, while it runs (with a shared state: in the term this process leads)."""
        if self.shared is None:
            return self._own_agent
        term = self.shared.term
        return term.embedded_agent if term is not None else None

    def _build_control(self, table: ReplicaTable, kv: KvWriter) -> ControlPlane:
        key = self.shared.placement_key if self.shared is not None else None
        previous = self.shared.previous_placement_key if self.shared is not None else None
        control = ControlPlane(table, kv, self.registry, self.metrics.registry, self.config, placement_key=key,
                               previous_placement_key=previous)
        self.autoscale.attach(control)
        return control

    async def _wait_for_replica(self, model: str) -> bool:
        """With a shared state: the control plane's adoption window while leading, else the first snapshot."""
        assert self.shared is not None
        if self.control is not None:
            return await self.control.wait_for_replica(model)
        return await self.shared.wait_for_replica(model)

    def agent_control(self) -> ControlPlane | None:
        """The control plane that may take an agent's session now: none on a follower, and none from the moment
        this process's term is over (before its control plane has even unwound), so a new ``/agent`` upgrade is
        answered ``503 not_leader`` rather than accepted by a control plane that cannot serve it."""
        control = self.control
        return control if control is not None and control.agents.running else None

    def _state_loaded(self) -> bool:
        """Whether this process knows the cluster's models: always, but for a follower of a cluster before its
        first copy of the shared state (:attr:`SharedState.has_state`)."""
        return self.shared is None or self.shared.has_state

    async def _lead(self, term: "LeaderTerm") -> None:
        """One term as the cluster's leader (:mod:`llmgw.cluster.term`): the control plane (and through it every
        agent session it admits), the config's replicas and the embedded agent, all in the term's nursery, so
        they end with it."""
        shared = self.shared
        assert shared is not None and self.static is not None and self.term_kv is not None
        try:
            control = self._build_control(term.table, term.kv)
        except Exception:  # e.g. an unreadable identity store: this process cannot lead, but it still routes
            log.exception("cluster leader: the control plane cannot start here; the term ends")
            return
        await shared.identities.load_into(control.identities)  # before any agent is served
        term.start_soon(shared.identities.write_from, control.identities, term.writer.fence)
        # The replicas followed until now stay in routing, held, until the sources below claim them.
        term.kv.remote_listeners.append(self.term_kv.remote_resync)
        self.static.rejoin(self.config)
        self.term_kv.resync_all(self.static.kv_fed(), "a new term starts: publish the engine's truth")
        term.control = control
        await term.start(control.run)
        if self._listening:
            control.reports.listening(self._listening)
        if self.config.agents.embedded:
            await term.start(self._run_embedded_agent, control, term)
        await trio.sleep_forever()

    async def run(self, listen: tuple[str, int] | None = None, control_listen: tuple[str, int] | None = None, *,
                  reuse_port: bool = False, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled or shut down; ``reuse_port``: the data listener shares its address with other
        processes (``SO_REUSEPORT``: the workers of ``llmgw serve --workers``)."""
        data_host, data_port = listen or (self.config.listen.host, self.config.listen.port)
        control_host, control_port = control_listen or (self.config.control_listen.host,
                                                        self.config.control_listen.port)
        self._control_host = control_host
        problem = exposure_problem(control_host, self.config)
        if problem:
            raise ConfigError([issue_at(self.config, "control_listen", problem)])
        control_server = ControlServer(functools.partial(create_control_app, self, self.control_metrics),
                                       self.control_metrics, ssl_context=self._control_tls_context(),
                                       limits=self._server_limits(self.connection_budget.control),
                                       connection_metrics=self.connection_metrics)
        control_server.config.websocket_max_message_size = self.config.agents.max_message_bytes
        budget = self.connection_budget
        (log.warning if budget.too_low else log.info)("%s%s", budget.describe(), " (too few open files: raise the "
                                                      "hard limit, docs/security.md#sockets)" if budget.too_low
                                                      else "")
        self._started_at = trio.current_time()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.replicas.run)
            if self.shared is not None:
                await nursery.start(self.shared.run, self._lead if self.role == CONTROL else None, self._settled)
                await nursery.start(self.health_report.watch)
            await nursery.start(self.tenancy.run)  # after the shared state: the Redis limiter runs on its link
            await nursery.start(self.flow.run)  # the queue, before the first request
            if self.static is not None:
                await nursery.start(self.static.run)
                self.static.apply(self.config)
            if self.control is not None:
                await nursery.start(self.control.run)
            await nursery.start(self.key_admin.follow)  # the stored API keys, before the first request
            nursery.start_soon(scrape_engine_load, self.router)  # for tiers' engine_metrics_interval and the room
            nursery.start_soon(self.kv_index.maintain)  # resync retries, reset windows, predictions' expiry
            nursery.start_soon(self.capacity.run)  # the status page's replicas over time
            with listening_on(host_port(data_host, data_port)):
                data = await nursery.start(functools.partial(self.data_server.serve, data_host, data_port,
                                                             reuse_port=reuse_port))
            with listening_on(host_port(control_host, control_port)):
                control = await nursery.start(functools.partial(control_server.serve, control_host, control_port,
                                                                shutdown=self._control_shutdown))
            self._listening = [data, control]
            if self.control is not None:
                self.control.reports.listening(self._listening)  # a node's endpoint there would loop
            self.addresses = Addresses(data, control, "https" if self.config.data_tls else "http",
                                       "https" if self.config.control_tls else "http")
            if self.shared is not None:
                self.shared.listening(self.addresses.control_url)
            if self.config.agents.embedded and self._own_control is not None:
                await nursery.start(self._run_embedded_agent, self._own_control, None)
            elif self.config.agents.embedded and self.role != CONTROL:
                log.info("--role gateway: the config's embedded agent runs in the control-plane process only")
            log.debug("llmgw serving the OpenAI API on %s and the control API on %s",
                     self.addresses.data_url, self.addresses.control_url)
            task_status.started(self.addresses)

    def _server_limits(self, max_connections: int) -> ServerLimits:
        """The client limits of ``config.limits`` for one port (both ports take the same, but for the cap)."""
        lim = self.config.limits
        return ServerLimits(max_header_bytes=lim.max_header_bytes, max_body_bytes=lim.max_body_bytes,
                            header_timeout=lim.client_header_timeout, body_timeout=lim.client_body_timeout,
                            keepalive_timeout=lim.keepalive_timeout, max_connections=max_connections)

    def _settled(self) -> bool:
        """What this leader knows is worth publishing (followers keep their last view until then): its term's
        adoption window is over, and the replicas whose KV events it follows have sent their first copy (or
        ``KV_SETTLE_SECONDS`` passed), so a restart never shows the cluster an empty index."""
        term = self.shared.term if self.shared is not None else None
        control = term.control if term is not None else None
        if term is None or control is None or self.static is None:
            return False  # the term's control plane is not up yet
        now = trio.current_time()
        started = max(self._started_at, term.started_at)
        if now < max(control.reconciler.place_after, started + SETTLE_SECONDS):
            return False
        fed = [*self.static.kv_fed(), *control.kv_fed()]
        return now >= started + KV_SETTLE_SECONDS or all(
            self.kv_index.state(name) is not IndexState.NO_EVENTS for name in fed)

    @staticmethod
    def _check_state_settings(config: Config) -> None:
        """The Redis password's variable is set and the TLS files can be used: found at start, not as an outage."""
        sentinel = config.state.sentinel
        checks: list[tuple[Located, str, Callable[..., object]]] = [(config.state, "password_env", client_options),
                                                                   (config.state, "previous_secret_env",
                                                                    previous_cluster_secret)]
        if sentinel is not None:
            checks.append((sentinel, "password_env", sentinel_options))
        for where, key, check in checks:
            try:
                check(config.state)
            except ValueError as exc:
                raise ConfigError([issue_at(where, key, str(exc))]) from None
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError([issue_at(config.state, "tls",
                                            f"cannot be used: {describe_tls_error(exc)}")]) from None
        try:
            if cluster_secret(config.state) is None:
                raise ValueError(REDIS_NEEDS_SECRET)
        except ValueError as exc:
            raise ConfigError([issue_at(config.state, "secret_env", str(exc))]) from None

    def _control_tls_context(self):
        """The control listener's server context (``control_tls``), or None for plain HTTP."""
        tls = self.config.control_tls
        if tls is None:
            return None
        try:
            return tls.context()
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError([issue_at(tls, "cert_file", f"cannot be used: {describe_tls_error(exc)}")]) from None

    async def _run_embedded_agent(self, control: ControlPlane, term: "LeaderTerm | None", *,
                                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """This machine's agent, in-process (the same Agent and session code as a remote one), joined to
        ``control``: the process's own, or ``term``'s."""
        from ..agent.agent import Agent
        from ..wire.channel import InProcessConnector

        agents = self.config.agents
        node_id = agents.embedded_node_id
        connector = InProcessConnector(control.accept_in_process, f"embedded agent {node_id}")
        agent = Agent(connector, node_id=node_id, discovery=self.embedded_discovery, state_dir=agents.state_dir,
                      address="127.0.0.1", registry=self.registry, metrics_registry=self.metrics.registry,
                      engine_ports=agents.engine_ports,
                      announce=lambda line: log.debug("%s", line))  # the control side logs it
        if term is not None:
            term.embedded_agent = agent
        else:
            self._own_agent = agent
        await agent.run(task_status=task_status)

    async def reload(self, *, allow_empty: bool = False) -> ReloadOutcome:
        """Re-read the config file and apply all of it, or nothing (the outcome says which, and why).

        API keys, the data plane's timeouts and retries, ``access_log``, profiles, deployments, static models,
        admin tokens and agent settings (token, heartbeats) apply at once; the settings of
        :data:`.reload_guard.RESTART_KEYS` (listeners, the server's limits, health probing...) wait for a restart,
        and the outcome's ``restart_required`` names them, on this reload and every later one until a restart.
        The file is read once and those bytes parsed (write it with an atomic rename). Refused
        (:mod:`.reload_guard`): an invalid config; unless ``allow_empty``, a file with no YAML document or one
        removing every model and deployment; always, one that empties ``admin_tokens`` or leaves a non-loopback
        control port without tokens.
        """
        async with self._reload_lock:
            outcome = await self._reload(allow_empty)
            self._reload_metrics.count(outcome)
            return outcome

    async def _reload(self, allow_empty: bool) -> ReloadOutcome:
        source = self.config.source
        if not source or source.startswith("<"):
            log.warning("reload: there is no config file to reload (the demo, or a config given as text)")
            return ReloadOutcome(refusal=Refusal(409, "no_config_file", (
                "there is no config file to reload (the demo, or a config given as text)",)))
        try:
            text = await trio.to_thread.run_sync(read_config_text, source)
            config = await trio.to_thread.run_sync(
                functools.partial(load_checked_config, source, self.registry, text=text))
            if self.adjust_config is not None:
                config = self.adjust_config(config)
        except ConfigError as exc:
            errors = tuple(str(issue) for issue in exc.errors)
            log.error("reload of %s failed; keeping the running config:\n  %s", source, "\n  ".join(errors))
            return ReloadOutcome(refusal=Refusal(422, "invalid", errors), restart_required=self._waiting(self.config))
        summary = summarize(self.config, config)
        refused = refusal(self.config, config, summary, blank=is_blank(text), allow_empty=allow_empty,
                          control_host=self._control_host)
        if refused:
            log.error("reload of %s refused; keeping the running config: %s (it would change %s)", source,
                      refused.message, summary.describe())
            return ReloadOutcome(summary, refused, self._waiting(self.config))
        waiting = self._waiting(config)
        if waiting:
            log.warning("reload of %s: %s changed since this process started; that takes a restart (applied: "
                        "everything else)", source, ", ".join(waiting))
        if summary.join_tokens[0] and not summary.join_tokens[1]:
            log.warning("reload: agents.token and agents.tokens are now empty: no new node can join (nodes that "
                        "joined keep their identity)")
        self.config = config
        self.dataplane.apply(dataplane_settings(config))
        self.directory.set_config(*config_entries(config))
        self.dataplane.tenancy = self.tenancy.apply(config)
        self.dataplane.flow = self.flow.apply(config)
        self.autoscale.apply(config)
        if self.shared is not None:
            self.shared.apply_config(config)
        if self.static is not None:
            self.static.apply(config)
        if self.control is not None:
            self.control.apply_config(config)
        log.info("reloaded %s: %d models, %d deployments (%s)%s", source, len(config.models),
                 len(config.deployments), summary.describe(), " (confirmed with allow_empty)" if allow_empty else "")
        return ReloadOutcome(summary, restart_required=waiting)

    def _waiting(self, config: Config) -> tuple[str, ...]:
        """The settings of ``config`` that differ from the started config's: applied only by a restart."""
        return restart_required(self.started_config, config)

    async def stop_embedded_shards(self, grace: float = 5.0) -> None:
        """Stop the embedded agent's engines (the demo's exit; a real agent's engines outlive it)."""
        if self.embedded_agent is not None and self.control is not None:
            self.control.closing()
            self.control.freeze()  # nothing may start them again
            with trio.CancelScope(shield=True), trio.move_on_after(grace + 5.0):
                await self.embedded_agent.stop_all_shards(grace)

    async def shutdown(self, grace: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish for up to ``grace`` seconds, then stop everything."""
        grace = self.config.limits.shutdown_grace if grace is None else grace
        self.draining = True
        if self.control is not None:
            self.control.closing()
        inflight, arriving = self.data_server.active_requests, self.data_server.unread_connections
        log.log(logging.INFO if inflight or arriving else logging.DEBUG,
                "draining: no new connections; waiting up to %gs for %d in-flight requests and %d connections "
                "whose first request is still arriving", grace, inflight, arriving)
        await self.data_server.drain(grace)
        await self.tenancy.stop()  # before the shared state's link: the limiter gives its shares back over it
        if self.stop_engines_on_exit:
            await self.stop_embedded_shards()
        self._control_shutdown.set()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
