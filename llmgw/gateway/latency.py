"""Latency truth for one relayed stream: when its first token arrived, and the gap before each token after it.

Engines such as vLLM send a streamed response's head at once and its first
token later, so the head (``llmgw_time_to_first_byte_seconds``) says nothing
about the time to first token. :class:`StreamWatch` reads a server-sent-event
stream piece by piece until the first ``data:`` event that carries output (a
non-empty ``text``, ``delta.content``, reasoning content or tool calls): that
instant is the time to first token.

From then on it only counts ``data:`` lines, without parsing them, to observe
the inter-token latency as vLLM does: one gap per token. vLLM
(``vllm/v1/metrics/stats.py``, ``IterationStats.update_from_output``) observes
``vllm:inter_token_latency_seconds`` once per engine step that gives a running
request new tokens: the time since that request's previous step. It sends one
SSE event per such step, so here each event after the first token is one
token, stamped with the arrival of the piece that brings its ``data:``; a
piece that brings ``n`` events at once (they were sent at different steps but
arrived together) counts as ``n`` tokens that split the gap since the
previous token-bearing piece evenly. The gaps' count is the
tokens after the first and their sum the time from the first token to the
last, whatever the pieces. An event that carries several tokens (speculative
decoding; vLLM merging steps while the HTTP writer lags) counts as one, as
vLLM's own histogram does for a speculative step.

The gaps are counted into the histogram's buckets locally (an integer add per
piece) and added to the shared histogram once, when the stream ends
(:func:`llmgw.metrics.add_observations`): the same counts as one ``observe``
per token, at a fraction of the cost on the hot path. The events after the
last token (the usage chunk, ``[DONE]``) are no tokens: the last
:data:`HELD_PIECES` pieces that brought events are held back until the end,
when :func:`events_after_last_token` tells them apart from the stream's last
pieces (the data plane's tail, which it also reads ``usage`` from).
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from collections.abc import Sequence

MAX_UNPARSED_BYTES = 1 << 20  # a first event longer than this is not looked into: the first token is then unknown
HELD_PIECES = 2  # the usage chunk and [DONE] may each come in a piece of their own
_LINE_END = b"\n"  # the tail of a piece that ended a line
_TOKEN_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\{')  # a chunk with a choice in it (a usage chunk has none)


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


def events_after_last_token(tail: list[bytes]) -> int:
    """How many ``data:`` lines end a stream after its last token-bearing one (``[DONE]``, a usage chunk without
    choices, an error event), read from its last pieces.

    A chunk with a choice is a token, even with empty content: vLLM's last chunk (the finish reason, with the
    end-of-sequence token's empty text) is a step of its own, which it observes."""
    for pieces in range(1, len(tail) + 1):  # the last piece alone nearly always holds the answer
        text = tail[-1] if pieces == 1 else b"".join(tail[-pieces:])
        found, end = 0, len(text)
        while True:  # data line by data line from the end: only the last few are looked at
            start = text.rfind(b"\ndata:", 0, end) + 1
            if start == 0:
                if pieces < len(tail):
                    break  # the line may begin in the piece before: look again with it
                if not text.startswith(b"data:"):
                    return found
            if _TOKEN_CHOICES.search(text, start + 5, end) is not None:
                return found
            found += 1
            if start == 0:
                return found
            end = start
    return 0


class StreamWatch:
    """Fed every piece of one SSE response with the time it arrived; knows when the first token came and counts
    the gaps before the later ones into ``counts`` (one slot per bucket of ``bounds``, the last ``inf``)."""

    __slots__ = ("first_token_at", "last_token_at", "counts", "_bounds", "_pending", "_tail",
                 "_older_at", "_older_n", "_newer_at", "_newer_n")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None  # the last token-bearing piece accounted (see close)
        self.counts: list[int] = []  # gaps per bucket, once the first token came
        self._bounds = bounds
        self._pending: bytes | None = b""  # the start of a line the next piece completes (None: gave up)
        self._tail = _LINE_END  # the last bytes of the stream so far, for a "\ndata:" cut between two pieces
        self._older_at = self._newer_at = 0.0  # the pieces held back: arrival and data lines
        self._older_n = self._newer_n = 0

    def feed(self, piece: bytes, now: float) -> None:
        if self.first_token_at is not None:
            events = piece.count(b"\ndata:")
            tail = self._tail
            if tail is _LINE_END:  # the last piece ended a line, as pieces nearly always do: no copy
                events += piece.startswith(b"data:")
            else:  # what the last piece's end and this one's start spell together ("\nda" + "ta:")
                events += (tail + piece[:5]).count(b"\ndata:")
            self._tail = _LINE_END if piece.endswith(b"\n") else (tail + piece)[-5:]  # shorter than "\ndata:"
            if events:  # hold this piece back; account the one held before the last (inlined: the hot path)
                older = self._older_n
                if older:
                    at = self._older_at
                    self.counts[bisect_left(self._bounds, (at - self.last_token_at) / older)] += older  # type: ignore[operator]
                    self.last_token_at = at
                self._older_at = self._newer_at
                self._older_n = self._newer_n
                self._newer_at = now
                self._newer_n = events
            return
        if self._pending is None:  # gave up on an oversized first event
            return
        # Line by line up to the first token, without splitting the rest (a first piece may hold the whole stream).
        text = self._pending + piece if self._pending else piece
        start = 0
        end = text.find(b"\n")
        while end >= 0:
            if text.startswith(b"data:", start, end) and self._has_output(text[start + 5:end]):
                self.first_token_at = self.last_token_at = now
                self.counts = [0] * len(self._bounds)
                self._pending = b""
                self._tail = _LINE_END if text.endswith(b"\n") else text[text.rfind(b"\n"):][-5:]
                self._newer_at = now
                self._newer_n = text.count(b"\ndata:", end)  # the data lines after this one
                return
            start = end + 1
            end = text.find(b"\n", start)
        pending = text[start:]
        self._pending = pending if len(pending) <= MAX_UNPARSED_BYTES else None

    @property
    def tokens_seen(self) -> int:
        """The events that carried tokens so far, the first one's included (one per engine step: a stream
        broken off is charged these); before :meth:`close`, the last ones held back may include the usage chunk
        and ``[DONE]``."""
        if self.first_token_at is None:
            return 0
        return 1 + sum(self.counts) + self._older_n + self._newer_n

    def _account(self, at: float, events: int) -> None:
        """``events`` tokens that arrived at ``at``: each waited an equal share of the time since the last."""
        assert self.last_token_at is not None  # set with the first token, before any piece is held
        self.counts[bisect_left(self._bounds, (at - self.last_token_at) / events)] += events
        self.last_token_at = at

    def close(self, trailing: int) -> None:
        """The stream ended and its last ``trailing`` data lines were no tokens: account the pieces held back."""
        dropped = min(trailing, self._newer_n)
        self._newer_n -= dropped
        self._older_n -= min(trailing - dropped, self._older_n)
        for at, events in ((self._older_at, self._older_n), (self._newer_at, self._newer_n)):
            if events:
                self._account(at, events)
        self._older_n = self._newer_n = 0

    @staticmethod
    def _has_output(payload: bytes) -> bool:
        payload = payload.strip()
        if not payload or payload == b"[DONE]":
            return False
        try:
            return carries_output(json.loads(payload))
        except (ValueError, UnicodeDecodeError, RecursionError):
            return False
