"""How much of its output cap (``max_tokens``) a request to a model will come to hold in the engine's KV cache,
learnt from the answers' ``usage``: the output allowance the flow room reserves instead of the whole cap.

Clients set ``max_tokens`` as a bound, and an answer that ends at its EOS holds fewer output tokens than that;
reserving the whole cap for every request in flight keeps part of the engines' caches empty while requests wait
at the gateway. The room counts the KV of the requests in flight together, so what matters is what a *group* of
them holds: each :data:`BLOCK` consecutive answers with a cap give one sample, their completion tokens over their
caps (each completion counted at most its cap); the allowance is the ``quantile`` of the last :data:`BLOCKS`
samples (a high one: a group that runs longer than expected is what makes an engine preempt), times a request's
cap, rounded up: always within ``[0, cap]``. The whole cap until :data:`MIN_BLOCKS` samples, and while
``quantile`` is None (``flow.learn_output: false``: still learning, so that turning it on takes effect at once).
An answer without usage (a stream cut short, an engine that gives none) teaches nothing.

An allowance learnt too low lets in more than the caches hold once the answers run long; the engines' own KV
usage (scraped) is the backstop for that: at ``kv_high`` it cuts the replica's capacity (llmgw/flow/capacity.py).
"""

from __future__ import annotations

import math

BLOCK = 8  # answers per sample: about the sequences one engine runs at once, whose KV shares one cache
BLOCKS = 64  # samples kept: the last 512 answers with a cap
MIN_BLOCKS = 4  # samples before the allowance is below the cap (32 answers)
DEFAULT_QUANTILE = 0.9


class OutputAllowance:
    __slots__ = ("quantile", "fraction", "answers", "_samples", "_next", "_used", "_capped", "_count")

    def __init__(self, quantile: float | None = DEFAULT_QUANTILE) -> None:
        self.quantile: float | None = None
        self.fraction = 1.0  # of a request's cap, what it reserves
        self.answers = 0  # answers with a cap and usage seen
        self._samples: list[float] = []  # a ring of block ratios, BLOCKS at most
        self._next = 0
        self._used = self._capped = self._count = 0  # the block being filled
        self.set_quantile(quantile)

    def set_quantile(self, quantile: float | None) -> None:
        """Reserve this quantile of the samples from now on (None: the whole cap)."""
        self.quantile = None if quantile is None else min(1.0, max(0.0, quantile))
        self._learnt()

    def _learnt(self) -> None:
        """The fraction from the samples (a sort of :data:`BLOCKS` floats at most)."""
        quantile = self.quantile
        if quantile is None or len(self._samples) < MIN_BLOCKS:
            self.fraction = 1.0
            return
        ordered = sorted(self._samples)
        self.fraction = ordered[min(len(ordered) - 1, math.ceil(quantile * len(ordered)) - 1)] if quantile > 0 \
            else ordered[0]

    def observe(self, cap: int | None, usage: object) -> None:
        """An answer to a request whose output was capped at ``cap`` tokens (None: it set none) ended with
        ``usage`` (anything an engine sent: typed ``object`` so that the compiled build takes what the pure one
        does)."""
        if cap is None or cap <= 0 or not isinstance(usage, dict):
            return
        completion = usage.get("completion_tokens")
        if not isinstance(completion, int) or isinstance(completion, bool) or completion < 0:
            return
        self.answers += 1
        self._used += min(completion, cap)
        self._capped += cap
        self._count += 1
        if self._count < BLOCK:
            return
        sample = self._used / self._capped
        self._used = self._capped = self._count = 0
        if len(self._samples) < BLOCKS:
            self._samples.append(sample)
        else:
            self._samples[self._next] = sample
        self._next = (self._next + 1) % BLOCKS
        self._learnt()

    def tokens(self, cap: int) -> int:
        """The output tokens reserved for ``cap`` (one request's cap, or several summed): within ``[0, cap]``."""
        if cap <= 0:
            return 0
        return cap if self.fraction >= 1.0 else min(cap, math.ceil(cap * self.fraction))
