"""Whether a measurement's rounds agree: the spread of per-round values, and the bound beyond which a ratio of two
targets is not printed (rounds that disagree measured the machine's other work more than the targets).

The proxy benchmark measures its targets interleaved, round after round, and reports the median of the per-round
ratios; when those ratios differ by more than :data:`RATIO_SPREAD_BOUND` of their median, the median is noise
from something else on the machine, and printing it as a result would mislead. docs/development.md, "A quiet
measurement", says how to get rounds that agree.
"""

from __future__ import annotations

import statistics

RATIO_SPREAD_BOUND = 0.10  # (max - min) / median of the per-round ratios


def spread(values: list[float]) -> float | None:
    """(max - min) / median of ``values``; None for fewer than two values, or a median of 0."""
    if len(values) < 2:
        return None
    median = statistics.median(values)
    return (max(values) - min(values)) / abs(median) if median else None


def disagreement(values: list[float], bound: float = RATIO_SPREAD_BOUND) -> str | None:
    """Why the median of ``values`` is not to be printed (the rounds disagree beyond ``bound``), else None."""
    observed = spread(values)
    if observed is None or observed <= bound:
        return None
    return (f"not printed: the rounds disagree by {observed * 100:.0f}% (bound {bound * 100:.0f}%): "
            f"the machine was not quiet")
