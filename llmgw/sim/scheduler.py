"""Continuous batching: which requests run in the next engine step, and what a step changes.

Pure and synchronous (no clock, no I/O), after vLLM v1's scheduler:

- running requests first, in admission order: each gets the tokens it still
  has to compute (one per decoding request, the rest of a chunked or resumed
  prefill), within the step's token budget (``max_num_batched_tokens``) and,
  with ``long_prefill_token_threshold`` > 0 while the engine holds more than
  one request (running and waiting, counted as the step is planned), at most
  that many (vLLM's ``--long-prefill-token-threshold``, 0.32; with
  ``adaptive_long_prefill``, its ``--long-prefill-token-threshold-adaptive``,
  never below ``max_num_batched_tokens`` // those requests);
  when its blocks do not fit, the most recently admitted running request is
  preempted (blocks freed, recomputed later from the start, prefix cache
  permitting) until they do;
- then, unless something was preempted, waiting requests in the queue's order
  (``fcfs``: arrival; ``priority``: a request's ``priority``, lower first, then
  arrival) while the budget, ``max_num_seqs`` and free blocks allow; each starts with
  its prefix-cache hit and computes the rest, capped the same way (chunked
  across steps when the budget is short; without ``chunked_prefill`` only a
  step with budget for the whole capped rest admits it, as in vLLM, where the
  cap applies first); the first that does not fit stops admission;
- with ``policy="priority"`` (vLLM's ``--scheduling-policy priority``) the
  request preempted when blocks run out is the running request of the lowest
  priority (the highest ``priority`` value, the latest arrival among equals),
  not the most recently admitted one; if it was already scheduled in this step,
  its tokens go back to the budget. As in vLLM (v0.10 to 0.32), a waiting
  request never preempts a running one: it is only ordered first among the
  waiting, so a running batch prefill keeps its share of every step's budget;
- after the step, every request whose scheduled tokens reached the end of its
  tokens samples one token; a request finishes at EOS or at its length limit,
  and its blocks are freed (cached blocks stay cached, evictable).

A request whose own step work raises (hashing its blocks, sampling its token)
is failed alone: it leaves the queues with its error and its blocks freed; the
other requests and the engine carry on.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field

import trio

from llmgw.kv.events import KVEvent

from .blockhash import SequenceHashes
from .cache import Block, KVCacheManager
from .timing import StepWork, causal_attention_pairs
from .tokenizer import EOS_ID

log = logging.getLogger(__name__)


FCFS, PRIORITY = "fcfs", "priority"  # vLLM's --scheduling-policy values
POLICIES = (FCFS, PRIORITY)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request inside the engine: its tokens, blocks and progress.

    ``planned_output`` is the whole output decided at submission (see
    ``sampler.py``); the scheduler reveals it one token per decode step.
    Consumers wait for progress with :meth:`wait_for_tokens`.
    """

    __slots__ = ("request_id", "prompt_len", "token_ids", "planned_output", "num_computed_tokens", "hashes",
                 "blocks", "num_cached_blocks", "lora_id", "lora_name", "num_cached_tokens", "status",
                 "finish_reason", "num_preemptions", "error", "scheduled_at", "first_token_at", "last_token_at",
                 "priority", "arrival", "_changed")

    def __init__(self, request_id: str, prompt_ids: list[int], planned_output: list[int], *,
                 hashes: SequenceHashes | None = None, lora_id: int | None = None, lora_name: str | None = None,
                 priority: int = 0):
        if not prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        if not planned_output:
            raise ValueError("a request must generate at least one token")
        self.request_id = request_id
        self.prompt_len = len(prompt_ids)
        self.token_ids = list(prompt_ids)
        self.planned_output = planned_output
        self.num_computed_tokens = 0
        self.hashes = hashes
        self.blocks: list[Block] = []
        self.num_cached_blocks = 0
        self.lora_id = lora_id
        self.lora_name = lora_name
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache, set when first scheduled
        self.status = Status.WAITING
        self.finish_reason: str | None = None  # "stop", "length", "abort" or "error"
        self.num_preemptions = 0
        self.error: str | None = None  # why the engine failed on this request
        self.scheduled_at: float | None = None  # when its first step began (the engine loop's clock)
        self.first_token_at = 0.0  # when its first and latest tokens came, on the engine's modelled clock
        self.last_token_at = 0.0
        self.priority = priority  # vLLM's request priority: lower is served first (policy "priority" only)
        self.arrival = -1  # its place in arrival order, set when the scheduler first takes it
        self._changed = trio.Event()
        if hashes is not None:
            hashes.extend(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def notify(self) -> None:
        self._changed.set()

    async def wait_for_tokens(self, seen: int) -> None:
        """Return once more than ``seen`` output tokens exist or the request finished."""
        while len(self.token_ids) - self.prompt_len <= seen and self.status is not Status.FINISHED:
            self._changed = trio.Event()
            await self._changed.wait()

    async def wait_finished(self) -> None:
        while self.status is not Status.FINISHED:
            self._changed = trio.Event()
            await self._changed.wait()


@dataclass(slots=True)
class Step:
    """What one engine step computes."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (request, tokens computed)
    prefill_tokens: int = 0  # tokens computed for prompts (or recomputation), not single decode tokens
    decode_requests: int = 0
    context_tokens: int = 0  # KV entries the step reads: each scheduled request's context, new tokens included
    attention_pairs: int = 0  # (query, key) pairs its new tokens attend to
    preempted: int = 0
    events: list[KVEvent] = field(default_factory=list)

    @property
    def work(self) -> StepWork:
        return StepWork(self.prefill_tokens, self.decode_requests, self.context_tokens, self.attention_pairs,
                        len(self.scheduled))


# vLLM's buckets of vllm:request_prefill_time_seconds (vllm/v1/metrics/loggers.py, request_latency_buckets)
PREFILL_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's buckets of vllm:inter_token_latency_seconds (the same in loggers.py since it was named so, v0.11)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
# llmgw_sim_step_seconds: a step's modelled length (x the time scale), from a decode step's few ms to a long prefill's
STEP_BUCKETS = (0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# llmgw_sim_step_overrun_seconds: how much later than modelled a step ended (the host's own delay)
OVERRUN_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass(slots=True)
class Histogram:
    """A Prometheus histogram's state: observations per bucket (each counting those up to its bound, as
    Prometheus exposes them), their sum and count."""

    bounds: tuple[float, ...]
    buckets: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.buckets = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.buckets[i] += 1


@dataclass(slots=True)
class SchedulerStats:
    """Monotonic counters, exported as ``vllm:`` metrics."""

    prefix_cache_queries: int = 0  # prompt tokens of admitted requests
    prefix_cache_hits: int = 0  # of those, tokens served from the prefix cache
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    steps: int = 0
    failed: int = 0  # requests failed by an error in their step work (finish_reason "error")
    # vLLM's request_prefill_time_seconds: first scheduled to first token, per request (the engine loop's clock)
    prefill: Histogram = field(default_factory=lambda: Histogram(PREFILL_TIME_BUCKETS))
    # vLLM's inter_token_latency_seconds (each token after a request's first: the time since its previous one) and
    # request_decode_time_seconds (a finished request's first token to its last), on the modelled clock: the sum of
    # the steps' modelled times (x the time scale), what the GPU would take, without the host's own delays
    inter_token: Histogram = field(default_factory=lambda: Histogram(INTER_TOKEN_LATENCY_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(PREFILL_TIME_BUCKETS))
    # each step's modelled length (x the time scale), and how much later than that it ended on the loop's clock: what
    # the modelled GPU took, told apart from what the host added (llmgw bench overload reports both beside its TTFTs)
    step: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS))
    overrun: Histogram = field(default_factory=lambda: Histogram(OVERRUN_BUCKETS))
    capped_chunks: int = 0  # prefill chunks cut short by long_prefill_token_threshold

    def observe_prefill(self, seconds: float) -> None:
        """One request's prefill time."""
        self.prefill.observe(seconds)


def _capped(tokens: int, cap: int) -> int:
    """``tokens``, at most ``cap`` when it is > 0."""
    return cap if 0 < cap < tokens else tokens


class Scheduler:
    """The waiting queue, the running batch and the KV cache manager."""

    def __init__(self, cache: KVCacheManager, *, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 chunked_prefill: bool = True, policy: str = FCFS, long_prefill_token_threshold: int = 0,
                 adaptive_long_prefill: bool = False):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: no cap)")
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.adaptive_long_prefill = adaptive_long_prefill
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy = policy
        self._arrivals = 0
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self.modelled_clock = 0.0  # the sum of the steps' modelled times (seconds): the engine's decode metrics' clock

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        if seq.arrival < 0:
            seq.arrival = self._arrivals
            self._arrivals += 1
        if self.policy == PRIORITY:
            self._queue_in_order(seq)
        else:
            self.waiting.append(seq)

    def _queue_in_order(self, seq: Sequence) -> None:
        """Insert ``seq`` where ``(priority, arrival)`` puts it (vLLM's priority queue, here a sorted deque: the
        admission loop and the debug route read it in order). Searched from the tail: a new arrival of the
        most common priority goes last at once."""
        waiting = self.waiting
        key = (seq.priority, seq.arrival)
        at = len(waiting)
        while at and (waiting[at - 1].priority, waiting[at - 1].arrival) > key:
            at -= 1
        waiting.insert(at, seq)

    def abort(self, seq: Sequence) -> None:
        """Finish ``seq`` now (client went away); its blocks are freed at once."""
        if self._remove(seq):
            self._finish(seq, "abort")

    def fail(self, seq: Sequence, exc: BaseException) -> None:
        """Finish ``seq`` with an error that its own step work raised; nothing else is touched."""
        log.error("request %s failed in the engine, which keeps running: %r", seq.request_id, exc,
                  exc_info=exc)
        if seq.status is Status.FINISHED:
            return
        try:
            self._remove(seq)
        except Exception:  # the queues or blocks were mid-change: drop what is left of it
            log.exception("freeing request %s after its failure failed too", seq.request_id)
            if seq in self.running:
                self.running.remove(seq)
        seq.error = f"{type(exc).__name__}: {exc}"
        seq.status = Status.FINISHED
        seq.finish_reason = "error"
        self.stats.failed += 1
        seq.notify()

    def _remove(self, seq: Sequence) -> bool:
        """Take an unfinished ``seq`` out of its queue and free its blocks; False if it was finished."""
        if seq.status is Status.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            return False
        self.cache.free(seq)  # a waiting request holds blocks only if its admission failed half way
        return True

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.stats.finished[reason] += 1

    def _preempt(self, seq: Sequence) -> None:
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        if self.policy == PRIORITY:
            self._queue_in_order(seq)  # vLLM: prepend_request is add_request in a priority queue
        else:
            self.waiting.appendleft(seq)

    def _take_victim(self) -> tuple[Sequence, int]:
        """Take the running request to preempt out of ``running``, with the index it had: the most recently
        admitted one (fcfs), or the one of the lowest priority, the latest arrival among equals (priority)."""
        running = self.running
        if self.policy != PRIORITY:
            return running.pop(), len(running)
        at = max(range(len(running)), key=lambda k: (running[k].priority, running[k].arrival))
        return running.pop(at), at

    @staticmethod
    def _unschedule(step: Step, seq: Sequence) -> int:
        """Take ``seq`` out of this step's plan; the tokens it was given (back to the budget)."""
        for k, (planned, num_new) in enumerate(step.scheduled):
            if planned is seq:
                del step.scheduled[k]
                return num_new
        return 0

    def preempt_all(self) -> int:
        """Preempt every running request (vLLM's ``reset_running_requests``); returns how many."""
        count = len(self.running)
        while self.running:
            self._preempt(self.running.pop())
        return count

    def chunk_cap(self) -> int:
        """The most tokens one request computes in the step about to be planned, 0 for no cap (vLLM 0.32's
        ``schedule``): the threshold, unless the engine holds a single request (nobody to starve); adaptive, never
        below the budget's fair share over the requests it holds."""
        held = len(self.running) + len(self.waiting)
        threshold = self.long_prefill_token_threshold if held > 1 else 0
        if threshold and self.adaptive_long_prefill:
            threshold = max(threshold, self.max_num_batched_tokens // held)
        return threshold

    def schedule(self) -> Step:
        """Plan the next step: allocate blocks (evictions and stores happen here, as in vLLM)."""
        step = Step()
        cache = self.cache
        budget = self.max_num_batched_tokens
        running = self.running
        scheduled = step.scheduled
        cap = self.chunk_cap()
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = min(_capped(len(seq.token_ids) - seq.num_computed_tokens, cap), budget)
            fits = self._allocate(seq, num_new)
            while fits is False:
                victim, at = self._take_victim()
                if at < i:  # scheduled earlier in this step (priority only): its tokens go back to the budget
                    i -= 1
                    budget += self._unschedule(step, victim)
                self._preempt(victim)
                step.preempted += 1
                if victim is seq:
                    break
                fits = self._allocate(seq, num_new)
            if fits is None:
                continue  # failed and removed: the next request is at index i now
            if not fits:
                break  # it preempted itself
            scheduled.append((seq, num_new))
            budget -= num_new
            i += 1
        if not step.preempted:
            self._admit(step, budget, cap)
        for seq, num_new in scheduled:
            if num_new == cap < len(seq.token_ids) - seq.num_computed_tokens:
                self.stats.capped_chunks += 1
            if num_new == 1 and seq.num_output_tokens and seq.num_computed_tokens == len(seq.token_ids) - 1:
                step.decode_requests += 1
            else:
                step.prefill_tokens += num_new
            step.context_tokens += seq.num_computed_tokens + num_new
            step.attention_pairs += causal_attention_pairs(seq.num_computed_tokens, num_new)
        step.events = cache.pool.take_events()
        return step

    def _allocate(self, seq: Sequence, num_new: int, hits: list[Block] | None = None) -> bool | None:
        """``allocate_slots``; None when it raised on this request (which is then failed)."""
        try:
            return self.cache.allocate_slots(seq, num_new, hits or [])
        except Exception as exc:
            self.fail(seq, exc)
            return None

    def _admit(self, step: Step, budget: int, cap: int) -> None:
        cache = self.cache
        size = cache.block_size
        waiting, running = self.waiting, self.running
        stats = self.stats
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            seq = waiting[0]
            try:
                hits = cache.computed_blocks(seq)
            except Exception as exc:
                self.fail(seq, exc)
                continue
            num_hit_tokens = len(hits) * size
            wanted = _capped(len(seq.token_ids) - num_hit_tokens, cap)
            if not self.chunked_prefill and wanted > budget:
                break  # its prefill must run whole: it waits for a step with budget for all of it
            num_new = min(wanted, budget)
            fits = self._allocate(seq, num_new, hits)
            if fits is None:
                continue
            if not fits:
                break
            waiting.popleft()
            seq.status = Status.RUNNING
            seq.num_computed_tokens = num_hit_tokens
            running.append(seq)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_hit_tokens
                stats.prefix_cache_queries += len(seq.token_ids)
                stats.prefix_cache_hits += num_hit_tokens
                stats.prompt_tokens += seq.prompt_len
            step.scheduled.append((seq, num_new))
            budget -= num_new

    def update(self, step: Step, seconds: float = 0.0) -> list[Sequence]:
        """Apply a computed step that lasted ``seconds`` (modelled): sample tokens, finish requests. Returns the
        requests that progressed."""
        progressed: list[Sequence] = []
        finished_any = False
        stats = self.stats
        stats.steps += 1
        stats.step.observe(seconds)
        self.modelled_clock += seconds
        for seq, num_new in step.scheduled:
            if seq.status is not Status.RUNNING:  # aborted (or failed) while the step ran
                continue
            try:
                finished_any |= self._advance(seq, num_new, progressed)
            except Exception as exc:
                self.fail(seq, exc)
        if finished_any:
            self.running = [s for s in self.running if s.status is Status.RUNNING]
        return progressed

    def _advance(self, seq: Sequence, num_new: int, progressed: list[Sequence]) -> bool:
        """Apply ``num_new`` computed tokens to ``seq``; True when it finished."""
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens < len(seq.token_ids):
            return False  # a prefill chunk: no token yet
        produced = seq.num_output_tokens
        token = seq.planned_output[produced]
        seq.token_ids.append(token)
        stats, now = self.stats, self.modelled_clock
        stats.generation_tokens += 1
        if produced:
            stats.inter_token.observe(now - seq.last_token_at)
        else:
            seq.first_token_at = now
        seq.last_token_at = now
        progressed.append(seq)
        if produced + 1 == len(seq.planned_output):
            stats.decode.observe(now - seq.first_token_at)
            self.cache.free(seq)
            self._finish(seq, "stop" if token == EOS_ID else "length")
            return True
        return False
