"""The decode and capacity charges of the routing cost model: what a new sequence costs where it decodes.

The time to first token (:mod:`llmgw.router.cost`) is what a request pays
before its answer starts; on a GPU, what it costs *after* that is its decode:
every engine step reads the weights and the KV cache of every running
sequence, so a step lasts longer the more sequences run and the longer their
contexts, and a replica whose KV cache fills up preempts (vLLM frees a running
sequence's blocks and computes it again later). Learnt per replica from the
streams the gateway relays (their token timings: :mod:`llmgw.gateway.latency`)::

    ITL(B, C) = base + per_sequence x B + per_context_token x C

with ``B`` the requests in flight on the replica and ``C`` their context
tokens (prompts and what they generated so far), both averaged over the
stretch of a stream observed. A stream is observed every
``SAMPLE_TOKENS`` tokens while it runs and once more when it ends, so a long
answer teaches the model long before it finishes. The fit is the TTFT model's
(an exponentially weighted ridge regression, :class:`llmgw.router.cost.Fit`),
each replica's shrunk toward all the model's replicas together. Per model,
the typical output length (tokens per stream) is a decayed mean over the
streams that ended.

For a request of ``P`` prompt tokens and a candidate ``r`` running ``B`` requests
with ``C`` context tokens (the rule, also in ``docs/routing.md``)::

    L           = expected output tokens: the typical length, at most the request's max_tokens
    ctx         = P + L / 2              the new sequence's context, averaged over its decode
    growth      = per_sequence + per_context_token x ctx     what it adds to every step there
    overlap     = min(L, typical / 2)                        how long a running sequence decodes beside it
    own(r)      = L x ITL_r(1, ctx) + overlap x (ITL_r(B + 1, C + ctx) - ITL_r(1, ctx))   its own decode time
    others(r)   = B x overlap x growth                       the delay it adds to the B sequences there (each
                                                             decodes about half a typical answer beside it)
    decode(r)   = weight x (own(r) - the smallest own of the candidates + others(r))
    free(r)     = (1 - KV usage) x KV capacity               vLLM's kv_cache_usage_perc and cache config
    demand(r)   = P + L + B x min(L, typical / 2)            its blocks and the others' growth meanwhile
    preempted(r) = max(0, demand(r) - free(r))               tokens the engine must preempt and compute again
    capacity(r) = weight x preempted(r) / throughput(r) x (1 + B)   every sequence there waits for the recompute

Both are in seconds of the users' waiting, like the cost they are added to,
so the cost model trades a prefill saved against a decode slowed. ``own`` is
counted beyond the fastest candidate's, so that a decode every candidate
would pay alike changes nothing (nor the ties). The slopes charged are those
of all the model's replicas together, and a replica's own ``base`` is used
only when it is more than ``BASE_DIFFERENCE`` away from all the replicas'
(another GPU); closer, the differences are the machine's noise (measured: two
identical simulators on one loaded host learnt bases of 9.1 and 10.0 ms, which
over a 1,100-token answer charged one of them 0.9 s for nothing, and four
learnt per-sequence slopes from 190 to 370 us: the one that looked cheapest
drew half of a burst). A replica the model has not
seen decode (no observation anywhere) is charged nothing, and neither is a
replica whose steps do not grow with the batch (the simulator's ``constant``
profile): the charges then change no decision. The capacity charge needs a
fresh scrape of the engine's ``/metrics`` (``engine_metrics_interval``).

Off by default (``cost_decode_weight: 0``: the charges are computed and
explained, but weigh nothing): measured on simulators sharing two loaded CPU
cores, the slopes learnt were the host's (each simulator's Python step growing
with its batch, five to ten times the modelled GPU's), and on the
``long-output`` workload the charge moved requests off their prompts' holders
for a hit rate of 0.77x ``cache_aware``'s and no better inter-token latency
(``docs/benchmarks.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from .cost import MAX_FORGOTTEN, SHRINK_WEIGHT, Fit, fit_line

DEFAULT_OUTPUT_TOKENS = 256.0  # the prior typical output length, until streams end
DEFAULT_DECODE_WEIGHT = 0.0  # off until measured on GPUs: on a shared CPU host the slopes learnt are its own
OUTPUT_DECAY = 0.97  # per stream that ended: about the last 33 count
SAMPLE_TOKENS = 32  # a running stream is observed every this many tokens
BASE_DIFFERENCE = 0.25  # a replica's own base ITL counts only this far (relative) from its peers': another GPU
MIN_SAMPLE_SECONDS = 1e-4
MAX_ITL = 30.0  # s: bounds of what one observation or the fit may say
MAX_PER_SEQUENCE = 1.0
MAX_PER_CONTEXT_TOKEN = 1e-3
MAX_OUTPUT_TOKENS = 1 << 20
CONTEXT_SCALE = 1024.0  # the context at which the prior weighs as one observation
SEQUENCE_SCALE = 4.0
MAX_STREAMS = 100_000  # streams followed at once (bounded: a gateway's in-flight requests are fewer)

Line = tuple[float, float, float, float]  # (base s, s per context token, s per sequence, noise s)


class TokenTimings(Protocol):
    """What the data plane knows of a stream's tokens (:class:`llmgw.gateway.latency.StreamWatch`)."""

    first_token_at: float | None
    last_token_at: float | None
    counts: list[int]


class ItlFit(Fit):
    """Observations ``itl ~ base + per_context_token x context + per_sequence x batch``."""

    __slots__ = ()
    SCALES = (1.0, CONTEXT_SCALE, SEQUENCE_SCALE)

    @staticmethod
    def bounded(theta: tuple[float, float, float]) -> tuple[float, float, float]:
        return (min(max(theta[0], 0.0), MAX_ITL), min(max(theta[1], 0.0), MAX_PER_CONTEXT_TOKEN),
                min(max(theta[2], 0.0), MAX_PER_SEQUENCE))


@dataclass
class _Live:
    """One replica's requests in flight as this gateway sees them, and their integrals over time (so that the
    mean batch and context over any stretch of a stream are two subtractions)."""

    at: float = 0.0
    requests: int = 0
    prompt_tokens: float = 0.0
    decoding: int = 0
    first_token_sum: float = 0.0  # sum of the decoding requests' first-token times
    area_requests: float = 0.0  # integral of requests dt
    area_prompt: float = 0.0  # integral of prompt_tokens dt
    area_age: float = 0.0  # integral of (sum over decoding requests of the time since their first token) dt

    def advance(self, now: float) -> None:
        dt = now - self.at
        if dt > 0:
            self.area_requests += self.requests * dt
            self.area_prompt += self.prompt_tokens * dt
            self.area_age += self.decoding * (now * now - self.at * self.at) / 2 - self.first_token_sum * dt
            self.at = now

    def age_sum(self, now: float) -> float:
        return max(0.0, self.decoding * now - self.first_token_sum)


@dataclass
class _Stream:
    """A stream being decoded: where it runs and the state at its last observation."""

    replica: str
    prompt_tokens: float
    first_at: float
    watch: TokenTimings | None
    at: float = 0.0
    gaps: int = 0
    seconds: float = 0.0
    area_requests: float = 0.0
    area_prompt: float = 0.0
    area_age: float = 0.0

    def mark(self, live: _Live, now: float, gaps: int, seconds: float) -> None:
        self.at, self.gaps, self.seconds = now, gaps, seconds
        self.area_requests, self.area_prompt, self.area_age = live.area_requests, live.area_prompt, live.area_age


@dataclass
class ReplicaDecode:
    data: ItlFit = field(default_factory=ItlFit)
    observations: int = 0
    live: _Live = field(default_factory=_Live)
    streams: dict[int, _Stream] = field(default_factory=dict)  # its requests in flight, by key
    engine: str | None = None


@dataclass(frozen=True, slots=True)
class DecodeCharge:
    """One candidate's decode and capacity charges and what they are made of."""

    output_tokens: float  # L
    batch: float  # B
    context_tokens: float  # C
    itl: float  # ITL_r(B + 1, C + ctx): the estimated gap between tokens with the request there
    growth: float  # what the request adds to every step there
    own_beyond_fastest: float
    others: float
    kv_free_tokens: float | None  # None: no fresh KV gauge
    preempted_tokens: float
    weight: float
    throughput: float

    @property
    def decode(self) -> float:
        return self.weight * (self.own_beyond_fastest + self.others)

    @property
    def capacity(self) -> float:
        return self.weight * self.preempted_tokens / self.throughput * (1 + self.batch)

    @property
    def total(self) -> float:
        return self.decode + self.capacity

    def as_json(self) -> dict[str, Any]:
        return {"decode_charge_s": round(self.decode, 4), "capacity_charge_s": round(self.capacity, 4),
                "decode": {"expected_output_tokens": round(self.output_tokens, 1), "batch": self.batch,
                           "context_tokens": round(self.context_tokens), "estimated_itl_s": round(self.itl, 6),
                           "itl_growth_s": round(self.growth, 7), "own_decode_beyond_fastest_s":
                           round(self.own_beyond_fastest, 4), "delay_to_running_s": round(self.others, 4),
                           "kv_free_tokens": None if self.kv_free_tokens is None else round(self.kv_free_tokens),
                           "preempted_tokens": round(self.preempted_tokens)}}


def max_output_tokens(body: dict[str, Any]) -> int | None:
    """The request's cap on its output (``max_completion_tokens`` or ``max_tokens``), None when it sets none."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_OUTPUT_TOKENS:
            return value
    return None


class DecodeModel:
    """Per model: every replica's ITL fit and in-flight requests, the typical output length, and the charges."""

    def __init__(self, prior_output_tokens: float = DEFAULT_OUTPUT_TOKENS, weight: float = DEFAULT_DECODE_WEIGHT,
                 decay: float = 0.97):
        self.weight = weight
        self.decay = decay
        self.replicas: dict[str, ReplicaDecode] = {}
        self.pooled = ItlFit()
        self.observations = 0
        self.prior_output_tokens = prior_output_tokens
        self._output_sum = 0.0  # decayed sums of the streams' lengths
        self._output_weight = 0.0
        self.streams: dict[int, str] = {}  # key of a request in flight -> its replica
        self.moved = {"decode": 0, "capacity": 0}  # decisions the charges moved (llmgw_routing_decode_moves_total)

    def replica(self, name: str) -> ReplicaDecode:
        state = self.replicas.get(name)
        if state is None:
            state = self.replicas[name] = ReplicaDecode()
        return state

    def follow(self, replicas: Sequence[Any]) -> None:
        """A replica name now on another engine forgets its own fit (as :meth:`CostModel.follow`)."""
        for replica in replicas:
            state = self.replica(replica.name)
            if state.engine != replica.engine_id:
                if state.engine is not None:
                    state.data, state.observations = ItlFit(), 0
                state.engine = replica.engine_id
        if len(self.replicas) > MAX_FORGOTTEN + 2 * len(replicas):  # replicas come and go: drop the idle gone
            keep = {replica.name for replica in replicas}
            for name in [n for n, state in self.replicas.items() if n not in keep and not state.streams]:
                del self.replicas[name]

    # -- what it has learnt -------------------------------------------------------------------------------------------

    @property
    def typical_output_tokens(self) -> float:
        return (self.prior_output_tokens + self._output_sum) / (1.0 + self._output_weight)

    def pooled_line(self) -> Line:
        return fit_line((0.0, 0.0, 0.0), self.pooled, self.observations)

    def line(self, name: str) -> Line:
        """The replica's fit, shrunk toward the pooled one until its own observations weigh ``SHRINK_WEIGHT``."""
        pooled = self.pooled_line()
        state = self.replica(name)
        own = fit_line(pooled[:3], state.data, state.observations)
        trust = state.data.w / (state.data.w + SHRINK_WEIGHT)
        base, per_context, per_sequence, noise = (p + trust * (o - p) for p, o in zip(pooled, own))
        return base, per_context, per_sequence, noise

    def charged_line(self, name: str) -> tuple[float, float, float]:
        """``(base, per_context_token, per_sequence)`` the charges use for ``name``: the slopes of all the model's
        replicas together, and the replica's own base only when it is more than ``BASE_DIFFERENCE`` from theirs."""
        pooled_base, per_context, per_sequence, _ = self.pooled_line()
        base = self.line(name)[0]
        if abs(base - pooled_base) <= BASE_DIFFERENCE * pooled_base:
            base = pooled_base  # the same hardware, seen through the machine's noise
        return base, per_context, per_sequence

    def live_requests(self, name: str) -> int:
        """This gateway's requests in flight on ``name`` as the decode model follows them."""
        return self.replica(name).live.requests

    def describe(self, name: str) -> dict[str, Any]:
        base, per_context, per_sequence = self.charged_line(name)
        own_base, own_per_context, own_per_sequence, noise = self.line(name)
        return {"itl_base_s": round(base, 6), "itl_per_sequence_s": round(per_sequence, 8),
                "itl_per_context_token_s": round(per_context, 10), "itl_noise_s": round(noise, 6),
                "own_fit": {"itl_base_s": round(own_base, 6), "itl_per_sequence_s": round(own_per_sequence, 8),
                            "itl_per_context_token_s": round(own_per_context, 10)},
                "itl_observations": self.replica(name).observations,
                "typical_output_tokens": round(self.typical_output_tokens, 1)}

    # -- learning: the tier's hooks call these -------------------------------------------------------------------------

    def routed(self, name: str, key: int, prompt_tokens: float, now: float) -> None:
        """A request (``key``: the same in the later calls) with ``prompt_tokens`` was handed to ``name``."""
        if key in self.streams or len(self.streams) >= MAX_STREAMS:
            return
        state = self.replica(name)
        live = state.live
        live.advance(now)
        live.requests += 1
        live.prompt_tokens += prompt_tokens
        self.streams[key] = name
        state.streams[key] = _Stream(name, prompt_tokens, math.nan, None)
        self._sample_running(state, now)

    def first_token(self, key: int, watch: TokenTimings | None, now: float) -> None:
        """Its first token came; ``watch`` is its stream's token timings (None: not streamed)."""
        name = self.streams.get(key)
        stream = self.replicas[name].streams.get(key) if name in self.replicas else None
        if stream is None or not math.isnan(stream.first_at):
            return
        live = self.replicas[stream.replica].live
        live.advance(now)
        live.decoding += 1
        live.first_token_sum += now
        stream.first_at = now
        stream.watch = watch
        stream.mark(live, now, 0, 0.0)

    def finished(self, key: int, now: float) -> None:
        """It ended (answered, failed or abandoned): a last observation of its stream, and its length."""
        name = self.streams.pop(key, None)
        state = self.replicas.get(name) if name is not None else None
        stream = state.streams.pop(key, None) if state is not None else None
        if state is None or stream is None:
            return
        live = state.live
        live.advance(now)
        if not math.isnan(stream.first_at):
            gaps = self._sample(state, stream, now, final=True)
            live.decoding -= 1
            live.first_token_sum -= stream.first_at
            if live.decoding <= 0:
                live.decoding, live.first_token_sum = 0, 0.0
            if gaps:
                length = min(gaps + 1, MAX_OUTPUT_TOKENS)
                self._output_sum = self._output_sum * OUTPUT_DECAY + length
                self._output_weight = self._output_weight * OUTPUT_DECAY + 1.0
        live.requests = max(0, live.requests - 1)
        live.prompt_tokens = max(0.0, live.prompt_tokens - stream.prompt_tokens)
        if not live.requests:
            live.prompt_tokens = 0.0
        self._sample_running(state, now)

    def _sample_running(self, state: ReplicaDecode, now: float) -> None:
        for stream in state.streams.values():
            if stream.watch is not None:
                self._sample(state, stream, now, final=False)

    def _sample(self, state: ReplicaDecode, stream: _Stream, now: float, final: bool) -> int:
        """Observe ``stream`` since its last mark when ``SAMPLE_TOKENS`` or more came (any at its end); its gaps."""
        watch = stream.watch
        if watch is None or watch.first_token_at is None or watch.last_token_at is None:
            return 0
        gaps = sum(watch.counts)
        seconds = watch.last_token_at - watch.first_token_at
        new_gaps, new_seconds, dt = gaps - stream.gaps, seconds - stream.seconds, now - stream.at
        if new_gaps < (1 if final else SAMPLE_TOKENS) or new_seconds < MIN_SAMPLE_SECONDS or dt < MIN_SAMPLE_SECONDS:
            return gaps
        live = state.live
        itl = new_seconds / new_gaps
        batch = (live.area_requests - stream.area_requests) / dt
        age = (live.area_age - stream.area_age) / dt  # sequence-seconds since their first tokens, on average
        context = (live.area_prompt - stream.area_prompt) / dt + age / itl
        stream.mark(live, now, gaps, seconds)
        self.observe(stream.replica, batch, context, itl)
        return gaps

    def observe(self, name: str, batch: float, context: float, itl: float) -> None:
        """One stretch of a stream on ``name``: ``itl`` seconds a token, with ``batch`` requests of ``context``
        tokens in flight on average."""
        if not (0 < itl <= MAX_ITL and 0 <= batch < 1 << 20 and 0 <= context < 1 << 40):
            return
        state = self.replica(name)
        state.data.add(context, batch, itl, self.decay)
        state.observations += 1
        self.pooled.add(context, batch, itl, self.decay)
        self.observations += 1

    # -- the charges ---------------------------------------------------------------------------------------------------

    def charges(self, names: Sequence[str], prompt_tokens: int, max_tokens: int | None, batches: Sequence[float],
                prompt_contexts: Sequence[float], throughputs: Sequence[float],
                kv_free: Sequence[float | None], now: float) -> list[DecodeCharge]:
        """Each candidate's :class:`DecodeCharge` for a request of ``prompt_tokens`` capped at ``max_tokens``
        output tokens: ``batches[i]`` requests in flight there with ``prompt_contexts[i]`` prompt tokens,
        ``kv_free[i]`` free KV tokens (None: unknown), ``throughputs[i]`` its prefill tokens/s."""
        typical = self.typical_output_tokens
        length = min(typical, max_tokens) if max_tokens is not None else typical
        overlap = min(length, typical / 2)  # how long a running sequence decodes beside it: half a typical one
        mean_context = prompt_tokens + length / 2
        parts = []
        for i, name in enumerate(names):
            base, per_context, per_sequence = self.charged_line(name)
            state = self.replica(name)
            live = state.live
            batch = batches[i]
            itl_now = base + per_context * prompt_contexts[i] + per_sequence * batch
            generated = live.age_sum(now) / itl_now if itl_now > 0 else 0.0
            if live.decoding and batch > live.requests and live.requests:
                generated *= batch / live.requests  # the other gateways' sequences decode there too
            context = prompt_contexts[i] + generated
            growth = per_sequence + per_context * mean_context
            alone = base + growth  # its own steps with nothing else running
            itl = alone + per_context * context + per_sequence * batch
            free = kv_free[i] if i < len(kv_free) else None
            preempted = 0.0
            if free is not None:
                preempted = max(0.0, prompt_tokens + length + batch * min(length, typical / 2) - free)
            own = length * alone + overlap * (itl - alone)  # the others slow it while they run: overlap tokens
            parts.append((batch, context, itl, growth, own, batch * overlap * growth, free, preempted))
        fastest = min((p[4] for p in parts), default=0.0)
        return [DecodeCharge(length, batch, context, itl, growth, own - fastest, others, free, preempted,
                             self.weight, throughputs[i])
                for i, (batch, context, itl, growth, own, others, free, preempted) in enumerate(parts)]
