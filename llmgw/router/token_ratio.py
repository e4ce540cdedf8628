"""Prompt tokens per character of a model, learnt from what its engines report: the prefix tree's token counts.

The ``prefix_tree`` tier matches characters of a request's canonical text
(:mod:`llmgw.router.canonical`), while the cost model counts tokens. Without
a tokenizer it guesses ``characters / CHARS_PER_TOKEN`` (4, English text with
a BPE tokenizer); but a tokenizer can make one token a character (the
simulator's byte tokenizer, code, some scripts), and a cold prompt's prefill
is then estimated at a quarter of what it computes. Each response whose usage
says its ``prompt_tokens`` is one observation of ``prompt_tokens / characters``
(the chat template's tokens included, as the engine computes them): an
exponentially weighted mean over responses (``DECAY`` per observation, the
mean of the observations' token and character counts, so long prompts weigh
more), kept within ``[MIN_RATIO, MAX_RATIO]``. Prompts shorter than
``MIN_CHARS`` are left out (their template tokens are most of them).
"""

from __future__ import annotations

import math

from .canonical import CHARS_PER_TOKEN

DECAY = 0.95  # per observation: about the last 20 responses count
MIN_CHARS = 64
MIN_RATIO, MAX_RATIO = 0.02, 4.0  # tokens per character (a byte tokenizer makes 1, token ids written as numbers less)


class TokensPerChar:
    """A model's learnt prompt tokens per character; ``1 / CHARS_PER_TOKEN`` until a response said."""

    __slots__ = ("tokens", "chars", "observations", "__weakref__")

    def __init__(self) -> None:
        self.tokens = 0.0  # decayed sums
        self.chars = 0.0
        self.observations = 0

    def observe(self, chars: object, prompt_tokens: object) -> None:
        """One response: ``prompt_tokens`` (its usage's) for a prompt of ``chars`` characters; anything that is not
        a sane count is ignored."""
        if type(chars) is not int or type(prompt_tokens) is not int or chars < MIN_CHARS or prompt_tokens <= 0:
            return
        if not MIN_RATIO <= prompt_tokens / chars <= MAX_RATIO:
            return
        self.tokens = self.tokens * DECAY + prompt_tokens
        self.chars = self.chars * DECAY + chars
        self.observations += 1

    @property
    def ratio(self) -> float:
        return self.tokens / self.chars if self.observations else 1.0 / CHARS_PER_TOKEN

    def count(self, chars: int) -> int:
        """The tokens ``chars`` characters make."""
        return int(math.floor(chars * self.ratio))
