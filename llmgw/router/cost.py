"""The routing cost model: each candidate's expected time to first token, learnt online per replica.

For one request and one candidate replica (the rule, also in ``docs/routing.md``)::

    new_tokens    = prompt_tokens - cached_tokens       what it would have to prefill
    queued_tokens = the new tokens of the requests routed to it that have no first token yet (the replica's
                    ledger: this gateway's and, in a cluster, the others'), less what its prefill throughput has
                    worked through since the oldest of them was routed, + the waiting requests its engine
                    reports beyond those, at its mean size
    requests      = its in-flight requests (the router's, or the engine's running + waiting when fresh and more)
    estimated TTFT = step + (queued_tokens + new_tokens) / prefill_throughput + requests x per_request
    recomputed    = the most tokens any candidate holds of the prompt - cached_tokens: what it would compute again
    delay to others = others_weight x (requests x new_tokens + recomputed) / prefill_throughput
    cost           = estimated TTFT + delay to others          (the router picks the smallest)

The *delay to others* is what the request's own prefill costs the requests on
that replica (each one's next tokens wait while it is computed; in a closed
loop they stand for the traffic that will queue behind it), plus the GPU
time of whatever it would compute again that another candidate already holds:
a recompute is never free, even on a replica idle at this moment, since
whatever is routed there next waits behind it, and it is work the cluster
need not do at all. A greedy rule that minimises only the request's own TTFT
moves requests of a popular prompt off its busy holder onto a replica that
must compute the whole prompt again: that request gains a little and everyone
on the other replica pays for the recompute (measured: ``docs/benchmarks/routing-workloads.md``).
Without that recompute term, a replica that *looks* idle paid nothing for it,
so the second request of a new prompt, whose first prefill was still queued on
its holder, went to compute it all again on any replica that looked idle: a
near-tie in TTFT won at the price of a whole prefill, and, with several
gateways whose views of each other's load are a few tens of ms old in a burst,
a replica looks idle far more often than it is (``docs/scaling.md``).
``others_weight`` 0 is the greedy rule.

``step`` (one engine step and the network), ``prefill_throughput`` (prompt
tokens per second) and ``per_request`` (what each request already in flight
adds: a decode step's share, a wait for a free slot) are learnt per replica
by an exponentially weighted least-squares fit of the observed TTFTs (at the
gateway: arrival to the first output token) against ``queued + new`` tokens
and ``requests`` at the time each request was routed. Priors keep the fit sane
before data arrives and when the data cannot tell the terms apart (every
request the same size): ``prior_throughput``, ``prior_step`` and no
per-request cost, as a ridge whose weight fades as data comes in. A replica's
own fit is shrunk toward the fit of all the model's replicas together, by
``w / (w + SHRINK_WEIGHT)`` for ``w`` its observations' weight, so a replica
that has seen little looks like its peers. Older data fades (``decay`` per
observation). A replica's *known rate* is the prior of its slope (and the known
rates' mean the pooled fit's), weighing ``ENGINE_RATE_WEIGHT`` observations
that do not fade: its engine's prefill rate as reported on ``/metrics``
(:mod:`llmgw.router.engine_prefill`, read by the load scraper; with the tier's
``cost_engine_prefill``) once the engine has told one, and before that the
replica's configured ``prefill_tokens_per_s`` (with ``cost_configured_prefill``;
the GPU's achievable FLOPs over twice the model's parameters). A workload of
cache hits, whose few new tokens cannot tell the slope, then estimates a cold
prefill with the engine's rate instead of ``prior_throughput``; and the first
wave of requests, decided before any replica answered, tells a slow GPU from
a fast one (``docs/benchmarks/routing-workloads.md``, "A prefill prior for the first wave").

One slow first token must not make a replica look slow for the next thirty
requests: an observation above the replica's estimate by more than
``max(OUTLIER_NOISES x noise, the estimate itself, OUTLIER_MIN_SECONDS)`` counts
as that much (a Huber-like clip; counted in ``clipped``). Replayed on the
TTFTs of two real vLLM replicas sharing a CPU (an engine's warm-up, a LoRA
adapter's first load, the other engine's burst), the clip cut the median error
of the next estimate from 24 to 8 ms; a replica that really turns ten times
slower is learnt in about 29 observations instead of 20.

A fit describes one engine: when a replica's name comes back on another
engine (``Replica.engine_id``: its engine was restarted or replaced and it
re-entered routing), :meth:`CostModel.follow` drops the replica's own
observations, so it starts again from its peers' fit instead of the old
process's history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

DEFAULT_PRIOR_THROUGHPUT = 20_000.0  # prompt tokens / s: a small model on one GPU (and the simulator's default)
DEFAULT_PRIOR_STEP = 0.02  # s: one decode step
DEFAULT_DECAY = 0.97  # per observation: about the last 33 requests count
DEFAULT_OTHERS_WEIGHT = 1.0  # how much the delay a request's prefill adds to the others on its replica counts
PRIOR_TOKENS = 512.0  # the scale at which the prior on the throughput weighs as one observation
PRIOR_REQUESTS = 4.0  # the scale at which the prior on the per-request cost weighs as one observation
PRIOR_WEIGHT = 1.0  # the priors weigh PRIOR_WEIGHT / (1 + w) observations, w the data's weight
# an engine's reported prefill rate (engine_prefill) weighs on the slope as this many observations at PRIOR_TOKENS
# (as much as 2 observations of a 2,048-token prefill), whatever the data's weight: it is measured, not assumed
ENGINE_RATE_WEIGHT = 32.0
SHRINK_WEIGHT = 10.0  # a replica's own fit counts half once its observations weigh this much
MIN_NOISE_OBSERVATIONS = 3
OUTLIER_NOISES = 4.0  # an observation counts at most this many noises above the estimate...
OUTLIER_MIN_SECONDS = 0.01  # ... or the estimate itself, or this much, whichever is the most
MIN_THROUGHPUT, MAX_THROUGHPUT = 50.0, 1e8
MAX_STEP = 30.0
MAX_PER_REQUEST = 30.0
MAX_OBSERVED_TTFT = 600.0
ENGINE, CONFIGURED = "engine", "configured"  # where a replica's known prefill rate is from (CostModel.known_rate)
MAX_FORGOTTEN = 64  # replicas kept beyond twice the candidates before the ones gone are dropped

Line = tuple[float, float, float, float]  # (step s, s per prefill token, s per in-flight request, noise s)


class Fit:
    """Decayed weighted sums of observations ``y ~ step + slope x + per_request r`` for least squares.

    ``SCALES`` are the sizes of ``(1, x, r)`` at which the prior weighs as one observation, :meth:`bounded` keeps
    a solution sane: a subclass fitting other quantities (:mod:`llmgw.router.decode_cost`) sets its own."""

    __slots__ = ("w", "s", "sy", "yy")
    SCALES = (1.0, PRIOR_TOKENS, PRIOR_REQUESTS)

    def __init__(self) -> None:
        self.w = 0.0
        self.s = [[0.0] * 3 for _ in range(3)]  # sums of f f^T, f = (1, x, r)
        self.sy = [0.0] * 3  # sums of f y
        self.yy = 0.0

    def add(self, x: float, r: float, y: float, decay: float) -> None:
        f = (1.0, x, r)
        self.w = self.w * decay + 1.0
        for i in range(3):
            row = self.s[i]
            for j in range(3):
                row[j] = row[j] * decay + f[i] * f[j]
            self.sy[i] = self.sy[i] * decay + f[i] * y
        self.yy = self.yy * decay + y * y

    def rescale(self, factor: float) -> None:
        """The observations as if their ``x`` had been counted ``factor`` times larger (another unit)."""
        s = self.s
        s[0][1] *= factor
        s[1][0] *= factor
        s[1][2] *= factor
        s[2][1] *= factor
        s[1][1] *= factor * factor
        self.sy[1] *= factor

    def prior_weight(self) -> float:
        """How many observations' worth the priors weigh beside this data: fading as data comes in."""
        return PRIOR_WEIGHT / (1.0 + self.w)

    def ridged(self, prior_weight: float, slope_weight: float = 0.0) -> list[list[float]]:
        """The observations' normal matrix ``F' W F`` plus the priors' ridge at ``SCALES`` (what :meth:`solve`
        solves, and :mod:`llmgw.router.uncertainty` inverts); ``slope_weight`` more observations' worth on the
        slope alone (a measured one: the engine's reported prefill rate)."""
        a = [row[:] for row in self.s]
        for i, scale in enumerate(self.SCALES):
            a[i][i] += prior_weight * scale * scale
        a[1][1] += slope_weight * self.SCALES[1] * self.SCALES[1]
        return a

    def solve(self, prior: Sequence[float], prior_weight: float, slope_weight: float = 0.0
              ) -> tuple[float, float, float]:
        """The ridge solution: the data's least squares pulled toward ``prior`` with ``prior_weight``
        observations' worth (at the scales ``SCALES``; ``slope_weight`` more on the slope), within bounds."""
        b = [y + prior_weight * scale * scale * p for y, scale, p in zip(self.sy, self.SCALES, prior)]
        b[1] += slope_weight * self.SCALES[1] * self.SCALES[1] * prior[1]
        return self.bounded(_solve3(self.ridged(prior_weight, slope_weight), b) or (prior[0], prior[1], prior[2]))

    @staticmethod
    def bounded(theta: tuple[float, float, float]) -> tuple[float, float, float]:
        step = min(max(theta[0], 0.0), MAX_STEP)
        slope = min(max(theta[1], 1.0 / MAX_THROUGHPUT), 1.0 / MIN_THROUGHPUT)
        per_request = min(max(theta[2], 0.0), MAX_PER_REQUEST)
        return step, slope, per_request

    def residual(self, theta: Sequence[float]) -> float:
        """The weighted RMS of ``y - theta . f`` over the observations (0 without any)."""
        if self.w <= 0:
            return 0.0
        sse = self.yy - 2 * sum(t * s for t, s in zip(theta, self.sy))
        sse += sum(theta[i] * theta[j] * self.s[i][j] for i in range(3) for j in range(3))
        return math.sqrt(max(sse, 0.0) / self.w)


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """``a x = b`` for a 3x3 system by Cramer's rule; None when (nearly) singular."""
    def det(m: list[list[float]]) -> float:
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))
    d = det(a)
    scale = abs(a[0][0] * a[1][1] * a[2][2]) or 1.0
    if not math.isfinite(d) or abs(d) <= 1e-12 * scale:
        return None
    out = []
    for k in range(3):
        m = [row[:] for row in a]
        for i in range(3):
            m[i][k] = b[i]
        out.append(det(m) / d)
    return out[0], out[1], out[2]


def fit_line(prior: Sequence[float], data: Fit, observations: int, slope_weight: float = 0.0) -> Line:
    """``data`` fitted on ``prior`` = (step, seconds per token, seconds per request), with its noise (0 below
    MIN_NOISE_OBSERVATIONS observations); ``slope_weight``: observations' worth of a measured prior slope."""
    theta = data.solve(prior, data.prior_weight(), slope_weight)
    noise = data.residual(theta) if observations >= MIN_NOISE_OBSERVATIONS else 0.0
    return (*theta, noise)


@dataclass
class ReplicaCost:
    """One replica's observations of its speed (its queued prefill is the replica's own ledger:
    ``Replica.queued_tokens``, counted by the router, shared by a cluster's gateways)."""

    model: "CostModel"
    data: Fit = field(default_factory=Fit)
    awaiting: int = 0  # requests this model routed there whose first token is still to be observed
    observations: int = 0
    clipped: int = 0  # observations counted lower (outliers: OUTLIER_NOISES)
    mean_new_tokens: float = 0.0  # EWMA of the new tokens of a request routed to it
    engine: str | None = None  # the engine id its observations are of (CostModel.follow)
    # s per new prompt token as known before its own observations (CostModel.follow): its engine's reported rate,
    # else its configured one; and which of the two (ENGINE or CONFIGURED)
    known_slope: float | None = None
    slope_from: str = ""
    _line: Line | None = None
    _generation: int = -1

    def forget_observations(self) -> None:
        """Its own fit starts again from nothing (the pooled fit keeps what it learnt)."""
        self.data = Fit()
        self.observations = 0
        self.clipped = 0
        self._line = None

    @property
    def slope_weight(self) -> float:
        """Observations' worth of the prior on its slope beyond the configured prior's: its known rate's."""
        return 0.0 if self.known_slope is None else ENGINE_RATE_WEIGHT

    def line(self) -> Line:
        """The fit of all the model's replicas (:meth:`CostModel.pooled_line`), its slope replaced by its known
        rate (:meth:`CostModel.known_rate`) when there is one, moved toward the fit of its own observations as they
        add up."""
        model = self.model
        if self._line is None or self._generation != model.generation:
            pooled = model.pooled_line()
            if self.known_slope is not None:
                pooled = (pooled[0], self.known_slope, pooled[2], pooled[3])
            own = fit_line(pooled[:3], self.data, self.observations, self.slope_weight)
            trust = self.data.w / (self.data.w + SHRINK_WEIGHT)
            step, slope, per_request, noise = (p + trust * (o - p) for p, o in zip(pooled, own))
            self._line = (step, slope, per_request, noise)
            self._generation = model.generation
        return self._line

    @property
    def step(self) -> float:
        return self.line()[0]

    @property
    def throughput(self) -> float:
        return 1.0 / self.line()[1]

    @property
    def per_request(self) -> float:
        return self.line()[2]

    @property
    def noise(self) -> float:
        """How far observed TTFTs stray from the fit (weighted RMS, seconds): closer estimates cannot be told
        apart."""
        return self.line()[3]


@dataclass(frozen=True, slots=True)
class Estimate:
    """One candidate's expected time to first token and what it is made of."""

    cached_tokens: int
    new_tokens: int
    queued_tokens: int
    requests: float
    step: float
    throughput: float
    per_request: float
    noise: float = 0.0
    others_weight: float = 0.0
    recomputed: int = 0  # tokens it would compute that another candidate holds

    @property
    def line(self) -> tuple[float, float, float]:
        """``theta``: the replica's fitted (step, seconds per prefill token, seconds per request in flight)."""
        return self.step, 1.0 / self.throughput, self.per_request

    @property
    def ttft_features(self) -> tuple[float, float, float]:
        """What the estimated TTFT multiplies :attr:`line` by: one step, the prefill ahead and its own, the requests
        in flight."""
        return 1.0, self.queued_tokens + self.new_tokens, self.requests

    @property
    def features(self) -> tuple[float, float, float]:
        """``g``: what :attr:`cost` multiplies :attr:`line` by (:mod:`llmgw.router.uncertainty` weighs the fit's
        uncertainty at it): the TTFT's, plus the delay to others' tokens, ``others_weight x (what computing this
        request's new tokens costs the requests in flight on the replica + what computing again what another
        replica holds costs whatever comes to it next)``."""
        one, tokens, requests = self.ttft_features
        return one, tokens + self.others_weight * (self.requests * self.new_tokens + self.recomputed), requests

    @property
    def ttft(self) -> float:
        return _dot(self.line, self.ttft_features)

    @property
    def cost(self) -> float:
        """``theta . g``: the estimated TTFT plus the delay to others (what the rule compares)."""
        return _dot(self.line, self.features)

    @property
    def delay_to_others(self) -> float:
        return self.cost - self.ttft

    def as_json(self) -> dict[str, Any]:
        return {"cached_tokens": self.cached_tokens, "new_tokens": self.new_tokens,
                "queued_tokens": self.queued_tokens, "requests": self.requests, "recomputed_tokens": self.recomputed,
                "estimated_ttft_s": round(self.ttft, 4), "delay_to_others_s": round(self.delay_to_others, 4),
                "cost_s": round(self.cost, 4)}


def _dot(theta: tuple[float, float, float], g: tuple[float, float, float]) -> float:
    return theta[0] * g[0] + theta[1] * g[1] + theta[2] * g[2]


class CostModel:
    """Per model: every replica's :class:`ReplicaCost`, the estimates for a request, and the bookkeeping hooks."""

    def __init__(self, prior_throughput: float = DEFAULT_PRIOR_THROUGHPUT, prior_step: float = DEFAULT_PRIOR_STEP,
                 decay: float = DEFAULT_DECAY, others_weight: float = DEFAULT_OTHERS_WEIGHT, engine_rates: bool = True,
                 configured_rates: bool = True):
        self.prior = (prior_step, 1.0 / prior_throughput, 0.0)
        self.engine_rates = engine_rates  # follow() reads the engines' reported prefill rates
        self.configured_rates = configured_rates  # ... and the replicas' configured ones (prefill_tokens_per_s)
        self.decay = decay
        self.others_weight = others_weight
        self.replicas: dict[str, ReplicaCost] = {}
        self.pooled = Fit()  # every replica's observations
        self.observations = 0
        self.generation = 0  # bumped by every observation: the replicas' fitted lines are then stale
        self._pooled_line: Line | None = None

    def replica(self, name: str) -> ReplicaCost:
        cost = self.replicas.get(name)
        if cost is None:
            cost = self.replicas[name] = ReplicaCost(self)
        return cost

    def follow(self, replicas: Sequence[Any]) -> None:
        """Note which engine each name is on (``replica.engine_id``): a name now on another engine (restarted or
        replaced) forgets its own observations. The same engine on a new replica object (re-adopted after a
        control-plane restart, followed by another gateway) keeps them. And each replica's known prefill rate
        (:meth:`known_rate`), the prior of its slope."""
        for replica in replicas:
            cost = self.replica(replica.name)
            if cost.engine != replica.engine_id:
                if cost.engine is not None:
                    cost.forget_observations()
                cost.engine = replica.engine_id
            tokens_per_s, source = self.known_rate(replica)
            slope = None if tokens_per_s is None else 1.0 / tokens_per_s
            if slope != cost.known_slope:
                cost.known_slope, cost.slope_from = slope, source
                self.generation += 1  # every line moves: the pooled prior's slope is the known rates' mean
                self._pooled_line = None

    def known_rate(self, replica: Any) -> tuple[float | None, str]:
        """``replica``'s prefill rate (tokens/s) before its observations, and where it is from (``ENGINE`` or
        ``CONFIGURED``): its engine's reported rate (``replica.prefill_rate``) once there is one, else its configured
        ``prefill_tokens_per_s``, else none (the configured prior ``prior_throughput`` stands)."""
        rate = getattr(replica, "prefill_rate", None) if self.engine_rates else None
        reported = None if rate is None else rate.tokens_per_s
        if reported is not None:
            return reported, ENGINE
        configured = getattr(replica, "prefill_tokens_per_s", None) if self.configured_rates else None
        if configured is not None and MIN_THROUGHPUT <= configured <= MAX_THROUGHPUT:
            return float(configured), CONFIGURED
        return None, ""

    def pooled_prior(self) -> tuple[tuple[float, float, float], float]:
        """The pooled fit's prior and the observations' worth of its slope beyond the configured prior's: the mean
        of the replicas' known seconds per token (:meth:`known_rate`) when any has one, else the configured."""
        slopes = [c.known_slope for c in self.replicas.values() if c.known_slope is not None]
        if not slopes:
            return self.prior, 0.0
        return (self.prior[0], sum(slopes) / len(slopes), self.prior[2]), ENGINE_RATE_WEIGHT

    def pooled_line(self) -> Line:
        """The fit of all the model's observations on the configured priors (the slope's: :meth:`pooled_prior`)."""
        if self._pooled_line is None:
            prior, slope_weight = self.pooled_prior()
            self._pooled_line = fit_line(prior, self.pooled, self.observations, slope_weight)
        return self._pooled_line

    def rescale_tokens(self, factor: float) -> None:
        """Every observation's tokens counted ``factor`` times larger: the prefix tree, which counts a prompt's
        tokens from its characters, learnt a new tokens-per-character ratio (:mod:`llmgw.router.token_ratio`), and
        what it observed in the old count must not teach a slope in the new one."""
        if not math.isfinite(factor) or factor <= 0:
            return
        self.pooled.rescale(factor)
        for cost in self.replicas.values():
            cost.data.rescale(factor)
            cost.mean_new_tokens *= factor
            cost._line = None
        self.generation += 1
        self._pooled_line = None

    def observe(self, name: str, tokens: float, requests: float, ttft: float) -> None:
        """A request routed to ``name`` with ``tokens`` of prefill up to its own and ``requests`` in flight ahead
        of it had its first token after ``ttft`` seconds."""
        if not 0 <= ttft <= MAX_OBSERVED_TTFT or not 0 <= tokens < 1 << 40 or not 0 <= requests < 1 << 20:
            return
        cost = self.replica(name)
        if self.observations >= MIN_NOISE_OBSERVATIONS:
            step, slope, per_request, noise = cost.line()
            expected = step + slope * tokens + per_request * requests
            cap = expected + max(OUTLIER_NOISES * noise, expected, OUTLIER_MIN_SECONDS)
            if ttft > cap:
                ttft = cap
                cost.clipped += 1
        cost.data.add(tokens, requests, ttft, self.decay)
        cost.observations += 1
        self.pooled.add(tokens, requests, ttft, self.decay)
        self.observations += 1
        self.generation += 1
        self._pooled_line = None

    def estimate(self, names: Sequence[str], prompt_tokens: int, cached_tokens: Sequence[int],
                 requests: Sequence[float], engine_waiting: Sequence[float | None] = (),
                 queued: Sequence[tuple[int, int, float]] = ()) -> list[Estimate]:
        """Each replica's :class:`Estimate` for a prompt of ``prompt_tokens`` of which it holds ``cached_tokens``,
        with ``requests[i]`` in flight to it and ``queued[i]`` = (tokens, requests, seconds since the oldest of
        them was routed) of prefill queued there (the replica's ledger; none when not given). What the engine has
        worked through since then, at the replica's fitted throughput, is no longer ahead of this request.

        ``engine_waiting[i]`` is the waiting requests replica ``i``'s engine reported in a fresh scrape (None when
        unknown): those beyond the queued requests the ledger knows (sent by gateways outside the cluster, or
        before a report arrived) count as that many requests of the replica's mean size.
        """
        if len(self.replicas) > MAX_FORGOTTEN + 2 * len(names):
            self._forget_others(names)
        estimates = []
        held = [min(max(c, 0), max(prompt_tokens - 1, 0)) for c in cached_tokens[:len(names)]]
        most = max(held, default=0)
        for i, name in enumerate(names):
            cost = self.replica(name)
            cached = held[i]
            queued_tokens, queued_requests, queued_for = queued[i] if i < len(queued) else (0, 0, 0.0)
            step, slope, per_request, noise = cost.line()
            queued_tokens = max(0, queued_tokens - int(max(queued_for, 0.0) / slope))
            waiting = engine_waiting[i] if i < len(engine_waiting) else None
            if waiting is not None and waiting > queued_requests:
                queued_tokens += int((waiting - queued_requests) * (cost.mean_new_tokens or prompt_tokens))
            estimates.append(Estimate(cached, prompt_tokens - cached, queued_tokens, requests[i], step, 1.0 / slope,
                                      per_request, noise, self.others_weight, most - cached))
        return estimates

    def _forget_others(self, names: Sequence[str]) -> None:
        """Drop replicas that are no longer candidates and await no first token (replicas come and go)."""
        keep = set(names)
        for name in [n for n, c in self.replicas.items() if n not in keep and not c.awaiting]:
            del self.replicas[name]

    # -- bookkeeping: the tier calls these from its routed / first_token / finished hooks --------------------------

    def routed(self, name: str, estimate_of: dict[str, Any]) -> None:
        """A request with ``estimate_of`` (a decision's ``cost`` detail) was handed to replica ``name``."""
        cost = self.replica(name)
        new = int(estimate_of.get("new_tokens", 0))
        cost.awaiting += 1
        cost.mean_new_tokens = new if not cost.mean_new_tokens else 0.9 * cost.mean_new_tokens + 0.1 * new
        estimate_of["pending"] = True

    def started(self, name: str, estimate_of: dict[str, Any],
                ttft: float | None) -> tuple[float, float, float] | None:
        """The request's first token arrived after ``ttft`` seconds (None: it ended without one); once per request.
        The observation ``(tokens, requests, ttft)`` it made, or None."""
        if not estimate_of.pop("pending", False):
            return None
        cost = self.replica(name)
        cost.awaiting = max(0, cost.awaiting - 1)
        if ttft is None:
            return None
        observed = (float(estimate_of.get("queued_tokens", 0) + estimate_of.get("new_tokens", 0)),
                    float(estimate_of.get("requests", 0)), ttft)
        self.observe(name, *observed)
        return observed

    def observe_engine(self, engine_id: str, name: str, tokens: float, requests: float, ttft: float) -> None:
        """An observation another gateway made of engine ``engine_id``: counted for ``name`` when that is the
        engine it is on here (ignored for an engine this model does not route to, or no longer)."""
        cost = self.replicas.get(name)
        if cost is not None and cost.engine == engine_id:
            self.observe(name, tokens, requests, ttft)

    def describe(self, name: str) -> dict[str, Any]:
        cost = self.replica(name)
        step, slope, per_request, noise = cost.line()
        known = None if cost.known_slope is None else round(1.0 / cost.known_slope, 1)
        return {"step_s": round(step, 4), "prefill_tokens_per_s": round(1.0 / slope, 1),
                "engine_prefill_tokens_per_s": known if cost.slope_from == ENGINE else None,
                "configured_prefill_tokens_per_s": known if cost.slope_from == CONFIGURED else None,
                "per_request_s": round(per_request, 4), "noise_s": round(noise, 4),
                "observations": cost.observations, "clipped_observations": cost.clipped,
                "awaiting_first_token": cost.awaiting}
