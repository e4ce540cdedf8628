"""The engine loop: runs scheduler steps on the Trio clock and hands out tokens and event batches.

Timing model (:mod:`llmgw.sim.timing`): a step lasts what the profile's
model says (constant: ``prefill_tokens / prefill_tokens_per_s +
decode_ms_per_step / 1000``; a GPU profile: its roofline over the batch),
times ``time_scale`` (0 = as fast as possible, still yielding to other tasks
between steps). Prefix-cache hits are not computed, so a hit saves exactly the
prefill time of its tokens. A request reaches the scheduler after the
profile's frontend overhead (none in the constant model). Tokens sampled by a step are delivered when the step ends; the
step's KV events go to the publisher as one batch at the same moment, as vLLM
publishes after the step ran. With nothing to do the loop sleeps on an event:
no polling, no CPU.

No request can stop the loop: the scheduler fails a request whose own step work
raises, and anything else a step raises fails the requests of that step (500s
for them, ``llmgw_sim_request_failures_total``), never the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import trio

from llmgw.kv.events import BlockStored, EventBatch, KVEvent

from .scheduler import Scheduler, Sequence, Step
from .timing import ConstantTiming, Timing

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FirstToken:
    """One request's first token, as the engine produced it (its arrival is its place in the scheduler's arrival
    order; the times are the engine loop's clock)."""

    request_id: str
    priority: int
    arrival: int
    scheduled_at: float
    first_token_at: float
    preemptions: int


class StepLoop:
    """Owns the scheduler; one task runs :meth:`run`."""

    def __init__(self, scheduler: Scheduler, *, prefill_tokens_per_s: float = 20000.0,
                 decode_ms_per_step: float = 20.0, timing: Timing | None = None, time_scale: float = 1.0,
                 data_parallel_rank: int = 0, events_out: trio.MemorySendChannel | None = None,
                 suppress_events: frozenset[str] = frozenset(), strip_token_ids: bool = False,
                 first_tokens_kept: int = 0):
        """``timing`` defaults to the constant model with ``prefill_tokens_per_s`` and ``decode_ms_per_step``.
        ``first_tokens_kept``: how many of the latest first tokens to keep in :attr:`first_tokens` (the order
        the engine served its requests in, for ``--debug-routes``); 0 keeps none."""
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.scheduler = scheduler
        self.timing: Timing = timing or ConstantTiming(prefill_tokens_per_s, decode_ms_per_step)
        self.time_scale = time_scale
        self.data_parallel_rank = data_parallel_rank
        self.events_out = events_out
        self.batches_published = 0  # batches handed to the publisher: the last one has seq batches_published - 1
        self.batches_dropped = 0  # batches the publisher could not take (queue full)
        # test switch: event types never published, as if the engine missed them (no sequence gap shows it)
        self.suppress_events = suppress_events
        self.events_suppressed = 0
        self.strip_token_ids = strip_token_ids  # test switch: BlockStored without token_ids (content keys impossible)
        self.first_tokens: deque[FirstToken] = deque(maxlen=first_tokens_kept or None)
        self._keep_first_tokens = first_tokens_kept > 0
        self._work = trio.Event()

    @property
    def cache(self):
        return self.scheduler.cache

    def step_seconds(self, step: Step) -> float:
        """Wall-clock length of ``step`` under the timing model."""
        return self.timing.step_seconds(step.work) * self.time_scale

    def submit(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self._work.set()

    async def arrive(self, seq: Sequence) -> None:
        """Submit ``seq`` after the frontend's overhead (HTTP, tokenization), as a request reaches vLLM's engine."""
        delay = self.timing.request_overhead_s * self.time_scale
        if delay > 0:
            await trio.sleep(delay)
        self.submit(seq)

    def abort(self, seq: Sequence) -> None:
        if not seq.finished:
            self.scheduler.abort(seq)
            seq.notify()
            self._work.set()

    def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> bool:
        """vLLM's reset: refused while blocks are in use, unless running requests are preempted first.

        ``AllBlocksCleared`` is published at once (vLLM publishes it with its next step).
        """
        if reset_running_requests and self.scheduler.preempt_all():
            self._work.set()
        ok = self.scheduler.cache.reset_prefix_cache()
        self._publish(self.scheduler.cache.pool.take_events())
        return ok

    def _publish(self, events: list[KVEvent]) -> None:
        if self.suppress_events and events:
            kept = [ev for ev in events if type(ev).__name__ not in self.suppress_events]
            self.events_suppressed += len(events) - len(kept)
            events = kept
        if self.strip_token_ids:
            events = [dataclasses.replace(ev, token_ids=[]) if isinstance(ev, BlockStored) else ev for ev in events]
        if not events or self.events_out is None:
            return
        try:
            self.events_out.send_nowait(EventBatch(time.time(), events, self.data_parallel_rank))
            self.batches_published += 1
        except trio.WouldBlock:
            self.batches_dropped += 1
            log.warning("KV event queue is full; dropped a batch of %d events", len(events))

    async def run(self) -> None:
        scheduler = self.scheduler
        while True:
            if not scheduler.has_work():
                self._work = trio.Event()
                await self._work.wait()
                continue
            started = trio.current_time()
            try:
                step = scheduler.schedule()
            except Exception as exc:  # not one request's own failure (those are failed inside): fail the batch
                self._fail_all(list(scheduler.running) + list(scheduler.waiting)[:1], exc)
                continue
            if not step.scheduled:
                # Nothing fits (cannot happen with a sane config); wait for a submission or an abort.
                self._publish(step.events)
                self._work = trio.Event()
                await self._work.wait()
                continue
            for seq, _ in step.scheduled:
                if seq.scheduled_at is None:
                    seq.scheduled_at = started
            seconds = self.step_seconds(step)
            if seconds > 0:
                await trio.sleep_until(started + seconds)
            else:
                await trio.lowlevel.checkpoint()
            scheduler.stats.overrun.observe(max(0.0, trio.current_time() - started - seconds))
            try:
                progressed = scheduler.update(step, seconds)
            except Exception as exc:
                self._fail_all([seq for seq, _ in step.scheduled], exc)
                progressed = []
            done = trio.current_time()
            for seq in progressed:
                if seq.num_output_tokens == 1 and seq.scheduled_at is not None:
                    scheduler.stats.observe_prefill(done - seq.scheduled_at)
                    if self._keep_first_tokens:
                        self.first_tokens.append(FirstToken(seq.request_id, seq.priority, seq.arrival,
                                                            seq.scheduled_at, done, seq.num_preemptions))
                seq.notify()
            self._publish(step.events)

    def _fail_all(self, seqs: list[Sequence], exc: Exception) -> None:
        log.error("an engine step failed; failing its %d requests, the engine keeps running", len(seqs))
        for seq in seqs:
            self.scheduler.fail(seq, exc)


def queue_size(max_queue_size: int | None) -> float:
    """Capacity of the engine -> publisher channel (vLLM's ``max_queue_size``)."""
    return math.inf if not max_queue_size else max_queue_size
