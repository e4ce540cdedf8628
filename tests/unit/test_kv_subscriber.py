"""EngineSubscription against a scripted publisher on loopback: gaps, replay, restarts, decode errors, ranks, clears.

The fake engine is an XPUB (so it can wait for the subscription before
sending: no slow-joiner losses) that *connects* to the subscription's bound
SUB, as vLLM does with an endpoint without ``*``, and a ROUTER answering
vLLM 0.26+'s replay protocol from a buffer the test controls.
"""

from __future__ import annotations

import errno
import logging
import subprocess
import sys
import time
from collections import Counter

import pytest
import trio
import zmq

from llmgw.fdpressure import FD_EXHAUSTION
from llmgw.kv import zmq_trio
from llmgw.kv.codec import END_SEQ_BYTES, encode_batch
from llmgw.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from llmgw.kv.subscriber import EngineSubscription, rank_endpoint

TOPIC = b"kv"


def payload(seq: int, *events, rank: int = 0) -> bytes:
    events = events or (BlockStored([seq], None, [1, 2, 3, 4], 4, medium="GPU"),)
    return encode_batch(EventBatch(float(seq), list(events), rank))


class FakeEngine:
    """A PUB that connects to the subscription and a replay ROUTER with a buffer of ``seq -> payload``."""

    def __init__(self, ctx: zmq.Context, sub_endpoint: str, *, answer_replays: bool = True):
        self.ctx = ctx
        self.sub_endpoint = sub_endpoint
        self.answer_replays = answer_replays
        self.buffer: dict[int, bytes] = {}
        self.replay_requests: list[int] = []
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:0")
        self.replay_endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()

    async def start(self) -> None:
        self.pub.connect(self.sub_endpoint)
        with trio.fail_after(5):
            frames = await zmq_trio.recv_multipart(self.pub)  # the subscription arrived: nothing will be lost
        assert frames == [b"\x01" + TOPIC]

    async def publish(self, seq: int, data: bytes | None = None, *, live: bool = True) -> None:
        data = payload(seq) if data is None else data
        self.buffer[seq] = data
        if live:
            await zmq_trio.send_multipart(self.pub, [TOPIC, seq.to_bytes(8, "big"), data])

    async def send_live(self, seq: int) -> None:
        """Send a batch already in the buffer on the live stream."""
        await zmq_trio.send_multipart(self.pub, [TOPIC, seq.to_bytes(8, "big"), self.buffer[seq]])

    async def serve_replays(self) -> None:
        while True:
            identity, empty, start = await zmq_trio.recv_multipart(self.router)
            assert empty == b""
            self.replay_requests.append(int.from_bytes(start, "big"))
            if not self.answer_replays:
                continue
            for seq in sorted(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await zmq_trio.send_multipart(self.router, [identity, b"", TOPIC, seq.to_bytes(8, "big"),
                                                                self.buffer[seq]])
            await zmq_trio.send_multipart(self.router, [identity, b"", b"", END_SEQ_BYTES, b""])

    def close(self) -> None:
        zmq_trio.close(self.pub)
        zmq_trio.close(self.router)


class Recorder:
    def __init__(self):
        self.log: list = []

    def on_batch(self, batch: EventBatch) -> None:
        self.log.append(("batch", int(batch.ts), [type(e).__name__ for e in batch.events]))

    def on_reset(self, reason: str) -> None:
        self.log.append(("reset", reason))

    def seqs(self) -> list[int]:
        return [entry[1] for entry in self.log if entry[0] == "batch"]


@pytest.fixture
async def rig():
    """``await rig(replay=True, answer=True, **subscription_options)`` -> (subscription, engine, recorder)."""
    ctx = zmq.Context()
    engines = []
    async with trio.open_nursery() as nursery:

        async def make(replay: bool = True, answer: bool = True, **options):
            recorder = Recorder()
            sub = EngineSubscription("tcp://127.0.0.1:0", topic=TOPIC, on_batch=recorder.on_batch,
                                     on_reset=recorder.on_reset, replay_timeout=options.pop("replay_timeout", 2.0),
                                     **options)
            endpoint = await nursery.start(sub.run)
            engine = FakeEngine(ctx, endpoint, answer_replays=answer)
            engines.append(engine)
            if replay:
                sub.replay_endpoint = engine.replay_endpoint
            nursery.start_soon(engine.serve_replays)
            await engine.start()
            return sub, engine, recorder

        yield make
        nursery.cancel_scope.cancel()
    for engine in engines:
        engine.close()
    ctx.term()


async def wait(sub: EngineSubscription, predicate) -> None:
    with trio.fail_after(5):
        await sub.wait_for(predicate)


async def test_in_order_batches_are_applied(rig):
    sub, engine, rec = await rig()
    for seq in range(3):
        await engine.publish(seq)
    await wait(sub, lambda s: s.batches == 3)
    assert rec.seqs() == [0, 1, 2] and sub.gaps == 0 and not sub.resets
    assert sub.events == {"BlockStored": 3}


async def test_a_gap_is_replayed_in_order_and_live_copies_are_dropped(rig):
    sub, engine, rec = await rig()
    await engine.publish(0)
    for seq in range(1, 6):
        await engine.publish(seq, live=False)
    for seq in (3, 4, 5):  # 4 and 5 are buffered before the replay is answered: it returns them too
        await engine.send_live(seq)
    await wait(sub, lambda s: s.live_seq == 5)
    assert rec.seqs() == [0, 1, 2, 3, 4, 5]
    assert engine.replay_requests == [1]
    assert sub.gaps == 1 and sub.replays == {"filled": 1} and sub.duplicates == 2 and not sub.resets


async def test_a_hole_the_engine_no_longer_buffers_resets_with_gap(rig):
    sub, engine, rec = await rig()
    await engine.publish(0)
    await engine.publish(1, live=False)
    del engine.buffer[1]  # fell out of the engine's replay buffer
    await engine.publish(2, live=False)
    await engine.publish(3)
    await wait(sub, lambda s: s.last_seq == 3)
    assert rec.log == [("batch", 0, ["BlockStored"]), ("reset", "gap"), ("batch", 2, ["BlockStored"]),
                       ("batch", 3, ["BlockStored"])]
    assert sub.replays == {"incomplete": 1} and sub.resets == {"gap": 1}


async def test_without_replay_a_gap_resets(rig):
    sub, engine, rec = await rig(replay=False)
    await engine.publish(0)
    await engine.publish(1, live=False)
    await engine.publish(2)
    await wait(sub, lambda s: s.last_seq == 2)
    assert rec.log == [("batch", 0, ["BlockStored"]), ("reset", "gap"), ("batch", 2, ["BlockStored"])]
    assert sub.replays == {"disabled": 1} and engine.replay_requests == []


async def test_a_replay_that_never_ends_times_out_and_resets(rig):
    sub, engine, rec = await rig(answer=False, replay_timeout=0.2)
    await engine.publish(0)
    await engine.publish(1, live=False)
    await engine.publish(2)
    await wait(sub, lambda s: s.last_seq == 2)
    assert sub.replays == {"timeout": 1} and sub.resets == {"gap": 1} and rec.seqs() == [0, 2]
    assert sub._dealer is None  # closed: a late answer cannot be taken for the next replay's


async def test_a_loss_at_the_end_of_a_burst_is_found_by_the_idle_probe(rig):
    sub, engine, rec = await rig(idle_probe=0.1)
    await engine.publish(0)
    await engine.publish(1, live=False)  # the last batch before silence: no later batch reveals the gap
    await engine.publish(2, live=False)
    await wait(sub, lambda s: s.last_seq == 2)
    assert rec.seqs() == [0, 1, 2] and sub.gaps == 1 and sub.replays == {"filled": 1} and not sub.resets
    requests = len(engine.replay_requests)
    with trio.fail_after(5):  # idle probes go on, and find nothing: they count nothing
        while len(engine.replay_requests) < requests + 2:
            await trio.sleep(0.05)
    assert sub.gaps == 1 and sub.replays == {"filled": 1} and rec.seqs() == [0, 1, 2]


async def test_the_idle_probe_resets_when_the_lost_batch_is_gone(rig):
    sub, engine, rec = await rig(idle_probe=0.1)
    await engine.publish(0)
    await engine.publish(1, live=False)
    await engine.publish(2, live=False)
    del engine.buffer[1]
    await wait(sub, lambda s: s.last_seq == 2)
    assert rec.log[1:] == [("reset", "gap"), ("batch", 2, ["BlockStored"])]
    assert sub.replays == {"incomplete": 1}


async def test_a_stream_joined_late_is_replayed_from_zero(rig):
    sub, engine, rec = await rig()
    for seq in range(3):
        await engine.publish(seq, live=False)  # published before the subscription heard anything
    await engine.publish(3)
    await wait(sub, lambda s: s.last_seq == 3)
    assert rec.seqs() == [0, 1, 2, 3] and engine.replay_requests == [0] and not sub.resets


async def test_sequence_going_back_is_an_engine_restart(rig):
    sub, engine, rec = await rig()
    for seq in range(3):
        await engine.publish(seq)
    engine.buffer.clear()  # a new engine process: new buffer, seq from 0
    await engine.publish(0)
    await engine.publish(1)
    await wait(sub, lambda s: s.batches == 5)
    assert rec.log[3:] == [("reset", "engine_restart"), ("batch", 0, ["BlockStored"]),
                           ("batch", 1, ["BlockStored"])]
    sub.notify_engine_restart()  # the supervisor can say so too
    assert rec.log[-1] == ("reset", "engine_restart") and sub.last_seq is None


async def test_a_restart_whose_first_batch_was_lost_is_found_by_the_idle_probe(rig):
    sub, engine, rec = await rig(idle_probe=0.1)
    await engine.publish(0)
    await engine.publish(1)
    await wait(sub, lambda s: s.last_seq == 1)
    engine.buffer.clear()  # a new engine run, whose first batch the subscription never heard live
    await engine.publish(0, live=False)
    await wait(sub, lambda s: s.resets["engine_restart"] == 1 and s.last_seq == 0)
    assert rec.log[2:] == [("reset", "engine_restart"), ("batch", 0, ["BlockStored"])]
    engine.buffer[1] = payload(1)  # the same run goes on: a probe from the last seq finds the same bytes
    await engine.publish(2, live=False)
    await wait(sub, lambda s: s.last_seq == 2)
    assert sub.resets == {"engine_restart": 1}


async def test_all_blocks_cleared_resets_at_its_place(rig):
    sub, engine, rec = await rig()
    events = (BlockStored([1], None, [1, 2, 3, 4], 4), AllBlocksCleared(), BlockRemoved([9]))
    await engine.publish(0, payload(0, *events))
    await wait(sub, lambda s: s.batches == 1)
    assert rec.log == [("batch", 0, ["BlockStored"]), ("reset", "cleared"), ("batch", 0, ["BlockRemoved"])]
    assert sub.events == {"BlockStored": 1, "AllBlocksCleared": 1, "BlockRemoved": 1}


async def test_undecodable_messages_are_counted_logged_once_and_reset(rig, caplog):
    sub, engine, rec = await rig()
    caplog.set_level(logging.WARNING, logger="llmgw.kv.subscriber")
    await engine.publish(0, b"\xc1 not msgpack")
    await engine.publish(1, b"\x93\x01")
    await zmq_trio.send_multipart(engine.pub, [TOPIC, b"\x00\x01", b""])  # a bad seq frame
    await engine.publish(2)
    await wait(sub, lambda s: s.last_seq == 2)
    assert sub.decode_errors == 3
    assert rec.log == [("reset", "decode_error"), ("reset", "decode_error"), ("batch", 2, ["BlockStored"])]
    assert len([r for r in caplog.records if "undecodable" in r.message]) == 1


async def test_a_failing_consumer_resets_but_never_stops_the_stream(rig, caplog):
    sub, engine, rec = await rig()
    applied = []

    def flaky(batch):
        if int(batch.ts) == 1:
            raise RuntimeError("consumer bug")
        applied.append(int(batch.ts))

    sub.on_batch = flaky
    for seq in range(3):
        await engine.publish(seq)
    await wait(sub, lambda s: s.last_seq == 2)
    assert applied == [0, 2] and rec.log == [("reset", "apply_error")]
    assert len([r for r in caplog.records if "applying a KV-event batch failed" in r.message]) == 1


async def test_batches_of_another_rank_are_dropped(rig):
    sub, engine, rec = await rig(data_parallel_rank=1)
    await engine.publish(0, payload(0, rank=0))  # not ours: counted, and its seq is not ours either
    await engine.publish(0, payload(0, rank=1))
    await wait(sub, lambda s: s.batches == 1)
    assert sub.wrong_rank == 1 and rec.seqs() == [0] and not sub.resets


async def test_cancelling_closes_the_sockets_and_frees_the_port(nursery):
    recorder = Recorder()
    sub = EngineSubscription("tcp://127.0.0.1:0", on_batch=recorder.on_batch, on_reset=recorder.on_reset,
                             replay_endpoint="tcp://127.0.0.1:9")
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as inner:
            endpoint = await inner.start(sub.run)
            scope.cancel()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.bind(endpoint)  # the port is free again
    sock.close(linger=0)
    ctx.term()


def test_rank_endpoints_follow_vllm():
    assert rank_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert rank_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert rank_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert rank_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    with pytest.raises(ValueError):
        rank_endpoint("ipc:///tmp/kv", 1)


async def test_an_oversized_message_cuts_off_its_sender_and_the_stream_goes_on(rig):
    from prometheus_client import CollectorRegistry

    from llmgw.kv.metrics import KvMetrics

    registry = CollectorRegistry()
    sub, engine, rec = await rig(max_message_bytes=64 * 1024, metrics=KvMetrics(registry).source("n", "r", "m"),
                                 source="r/dp0")
    await engine.publish(0)
    await wait(sub, lambda s: s.batches == 1)
    hostile = engine.ctx.socket(zmq.XPUB)  # any local process may connect to the bound SUB
    hostile.setsockopt(zmq.LINGER, 0)
    try:
        hostile.connect(sub.bound_endpoint)
        with trio.fail_after(5):
            await zmq_trio.recv_multipart(hostile)  # subscribed: the next message is delivered, or refused
        await zmq_trio.send_multipart(hostile, [TOPIC, (1).to_bytes(8, "big"), b"\x00" * (8 * 1024 * 1024)])
        await wait(sub, lambda s: s.disconnects == 1)
    finally:
        zmq_trio.close(hostile)
    for seq in (1, 2):
        await engine.publish(seq)
    await wait(sub, lambda s: s.batches == 3)
    assert rec.seqs() == [0, 1, 2] and not sub.resets and sub.decode_errors == 0
    assert registry.get_sample_value("llmgw_kv_peer_disconnects_total", {"source": "r/dp0"}) == 1


async def test_a_message_within_the_bound_is_taken(rig):
    sub, engine, rec = await rig(max_message_bytes=64 * 1024)
    big = payload(0, BlockStored(list(range(1, 400)), None, list(range(400 * 16)), 16, medium="GPU"))
    assert 16 * 1024 < len(big) < 64 * 1024
    await engine.publish(0, big)
    await wait(sub, lambda s: s.batches == 1)
    assert sub.disconnects == 0 and sub.events == {"BlockStored": 1}


def test_the_message_size_is_a_routing_option_and_an_agent_flag():
    from types import SimpleNamespace

    from llmgw.commands.agent import parse_kv_message_size
    from llmgw.kv.external import ExternalKv
    from llmgw.kv.subscriber import DEFAULT_MAX_MESSAGE_BYTES
    from llmgw.plugins.kv_index import KvIndexOptions

    spec = SimpleNamespace(kv_events="tcp://127.0.0.1:5557", kv_replay=None)
    assert ExternalKv.of("r", spec, {}).max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES == 32 * 1024 * 1024
    assert ExternalKv.of("r", spec, {"max_event_message_bytes": "64MiB"}).max_message_bytes == 64 * 1024 * 1024
    assert KvIndexOptions.parse({"max_event_message_bytes": "2GiB"})[1] == [
        "max_event_message_bytes: must be from 1KiB to 1GiB"]
    assert parse_kv_message_size("1MiB") == 1024 * 1024
    with pytest.raises(ValueError, match="--kv-max-message-size '2GiB': must be from 1KiB to 1GiB"):
        parse_kv_message_size("2GiB")


class TaskSteps(trio.abc.Instrument):
    """Counts every task's steps (the runs between two of its checkpoints): two batches applied in the same step
    of the subscription's task held the Trio loop between them."""

    def __init__(self) -> None:
        self.steps: Counter[trio.lowlevel.Task] = Counter()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task] += 1


@pytest.fixture
async def witnessed(rig):
    """The rig, with each applied batch recorded with the step of the subscription's task it was applied in."""
    counter = TaskSteps()
    trio.lowlevel.add_instrument(counter)

    async def make():
        sub, engine, rec = await rig()
        steps: list[int] = []
        record = sub.on_batch

        def on_batch(batch: EventBatch) -> None:
            steps.append(counter.steps[trio.lowlevel.current_task()])
            record(batch)

        sub.on_batch = on_batch
        return sub, engine, rec, steps

    yield make
    trio.lowlevel.remove_instrument(counter)


BACKLOG = 40


async def test_a_backlog_of_live_batches_is_ingested_one_loop_step_each(witnessed):
    sub, engine, rec, steps = await witnessed()
    for seq in range(BACKLOG):
        data = payload(seq)
        engine.buffer[seq] = data
        engine.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), data])
    time.sleep(0.3)  # the loop busy elsewhere (not awaiting): the batches queue up on the SUB socket
    await wait(sub, lambda s: s.last_seq == BACKLOG - 1)
    assert rec.seqs() == list(range(BACKLOG)) and sub.gaps == 0
    # every batch in a loop step of its own: other tasks (the relays of first tokens) run between them
    assert len(set(steps)) == BACKLOG, f"{BACKLOG} batches applied in {len(set(steps))} steps"


async def test_a_long_replay_is_applied_one_loop_step_each(witnessed):
    sub, engine, rec, steps = await witnessed()
    for seq in range(BACKLOG):
        await engine.publish(seq, live=False)  # the engine ran before the subscription: a replay from 0
    await engine.publish(BACKLOG)
    await wait(sub, lambda s: s.last_seq == BACKLOG)
    assert rec.seqs() == list(range(BACKLOG + 1)) and sub.replays == {"filled": 1}
    assert len(set(steps)) == BACKLOG + 1, f"{BACKLOG + 1} batches applied in {len(set(steps))} steps"


async def test_an_engine_restart_notified_during_a_replay_ends_it(witnessed):
    sub, engine, rec, steps = await witnessed()
    record = sub.on_batch

    def on_batch(batch: EventBatch) -> None:
        record(batch)
        if int(batch.ts) == 5:
            sub.notify_engine_restart()  # the supervisor, between two replayed batches

    sub.on_batch = on_batch
    for seq in range(BACKLOG):
        await engine.publish(seq, live=False)
    await engine.publish(BACKLOG)
    await wait(sub, lambda s: s.resets)
    await trio.sleep(0.1)
    assert rec.seqs() == [0, 1, 2, 3, 4, 5]  # nothing more of the old run's replay, nor its live batch
    assert sub.resets == {"engine_restart": 1} and sub.last_seq is None


class ShortContext:
    """A real context whose next ``short`` sockets of ``kind`` cannot be opened (``EMFILE``), as in a process that
    ran out of descriptors."""

    def __init__(self, kind: int, short: int):
        self.ctx = zmq.Context()
        self.kind = kind
        self.short = short

    def socket(self, kind: int) -> zmq.Socket:
        if kind == self.kind and self.short > 0:
            self.short -= 1
            raise zmq.ZMQError(errno.EMFILE)
        return self.ctx.socket(kind)


async def test_a_subscription_waits_out_a_shortage_of_descriptors_then_receives(rig):
    before = FD_EXHAUSTION.counts.get("kv_subscription", 0)
    sub, engine, rec = await rig(context=ShortContext(zmq.SUB, 2))  # started once the third try opened it
    assert FD_EXHAUSTION.counts["kv_subscription"] == before + 2
    await engine.publish(0)
    await wait(sub, lambda s: s.batches == 1)
    assert rec.seqs() == [0]


async def test_a_replay_socket_that_cannot_be_opened_is_a_lost_gap_and_the_next_replay_opens_it(rig):
    before = FD_EXHAUSTION.counts.get("kv_replay", 0)
    sub, engine, rec = await rig(context=ShortContext(zmq.DEALER, 1))
    await engine.publish(0)
    await engine.publish(1, live=False)
    await engine.publish(2)  # a gap: its replay has no socket, so batch 1 is lost (a reset), never the task
    await wait(sub, lambda s: s.last_seq == 2)
    assert sub.replays == {"no_descriptor": 1} and sub.resets == {"gap": 1} and rec.seqs() == [0, 2]
    assert FD_EXHAUSTION.counts["kv_replay"] == before + 1
    await engine.publish(3, live=False)
    await engine.publish(4)  # the next gap: descriptors are back
    await wait(sub, lambda s: s.last_seq == 4)
    assert sub.replays == {"no_descriptor": 1, "filled": 1} and rec.seqs() == [0, 2, 3, 4]


SHORT_PROCESS = """
import errno, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from llmgw.kv import zmq_trio
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
for fd in held[-3:]:  # a socket's descriptor is free, but not the new context's threads' (libzmq would abort)
    os.close(fd)
try:
    zmq_trio.open_context()
except OSError as exc:
    sys.exit(0 if exc.errno == errno.EMFILE else 3)
sys.exit(4)
"""


def test_a_new_context_is_refused_with_an_error_not_an_abort_when_descriptors_are_short():
    done = subprocess.run([sys.executable, "-c", SHORT_PROCESS], capture_output=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr.decode()[-2000:])
