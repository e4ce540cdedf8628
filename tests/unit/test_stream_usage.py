"""Forcing a stream's usage upstream and taking it out of what the client reads (llmgw/gateway/stream_usage.py)."""

from __future__ import annotations

import json

from hypothesis import given, strategies as st

from llmgw.gateway.stream_usage import MAX_HELD_BYTES, UsageChunkFilter, is_usage_chunk, usage_forced_body

CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n'
USAGE = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
         b'"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}\n\n')
DONE = b"data: [DONE]\n\n"
STREAM = CHUNK % b"a" + CHUNK % b"b" + CHUNK % b"usage" + USAGE + DONE
WITHOUT = CHUNK % b"a" + CHUNK % b"b" + CHUNK % b"usage" + DONE


def test_the_option_is_added_only_to_a_stream_that_did_not_ask():
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "h\u00e9 \ud800"}]}
    forced = usage_forced_body("/v1/chat/completions", body)
    assert forced is not None and json.loads(forced) == {**body, "stream_options": {"include_usage": True}}
    # continuous_usage_stats without include_usage gave this client no usage: it must not start to
    kept = {**body, "stream_options": {"continuous_usage_stats": True, "include_usage": False, "x": 1}}
    assert json.loads(usage_forced_body("/v1/completions", kept) or b"")["stream_options"] == {
        "include_usage": True, "x": 1}
    assert usage_forced_body("/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}) is None
    assert usage_forced_body("/v1/chat/completions", {**body, "stream": False}) is None
    assert usage_forced_body("/v1/chat/completions", {**body, "stream_options": "bad"}) is None  # the engine's 400
    assert usage_forced_body("/v1/embeddings", body) is None


def test_a_usage_chunk_is_the_one_without_choices():
    assert is_usage_chunk(USAGE.strip())
    assert not is_usage_chunk((CHUNK % b"usage").strip())
    assert not is_usage_chunk(b'data: {"choices":[],"usage":null}')
    assert not is_usage_chunk(b"data: [DONE]")


def test_pieces_that_end_with_events_pass_untouched():
    strip = UsageChunkFilter()
    piece = CHUNK % b"a"
    assert strip.feed(piece) is piece
    assert strip.feed(USAGE + DONE) == DONE
    assert strip.removed == 1


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12), st.booleans())
def test_any_split_relays_exactly_the_stream_without_its_usage_chunk(cuts, crlf):
    stream, expected = (STREAM, WITHOUT) if not crlf else (STREAM.replace(b"\n", b"\r\n"),
                                                         WITHOUT.replace(b"\n", b"\r\n"))
    pieces = split_at(stream, cuts)
    strip = UsageChunkFilter()
    relayed = b"".join(strip.feed(piece) for piece in pieces) + strip.flush()
    assert relayed == expected


@given(st.binary(max_size=300), st.lists(st.integers(min_value=0, max_value=300), max_size=6))
def test_anything_without_a_usage_chunk_goes_through_unchanged(data, cuts):
    strip = UsageChunkFilter()
    relayed = b"".join(strip.feed(piece) for piece in split_at(data, cuts)) + strip.flush()
    if strip.removed == 0:
        assert relayed == data


def test_an_endless_event_is_not_held_beyond_the_bound():
    strip = UsageChunkFilter()
    big = b"data: " + b"x" * (MAX_HELD_BYTES - 6)
    assert strip.feed(big) == b""  # held: the event may still end
    assert strip.feed(b"yy") == big + b"yy"  # beyond the bound: relayed as it comes
    assert strip.feed(b"z\n\n") == b"z\n\n"
