"""The routing cost model: each candidate's expected time to first token, learnt online per replica.

For one request and one candidate replica (the rule, also in ``docs/routing.md``)::

    new_tokens    = prompt_tokens - cached_tokens            (what it would have to prefill)
    queued_tokens = its routed, not yet first-token'd prefill work (the router's own accounting)
                    + excess waiting requests the engine reports x the mean new tokens of a request
    estimated TTFT = (queued_tokens + new_tokens) / prefill_throughput + step_time

``prefill_throughput`` and ``step_time`` are learnt per replica by an
exponentially weighted least-squares fit of observed TTFT (at the gateway:
arrival to the first output token) against ``queued + new`` tokens at the
time the request was routed: the slope is 1 / throughput, the intercept the
step time (queueing behind decodes, one engine step, the network). Two prior
pseudo-observations (from ``prior_throughput`` and ``prior_step``, or the mean
of the model's other replicas once they have learnt) keep the fit sane before
data arrives and when every observation has the same size; data outweighs
them after a few requests, and older data fades (``decay`` per observation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

DEFAULT_PRIOR_THROUGHPUT = 20_000.0  # prompt tokens / s: a small model on one GPU (and the simulator's default)
DEFAULT_PRIOR_STEP = 0.02  # s: one decode step
DEFAULT_DECAY = 0.97  # per observation: about the last 33 requests count
PRIOR_TOKENS = 2048.0  # where the second prior point sits
PRIOR_WEIGHT = 1.0  # each prior point's weight (data weighs up to 1 / (1 - decay))
MIN_THROUGHPUT, MAX_THROUGHPUT = 50.0, 1e8
MAX_STEP = 30.0
MAX_OBSERVED_TTFT = 600.0
MIN_NOISE_OBSERVATIONS = 3
SHRINK_WEIGHT = 10.0  # a replica's own line counts half once its observations weigh this much


@dataclass
class Fit:
    """Decayed sums of ``(x, y)`` observations (x: tokens, y: seconds) for a weighted least-squares line."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    yy: float = 0.0

    def add(self, x: float, y: float, weight: float = 1.0, decay: float = 1.0) -> None:
        self.w = self.w * decay + weight
        self.x = self.x * decay + weight * x
        self.y = self.y * decay + weight * y
        self.xx = self.xx * decay + weight * x * x
        self.xy = self.xy * decay + weight * x * y
        self.yy = self.yy * decay + weight * y * y

    def residual(self, slope: float, step: float) -> float:
        """The weighted RMS of ``y - (step + slope x)`` over the observations (0 without any)."""
        if self.w <= 0:
            return 0.0
        sse = (self.yy - 2 * step * self.y - 2 * slope * self.xy + step * step * self.w
               + 2 * step * slope * self.x + slope * slope * self.xx)
        return math.sqrt(max(sse, 0.0) / self.w)


def fit_line(prior: tuple[float, float], data: Fit, observations: int) -> tuple[float, float, float]:
    """``(seconds per token, step seconds, noise seconds)`` of ``data`` with two prior points on the line
    ``prior = (seconds per token, step)``, within sane bounds; noise is 0 below MIN_NOISE_OBSERVATIONS."""
    prior_slope, prior_step = prior
    fit = Fit()
    weight = PRIOR_WEIGHT / (1.0 + data.w)  # the prior points' leverage fades as data comes in
    fit.add(0.0, prior_step, weight)
    fit.add(PRIOR_TOKENS, prior_step + PRIOR_TOKENS * prior_slope, weight)
    w, sx, sy = fit.w + data.w, fit.x + data.x, fit.y + data.y
    sxx, sxy = fit.xx + data.xx, fit.xy + data.xy
    var = sxx - sx * sx / w
    slope = (sxy - sx * sy / w) / var if var > 0 else prior_slope
    slope = min(max(slope, 1.0 / MAX_THROUGHPUT), 1.0 / MIN_THROUGHPUT)
    step = min(max((sy - slope * sx) / w, 0.0), MAX_STEP)
    noise = data.residual(slope, step) if observations >= MIN_NOISE_OBSERVATIONS else 0.0
    return slope, step, noise


@dataclass
class ReplicaCost:
    """One replica's observations of its speed, and the prefill work routed to it but not started."""

    model: "CostModel"
    data: Fit = field(default_factory=Fit)
    pending_tokens: int = 0  # new (uncached) prompt tokens of requests routed to it without a first token yet
    pending_requests: int = 0
    observations: int = 0
    mean_new_tokens: float = 0.0  # EWMA of the new tokens of a request routed to it
    _line: tuple[float, float, float] | None = None
    _generation: int = -1

    def observe(self, queued_and_new_tokens: float, ttft: float, decay: float) -> None:
        """One request's first token came ``ttft`` seconds after it arrived, with this much prefill before it."""
        self.data.add(float(queued_and_new_tokens), ttft, decay=decay)
        self.observations += 1

    def line(self) -> tuple[float, float, float]:
        """``(seconds per token, step seconds, noise seconds)``: the line of the model's replicas together
        (:meth:`CostModel.pooled_line`), moved toward the line of its own observations as they add up (weight
        ``w / (w + SHRINK_WEIGHT)``), so a replica that has seen little looks like its peers."""
        model = self.model
        if self._line is None or self._generation != model.generation:
            pooled = model.pooled_line()
            own = fit_line(pooled[:2], self.data, self.observations)
            trust = self.data.w / (self.data.w + SHRINK_WEIGHT)
            self._line = tuple(p + trust * (o - p) for p, o in zip(pooled, own))
            self._generation = model.generation
        return self._line

    @property
    def throughput(self) -> float:
        return 1.0 / self.line()[0]

    @property
    def step(self) -> float:
        return self.line()[1]

    @property
    def noise(self) -> float:
        """How far its observed TTFTs stray from its line (weighted RMS, seconds): estimates closer than this
        cannot be told apart."""
        return self.line()[2]


@dataclass(frozen=True, slots=True)
class Estimate:
    """One candidate's expected time to first token and what it is made of."""

    cached_tokens: int
    new_tokens: int
    queued_tokens: int
    throughput: float
    step: float
    noise: float = 0.0  # the replica's observed TTFTs' RMS distance from its line

    @property
    def ttft(self) -> float:
        return (self.queued_tokens + self.new_tokens) / self.throughput + self.step

    def as_json(self) -> dict:
        return {"cached_tokens": self.cached_tokens, "new_tokens": self.new_tokens,
                "queued_tokens": self.queued_tokens, "prefill_tokens_per_s": round(self.throughput, 1),
                "step_s": round(self.step, 4), "estimated_ttft_s": round(self.ttft, 4)}


class CostModel:
    """Per model: every replica's :class:`ReplicaCost`, the estimates for a request, and the bookkeeping hooks."""

    def __init__(self, prior_throughput: float = DEFAULT_PRIOR_THROUGHPUT, prior_step: float = DEFAULT_PRIOR_STEP,
                 decay: float = DEFAULT_DECAY):
        self.prior = (1.0 / prior_throughput, prior_step)
        self.decay = decay
        self.replicas: dict[str, ReplicaCost] = {}
        self.pooled = Fit()  # every replica's observations
        self.observations = 0
        self.generation = 0  # bumped by every observation: the replicas' fitted lines are then stale
        self._pooled_line: tuple[float, float, float] | None = None

    def replica(self, name: str) -> ReplicaCost:
        cost = self.replicas.get(name)
        if cost is None:
            cost = self.replicas[name] = ReplicaCost(self)
        return cost

    def pooled_line(self) -> tuple[float, float, float]:
        """The line of all the model's observations on the configured priors."""
        if self._pooled_line is None:
            self._pooled_line = fit_line(self.prior, self.pooled, self.observations)
        return self._pooled_line

    def observe(self, name: str, queued_and_new_tokens: float, ttft: float) -> None:
        if not 0 <= ttft <= MAX_OBSERVED_TTFT or not 0 <= queued_and_new_tokens < 1 << 40:
            return
        self.replica(name).observe(queued_and_new_tokens, ttft, self.decay)
        # The pool decays per observation of any replica, so it spans about as many requests as one replica's.
        self.pooled.add(float(queued_and_new_tokens), ttft, decay=self.decay)
        self.observations += 1
        self.generation += 1
        self._pooled_line = None

    def estimate(self, names: Sequence[str], prompt_tokens: int, cached_tokens: Sequence[int],
                 engine_waiting: Sequence[float | None] = ()) -> list[Estimate]:
        """Each replica's :class:`Estimate` for a prompt of ``prompt_tokens`` of which it holds ``cached_tokens``.

        ``engine_waiting[i]`` is the waiting requests replica ``i``'s engine reported in a fresh scrape (None when
        unknown): those beyond the router's own pending requests (sent by other gateways) count as that many
        requests of the replica's mean size.
        """
        estimates = []
        for i, name in enumerate(names):
            cost = self.replica(name)
            cached = min(max(cached_tokens[i], 0), max(prompt_tokens - 1, 0))
            queued = cost.pending_tokens
            waiting = engine_waiting[i] if i < len(engine_waiting) else None
            if waiting is not None and waiting > cost.pending_requests:
                queued += int((waiting - cost.pending_requests) * (cost.mean_new_tokens or prompt_tokens))
            slope, step, noise = cost.line()
            estimates.append(Estimate(cached, prompt_tokens - cached, queued, 1.0 / slope, step, noise))
        return estimates

    # -- bookkeeping: the tier calls these from its routed / first_token / finished hooks --------------------------

    def routed(self, name: str, estimate_of: dict) -> None:
        """A request with ``estimate_of`` (a decision's ``cost`` detail) was handed to replica ``name``."""
        cost = self.replica(name)
        new = int(estimate_of.get("new_tokens", 0))
        cost.pending_tokens += new
        cost.pending_requests += 1
        cost.mean_new_tokens = new if not cost.mean_new_tokens else 0.9 * cost.mean_new_tokens + 0.1 * new
        estimate_of["pending"] = True

    def started(self, name: str, estimate_of: dict, ttft: float | None) -> None:
        """The request's first token arrived after ``ttft`` seconds (None: it ended without one); once per request."""
        if not estimate_of.pop("pending", False):
            return
        cost = self.replica(name)
        cost.pending_tokens = max(0, cost.pending_tokens - int(estimate_of.get("new_tokens", 0)))
        cost.pending_requests = max(0, cost.pending_requests - 1)
        if ttft is not None:
            self.observe(name, estimate_of.get("queued_tokens", 0) + estimate_of.get("new_tokens", 0), ttft)

    def forget(self, name: str) -> None:
        self.replicas.pop(name, None)

    def describe(self, name: str) -> dict:
        cost = self.replica(name)
        return {"prefill_tokens_per_s": round(cost.throughput, 1), "step_s": round(cost.step, 4),
                "noise_s": round(cost.noise, 4), "observations": cost.observations, "pending_tokens": cost.pending_tokens,
                "pending_requests": cost.pending_requests}
