"""KV event publishing over ZMQ, framed exactly as vLLM's ``ZmqEventPublisher``.

Live: a PUB socket (bound or connected per vLLM's rule) sends one multipart
message per engine step with events, ``[topic, seq (8 bytes big-endian, from
0), payload]``; the payload is ``[ts, [events], dp_rank]`` in the map layout
(0.24+) or the array layout (0.22-0.23), encoded by ``llmgw.kv.codec``.

Replay (0.26+ protocol): a ROUTER socket, always bound, keeps the last
``buffer_steps`` batches; a request ``[identity, b"", seq8]`` gets one
``[identity, b"", topic, seq8, payload]`` per buffered batch with seq >= start,
then ``[identity, b"", b"", END, b""]`` (END = -1 as 8 signed bytes).

``drop`` (the ``--drop-event-seqs`` test switch) names sequence numbers that
are kept for replay but never sent live, so consumers can test gap recovery.

Each socket is owned by one task; the engine hands batches over a memory
channel. Endpoints that bound port 0 are resolved to ``tcp://HOST:PORT``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import trio
import zmq

from llmgw.kv import zmq_trio
from llmgw.kv.codec import (
    ARRAY_VARIANTS,
    BLOCK_REMOVED_FIELDS,
    BLOCK_STORED_FIELDS,
    END_SEQ_BYTES,
    MAP_VARIANTS,
    encode_batch,
)
from llmgw.kv.events import BlockRemoved, BlockStored, EventBatch

from .config import KVEventsConfig, binds

log = logging.getLogger(__name__)


def layout_trimmer(layout: str, fields: int | None) -> Callable[[EventBatch], EventBatch] | None:
    """A function clearing the event fields an older layout does not declare (None when nothing to clear).

    The simulator fills fields up to ``kv_cache_spec_kind`` (vLLM 0.22+); emulating an
    older release's layout drops the newer ones, as that release never had them.
    """
    variants = ARRAY_VARIANTS if layout == "array" else MAP_VARIANTS
    stored_count = fields or max(variants)
    removed_count = variants[stored_count]
    stored_drop: dict[str, Any] = {name: None for name in BLOCK_STORED_FIELDS[stored_count:]}
    removed_drop: dict[str, Any] = {name: None for name in BLOCK_REMOVED_FIELDS[removed_count:]}
    if stored_count >= 10 and removed_count >= 3:
        return None

    def trim(batch: EventBatch) -> EventBatch:
        events = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                ev = dataclasses.replace(ev, **stored_drop)
            elif isinstance(ev, BlockRemoved):
                ev = dataclasses.replace(ev, **removed_drop)
            events.append(ev)
        return EventBatch(batch.ts, events, batch.data_parallel_rank)

    return trim


@dataclass
class PublisherEndpoints:
    """Where subscribers reach the publisher."""

    pub: str  # connectable address of the PUB socket (or the peer it connects to)
    pub_configured: str  # as vLLM's /kv_event_sources reports it
    replay: str | None
    replay_configured: str | None


def connectable(endpoint: str, host: str) -> str:
    """``tcp://*:P`` / ``tcp://0.0.0.0:P`` / ``tcp://[::]:P`` -> ``tcp://HOST:P``; others unchanged."""
    match = re.fullmatch(r"tcp://(\*|0\.0\.0\.0|\[::\]|\[\*\]|::):(\d+)", endpoint)
    if not match:
        return endpoint
    return f"tcp://{host}:{match.group(2)}"


class EventPublisher:
    """The PUB socket, the replay ROUTER socket and the replay buffer."""

    def __init__(self, ctx: zmq.Context, config: KVEventsConfig, *, pub_endpoint: str,
                 replay_endpoint: str | None, layout: str = "map", fields: int | None = None,
                 drop: Callable[[int], bool] | None = None, advertise_host: str = "127.0.0.1"):
        self.ctx = ctx
        self.config = config
        self.pub_endpoint = pub_endpoint
        self.replay_endpoint = replay_endpoint
        self.layout = layout
        self.fields = fields
        self.drop = drop
        self.advertise_host = advertise_host
        self.topic = config.topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=max(config.buffer_steps, 1))
        self.next_seq = 0
        self.published = 0  # batches sent live
        self.dropped = 0  # batches withheld by the drop switch
        self.endpoints: PublisherEndpoints | None = None
        self._trim = layout_trimmer(layout, fields)

    def encode(self, batch: EventBatch) -> bytes:
        if self._trim is not None:
            batch = self._trim(batch)
        return encode_batch(batch, layout=self.layout, fields=self.fields)

    def _open(self) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = self.ctx.socket(zmq.PUB)
        replay = None
        try:
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            endpoint = self.pub_endpoint
            if "[" in endpoint or "::" in endpoint:
                pub.setsockopt(zmq.IPV6, 1)
            if binds(endpoint):
                pub.bind(endpoint)
                resolved = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
                pub_connectable = connectable(resolved, self.advertise_host)
                pub_configured = pub_connectable if endpoint.endswith(":0") else endpoint
            else:
                pub.connect(endpoint)
                pub_connectable = pub_configured = endpoint
            replay_connectable = replay_configured = None
            if self.replay_endpoint:
                replay = self.ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
                if "[" in self.replay_endpoint or "::" in self.replay_endpoint:
                    replay.setsockopt(zmq.IPV6, 1)
                replay.bind(self.replay_endpoint)
                resolved = replay.getsockopt(zmq.LAST_ENDPOINT).decode()
                replay_connectable = connectable(resolved, self.advertise_host)
                replay_configured = replay_connectable if self.replay_endpoint.endswith(":0") \
                    else self.replay_endpoint
        except BaseException:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        self.endpoints = PublisherEndpoints(pub_connectable, pub_configured, replay_connectable, replay_configured)
        return pub, replay

    async def serve(self, batches: trio.MemoryReceiveChannel, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Open the sockets, report :class:`PublisherEndpoints`, then publish and serve replays until cancelled."""
        pub, replay = self._open()
        try:
            task_status.started(self.endpoints)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._publish_loop, pub, batches)
                if replay is not None:
                    nursery.start_soon(self._replay_loop, replay)
        finally:
            zmq_trio.close(pub)
            if replay is not None:
                zmq_trio.close(replay)

    async def _publish_loop(self, pub: zmq.Socket, batches: trio.MemoryReceiveChannel) -> None:
        topic, drop = self.topic, self.drop
        async for batch in batches:
            try:
                payload = self.encode(batch)
            except Exception:
                log.exception("could not encode a KV event batch; skipped")
                continue
            seq = self.next_seq
            self.next_seq += 1
            self.buffer.append((seq, payload))
            if drop is not None and drop(seq):
                self.dropped += 1
                continue
            await zmq_trio.send_multipart(pub, [topic, seq.to_bytes(8, "big"), payload])
            self.published += 1

    async def _replay_loop(self, sock: zmq.Socket) -> None:
        while True:
            frames = await zmq_trio.recv_multipart(sock)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("ignored a replay request of %d frames (expected [identity, b'', seq8])", len(frames))
                continue
            identity = frames[0]
            start = int.from_bytes(frames[2], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await zmq_trio.send_multipart(sock, [identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await zmq_trio.send_multipart(sock, [identity, b"", b"", END_SEQ_BYTES, b""])
