"""A stream's usage for tenancy: ask the engine for it, and take it out of what the client sees if it did not ask.

An OpenAI-compatible engine sends a stream's token counts only in a final chunk (``"choices": []`` and
``"usage"``, just before ``data: [DONE]``), and only when the request set ``stream_options.include_usage``. A
limited key's reservation is settled with those counts, so for a stream whose client did not ask,
:func:`usage_forced_body` adds the option to the body sent upstream (the body is re-encoded only then; any other
request's bytes go through untouched), and a :class:`UsageChunkFilter` takes that chunk out of the relayed pieces,
so the client reads exactly the bytes it would have read from the engine without the option. The data plane reads
the usage from the upstream's own pieces (:func:`llmgw.gateway.usage.usage_of_stream_tail`), before the filter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

# The paths whose streams end with a usage chunk when asked (vLLM's; /v1/responses reports usage in its own events).
USAGE_OPTION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
MAX_HELD_BYTES = 1 << 20  # an event longer than this is relayed as it comes (it is no usage chunk), unfiltered
_USAGE_KEY = b'"usage"'
_EVENT_END = re.compile(rb"(\r\n\r\n|\n\n|\r\r)")
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")
_encode = json.JSONEncoder(separators=(",", ":")).encode


def usage_forced_body(path: str, body: Mapping[str, object]) -> bytes | None:
    """The body to send upstream instead of the client's when the engine must be asked for a stream's usage
    (``stream: true`` on a completion path, without ``stream_options.include_usage``); None: send the client's
    bytes. A ``stream_options`` that is not an object is left for the engine to refuse; its
    ``continuous_usage_stats`` is dropped (it takes effect only with ``include_usage``)."""
    if path not in USAGE_OPTION_PATHS or body.get("stream") is not True:
        return None
    options = body.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict) or options.get("include_usage") is True:
        return None
    forced = dict(body)
    # Without include_usage, continuous_usage_stats did nothing for this client; with it, every chunk would carry
    # usage: it goes, so that the chunks the client reads stay as they were.
    forced["stream_options"] = {**{k: v for k, v in options.items() if k != "continuous_usage_stats"},
                                "include_usage": True}
    return encode_body(forced)


def encode_body(body: Mapping[str, object]) -> bytes:
    """A body re-encoded for the engine: compact JSON with ASCII escapes, so a lone surrogate the client sent
    stays as it was."""
    return _encode(body).encode("ascii")


def _last_event_end(data: bytes) -> int:
    """Where the last complete event of ``data`` ends (0: none does)."""
    last = 0
    for end in _EVENT_ENDS:
        at = data.rfind(end)
        if at >= 0 and at + len(end) > last:
            last = at + len(end)
    return last


def is_usage_chunk(event: bytes) -> bool:
    """Whether one SSE event is the final usage chunk: a ``data:`` JSON object with ``"choices": []`` and a
    ``usage`` object."""
    for line in event.splitlines():
        if line.startswith(b"data:"):
            try:
                chunk = json.loads(line[5:])
            except (ValueError, RecursionError):
                return False
            return isinstance(chunk, dict) and chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict)
    return False


class UsageChunkFilter:
    """The pieces of one event stream, less its usage chunk, however the upstream split them.

    A piece that ends where an event ends (nearly all of them) passes at once, untouched and uncopied, unless it
    holds ``"usage"``. Otherwise the bytes after its last event end are held until the event's end arrives (at most
    :data:`MAX_HELD_BYTES`), so an event is looked at whole: the client gets the same bytes, at most one event
    later than it would have."""

    __slots__ = ("_held", "removed")

    def __init__(self) -> None:
        self._held = b""
        self.removed = 0  # usage chunks taken out

    def feed(self, piece: bytes) -> bytes:
        """What to relay of ``piece`` now (possibly ``b""``)."""
        data = self._held + piece if self._held else piece
        if data.endswith(_EVENT_ENDS):
            self._held = b""
            ready = data
        else:
            end = _last_event_end(data)
            ready, held = data[:end], data[end:]
            if len(held) > MAX_HELD_BYTES:
                ready, held = data, b""
            self._held = held
        return self._without_usage(ready) if _USAGE_KEY in ready else ready

    def flush(self) -> bytes:
        """The stream ended: what is still held (an unfinished last event), less a usage chunk."""
        held, self._held = self._held, b""
        return self._without_usage(held) if _USAGE_KEY in held else held

    def _without_usage(self, data: bytes) -> bytes:
        parts = _EVENT_END.split(data)  # event, end, event, end, ..., the rest after the last end
        kept: list[bytes] = []
        for i in range(0, len(parts), 2):
            event = parts[i]
            end = parts[i + 1] if i + 1 < len(parts) else b""
            if _USAGE_KEY in event and is_usage_chunk(event):
                self.removed += 1
                continue
            kept.append(event)
            kept.append(end)
        return b"".join(kept)
