"""The decode and capacity charges of the routing cost model: what a new sequence costs where it decodes.

The time to first token (:mod:`llmgw.router.cost`) is what a request pays
before its answer starts; on a GPU, what it costs *after* that is its decode:
every engine step reads the weights and the KV cache of every running
sequence, so a step lasts longer the more sequences run and the longer their
contexts, and a replica whose KV cache fills up preempts (vLLM frees a running
sequence's blocks and computes it again later). Learnt per replica from the
streams the gateway relays (their token timings: :mod:`llmgw.gateway.latency`)::

    ITL(B, C) = base + per_sequence x B + per_context_token x C
                     + host_per_sequence x B_fleet + host_per_context_token x C_fleet

with ``B`` the requests in flight on the replica and ``C`` their context
tokens (prompts and what they generated so far), ``B_fleet`` and ``C_fleet``
the same on the fleet's mean replica, all averaged over the stretch of a
stream observed. The host terms are what slows every replica alike when the
fleet is busy (simulators sharing a CPU, the gateway relaying more streams):
no pick avoids that, so it is never charged. Without them, in a closed loop
where every replica's batch rises and falls with the fleet's, the host's
slowdown was learnt as each replica's own (0.2-0.4 ms a sequence on two
loaded cores, where the simulated H100 adds ~0.04 ms). A stream is observed every
``SAMPLE_TOKENS`` tokens while it runs and once more when it ends, so a long
answer teaches the model long before it finishes. The fit is the TTFT model's
(an exponentially weighted ridge regression, :class:`llmgw.router.cost.Fit`),
each replica's shrunk toward all the model's replicas together. Where the
engines report their own inter-token latency (vLLM's histogram on ``/metrics``,
scraped with ``engine_metrics_interval``: :mod:`llmgw.router.engine_itl`), each
replica's line from those windows is charged instead (``cost_decode_source``:
``auto``, the default, as soon as any engine reported, and the prior line
until then; ``engine`` only; ``gateway``: the fit of the streams' gaps): an
engine's own step times carry no host in them. Per model,
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

    uncertainty(r) = weight x sd(L) x sqrt(B x growth^2 + (ITL_r(B + 1, C + ctx) - ITL_r(1, ctx))^2)

(``sd(L)``: the spread of the streams' lengths; each sequence there and the new
one decode beside each other for an independent length), which the override
gate adds to the TTFT estimates' (:mod:`llmgw.router.uncertainty`).

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
seen decode (no observation anywhere) is charged on the prior line (below), and
a replica whose steps do not grow with the batch (the simulator's ``constant``
profile) is soon charged ~nothing by a learnt line: the charges then change no
decision. The capacity charge needs a
fresh scrape of the engine's ``/metrics`` (``engine_metrics_interval``).

On by default (``cost_decode_weight: 1``, since issue 31), on the prior line
(``DEFAULT_ITL_*``: an H100 serving an 8B model; the options
``cost_itl_per_sequence`` and ``cost_itl_per_context_token``) until an engine
reports its ITL, whose line then replaces it (the engines' lines and the
gateway's fit are also pulled toward it, as one observation, fading as data
come in). So a burst of streams opened a few ms apart, none decoding yet when
the next is placed, is charged from the requests in flight on each candidate
and the expected output: 40 streams of 400 tokens under one long prompt went
all to its holder without it, and spread over the 4 replicas with it. The
gateway's fit of the streams' gaps is charged only with ``cost_decode_source:
gateway``: on loaded hosts its per-sequence slope was the simulator process's
own Python work, and charged by default it cost cache hits (``zipf`` 0.96x,
``long-output`` 0.81x) for no goodput (``docs/benchmarks/routing-workloads.md``).
``cost_decode_weight: 0`` computes and explains the charges but weighs them not
at all (the default before).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from .cost import MAX_FORGOTTEN, MIN_NOISE_OBSERVATIONS, PRIOR_WEIGHT, SHRINK_WEIGHT

DEFAULT_OUTPUT_TOKENS = 256.0  # the prior typical output length, until streams end
DEFAULT_DECODE_WEIGHT = 1.0  # on: concurrent long streams spread as a GPU would want (docs/routing.md)
# The prior ITL line, until streams or engines tell one: an H100 serving Llama-3.1-8B (what the simulator's default
# profile models). A step reads the weights (16 GB at 80 % of 3.35 TB/s: ~6 ms) and every running sequence's KV
# cache (128 KiB a token: ~49 ns a context token), and prepares each sequence on the host (~20 us).
DEFAULT_ITL_BASE = 0.0065
DEFAULT_ITL_PER_CONTEXT_TOKEN = 5e-8
DEFAULT_ITL_PER_SEQUENCE = 2e-5
SOURCES = ("auto", "engine", "gateway")  # where the charged ITL line comes from (cost_decode_source)
DEFAULT_SOURCE = "auto"  # the engines' reported ITL where any engine reported it, else the prior line
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
Theta = tuple[float, ...]  # base, per context token, per sequence, the host's per context token and per sequence
FEATURES = 5


class TokenTimings(Protocol):
    """What the data plane knows of a stream's tokens (:class:`llmgw.gateway.latency.StreamWatch`)."""

    first_token_at: float | None
    last_token_at: float | None
    counts: list[int]


class ItlFit:
    """Decayed weighted sums of observations ``itl ~ base + per_context_token x context + per_sequence x batch
    + host_per_context_token x fleet context + host_per_sequence x fleet batch`` for a ridge least squares (the
    cost model's :class:`~llmgw.router.cost.Fit`, with the fleet's two terms beside the replica's own)."""

    __slots__ = ("w", "s", "sy", "yy", "_solved")
    SCALES = (1.0, CONTEXT_SCALE, SEQUENCE_SCALE, CONTEXT_SCALE, SEQUENCE_SCALE)
    BOUNDS = (MAX_ITL, MAX_PER_CONTEXT_TOKEN, MAX_PER_SEQUENCE, MAX_PER_CONTEXT_TOKEN, MAX_PER_SEQUENCE)

    def __init__(self) -> None:
        self.w = 0.0
        self.s = [[0.0] * FEATURES for _ in range(FEATURES)]
        self.sy = [0.0] * FEATURES
        self.yy = 0.0
        # (prior, theta) of the last solve since the last observation: a decision reads each fit several times
        # (every candidate's line, the host's), with the same prior, between observations
        self._solved: tuple[tuple[float, ...], Theta] | None = None

    def add(self, f: Sequence[float], y: float, decay: float) -> None:
        self._solved = None
        self.w = self.w * decay + 1.0
        for i in range(FEATURES):
            row = self.s[i]
            for j in range(FEATURES):
                row[j] = row[j] * decay + f[i] * f[j]
            self.sy[i] = self.sy[i] * decay + f[i] * y
        self.yy = self.yy * decay + y * y

    def merge(self, other: "ItlFit") -> None:
        """Add ``other``'s observations to these (a pooled fit of several replicas')."""
        self._solved = None
        self.w += other.w
        for i in range(FEATURES):
            for j in range(FEATURES):
                self.s[i][j] += other.s[i][j]
            self.sy[i] += other.sy[i]
        self.yy += other.yy

    def solve(self, prior: Sequence[float]) -> Theta:
        """Pulled toward ``prior`` as much as :meth:`llmgw.router.cost.Fit.prior_weight` observations, within
        bounds (each at least 0)."""
        prior = tuple(prior)
        if self._solved is not None and self._solved[0] == prior:
            return self._solved[1]
        weight = PRIOR_WEIGHT / (1.0 + self.w)
        a = [row[:] for row in self.s]
        b = self.sy[:]
        for i, scale in enumerate(self.SCALES):
            a[i][i] += weight * scale * scale
            b[i] += weight * scale * scale * prior[i]
        # solved in units where every diagonal term is 1: the features' scales differ by ~10 orders of magnitude
        # (a batch, a context of 10^5 tokens squared), and the singularity test is relative to the largest
        d = [math.sqrt(a[i][i]) if a[i][i] > 0 else 1.0 for i in range(FEATURES)]
        scaled = _solve([[a[i][j] / (d[i] * d[j]) for j in range(FEATURES)] for i in range(FEATURES)],
                        [b[i] / d[i] for i in range(FEATURES)])
        theta = [y / d[i] for i, y in enumerate(scaled)] if scaled is not None else list(prior)
        solved = tuple(min(max(t, 0.0), bound) for t, bound in zip(theta, self.BOUNDS))
        self._solved = prior, solved
        return solved

    def residual(self, theta: Sequence[float]) -> float:
        """The weighted RMS of ``y - theta . f`` over the observations (0 without any)."""
        if self.w <= 0:
            return 0.0
        sse = self.yy - 2 * sum(t * s for t, s in zip(theta, self.sy))
        sse += sum(theta[i] * theta[j] * self.s[i][j] for i in range(FEATURES) for j in range(FEATURES))
        return math.sqrt(max(sse, 0.0) / self.w)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(b)
    m = [row[:] + [y] for row, y in zip(a, b)]
    scale = max((abs(m[i][i]) for i in range(n)), default=0.0) or 1.0
    for k in range(n):
        pivot = max(range(k, n), key=lambda i: abs(m[i][k]))
        if not math.isfinite(m[pivot][k]) or abs(m[pivot][k]) <= 1e-12 * scale:
            return None
        m[k], m[pivot] = m[pivot], m[k]
        for i in range(k + 1, n):
            factor = m[i][k] / m[k][k]
            for j in range(k, n + 1):
                m[i][j] -= factor * m[k][j]
    x = [0.0] * n
    for k in range(n - 1, -1, -1):
        x[k] = (m[k][n] - sum(m[k][j] * x[j] for j in range(k + 1, n))) / m[k][k]
    return x


def _line(prior: Sequence[float], data: ItlFit, observations: int) -> tuple[Theta, float]:
    theta = data.solve(prior)
    return theta, data.residual(theta) if observations >= MIN_NOISE_OBSERVATIONS else 0.0


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

    def start(self, prompt_tokens: float, now: float) -> None:
        self.advance(now)
        self.requests += 1
        self.prompt_tokens += prompt_tokens

    def first_token(self, now: float) -> None:
        self.advance(now)
        self.decoding += 1
        self.first_token_sum += now

    def end(self, prompt_tokens: float, first_at: float, now: float) -> None:
        """A request of ``prompt_tokens`` ended (``first_at``: its first token's time, NaN if none came)."""
        self.advance(now)
        if not math.isnan(first_at):
            self.decoding -= 1
            self.first_token_sum -= first_at
            if self.decoding <= 0:
                self.decoding, self.first_token_sum = 0, 0.0
        self.requests = max(0, self.requests - 1)
        self.prompt_tokens = max(0.0, self.prompt_tokens - prompt_tokens)
        if not self.requests:
            self.prompt_tokens = 0.0


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
    fleet_requests: float = 0.0  # the same integrals over every replica of the model
    fleet_prompt: float = 0.0
    fleet_age: float = 0.0

    def mark(self, live: _Live, fleet: _Live, now: float, gaps: int, seconds: float) -> None:
        self.at, self.gaps, self.seconds = now, gaps, seconds
        self.area_requests, self.area_prompt, self.area_age = live.area_requests, live.area_prompt, live.area_age
        self.fleet_requests, self.fleet_prompt, self.fleet_age = fleet.area_requests, fleet.area_prompt, fleet.area_age


@dataclass
class ReplicaDecode:
    data: ItlFit = field(default_factory=ItlFit)
    observations: int = 0
    live: _Live = field(default_factory=_Live)
    streams: dict[int, _Stream] = field(default_factory=dict)  # its requests in flight, by key
    engine: str | None = None
    engine_itl: Any = None  # its engine's reported ITL fit (llmgw.router.engine_itl.EngineItl), None: not known


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
    spread: float = 0.0  # the standard error of the decode charge before its weight (s): the outputs' lengths

    @property
    def uncertainty(self) -> float:
        return self.weight * self.spread

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
                           "preempted_tokens": round(self.preempted_tokens),
                           "decode_uncertainty_s": round(self.uncertainty, 4)}}


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
                 decay: float = 0.97, source: str = DEFAULT_SOURCE,
                 prior_per_sequence: float = DEFAULT_ITL_PER_SEQUENCE,
                 prior_per_context_token: float = DEFAULT_ITL_PER_CONTEXT_TOKEN):
        if source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
        self.weight = weight
        # what every line is pulled toward (as one observation's worth, fading as data come in): the charge works
        # from the requests in flight and their expected output before any of them has decoded (a burst)
        # (both slopes 0: the all-zero prior of before issue 31, nothing charged before data)
        base = DEFAULT_ITL_BASE if prior_per_sequence or prior_per_context_token else 0.0
        self.prior: Theta = (base, prior_per_context_token, prior_per_sequence, 0.0, 0.0)
        self.source = source
        self._engine_pooled: tuple[tuple[int, ...], Theta] | None = None  # (the fits' window counts, pooled line)
        self.decay = decay
        self.replicas: dict[str, ReplicaDecode] = {}
        self.pooled = ItlFit()
        self.observations = 0
        self.prior_output_tokens = prior_output_tokens
        self._output_sum = 0.0  # decayed sums of the streams' lengths (and of their squares, below)
        self._output_weight = 0.0
        self.streams: dict[int, str] = {}  # key of a request in flight -> its replica
        self.fleet = _Live()  # every replica's requests together: the common load the fit is relative to
        self._fleet_size = 0  # the candidates last followed (0: the replicas seen)
        self._output_squares = 0.0
        self.moved = {"decode": 0, "capacity": 0}  # decisions the charges moved (llmgw_routing_decode_moves_total)

    def replica(self, name: str) -> ReplicaDecode:
        state = self.replicas.get(name)
        if state is None:
            state = self.replicas[name] = ReplicaDecode()
        return state

    def follow(self, replicas: Sequence[Any]) -> None:
        """A replica name now on another engine forgets its own fit (as :meth:`CostModel.follow`)."""
        self._fleet_size = len(replicas)
        for replica in replicas:
            state = self.replica(replica.name)
            if state.engine != replica.engine_id:
                if state.engine is not None:
                    state.data, state.observations = ItlFit(), 0
                state.engine = replica.engine_id
            state.engine_itl = getattr(replica, "engine_itl", None)
        if len(self.replicas) > MAX_FORGOTTEN + 2 * len(replicas):  # replicas come and go: drop the idle gone
            keep = {replica.name for replica in replicas}
            for name in [n for n, state in self.replicas.items() if n not in keep and not state.streams]:
                del self.replicas[name]

    # -- what it has learnt -------------------------------------------------------------------------------------------

    @property
    def fleet_size(self) -> int:
        return self._fleet_size or len(self.replicas) or 1

    @property
    def typical_output_tokens(self) -> float:
        return (self.prior_output_tokens + self._output_sum) / (1.0 + self._output_weight)

    @property
    def output_tokens_spread(self) -> float:
        """The standard deviation of the streams' lengths (decayed as their mean; 0 before any ended)."""
        if self._output_weight <= 0:
            return 0.0
        mean = self._output_sum / self._output_weight
        return math.sqrt(max(0.0, self._output_squares / self._output_weight - mean * mean))

    def pooled_line(self) -> Line:
        theta, noise = _line(self.prior, self.pooled, self.observations)
        return theta[0], theta[1], theta[2], noise

    def host_line(self) -> tuple[float, float]:
        """What every replica's ITL grows by per sequence and per context token in flight on the fleet's mean
        replica: the host's (a shared CPU) or the data plane's, the same whichever replica a request goes to."""
        theta = self.pooled.solve(self.prior)
        return theta[3], theta[4]

    def line(self, name: str) -> Line:
        """The replica's fit, shrunk toward the pooled one until its own observations weigh ``SHRINK_WEIGHT``."""
        pooled, pooled_noise = _line(self.prior, self.pooled, self.observations)
        state = self.replica(name)
        own, own_noise = _line(pooled, state.data, state.observations)
        trust = state.data.w / (state.data.w + SHRINK_WEIGHT)
        base, per_context, per_sequence, noise = (p + trust * (o - p) for p, o in
                                                  zip((*pooled[:3], pooled_noise), (*own[:3], own_noise)))
        return base, per_context, per_sequence, noise

    def engine_fits(self) -> list[tuple[str, Any]]:
        """``(replica, its EngineItl)`` of the replicas whose engines reported ITL windows."""
        return [(name, state.engine_itl) for name, state in self.replicas.items()
                if state.engine_itl is not None and state.engine_itl.windows]

    def engine_pooled_line(self) -> Theta | None:
        """The line of every replica's engine-reported windows together, None before any engine reported one."""
        fits = self.engine_fits()
        if not fits:
            return None
        key = tuple(fit.windows for _, fit in fits)
        if self._engine_pooled is None or self._engine_pooled[0] != key:
            pooled = ItlFit()
            for _, fit in fits:
                pooled.merge(fit.data)
            self._engine_pooled = key, pooled.solve(self.prior)
        return self._engine_pooled[1]

    def engine_line(self, name: str, pooled: Theta | None = None) -> tuple[float, float, float] | None:
        """``(base, per_context_token, per_sequence)`` from ``name``'s engine's reported windows, shrunk toward all
        the engines' (``pooled``: :meth:`engine_pooled_line`, when the caller has it) until its own weigh
        ``SHRINK_WEIGHT``; None before any engine reported one."""
        pooled = pooled or self.engine_pooled_line()
        if pooled is None:
            return None
        engine_itl = self.replica(name).engine_itl
        if engine_itl is None or not engine_itl.windows:
            return pooled[0], pooled[1], pooled[2]
        own = engine_itl.data.solve(pooled)
        trust = engine_itl.data.w / (engine_itl.data.w + SHRINK_WEIGHT)
        base, per_context, per_sequence = (p + trust * (o - p) for p, o in zip(pooled[:3], own[:3]))
        return base, per_context, per_sequence

    @property
    def source_in_use(self) -> str:
        """Where the charged lines come from now: ``engine``, ``gateway``, ``prior`` (the gateway's, before any
        stream was observed: the prior line alone), or ``none`` (``cost_decode_source: engine`` before any engine
        reported its ITL: nothing charged)."""
        if self.source != "gateway" and self.engine_fits():
            return "engine"
        if self.source == "engine":
            return "none"
        return "gateway" if self.source == "gateway" and self.observations else "prior"

    def charged_line(self, name: str, source: str | None = None,
                     engine_pooled: Theta | None = None) -> tuple[float, float, float]:
        """``(base, per_context_token, per_sequence)`` the charges use for ``name``: its engine's reported line
        (:meth:`engine_line`) when the source allows and any engine reported one; else the gateway's observed
        slopes of all the model's replicas together, and the replica's own base only when it is more than
        ``BASE_DIFFERENCE`` from theirs (nothing under ``engine`` only). ``source`` and ``engine_pooled``: the
        :attr:`source_in_use` and :meth:`engine_pooled_line` when the caller has them (once for all candidates)."""
        source = source or self.source_in_use
        if source == "prior":
            return self.prior[0], self.prior[1], self.prior[2]
        if source != "gateway":
            line = self.engine_line(name, engine_pooled) if source == "engine" else None
            return line if line is not None else (0.0, 0.0, 0.0)
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
        engine_itl = self.replica(name).engine_itl
        return {"itl_source": self.source_in_use, "itl_base_s": round(base, 6),
                "itl_per_sequence_s": round(per_sequence, 8),
                "itl_per_context_token_s": round(per_context, 10), "itl_noise_s": round(noise, 6),
                "engine_itl_windows": 0 if engine_itl is None else engine_itl.windows,
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
        state.live.start(prompt_tokens, now)
        self.fleet.start(prompt_tokens, now)
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
        live.first_token(now)
        self.fleet.first_token(now)
        stream.first_at = now
        stream.watch = watch
        stream.mark(live, self.fleet, now, 0, 0.0)

    def finished(self, key: int, now: float) -> None:
        """It ended (answered, failed or abandoned): a last observation of its stream, and its length."""
        name = self.streams.pop(key, None)
        state = self.replicas.get(name) if name is not None else None
        stream = state.streams.pop(key, None) if state is not None else None
        if state is None or stream is None:
            return
        state.live.advance(now)
        self.fleet.advance(now)
        if not math.isnan(stream.first_at):
            gaps = self._sample(state, stream, now, final=True)
            if gaps:
                length = min(gaps + 1, MAX_OUTPUT_TOKENS)
                self._output_sum = self._output_sum * OUTPUT_DECAY + length
                self._output_squares = self._output_squares * OUTPUT_DECAY + length * length
                self._output_weight = self._output_weight * OUTPUT_DECAY + 1.0
        state.live.end(stream.prompt_tokens, stream.first_at, now)
        self.fleet.end(stream.prompt_tokens, stream.first_at, now)
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
        live, fleet = state.live, self.fleet
        itl = new_seconds / new_gaps
        batch = (live.area_requests - stream.area_requests) / dt
        age = (live.area_age - stream.area_age) / dt  # sequence-seconds since their first tokens, on average
        context = (live.area_prompt - stream.area_prompt) / dt + age / itl
        share = 1.0 / self.fleet_size  # the fleet's mean replica over the same stretch
        fleet_batch = (fleet.area_requests - stream.fleet_requests) / dt * share
        fleet_age = (fleet.area_age - stream.fleet_age) / itl
        fleet_context = ((fleet.area_prompt - stream.fleet_prompt) + fleet_age) / dt * share
        stream.mark(live, fleet, now, gaps, seconds)
        self.observe(stream.replica, batch, context, itl, fleet_batch, fleet_context)
        return gaps

    def observe(self, name: str, batch: float, context: float, itl: float, fleet_batch: float = 0.0,
                fleet_context: float = 0.0) -> None:
        """One stretch of a stream on ``name``: ``itl`` seconds a token, with ``batch`` requests of ``context``
        tokens in flight there on average, and ``fleet_batch`` of ``fleet_context`` on the fleet's mean replica."""
        if not (0 < itl <= MAX_ITL and all(0 <= x < 1 << 40 for x in (batch, context, fleet_batch, fleet_context))):
            return
        f = (1.0, context, batch, fleet_context, fleet_batch)
        state = self.replica(name)
        state.data.add(f, itl, self.decay)
        state.observations += 1
        self.pooled.add(f, itl, self.decay)
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
        spread = self.output_tokens_spread
        mean_context = prompt_tokens + length / 2
        host_per_context, host_per_sequence = self.host_line()  # the same on every candidate: only in itl_now
        host = 0.0
        if batches:
            host = (host_per_context * sum(prompt_contexts) + host_per_sequence * sum(batches)) / len(batches)
        parts = []
        source = self.source_in_use
        engine_pooled = self.engine_pooled_line() if source == "engine" else None
        for i, name in enumerate(names):
            base, per_context, per_sequence = self.charged_line(name, source, engine_pooled)
            state = self.replica(name)
            live = state.live
            batch = batches[i]
            itl_now = base + per_context * prompt_contexts[i] + per_sequence * batch + host
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
            # how long each of the B sequences there and the new one decode side by side is uncertain by the
            # spread of the outputs' lengths, independently for each
            error = spread * math.hypot(math.sqrt(batch) * growth, itl - alone)
            parts.append((batch, context, itl, growth, own, batch * overlap * growth, free, preempted, error))
        fastest = min((p[4] for p in parts), default=0.0)
        return [DecodeCharge(length, batch, context, itl, growth, own - fastest, others, free, preempted,
                             self.weight, throughputs[i], error)
                for i, (batch, context, itl, growth, own, others, free, preempted, error) in enumerate(parts)]
