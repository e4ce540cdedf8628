"""How uncertain a cost estimate is, and the gate an override must pass: an expected gain larger than that.

A candidate's cost (:mod:`llmgw.router.cost`) is linear in its replica's
fitted line ``theta = (step, seconds per prefill token, seconds per request)``::

    cost = theta . g,   g = (1, queued + new + others_weight x (requests x new + recomputed), requests)

(``Estimate.line`` and ``Estimate.features``: the cost is computed as that product),

so the uncertainty of its expected value is that of the fit at ``g``, the
standard error of a least-squares prediction::

    uncertainty = noise x sqrt(g' M g),   M = (F' W F + ridge)^-1

with ``noise`` the weighted RMS of the observed TTFTs around the fit (pulled
toward the prior step time as much as one observation weighs: before any data
the priors are all there is, and they are no certainty) and ``M``
the inverse of the (decayed) observations' normal matrix plus the priors'
ridge, both as the fit itself uses them. ``g' M g`` is about ``1 / w`` for a
request like the ones observed and grows with the square of how far
``queued + new`` tokens (and ``requests``) lie beyond them: a fit that saw
mostly cached requests of a few hundred new tokens knows little of what a
2,000-token cold prefill costs, however well it predicts the cached ones.
A replica's line is its own fit shrunk toward the pooled one (``trust =
w / (w + SHRINK_WEIGHT)``); its ``M`` is blended the same way. An engine's
reported prefill rate (:mod:`llmgw.router.engine_prefill`) is in the ridge
as the fit has it (``ENGINE_RATE_WEIGHT`` observations on the slope), so a
slope the engine measured is not taken for an extrapolation.

*The gate*: a request leaves the replica that holds the most of its prompt
(outcome ``cost_override``) only when the cost it expects to save there is
larger than ``cost_override_sigmas`` (default ``OVERRIDE_SIGMAS``) times the uncertainty of that difference
(``hypot`` of the two estimates'). Otherwise it stays with the cache, which
is the choice that does not depend on an extrapolation.
"""

from __future__ import annotations

import math
from typing import Sequence

from .cost import PRIOR_WEIGHT, SHRINK_WEIGHT, CostModel, Estimate, Fit

OVERRIDE_SIGMAS = 1.0  # an override's expected gain must exceed this many standard errors of the difference
# (routing option cost_override_sigmas; 0 turns the gate off)

Matrix = tuple[tuple[float, float, float], tuple[float, float, float], tuple[float, float, float]]
ZERO: Matrix = ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0))


def inverse(fit: Fit, slope_weight: float = 0.0) -> Matrix:
    """``(F' W F + ridge)^-1`` of ``fit`` with the ridge :func:`llmgw.router.cost.fit_line` solves it with."""
    return _inverse3(fit.ridged(fit.prior_weight(), slope_weight))


def _inverse3(a: list[list[float]]) -> Matrix:
    """The inverse of a symmetric positive definite 3x3 matrix (the ridge keeps it so): adjugate over the
    determinant."""
    c00 = a[1][1] * a[2][2] - a[1][2] * a[2][1]
    c01 = a[1][2] * a[2][0] - a[1][0] * a[2][2]
    c02 = a[1][0] * a[2][1] - a[1][1] * a[2][0]
    det = a[0][0] * c00 + a[0][1] * c01 + a[0][2] * c02
    if not math.isfinite(det) or det <= 0:
        return ZERO  # no information at all: treated as certain
    c11 = a[0][0] * a[2][2] - a[0][2] * a[2][0]
    c12 = a[0][2] * a[1][0] - a[0][0] * a[1][2]
    c22 = a[0][0] * a[1][1] - a[0][1] * a[1][0]
    return ((c00 / det, c01 / det, c02 / det), (c01 / det, c11 / det, c12 / det), (c02 / det, c12 / det, c22 / det))


class Uncertainty:
    """Per replica of a :class:`CostModel`, the blended ``M`` of its line (recomputed when an observation
    changes the fits), and the uncertainty of estimates."""

    def __init__(self, model: CostModel):
        self.model = model
        self._generation = -1
        # (the model's observations, the slope's weight, the pooled fit's M)
        self._pooled: tuple[int, float, Matrix] | None = None
        self._own: dict[str, tuple[Fit, int, float, Matrix]] = {}  # a replica's (fit, observations, slope weight, M)
        self._blended: dict[str, Matrix] = {}
        self.gated = 0  # overrides the gate refused (picks, not explanations): llmgw_cost_overrides_gated_total

    def _matrix(self, name: str) -> Matrix:
        """Replica ``name``'s blended ``M``; each inverse is recomputed only when its own data changed (the pooled
        one at every observation, a replica's at its own)."""
        model = self.model
        if self._generation != model.generation:
            self._generation = model.generation
            self._blended.clear()
        m = self._blended.get(name)
        if m is None:
            slope_weight = model.pooled_prior()[1]
            if self._pooled is None or self._pooled[:2] != (model.observations, slope_weight):
                self._pooled = (model.observations, slope_weight, inverse(model.pooled, slope_weight))
            pooled = self._pooled[2]
            cost = model.replica(name)
            data = cost.data
            kept = self._own.get(name)
            if kept is None or kept[0] is not data or kept[1:3] != (cost.observations, cost.slope_weight):
                if len(self._own) > 2 * len(model.replicas) + 16:  # replicas that left
                    self._own.clear()
                kept = self._own[name] = (data, cost.observations, cost.slope_weight,
                                          inverse(data, cost.slope_weight))
            own = kept[3]
            trust = data.w / (data.w + SHRINK_WEIGHT)
            rows = [tuple(p + trust * (o - p) for p, o in zip(prow, orow)) for prow, orow in zip(pooled, own)]
            m = self._blended[name] = ((rows[0][0], rows[0][1], rows[0][2]), (rows[1][0], rows[1][1], rows[1][2]),
                                       (rows[2][0], rows[2][1], rows[2][2]))
        return m

    def noise(self, fitted: float) -> float:
        """The noise the uncertainty uses: the fit's, pulled toward the prior step time (as much as
        ``PRIOR_WEIGHT`` observations) so that a model with little data is not taken for a certain one."""
        model = self.model
        weight = model.pooled.w
        prior = model.prior[0]
        return math.sqrt((weight * fitted * fitted + PRIOR_WEIGHT * prior * prior) / (weight + PRIOR_WEIGHT))

    def of(self, name: str, estimate: Estimate) -> float:
        """The standard error of ``estimate.cost`` (seconds) for replica ``name``."""
        g = estimate.features
        m = self._matrix(name)
        leverage = sum(g[i] * m[i][j] * g[j] for i in range(3) for j in range(3))
        return self.noise(estimate.noise) * math.sqrt(max(leverage, 0.0))

    def all(self, names: Sequence[str], estimates: Sequence[Estimate]) -> list[float]:
        return [self.of(name, e) for name, e in zip(names, estimates)]


def certainly_costlier(kept: Estimate, taken: Estimate) -> bool:
    """Whether ``kept`` costs more than ``taken`` whatever the uncertainty the two lines share: ``kept`` at least as
    large in every term (``g``) on a line at least as slow in every parameter (the same line before any data, when
    every replica is on the priors; a burst's holder, whose first answers came slowly behind its queue, is seen
    slower since). Then ``cost = theta . g`` is larger for ``kept`` under any error common to both lines (the
    priors', the pooled fit's), and that uncertainty says how large the gain is, never whether there is one: a
    burst's requests, decided before their first tokens, all queued behind the holder of their prompt."""
    slower = kept.step >= taken.step and kept.throughput <= taken.throughput and kept.per_request >= taken.per_request
    return slower and all(k >= t for k, t in zip(kept.features, taken.features))


def override_pays(gain: float, uncertainty_kept: float, uncertainty_taken: float,
                  sigmas: float = OVERRIDE_SIGMAS) -> bool:
    """Whether an expected ``gain`` (seconds of cost) is worth leaving the cache for: larger than ``sigmas``
    standard errors of the difference of the two estimates."""
    return gain > sigmas * math.hypot(uncertainty_kept, uncertainty_taken)
