"""OpenAI's rate-limit headers: ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` and ``retry-after``.

OpenAI writes a reset as a Go duration (``1s``, ``6m0s``, ``20ms``, ``1.5s``); clients (the OpenAI SDKs,
LiteLLM, LangChain) parse that form, so it is kept exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Window:
    """One limit's state as a client sees it: the limit, what is left, seconds until it is whole again."""

    limit: int
    remaining: int
    reset: float


def format_reset(seconds: float) -> str:
    """``seconds`` as OpenAI writes a reset: ``20ms`` under a second, else Go's ``1h2m3.5s`` (ms precision)."""
    millis = max(0, math.ceil(seconds * 1000 - 1e-6))
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, fraction = divmod(rest, 1000)
    text = f"{whole}.{fraction:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    if minutes:
        return f"{minutes}m{text}"
    return text


def ratelimit_headers(requests: Window | None, tokens: Window | None) -> list[tuple[bytes, bytes]]:
    """The x-ratelimit-* headers of the limits there are (none: ``[]``)."""
    headers: list[tuple[bytes, bytes]] = []
    for name, window in ((b"requests", requests), (b"tokens", tokens)):
        if window is not None:
            headers += [(b"x-ratelimit-limit-" + name, str(window.limit).encode()),
                        (b"x-ratelimit-remaining-" + name, str(window.remaining).encode()),
                        (b"x-ratelimit-reset-" + name, format_reset(window.reset).encode())]
    return headers


def retry_after_header(seconds: float) -> tuple[bytes, bytes]:
    """``Retry-After`` in whole seconds (HTTP has no fractions), rounded up, at least 1."""
    return (b"retry-after", str(max(1, math.ceil(seconds))).encode())
