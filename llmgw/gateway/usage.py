"""The engine's ``usage`` block of a response, found cheaply: token counters, and tiers that ask (``wants_usage``).

The data plane never parses a response body as a whole; for the token
counters (``llmgw_prompt_tokens_total`` and its siblings) and for tiers that
want usage (the ``kv_index`` tier compares its predicted cached tokens with
``usage.prompt_tokens_details.cached_tokens``) it hands these functions:

- a whole (non-streamed) body: the last ``"usage"`` key is decoded from there
  on, not the whole body (vLLM and the simulator put it last);
- the last few pieces of a stream: the final usage chunk (sent only when the
  request set ``stream_options.include_usage``) is among the last SSE events,
  just before ``data: [DONE]``.

Both return None when there is no usage object, never raise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

_KEY = b'"usage"'
_decoder = json.JSONDecoder()
STREAM_TAIL_PIECES = 4  # pieces of a stream the data plane keeps (references, no copies) for the usage chunk


def usage_of_body(data: bytes) -> dict | None:
    """``usage`` of a JSON response body, decoding only from its last ``"usage"`` key."""
    at = data.rfind(_KEY)
    if at < 0:
        return None
    try:
        text = data[at + len(_KEY):].decode("utf-8")
        colon = text.index(":")
        start = colon + 1
        while start < len(text) and text[start] in " \t\r\n":
            start += 1
        value, _ = _decoder.raw_decode(text, start)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def usage_of_stream_tail(pieces: list[bytes]) -> dict | None:
    """``usage`` of the last SSE event that carries one, among the last pieces of a stream."""
    tail = b"".join(pieces)
    if _KEY not in tail:
        return None
    for event in reversed(tail.replace(b"\r\n", b"\n").split(b"\n\n")):
        if _KEY not in event:
            continue
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    chunk = json.loads(line[5:])
                except (ValueError, UnicodeDecodeError):
                    break  # the start of the tail cut this event: nothing older will be the final chunk
                usage = chunk.get("usage") if isinstance(chunk, dict) else None
                if isinstance(usage, dict):
                    return usage
    return None


def usage_counts(usage: Mapping[str, object]) -> tuple[int | None, int | None, int | None]:
    """``(prompt_tokens, cached_tokens, completion_tokens)`` of a usage object, each None where it is missing or
    not a sane count (an integer in ``[0, 2**40)``)."""
    details = usage.get("prompt_tokens_details")
    cached = _count_of(details, "cached_tokens") if isinstance(details, dict) else None
    return _count_of(usage, "prompt_tokens"), cached, _count_of(usage, "completion_tokens")


def _count_of(mapping: Mapping[str, object], key: str) -> int | None:
    value = mapping.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 40 else None
