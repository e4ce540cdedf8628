"""How many prompt tokens the model's engines count per token the router estimated (characters / 4), learnt from
the answers' ``usage``: what turns the router's prompt estimate into the KV tokens a request will hold.

A tokenizer can count several times the estimate (the simulator's counts ~4x, a code or non-Latin prompt more than
English), so a KV budget counted in estimated tokens alone would let several times too many requests through. The
ratio is a moving average of ``usage.prompt_tokens / estimate`` over the model's answers, each sample clamped to
``[MIN_RATIO, MAX_RATIO]`` (a forged or broken usage block moves it at most that far); 1.0 until an answer says.
"""

from __future__ import annotations

MIN_RATIO, MAX_RATIO = 0.25, 16.0
WEIGHT = 0.1  # a new answer's share of the average: ~10 answers to follow a change of workload


class PromptTokenRatio:
    __slots__ = ("ratio", "samples")

    def __init__(self) -> None:
        self.ratio = 1.0
        self.samples = 0

    def observe(self, estimated: int, usage: object) -> None:
        """An answer to a request whose prompt was estimated at ``estimated`` tokens ended with ``usage`` (anything
        an engine sent: only a dict with an integer ``prompt_tokens`` teaches; typed ``object`` so that the compiled
        build takes what the pure one does)."""
        if estimated <= 0 or not isinstance(usage, dict):
            return
        counted = usage.get("prompt_tokens")
        if not isinstance(counted, int) or isinstance(counted, bool) or counted <= 0:
            return
        sample = min(MAX_RATIO, max(MIN_RATIO, counted / estimated))
        self.ratio = sample if not self.samples else self.ratio + WEIGHT * (sample - self.ratio)
        self.samples += 1

    def tokens(self, estimated: int) -> int:
        """The engine's likely count of ``estimated`` prompt tokens."""
        return round(estimated * self.ratio)
