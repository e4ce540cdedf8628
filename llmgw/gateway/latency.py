"""Latency truth for one relayed response: when its first token arrived, and how fast the rest followed.

Engines such as vLLM send a streamed response's head at once and its first
token later, so the head (``llmgw_time_to_first_byte_seconds``) says nothing
about the time to first token. :class:`StreamWatch` reads a server-sent-event
stream piece by piece until the first ``data:`` event that carries output (a
non-empty ``text``, ``delta.content``, reasoning content or tool calls): that
instant is the time to first token. From then on it only counts ``data:``
events, without parsing them. A non-streamed response's first token is its
whole body.

The mean inter-token latency of a stream is the time from its first token to
its end over the tokens after the first: usage's ``completion_tokens`` when
the stream reports usage, otherwise the events counted (one token each, as
vLLM sends them by default), less the closing ``[DONE]``.
"""

from __future__ import annotations

import json

MAX_UNPARSED_BYTES = 1 << 20  # a first event longer than this is not looked into: the first token is then unknown


def carries_output(chunk: object) -> bool:
    """Whether one decoded SSE chunk of a completion or chat stream carries generated output."""
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")
                                        or delta.get("reasoning") or delta.get("tool_calls")):
            return True
    return False


class StreamWatch:
    """Fed every piece of one SSE response with the time it arrived; knows when the first token came."""

    __slots__ = ("first_token_at", "events_after_first", "_pending", "_tail")

    def __init__(self) -> None:
        self.first_token_at: float | None = None
        self.events_after_first = 0  # data: events after the one with the first token ([DONE] included)
        self._pending: bytes | None = b""  # the start of a line the next piece completes (None: gave up)
        self._tail = b""  # the last bytes of the previous piece: a "data:" cut in two is counted once

    def feed(self, piece: bytes, now: float) -> None:
        if self.first_token_at is not None:
            seen = self._tail + piece
            self.events_after_first += seen.count(b"data:")
            self._tail = seen[-4:]  # shorter than "data:": never counted twice
            return
        if self._pending is None:  # gave up on an oversized first event
            return
        lines = (self._pending + piece).split(b"\n")
        pending = lines.pop()
        for at, line in enumerate(lines):
            if not line.startswith(b"data:") or not self._has_output(line[5:]):
                continue
            self.first_token_at = now
            rest = lines[at + 1:]
            self.events_after_first = sum(1 for later in rest if later.startswith(b"data:")) + pending.count(b"data:")
            self._pending = b""
            self._tail = pending[-4:]
            return
        self._pending = pending if len(pending) <= MAX_UNPARSED_BYTES else None

    @staticmethod
    def _has_output(payload: bytes) -> bool:
        payload = payload.strip()
        if not payload or payload == b"[DONE]":
            return False
        try:
            return carries_output(json.loads(payload))
        except (ValueError, UnicodeDecodeError, RecursionError):
            return False

    def tokens_after_first(self, completion_tokens: int | None) -> int:
        """Output tokens after the first: from usage when known, else the data events less ``[DONE]``."""
        if completion_tokens is not None:
            return completion_tokens - 1
        return self.events_after_first - 1
