"""One engine's (one data-parallel rank's) KV-event stream: ZMQ under Trio, sequence tracking, replay, resets.

:class:`EngineSubscription` owns a SUB socket and, when the engine has a
replay endpoint, a DEALER socket, in its own ZMQ context, all used by the one
task running :meth:`EngineSubscription.run` (Trio allows one waiter per FD;
the two sockets are never waited on at once). Cancelling that task closes
both sockets (``notify_closing`` first, ``linger=0``) and terminates the
context.

Descriptors. Out of file descriptors (``EMFILE``, ``ENFILE``), the
subscription never fails: opening the context and SUB is retried with a
back-off until it succeeds (the context is made by
:func:`~llmgw.kv.zmq_trio.open_context`, since libzmq aborts the process when
a new context's threads cannot get theirs), and a DEALER that cannot be opened
is a replay with the result ``no_descriptor`` (a gap it cannot fill resets, as
after a timeout); each is counted in ``llmgw_fd_exhaustion_total{where}``
(``kv_subscription``, ``kv_replay``: :mod:`llmgw.fdpressure`).

Modes. ``mode="connect"`` dials an engine that binds its PUB: the agent's
engines, on ``ipc://`` sockets in its private directory
(:mod:`llmgw.agent.kv_sockets`: vLLM binds an ``ipc://`` endpoint, and only
the agent's user can open the directory), and static external replicas
(``kv_events: ipc://PATH`` or ``tcp://host:port``); the connection is retried
until the engine has bound it. ``mode="bind"``: the SUB binds and the
engine's PUB connects to it (vLLM connects when a tcp endpoint has no ``*``);
bind ``tcp://127.0.0.1:0`` and the resolved endpoint is what
``nursery.start`` returns. A bound loopback SUB accepts any local publisher,
which is why the agent no longer uses it. One subscription per data-parallel rank: vLLM offsets the
port of rank ``r`` by ``r`` (:func:`rank_endpoint`), and a batch whose
``data_parallel_rank`` is not the expected one is counted and dropped.

Sequence numbers (8 bytes big-endian, from 0, one per published batch):

- the next one: applied;
- a jump (a gap: HWM drop, a late join, the simulator's
  ``--drop-event-seqs``): replay is asked through the DEALER (``[b"",
  seq8]``), replies are read until the END marker within ``replay_timeout``,
  and the missing batches applied in order, de-duplicated by seq (live
  messages can interleave with a replay). A hole replay cannot fill (replay
  off, the engine no longer buffers the start, timeout) resets the mirror
  with reason ``gap``; what arrived after the hole is applied on the fresh
  state;
- one not above the last *live* seq: the engine restarted (vLLM restarts at
  0 and sends no ``AllBlocksCleared``): reset ``engine_restart``;
- one not above the last applied but above the last live seq: a live copy of
  a batch already replayed, dropped.

The first message of a stream that does not start at 0 (the engine ran
before the subscription) is a gap from 0. A lost batch shows as a gap only
when a later one arrives, so after ``idle_probe`` seconds of silence (default
2) the subscription asks the replay socket for anything after the last batch
it applied: a loss at the end of a burst (or of the engine's very first
batch, published before the subscription reached it) is found and filled
within seconds, and an idle engine costs one small round trip per probe. ``AllBlocksCleared`` resets with
reason ``cleared`` at its place in the batch. A message that cannot be
decoded is counted and logged once per subscription, and, since its events
are lost, resets with reason ``decode_error``; it never stops the task.

Size. Both sockets set ``ZMQ_MAXMSGSIZE`` (``max_message_bytes``, default
:data:`DEFAULT_MAX_MESSAGE_BYTES`): any process that can reach the socket (on
tcp, any on the host) can send to it, and without a bound one message may be
as large as it likes. A peer
sending a larger frame is disconnected by libzmq before the frame is buffered
(a real engine's PUB reconnects at once, and the lost batch is a gap that
replay fills). A monitor socket, read by a second task, counts those
disconnections (``disconnects``, ``llmgw_kv_peer_disconnects_total``) and logs
the first: engines that go away are counted too.

Callbacks are synchronous and run in this task: ``on_batch(batch)`` with an
:class:`~llmgw.kv.events.EventBatch` of events to apply (typically
``EngineMirror.apply``), ``on_reset(reason)`` (typically ``EngineMirror.reset``).
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio
import zmq

from ..fdpressure import ShortageBackoff, capacity_errno, note_shortage
from ..units import parse_size
from . import zmq_trio
from .codec import EventDecodeError, decode_batch, parse_frames, parse_replay_reply, replay_request
from .events import AllBlocksCleared, EventBatch

if TYPE_CHECKING:
    from .metrics import SourceMetrics

log = logging.getLogger(__name__)
DISCONNECT_NOTE_DELAY = 2.0  # seconds a subscription must outlive its first disconnect to log it

MODES = ("bind", "connect")
DEFAULT_REPLAY_TIMEOUT = 2.0
DEFAULT_IDLE_PROBE = 2.0  # seconds of silence before asking the replay socket whether a batch was lost
DEFAULT_RCVHWM = 100_000  # as vLLM's PUB send HWM: a slow agent loses batches only past this many
# The largest real batch is one scheduler step: BlockStored events with every token of every block the step
# completed (up to max_num_batched_tokens, 5 bytes per token id in msgpack, per KV-cache group), their hashes
# (34 bytes each as bin) and as many BlockRemoved events (about 80 bytes each in the map layout). At 1M tokens in
# one step that is about 13 MB per group; 32 MiB leaves room for two groups at that size (docs/kv-routing.md).
DEFAULT_MAX_MESSAGE_BYTES = 32 * 1024 * 1024
MAX_MESSAGE_BYTES_LIMIT = 1024 * 1024 * 1024  # what the setting itself may be raised to


def message_size_setting(value: object) -> int:
    """A ``max_message_bytes`` setting from a size (``64MiB`` or bytes): 1 KiB to 1 GiB; ``ValueError`` otherwise."""
    size = parse_size(value)
    if not 1024 <= size <= MAX_MESSAGE_BYTES_LIMIT:
        raise ValueError("must be from 1KiB to 1GiB")
    return size


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's endpoint for data-parallel rank ``rank``: tcp port + rank (port 0 never offset), inproc ``_dp<r>``."""
    if rank == 0:
        return endpoint
    match = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    if match:
        port = int(match.group(2))
        return endpoint if port == 0 else f"{match.group(1)}{port + rank}"
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    raise ValueError(f"cannot derive data-parallel rank {rank}'s endpoint from {endpoint!r} (tcp or inproc only)")


class EngineSubscription:
    """The KV-event stream of one engine rank; run it with ``await nursery.start(sub.run)``."""

    def __init__(self, endpoint: str, *, on_batch: Callable[[EventBatch], None], on_reset: Callable[[str], None],
                 mode: str = "bind", replay_endpoint: str | None = None, topic: bytes = b"",
                 data_parallel_rank: int = 0, decode: Callable[[bytes], EventBatch] = decode_batch,
                 replay_timeout: float = DEFAULT_REPLAY_TIMEOUT, idle_probe: float | None = DEFAULT_IDLE_PROBE,
                 rcvhwm: int = DEFAULT_RCVHWM, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 source: str | None = None, metrics: SourceMetrics | None = None,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None,
                 clock: Callable[[], float] | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be 'bind' or 'connect', not {mode!r}")
        self.endpoint = endpoint
        self.mode = mode
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.decode = decode
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.replay_timeout = replay_timeout
        self.idle_probe = idle_probe
        self.rcvhwm = rcvhwm
        self.max_message_bytes = max_message_bytes
        self.source = source or endpoint
        self.metrics = metrics
        self._context = context
        self.clock = clock or trio.current_time
        self.bound_endpoint: str | None = None
        # sequence state
        self.last_seq: int | None = None  # last batch applied (live or replayed)
        self.live_seq: int | None = None  # last seq seen on the live stream (strictly increasing per engine run)
        self._dealer: zmq.Socket[bytes] | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._decode_error_logged = False
        self._apply_error_logged = False
        self._last_digest: int | None = None
        self._engine_runs = 0  # engine restarts the supervisor notified
        # statistics (also exported through ``metrics``)
        self.batches = 0
        self.events: Counter[str] = Counter()
        self.gaps = 0
        self.replays: Counter[str] = Counter()
        self.resets: Counter[str] = Counter()
        self.decode_errors = 0
        self.wrong_rank = 0
        self.disconnects = 0  # peers libzmq cut off: a message over max_message_bytes, or an engine gone
        self.duplicates = 0
        self.last_batch_at: float | None = None
        self._arrived = trio.Event()

    # -- the task ---------------------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[str | None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the sockets, report the endpoint (resolved when bound), then receive until cancelled. Opening
        waits out a shortage of descriptors (retried with a back-off, counted, logged); other errors raise."""
        own_context = self._context is None
        sub = monitor = None
        try:
            sub, monitor = await self._open_sockets()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._count_disconnects, monitor)
                task_status.started(self.bound_endpoint)
                await self._receive(sub)
        finally:
            self._close_sockets(sub, monitor, own_context)

    async def _open_sockets(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """The context (unless given), the SUB bound or connected, and its monitor; retried while descriptors are
        short (:mod:`llmgw.fdpressure`)."""
        backoff = ShortageBackoff()
        while True:
            sub = monitor = None
            try:
                ctx = self._ctx = self._context if self._context is not None else zmq_trio.open_context()
                sub = ctx.socket(zmq.SUB)
                self._configure(sub)
                monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                # let libzmq process pending commands now (an idle SUB subscribes to nobody)
                sub.getsockopt(zmq.EVENTS)
                return sub, monitor
            except (zmq.ZMQError, OSError) as exc:
                self._close_sockets(sub, monitor, self._context is None)
                if capacity_errno(exc) is None:
                    raise
                note_shortage("kv_subscription", exc, self.source)
            await trio.sleep(backoff.next_delay())

    def _configure(self, sub: zmq.Socket[bytes]) -> None:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        if "[" in self.endpoint or "::" in self.endpoint:
            sub.setsockopt(zmq.IPV6, 1)
        if self.mode == "bind":
            sub.bind(self.endpoint)
            self.bound_endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            sub.connect(self.endpoint)
            self.bound_endpoint = self.endpoint

    def _close_sockets(self, sub: zmq.Socket[bytes] | None, monitor: zmq.Socket[bytes] | None,
                       own_context: bool) -> None:
        if monitor is not None:
            if sub is not None:
                sub.disable_monitor()
            zmq_trio.close(monitor)
        if sub is not None:
            zmq_trio.close(sub)
        self._close_dealer()
        if own_context and self._ctx is not None:
            self._ctx.term()
        self._ctx = None

    async def _receive(self, sub: zmq.Socket[bytes]) -> None:
        while True:
            messages = zmq_trio.drain(sub)
            if not messages:
                # Wait outside the drain, so a deadline can never drop messages already taken off the socket.
                with trio.move_on_after(math.inf if self.idle_probe is None else self.idle_probe):
                    await zmq_trio.wait_for(sub, zmq.POLLIN)
                messages = zmq_trio.drain(sub)
                if not messages:
                    await self._probe()
                    continue
            for frames in messages:
                await self._on_live(frames)
                # One batch per loop turn: a backlog (the loop was busy, a burst of steps) must not hold the
                # tasks relaying first tokens for the whole drain (docs/benchmarks/routing-workloads.md,
                # "KV-event ingestion").
                await trio.lowlevel.checkpoint()

    async def _count_disconnects(self, monitor: zmq.Socket[bytes]) -> None:
        """Count the SUB's peers that libzmq disconnected (the monitor reports nothing else)."""
        while True:
            await zmq_trio.recv_multipart(monitor)
            self.disconnects += 1
            if self.metrics is not None:
                self.metrics.peer_disconnect(self.source)
            self._arrived.set()
            if self.disconnects == 1:
                # An engine stopped on purpose disconnects too, and its subscription is cancelled within moments:
                # say it only when the subscription outlives the disconnect (the others are counted meanwhile).
                await trio.sleep(DISCONNECT_NOTE_DELAY)
                log.info("%s: a KV-event peer was disconnected: the engine went away, or it sent a message over %d "
                         "bytes (max_message_bytes); further ones are counted in llmgw_kv_peer_disconnects_total",
                         self.source, self.max_message_bytes)

    async def wait_for(self, predicate: Callable[["EngineSubscription"], bool]) -> None:
        """Wait until ``predicate(self)`` holds, re-checked after every message (for tests and the agent)."""
        while not predicate(self):
            self._arrived = trio.Event()
            await self._arrived.wait()

    def notify_engine_restart(self) -> None:
        """The supervisor restarted the engine: forget the old run's sequence and reset (if anything was seen)."""
        if self.live_seq is not None or self.last_seq is not None:
            self.live_seq = self.last_seq = None
            self._engine_runs += 1  # a replay being applied belongs to the old run: it stops
            self._reset("engine_restart")

    # -- live messages ----------------------------------------------------------------------------------------------

    async def _on_live(self, frames: list[bytes]) -> None:
        try:
            try:
                _, seq, payload = parse_frames(frames)
            except EventDecodeError as exc:
                self._decode_error(exc)
                return
            batch = self._decode_payload(payload)
            if batch is not None and not self._rank_ok(batch):
                return
            if self.live_seq is not None and seq <= self.live_seq:
                log.info("%s: sequence went back from %d to %d: the engine restarted", self.source, self.live_seq, seq)
                self.live_seq = self.last_seq = None
                self._reset("engine_restart")
            self.live_seq = seq
            last = self.last_seq
            if last is not None and seq <= last:
                self.duplicates += 1  # a live copy of a batch a replay already gave us
            elif (last is None and seq == 0) or (last is not None and seq == last + 1):
                self._apply(seq, batch, payload)
            else:
                await self._fill_gap(0 if last is None else last + 1, seq, batch, payload)
        finally:
            self._arrived.set()

    def _decode_payload(self, payload: bytes) -> EventBatch | None:
        try:
            return self.decode(payload)
        except Exception as exc:  # EventDecodeError, or anything a third-party decoder plugin raises
            self._decode_error(exc)
            return None

    def _rank_ok(self, batch: EventBatch) -> bool:
        rank = batch.data_parallel_rank
        if rank is None or rank == self.data_parallel_rank:
            return True
        self.wrong_rank += 1
        if self.metrics is not None:
            self.metrics.ignored("wrong_rank", len(batch.events))
        if self.wrong_rank == 1:
            log.warning("%s: dropped a batch of data-parallel rank %d (this subscription expects rank %d); "
                        "further ones are counted silently", self.source, rank, self.data_parallel_rank)
        return False

    def _decode_error(self, exc: Exception) -> None:
        self.decode_errors += 1
        if self.metrics is not None:
            self.metrics.decode_error(self.source)
        if not self._decode_error_logged:
            self._decode_error_logged = True
            log.warning("%s: undecodable KV-event message (%s); further ones are counted silently", self.source, exc)

    def _apply(self, seq: int, batch: EventBatch | None, payload: bytes) -> None:
        """Apply one batch at its place in the sequence (``None``: it could not be decoded)."""
        self.last_seq = seq
        self._last_digest = hash(payload)  # the same bytes live and in replay: tells engine runs apart
        self.batches += 1
        self.last_batch_at = self.clock()
        self._arrived.set()
        if batch is None:
            self._reset("decode_error")
            return
        self._count(batch)
        events = batch.events
        start = 0
        for i, event in enumerate(events):
            if isinstance(event, AllBlocksCleared):
                if i > start:
                    self._deliver(EventBatch(batch.ts, events[start:i], batch.data_parallel_rank))
                self._reset("cleared")
                start = i + 1
        if start == 0:
            self._deliver(batch)
        elif start < len(events):
            self._deliver(EventBatch(batch.ts, events[start:], batch.data_parallel_rank))

    def _deliver(self, batch: EventBatch) -> None:
        try:
            self.on_batch(batch)
        except Exception:
            # A bug in the consumer must not stop the stream (nor the shard that owns it): log it once,
            # and start over from a known state.
            if not self._apply_error_logged:
                self._apply_error_logged = True
                log.exception("%s: applying a KV-event batch failed; resetting (logged once)", self.source)
            self._reset("apply_error")

    def _count(self, batch: EventBatch) -> None:
        kinds = Counter(type(event).__name__ for event in batch.events)
        kinds.update(batch.skipped)
        self.events.update(kinds)
        if self.metrics is not None:
            for kind, count in kinds.items():
                self.metrics.event(kind, count)

    def reset(self, reason: str) -> None:
        """Declare the mirrored cache unknown (e.g. the router asked for a ``resync``): counted, ``on_reset`` called;
        the sequence is kept (the engine did not restart)."""
        self._reset(reason)

    def _reset(self, reason: str) -> None:
        self.resets[reason] += 1
        if self.metrics is not None:
            self.metrics.reset(reason)
        self.on_reset(reason)

    # -- gaps and replay --------------------------------------------------------------------------------------------

    async def _fill_gap(self, start: int, seq: int, batch: EventBatch | None, payload: bytes) -> None:
        """Batches ``start .. seq-1`` are missing; ``seq`` (decoded as ``batch``) just arrived live."""
        self._gap(start, seq)
        result, replies = await self._replay(start)
        if not await self._apply_replayed(start, result, replies, seq):
            return  # the engine restarted meanwhile: this batch was the old run's
        if self.last_seq is None or seq > self.last_seq:
            self._apply(seq, batch, payload)

    async def _probe(self) -> None:
        """After ``idle_probe`` seconds of silence, ask the replay socket what follows the last batch applied.

        A batch lost on the live stream shows as a gap only when a later one
        arrives; when the engine falls silent right after (the end of a burst,
        or the first batch of a restarted engine, published before the
        subscription reached it), the loss would stay unseen. The probe asks
        from the last applied seq: the same engine run answers with that very
        batch (same bytes) and whatever followed; a restarted engine answers
        with another batch at that seq, or with nothing that far: that is an
        engine restart (reset, then replay from 0). Nothing new costs one
        batch and counts nothing.
        """
        last = self.last_seq
        start = 0 if last is None else last
        result, replies = await self._replay(start)
        if result != "ok":
            return  # unreachable or replay off: the next probe tries again
        if last is not None:
            same_run = bool(replies) and replies[0][0] == last and hash(replies[0][1]) == self._last_digest
            if not same_run and (not replies or replies[0][0] <= last):
                log.info("%s: the engine's batch %d is not the one applied: the engine restarted", self.source, last)
                self.live_seq = self.last_seq = None
                self._reset("engine_restart")
                start = 0
                result, replies = await self._replay(0)
                if result != "ok":
                    return
            else:
                start = last + 1
        replies = [(s, payload) for s, payload in replies if s >= start]
        if not replies:
            return
        self._gap(start, replies[0][0])
        await self._apply_replayed(start, result, replies, None)

    def _gap(self, start: int, seq: int) -> None:
        self.gaps += 1
        if self.metrics is not None:
            self.metrics.gap()
        log.debug("%s: gap: expected %d, got %d", self.source, start, seq)

    async def _apply_replayed(self, start: int, result: str, replies: list[tuple[int, bytes]],
                              seq: int | None) -> bool:
        """Apply replayed batches from ``start`` in order; a hole before ``seq`` (or before them) resets ``gap``.

        One batch per loop turn (an engine buffers thousands); a restart notified meanwhile ends the replay
        (False).
        """
        known = {s: payload for s, payload in replies if self.last_seq is None or s > self.last_seq}
        pending = sorted(known.items())
        expected = start
        position = 0
        run = self._engine_runs
        while position < len(pending) and pending[position][0] == expected:  # the contiguous part
            if position and not await self._same_run_after_yield(run):
                return False
            s, payload = pending[position]
            self._apply(s, self._checked(payload), payload)
            expected = s + 1
            position += 1
        if (seq is not None and expected >= seq) or (seq is None and position == len(pending) and position):
            result = "filled"
        elif result == "ok":
            result = "incomplete"
        self.replays[result] += 1
        if self.metrics is not None:
            self.metrics.replay(result)
        if result != "filled":
            missing = f"{expected}-{seq - 1}" if seq is not None else f"from {expected}"
            log.info("%s: batches %s are lost (replay: %s): resetting", self.source, missing, result)
            self._reset("gap")
            for s, payload in pending[position:]:  # what came after the hole, on the fresh state
                if self.last_seq is None or s > self.last_seq:
                    if not await self._same_run_after_yield(run):
                        return False
                    self._apply(s, self._checked(payload), payload)
        return True

    async def _same_run_after_yield(self, run: int) -> bool:
        """Let the loop run other tasks between two replayed batches; False if the engine restarted meanwhile."""
        await trio.lowlevel.checkpoint()
        return self._engine_runs == run

    def _checked(self, payload: bytes) -> EventBatch | None:
        batch = self._decode_payload(payload)
        if batch is not None and not self._rank_ok(batch):
            return EventBatch(batch.ts, [], batch.data_parallel_rank)  # keeps the seq; the events are not ours
        return batch

    async def _replay(self, start: int) -> tuple[str, list[tuple[int, bytes]]]:
        """Ask the engine for every buffered batch from ``start``: ``(result, [(seq, payload)])``.

        ``result`` is ``ok`` (the END marker came), ``timeout``, ``disabled``, or ``no_descriptor`` (the
        DEALER could not be opened for want of descriptors: counted in ``llmgw_fd_exhaustion_total``).
        After a timeout the DEALER is closed, so late replies cannot be taken
        for the next replay's.
        """
        if not self.replay_endpoint or self._ctx is None:
            return "disabled", []
        if self._dealer is None:
            try:
                self._dealer = self._open_dealer(self._ctx)
            except zmq.ZMQError as exc:
                if capacity_errno(exc) is None:
                    raise
                note_shortage("kv_replay", exc, self.source)  # the next gap or probe tries again
                return "no_descriptor", []
        dealer = self._dealer
        replies: list[tuple[int, bytes]] = []
        with trio.move_on_after(self.replay_timeout):
            await zmq_trio.send_multipart(dealer, replay_request(start))
            while True:
                frames = await zmq_trio.recv_multipart(dealer)
                try:
                    reply = parse_replay_reply(frames)
                except EventDecodeError as exc:
                    self._decode_error(exc)
                    continue
                if len(reply) == 1:  # ("end",)
                    return "ok", replies
                replies.append((reply[1], reply[2]))
        self._close_dealer()
        return "timeout", replies

    def _open_dealer(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
        assert self.replay_endpoint is not None
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            if "[" in self.replay_endpoint or "::" in self.replay_endpoint:
                dealer.setsockopt(zmq.IPV6, 1)
            dealer.connect(self.replay_endpoint)
        except BaseException:
            zmq_trio.close(dealer)
            raise
        return dealer

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            zmq_trio.close(self._dealer)
            self._dealer = None
