"""What an admission reserves for one request: its prompt's tokens, its most output tokens, and their cost.

A reservation is settled with the engine's usage once the answer ends, so an estimate that errs high costs only
headroom for the request's duration, while one that errs low lets a key overshoot its limit. Every estimate here
errs high, and is bounded:

- the prompt: the tokenizer's count when the caller has one; a completion's prompt given as token ids counts
  them; else the request body's size in bytes. A byte-level
  BPE tokenizer (and SentencePiece with byte fallback) makes at most one token per byte of text, and a JSON body
  holds each string's UTF-8 bytes or more (escapes are longer), plus, for every message, its ``{"role":...,
  "content":...}`` frame, which is more bytes than a chat template's tokens around it. Capped at
  ``tenancy.max_prompt_estimate`` and the model's ``max_model_len``;
- the output: ``max_completion_tokens`` (chat), ``max_tokens``, ``max_output_tokens`` (responses), else
  ``tenancy.default_max_tokens``, for each of ``n`` choices, each capped at ``max_model_len``; none for the paths
  that generate nothing (embeddings, tokenize, score, ...);
- the cost: the model's price for those tokens, the input at the uncached price.

It reads a few keys of the parsed body and walks nothing but a prompt of token ids (already parsed within the
data plane's JSON limits), and it never raises.
"""

from __future__ import annotations

from collections.abc import Mapping

from .model import Estimate, PriceList, TenancySettings

# The paths whose answer is generated text: only they reserve output tokens.
GENERATING_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses",
                              "/v1/audio/transcriptions", "/v1/audio/translations"})
OUTPUT_LIMIT_KEYS = ("max_completion_tokens", "max_tokens", "max_output_tokens")  # the first one given counts
MAX_CHOICES = 128  # the most choices (``n``) an estimate multiplies by; an engine refuses more long before
MAX_COUNT = 1 << 40  # any count larger than this in a body is taken as this


def _count(value: object) -> int | None:
    """A JSON integer >= 0 (not a bool, not a float), bounded by :data:`MAX_COUNT`; None otherwise."""
    if type(value) is not int or value < 0:
        return None
    return min(value, MAX_COUNT)


def _token_ids(prompt: object) -> int | None:
    """How many token ids a completion's ``prompt`` holds when it is token ids (a list of ints, or a batch of
    such lists); None when it is text."""
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(type(item) is int for item in prompt):
        return len(prompt)
    if all(isinstance(item, list) and all(type(i) is int for i in item) for item in prompt):
        return sum(len(item) for item in prompt)
    return None


class Estimator:
    """Estimates of one configuration (its settings, prices and models' context lengths); swapped whole on
    reload."""

    __slots__ = ("settings", "prices", "max_model_len")

    def __init__(self, settings: TenancySettings, prices: PriceList,
                 max_model_len: Mapping[str, int] | None = None) -> None:
        self.settings = settings
        self.prices = prices
        self.max_model_len: dict[str, int] = dict(max_model_len or {})

    def estimate(self, model: str, path: str, body: Mapping[str, object], body_bytes: int,
                 prompt_tokens: int | None = None) -> Estimate:
        """The reservation of a request to ``model`` on ``path`` whose parsed body is ``body`` (``body_bytes``
        long); ``prompt_tokens``: the tokenizer's count, when the caller has one."""
        settings = self.settings
        context = self.max_model_len.get(model)
        prompt = _count(prompt_tokens)
        if prompt is None and path == "/v1/completions":
            prompt = _token_ids(body.get("prompt"))
        if prompt is None:
            prompt = min(max(body_bytes, 0), settings.max_prompt_estimate)
        if context is not None:
            prompt = min(prompt, context)
        output = 0
        if path in GENERATING_PATHS:
            limit = None
            for key in OUTPUT_LIMIT_KEYS:
                limit = _count(body.get(key))
                if limit is not None:
                    break
            if limit is None:
                limit = max(settings.default_max_tokens, 0)
            if context is not None:
                limit = min(limit, context)
            choices = _count(body.get("n"))
            output = limit * min(max(choices if choices is not None else 1, 1), MAX_CHOICES)
        return Estimate(prompt, output, self.prices.of(model).cost(prompt, 0, output))
