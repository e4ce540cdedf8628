"""Every shard of one agent: one nursery of supervisors, the ledger they share, adoption at start.

:meth:`ShardManager.run` first adopts every engine the ledger lists that is
still alive (a previous agent started it) and reports the dead ones as FAILED,
then runs until cancelled. Cancelling it stops supervision, never the engines:
the next agent over the same ``state_dir`` adopts them.

``start`` is idempotent on (shard id, generation): the same StartShard twice
does nothing (but for a new placement proof, kept in the ledger and reported:
the cluster secret was rotated, and the engine keeps running), an older
generation is refused, a newer one drains the old engine before starting the
new one (they would share GPUs). ``reports()`` is
what the agent sends in Register on every (re)connect: running shards, plus
the FAILED ones the control plane has not yet told the agent to forget (a
StartShard or StopShard for that id clears them). Stopped shards are dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import trio

from .. import wire
from ..logfields import log_fields
from ..plugins_manager import PluginError, Registry
from .engine import Engine, LaunchContext
from .kv_sockets import KvEndpoints
from .ledger import Ledger, LedgerEntry
from .logs import secure_log_folder
from .ports import PortAllocator
from .supervisor import ShardSupervisor, SupervisorSettings

if TYPE_CHECKING:
    from .kv import AgentKv

log = logging.getLogger(__name__)

State = wire.ShardState
LEDGER_FILE = "shards.json"


class EngineCatalog:
    """Engine instances by name, from the plugin registry or a plain ``{name: factory or engine}`` mapping."""

    def __init__(self, engines: Registry | Mapping[str, object]):
        self._source = engines
        self._built: dict[str, Engine] = {}

    def get(self, name: str) -> Engine:
        built = self._built.get(name)
        if built is not None:
            return built
        factory: Any  # an engine, or what makes one
        if isinstance(self._source, Registry):
            factory = self._source.get("engines", name)
        else:
            try:
                factory = self._source[name]
            except KeyError:
                known = ", ".join(sorted(self._source)) or "none"
                raise PluginError(f"no engine named {name!r} (known: {known})") from None
        is_engine = not isinstance(factory, type) and hasattr(factory, "command")
        engine: Engine = factory if is_engine else factory()
        self._built[name] = engine
        return engine


class ShardManager:
    def __init__(self, engines: Registry | Mapping[str, object], *, state_dir: Path, node_address: str,
                 host: str = "127.0.0.1", on_status: Callable[[wire.ShardReport], None],
                 ports: PortAllocator | None = None, settings: SupervisorSettings | None = None,
                 ctx_factory: Callable[[wire.StartShard, int], LaunchContext] | None = None,
                 python: str = sys.executable, replace_drain_timeout: float = 120.0, replace_grace: float = 30.0,
                 kv: "AgentKv | None" = None):
        self.engines = EngineCatalog(engines)
        self.state_dir = Path(state_dir)
        self.node_address = node_address
        self.host = host
        self.python = python
        self.ports = ports if ports is not None else PortAllocator(host)
        self.settings = settings or SupervisorSettings()
        self.ledger = Ledger(self.state_dir / LEDGER_FILE)
        self.replace_drain_timeout = replace_drain_timeout
        self.replace_grace = replace_grace
        self._on_status = on_status
        self.kv = kv  # follows the KV events of shards whose profile has kv_events (llmgw.agent.kv)
        self._ctx_factory = ctx_factory or self.launch_context
        self._shards: dict[str, ShardSupervisor] = {}
        self._tombstones: dict[str, wire.ShardReport] = {}  # FAILED shards without a supervisor
        self._predecessors: dict[str, ShardSupervisor] = {}  # generations still draining before their successor
        self._nursery: trio.Nursery | None = None

    def launch_context(self, spec: wire.StartShard, http_port: int) -> LaunchContext:
        """The default context: this manager's addresses and folder, the spec's GPUs, and the KV-event endpoints
        of the shard's subscription when it has one."""
        kv = self.kv.get(spec) if self.kv is not None else None
        return LaunchContext(host=self.host, http_port=http_port, node_address=self.node_address,
                             state_dir=self.state_dir, gpu_indices=tuple(spec.gpu_indices), python=self.python,
                             kv_events_endpoint=kv.endpoints.events if kv is not None else None,
                             kv_replay_endpoint=kv.endpoints.replay if kv is not None else None)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Adopt what the ledger lists, then supervise until cancelled (engines keep running after that)."""
        secure_log_folder(self.state_dir)
        self.ledger.reload()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.ledger.save_when_possible)
            try:
                for entry in self.ledger.entries():
                    await self._adopt(entry, nursery)
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None

    async def _adopt(self, entry: LedgerEntry, nursery: trio.Nursery) -> None:
        if not self.ledger.alive(entry):
            self._bury(entry.spec, f"exited while the agent was away (pid {entry.pid} is gone or is another "
                                   f"process now)")
            self.ledger.remove(entry.shard_id)
            return
        try:
            engine = self.engines.get(entry.spec.profile.engine)
        except PluginError as exc:
            # Leave the engine and its ledger entry alone: an agent that has the plugin can adopt it.
            self._bury(entry.spec, f"cannot adopt pid {entry.pid}: {exc}")
            return
        supervisor = self._supervisor(entry.spec, engine, adopt=entry)
        self._shards[entry.shard_id] = supervisor
        await nursery.start(self._run_supervisor, supervisor)

    def start(self, spec: wire.StartShard) -> None:
        """Run a shard (see the module docstring for repeated and newer StartShards)."""
        if self._nursery is None:
            raise RuntimeError("ShardManager.run is not running")
        current = self._shards.get(spec.shard_id)
        if current is not None and not current.finished:
            if spec.generation == current.spec.generation:
                if spec.placement_proof and spec.placement_proof != current.spec.placement_proof:
                    self._reprove(current, spec.placement_proof)
                else:
                    log.debug("shard %s generation %d is already running", spec.shard_id, spec.generation)
                return
            if spec.generation < current.spec.generation:
                log.warning("shard %s: refusing generation %d, generation %d runs", spec.shard_id,
                            spec.generation, current.spec.generation,
                            extra=log_fields(shard=spec.shard_id, replica=spec.replica_id, pid=current.pid or None))
                return
        try:
            engine = self.engines.get(spec.profile.engine)
        except PluginError as exc:
            self._bury(spec, str(exc))
            return
        self._tombstones.pop(spec.shard_id, None)
        supervisor = self._supervisor(spec, engine)
        self._shards[spec.shard_id] = supervisor
        if current is not None and not current.finished:
            supervisor.reason = f"waiting for generation {current.spec.generation} to drain and stop"
        self._on_status(supervisor.report())
        self._nursery.start_soon(self._replace_then_run, current, supervisor)

    def _reprove(self, supervisor: ShardSupervisor, proof: str) -> None:
        """Keep a running shard's new placement proof (issued under a new cluster secret) for its next adoption."""
        supervisor.spec = dataclasses.replace(supervisor.spec, placement_proof=proof)
        entry = self.ledger.get(supervisor.spec.shard_id)
        if entry is not None and entry.spec.generation == supervisor.spec.generation:
            self.ledger.put(dataclasses.replace(entry, spec=supervisor.spec))
        log.info("shard %s: a new placement proof from the control plane (the cluster secret was rotated), kept; "
                 "the engine runs on", supervisor.spec.shard_id,
                 extra=log_fields(shard=supervisor.spec.shard_id, replica=supervisor.spec.replica_id))
        self._on_status(supervisor.report())

    async def stop(self, shard_id: str, grace: float = 30.0, reason: str = "") -> wire.ShardReport:
        """Stop a shard without waiting for in-flight requests; its final report."""
        supervisor = self._shards.get(shard_id)
        if supervisor is None:
            return self._not_running(shard_id)
        async with trio.open_nursery() as nursery:
            predecessor = self._predecessors.get(shard_id)
            if predecessor is not None:  # unwanted now too: cut its drain short
                nursery.start_soon(predecessor.stop, grace, reason)
            nursery.start_soon(supervisor.stop, grace, reason)
        return self._settle(supervisor)

    async def drain(self, shard_id: str, timeout: float = 600.0, grace: float = 30.0,
                    reason: str = "") -> wire.ShardReport:
        """Drain a shard (out of routing, in-flight requests finish), then stop it; its final report."""
        supervisor = self._shards.get(shard_id)
        if supervisor is None:
            return self._not_running(shard_id)
        await supervisor.drain(timeout, grace, reason)
        return self._settle(supervisor)

    async def sleep(self, shard_id: str, level: int = 1, timeout: float = 30.0, reason: str = "") -> None:
        """Put a shard's engine to sleep (see :meth:`ShardSupervisor.sleep`)."""
        supervisor = self._shards.get(shard_id)
        if supervisor is None:
            self._not_running(shard_id)
            return
        await supervisor.sleep(level, timeout, reason)

    async def wake(self, shard_id: str, timeout: float = 600.0, reason: str = "") -> None:
        """Wake a shard's sleeping engine (see :meth:`ShardSupervisor.wake`)."""
        supervisor = self._shards.get(shard_id)
        if supervisor is None:
            self._not_running(shard_id)
            return
        await supervisor.wake(timeout, reason)
        self._settle(supervisor)  # stopped when it did not wake

    def reports(self) -> list[wire.ShardReport]:
        """Every shard this agent knows, for Register."""
        return [s.report() for s in self._shards.values()] + list(self._tombstones.values())

    def get(self, shard_id: str) -> ShardSupervisor | None:
        return self._shards.get(shard_id)

    # -- internals -----------------------------------------------------------------------------------------------

    def _supervisor(self, spec: wire.StartShard, engine: Engine, adopt: LedgerEntry | None = None) -> ShardSupervisor:
        return ShardSupervisor(spec, engine, ctx_factory=self._ctx_factory, ledger=self.ledger,
                               on_status=self._on_status, adopt=adopt, ports=self.ports, settings=self.settings)

    async def _replace_then_run(self, predecessor: ShardSupervisor | None, supervisor: ShardSupervisor) -> None:
        if predecessor is not None and not predecessor.finished:
            self._predecessors[supervisor.shard_id] = predecessor
            try:
                await predecessor.drain(self.replace_drain_timeout, self.replace_grace,
                                        reason=f"replaced by generation {supervisor.spec.generation}")
            finally:
                if self._predecessors.get(supervisor.shard_id) is predecessor:
                    del self._predecessors[supervisor.shard_id]
        await self._run_supervisor(supervisor)

    async def _run_supervisor(self, supervisor: ShardSupervisor, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from .kv import wants_kv

        spec = supervisor.spec
        kv = None
        async with trio.open_nursery() as nursery:
            if self.kv is not None and wants_kv(spec):
                # The subscription lives as long as the supervisor (across engine restarts), connected before the
                # engine starts; an adopted engine's endpoints come from the ledger.
                try:
                    kv = await nursery.start(functools.partial(self.kv.run_shard, spec,
                                                               endpoints=self._adopted_kv_endpoints(supervisor)))
                except Exception:
                    log.exception("shard %s: cannot follow its KV events; it runs without them", spec.shard_id,
                                  extra=log_fields(shard=spec.shard_id, replica=spec.replica_id))
                else:
                    supervisor.on_engine_restart = kv.notify_engine_restart
            await supervisor.run(task_status=task_status)
            nursery.cancel_scope.cancel()
        # Here only when the shard ended (stopped, or failed for good): an agent that leaves is cancelled above,
        # and its engines keep their sockets for the next agent.
        if kv is not None and self.kv is not None:
            self.kv.sockets.remove(kv.endpoints)
        self._settle(supervisor)

    @staticmethod
    def _adopted_kv_endpoints(supervisor: ShardSupervisor) -> KvEndpoints | None:
        """The KV-event endpoints the ledger recorded for an adopted engine (None: a launch makes new ones)."""
        adopted = supervisor.adopting
        if adopted is None:
            return None
        if not adopted.kv_events_endpoint:
            log.warning("shard %s: engine pid %d was started without private KV-event sockets (by an older llmgw, "
                        "over loopback TCP): replica %s's KV index stays empty until the engine restarts",
                        supervisor.shard_id, adopted.pid, supervisor.spec.replica_id,
                        extra=log_fields(shard=supervisor.shard_id, replica=supervisor.spec.replica_id,
                                         pid=adopted.pid))
            return None
        return KvEndpoints(adopted.kv_events_endpoint, adopted.kv_replay_endpoint)

    def _settle(self, supervisor: ShardSupervisor) -> wire.ShardReport:
        """Forget a supervisor whose shard stopped (a failed one stays, for reports)."""
        report = supervisor.report()
        if supervisor.finished and supervisor.state is State.STOPPED \
                and self._shards.get(supervisor.shard_id) is supervisor:
            del self._shards[supervisor.shard_id]
        return report

    def _bury(self, spec: wire.StartShard, reason: str) -> None:
        """Report a shard that has no supervisor as FAILED, and keep that report for Register."""
        report = wire.ShardReport(shard_id=spec.shard_id, replica_id=spec.replica_id, rank=spec.rank,
                                  node_count=spec.node_count, state=State.FAILED, reason=reason,
                                  fingerprint=spec.fingerprint, generation=spec.generation,
                                  gpu_indices=list(spec.gpu_indices),
                                  model=spec.profile.served_model_name or spec.profile.model_path)
        log.warning("shard %s is failed: %s", spec.shard_id, reason,
                    extra=log_fields(shard=spec.shard_id, replica=spec.replica_id, generation=spec.generation))
        self._tombstones[spec.shard_id] = report
        self._on_status(report)

    def _not_running(self, shard_id: str) -> wire.ShardReport:
        known = self._tombstones.pop(shard_id, None) or wire.ShardReport(shard_id=shard_id)
        report = dataclasses.replace(known, state=State.STOPPED, reason="not running on this node", pid=0,
                                     log_tail=[])
        self._on_status(report)
        return report
