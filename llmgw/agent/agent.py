"""The agent loop: supervise this node's shards for the agent's whole life, and keep one stream to the control plane.

:class:`Agent` runs a :class:`~llmgw.agent.shards.ShardManager` in its own
nursery (it adopts the engines its ledger lists at start, and never stops
them because a connection ended), and a connection loop beside it:

1. connect (a websocket to ``ws://HOST:PORT/agent``, proving the join token
   and the node secret in the upgrade request's headers, or an in-process
   channel for the embedded agent: same code, see :mod:`llmgw.wire.channel`);
   an upgrade refused with 401 or 403 stops the agent, as a refused Register does;
2. send Register: discovery, the join token, and every shard it runs
   (``ShardManager.reports()``), so they can be adopted (without their log
   tails if it would exceed the control plane's first-frame limit);
3. wait for Registered (refused for a bad token or node secret: the agent
   stops, since retrying cannot help). On the node's first join, Registered
   carries the node's secret: it is written to ``STATE_DIR/node-secret``
   (mode 0600) before anything else is sent, and presented in every later
   Register (see :mod:`llmgw.control.identity`);
4. then, in a session nursery: a reader that carries out StartShard,
   StopShard, DrainShard, SleepShard and WakeShard (all but starts run in the
   agent's nursery, so a dropped connection does not interrupt them) under a deadline on every
   receive (the control plane heartbeats too); a writer, the only task that
   sends; heartbeats; the shard statuses, forwarded as they change; and the
   KV-cache changes of shards that publish KV events (:mod:`llmgw.agent.kv`:
   a full copy first, then net changes, so every reconnect resynchronises).

Statuses are buffered while disconnected, the latest per shard winning; the
Register of the next connection carries the full current state and replaces
the buffer (so an older status never lands after a newer state). Any
connection error leads to a reconnect after a capped exponential backoff
(50 ms doubling to a heartbeat interval, at most 5 s; from 50 ms again after a
session it was registered on, so a leader that closes its sessions at the end
of its term sees them at the next one at once). A session whose control plane
went silent is given up after :func:`~llmgw.wire.liveness.silence_limit`, and
the next dial goes to another of the ``--join`` URLs first. Every failed dial
is logged with the URL it tried and why.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import ssl
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import trio

from .. import __version__, wire
from ..logfields import log_fields
from ..plugins_manager import Registry, default_registry
from ..wire.channel import (
    MAX_REGISTER_BYTES,
    AgentCredentials,
    Channel,
    ChannelClosed,
    Connector,
    UpgradeRefused,
    WebSocketConnector,
)
from ..wire.liveness import BACKOFF_FIRST, next_backoff, silence_limit
from .statelock import StateDirLock

log = logging.getLogger(__name__)

REGISTER_TIMEOUT = 10.0
OUTBOX_SIZE = 256
SECRET_FILE = "node-secret"


class AgentRefused(Exception):
    """The control plane refused this agent's Register (a wrong token, most likely)."""


class ConnectionLost(Exception):
    """The control plane went silent."""


class LatestReports:
    """Shard reports waiting to be sent: the latest per shard wins."""

    def __init__(self) -> None:
        self._reports: dict[str, wire.ShardReport] = {}
        self._ready = trio.Event()

    def put(self, report: wire.ShardReport) -> None:
        self._reports[report.shard_id] = report
        self._ready.set()

    def clear(self) -> None:
        self._reports.clear()

    async def take(self) -> list[wire.ShardReport]:
        """Wait for at least one report; all of them, oldest first."""
        while not self._reports:
            await self._ready.wait()
            self._ready = trio.Event()
        reports, self._reports = list(self._reports.values()), {}
        return reports

    def __len__(self) -> int:
        return len(self._reports)


def default_state_dir(node_id: str) -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "llmgw" / f"agent-{node_id}"


def default_address(join_url: str) -> str:
    """The local address this machine uses to reach the control plane (how other machines can dial it)."""
    host = urlsplit(join_url).hostname or "127.0.0.1"
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # no packet is sent: this only picks the route
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class Agent:
    def __init__(self, join: str | Connector, *, token: str = "", node_id: str, discovery: str = "auto",
                 state_dir: Path | str | None = None, labels: dict[str, str] | None = None,
                 address: str | None = None, registry: Registry | None = None, host: str | None = None,
                 announce: Callable[[str], None] | None = None, metrics_registry=None,
                 kv_max_message_bytes: int | None = None, engine_ports: tuple[int, int] | None = None):
        """``metrics_registry``: where the KV-event series go (the gateway's, for the embedded agent; a private
        one otherwise). ``kv_max_message_bytes``: the KV-event subscriptions' ZMQ_MAXMSGSIZE (default 32 MiB).
        ``engine_ports``: the (low, high) range engines' HTTP ports are taken from (default 20000-32000)."""
        from .kv import AgentKv
        from .kv_sockets import KV_SOCKET_DIR, KvSocketDir
        from .ports import DEFAULT_ENGINE_PORTS, PortAllocator
        from .shards import ShardManager

        self.connector: Connector = WebSocketConnector(join) if isinstance(join, str) else join
        self.token = token
        self.node_id = node_id
        self.discovery = discovery
        self.labels = dict(labels or {})
        self.address = address or default_address(self.connector.url)
        self.state_dir = Path(state_dir) if state_dir else default_state_dir(node_id)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.announce = announce or (lambda line: log.info("%s", line))
        self.connected = False
        self.sessions = 0  # accepted registrations so far
        self.heartbeat_interval = 5.0
        self._pending = LatestReports()
        self._nursery: trio.Nursery | None = None
        # Why the last session was given up for silence: the websocket's close handshake with a silent peer then
        # times out too, and that error, not this one, is what comes out of the connection.
        self._silence: ConnectionLost | None = None
        registry = registry or default_registry()
        host = host or self.address
        self.shards = ShardManager(registry, state_dir=self.state_dir, node_address=self.address, host=host,
                                   on_status=self._pending.put,
                                   ports=PortAllocator(host, *(engine_ports or DEFAULT_ENGINE_PORTS)))
        self.kv = AgentKv(registry, node_id, sockets=KvSocketDir(self.state_dir / KV_SOCKET_DIR),
                          metrics_registry=metrics_registry,
                          **({"max_message_bytes": kv_max_message_bytes} if kv_max_message_bytes else {}))
        self.shards.kv = self.kv

    # -- lifetime ------------------------------------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Supervise shards and stay connected until cancelled (engines keep running after that).

        The state dir is locked for the whole run: a second agent on it fails at once with
        :class:`~llmgw.agent.statelock.StateDirBusy`, naming this process."""
        with StateDirLock(self.state_dir):
            await self._discover()  # a bad --discovery fails here, at start, rather than on every reconnect
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.shards.run)
                task_status.started()
                await self._connect_forever()

    async def stop_all_shards(self, grace: float = 5.0) -> None:
        """Stop every shard this agent runs (the demo does this at exit; a real agent never does)."""
        async with trio.open_nursery() as nursery:
            for report in self.shards.reports():
                nursery.start_soon(functools.partial(self.shards.stop, report.shard_id, grace, reason="agent exit"))

    async def _connect_forever(self) -> None:
        from trio_websocket import HandshakeError

        lost = (ChannelClosed, ConnectionLost, HandshakeError, OSError, trio.BrokenResourceError, trio.TooSlowError,
                wire.WireError, UpgradeRefused)
        delay = BACKOFF_FIRST
        while True:
            sessions = self.sessions
            tried = self.connector.url
            error: BaseException | None = None
            try:
                register = await self._register_message()  # before dialling: the control plane waits for it
                try:
                    async with self.connector.connect(AgentCredentials.of(register)) as channel:
                        await self._session(channel, register)
                except UpgradeRefused as refused:
                    if refused.final:
                        raise AgentRefused(refused.message) from None
                    raise
            except* AgentRefused as group:  # a wrong token does not heal by retrying: the agent stops
                self.announce(f"llmgw-agent {self.node_id} refused by {tried}: {group.exceptions[0]}")
                raise
            except* lost as group:
                error = group.exceptions[0]
            except* Exception:
                log.exception("the session with %s failed; reconnecting", tried)
            if self.sessions != sessions:  # it was registered: start the backoff over
                delay = BACKOFF_FIRST
            silence, self._silence = self._silence, None
            error = silence or error
            if error is not None:
                self._lost(error, delay, tried)
            self.connected = False
            await trio.sleep(delay)
            delay = next_backoff(delay, self.heartbeat_interval)

    def _lost(self, error: BaseException, delay: float, tried: str) -> None:
        """Say why the dial of (or the session with) ``tried`` ended, and where the next dial goes, when."""
        while isinstance(error, BaseExceptionGroup):
            error = error.exceptions[0]
        if isinstance(error, ConnectionLost):
            self.connector.skip()  # a frozen control plane would hold the next upgrade until the connect timeout
        why = str(error) or type(error).__name__
        then = f"{self.connector.url} in {delay:.2g}s"
        if self.connected:
            self.announce(f"llmgw-agent {self.node_id} disconnected from {tried}: {why}; reconnecting to {then} "
                          "(engines keep running)")
        else:  # a certificate problem needs a human: said louder than a control plane not up yet
            level = logging.WARNING if isinstance(error, ssl.SSLError) else logging.INFO
            log.log(level, "cannot reach %s (%s); trying %s", tried, why, then, extra=log_fields(node=self.node_id))
        self.connected = False

    # -- one connection ------------------------------------------------------------------------------------------

    async def _session(self, channel: Channel, register: wire.Register) -> None:
        await channel.send(register)
        with trio.fail_after(REGISTER_TIMEOUT):
            reply = await channel.receive()
        if not isinstance(reply, wire.Registered):
            raise wire.WireError(f"expected Registered, got {type(reply).__name__}")
        if not reply.accepted:
            raise AgentRefused(reply.reason or "no reason given")
        if reply.node_secret:
            self._save_secret(reply.node_secret)  # before any other message: that one tells it was kept
        self.heartbeat_interval = reply.heartbeat_interval
        self.connector.heartbeat(reply.heartbeat_interval)  # its next dials wait as long as its heartbeat says
        self.connected = True
        self.sessions += 1
        self.announce(f"llmgw-agent {self.node_id} connected to {self.connector.url} "
                      f"({len(register.gpus)} GPUs, {len(register.shards)} running shards)")
        outbox_send, outbox_receive = trio.open_memory_channel(OUTBOX_SIZE)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write, channel, outbox_receive)
            nursery.start_soon(self._heartbeats, outbox_send, reply.heartbeat_interval)
            nursery.start_soon(self._forward_statuses, outbox_send)
            await nursery.start(self.kv.session, outbox_send.send)  # KV changes: a FULL copy, then deltas
            await self._read(channel, outbox_send, reply.heartbeat_interval)

    async def _discover(self) -> wire.Register:
        from .discovery import discover

        return await trio.to_thread.run_sync(functools.partial(
            discover, self.discovery, node_id=self.node_id, address=self.address, labels=self.labels))

    async def _register_message(self) -> wire.Register:
        register = await self._discover()
        register.token = self.token
        register.node_secret = self._load_secret()
        register.agent_version = register.agent_version or __version__
        self._pending.clear()  # the Register carries the current state of every shard
        register.shards = self.shards.reports()
        return self._fitted(register)

    def _fitted(self, register: wire.Register) -> wire.Register:
        """``register``, without its shards' log tails if it would be larger than a first frame may be."""
        size = len(wire.encode(register))
        if size <= MAX_REGISTER_BYTES:
            return register
        log.warning("the Register of node %s is %d bytes, more than the %d a first frame may be: its shards' log "
                    "tails are left out", self.node_id, size, MAX_REGISTER_BYTES, extra=log_fields(node=self.node_id))
        return dataclasses.replace(register, shards=[dataclasses.replace(report, log_tail=[])
                                                     for report in register.shards])

    def _load_secret(self) -> str:
        try:
            return (self.state_dir / SECRET_FILE).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return ""

    def _save_secret(self, secret: str) -> None:
        from ..private_file import write_private

        write_private(self.state_dir / SECRET_FILE, secret.encode() + b"\n")
        log.info("node %s joined: its node secret is in %s", self.node_id, self.state_dir / SECRET_FILE,
                 extra=log_fields(node=self.node_id))

    async def _read(self, channel: Channel, outbox: trio.MemorySendChannel, interval: float) -> None:
        limit = silence_limit(interval)
        while True:
            with trio.move_on_after(limit):
                message = await channel.receive()
                self._handle(message, outbox)
                continue
            self._silence = ConnectionLost(f"the control plane said nothing for {limit:g}s")
            raise self._silence

    def _handle(self, message, outbox: trio.MemorySendChannel) -> None:
        nursery = self._nursery
        assert nursery is not None  # run() opened it before connecting
        if isinstance(message, wire.StartShard):
            log.debug("start shard %s (replica %s rank %d, generation %d, GPUs %s)", message.shard_id,
                     message.replica_id, message.rank, message.generation, message.gpu_indices)
            try:
                self.shards.start(message)
            except Exception as exc:  # a bad spec must not end the session
                log.exception("cannot start shard %s", message.shard_id, extra=log_fields(
                    node=self.node_id, shard=message.shard_id, replica=message.replica_id))
                self._reply(outbox, wire.ErrorMessage(code="start_failed", message=str(exc), about=message.shard_id))
        elif isinstance(message, wire.StopShard):
            log.debug("stop shard %s: %s", message.shard_id, message.reason)
            nursery.start_soon(functools.partial(self.shards.stop, message.shard_id, message.grace,
                                                       reason=message.reason))
        elif isinstance(message, wire.DrainShard):
            log.debug("drain shard %s: %s", message.shard_id, message.reason)
            nursery.start_soon(functools.partial(self.shards.drain, message.shard_id, message.timeout,
                                                       message.grace, reason=message.reason))
        elif isinstance(message, wire.SleepShard):
            log.debug("sleep shard %s: %s", message.shard_id, message.reason)
            nursery.start_soon(functools.partial(self.shards.sleep, message.shard_id, message.level,
                                                 message.timeout, reason=message.reason))
        elif isinstance(message, wire.WakeShard):
            log.debug("wake shard %s: %s", message.shard_id, message.reason)
            nursery.start_soon(functools.partial(self.shards.wake, message.shard_id, message.timeout,
                                                 reason=message.reason))
        elif isinstance(message, wire.KvResync):
            if not self.kv.resync(message):
                self._reply(outbox, wire.ErrorMessage(code="kv_unknown_shard", about=message.shard_id,
                                                      message="no KV-event subscription for this shard and rank"))
        elif isinstance(message, wire.ErrorMessage):
            log.warning("the control plane refused something (%s) about %s: %s", message.code,
                        message.about or "-", message.message, extra=log_fields(node=self.node_id))
        elif isinstance(message, wire.Heartbeat):
            pass
        else:
            name = message.type_name if isinstance(message, wire.UnknownMessage) else type(message).__name__
            log.debug("ignored a %s from the control plane", name)

    @staticmethod
    def _reply(outbox: trio.MemorySendChannel, message: wire.Message) -> None:
        try:
            outbox.send_nowait(message)
        except trio.WouldBlock:
            log.warning("outbox full: dropped a %s", type(message).__name__)

    async def _write(self, channel: Channel, outbox: trio.MemoryReceiveChannel) -> None:
        async for message in outbox:
            await channel.send(message)

    async def _heartbeats(self, outbox: trio.MemorySendChannel, interval: float) -> None:
        seq = 0
        while True:
            seq += 1
            await outbox.send(wire.Heartbeat(seq=seq, sent_at=time.time()))
            await trio.sleep(interval)

    async def _forward_statuses(self, outbox: trio.MemorySendChannel) -> None:
        while True:
            for report in await self._pending.take():
                await outbox.send(wire.ShardStatus(shard=report))
