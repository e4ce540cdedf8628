"""StreamWatch: the first SSE event carrying output, however the stream is cut into pieces; never an exception."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from llmgw.gateway.latency import StreamWatch, carries_output


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


ROLE = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
TOKENS = [event({"choices": [{"index": 0, "delta": {"content": word}}]}) for word in ("Hel", "lo", " there")]
USAGE = event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
STREAM = ROLE + b"".join(TOKENS) + USAGE + b"data: [DONE]\n\n"
FIRST_TOKEN_LINE_END = len(ROLE) + len(TOKENS[0]) - 2  # the newline ending its data line


def test_chunk_shapes():
    assert carries_output({"choices": [{"text": "a"}]})
    assert not carries_output({"choices": [{"text": ""}]})
    assert carries_output({"choices": [{"delta": {"tool_calls": [{"id": "x"}]}}]})
    assert carries_output({"choices": [{"delta": {"reasoning_content": "hmm"}}]})
    assert not carries_output({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert not carries_output({"choices": []}) and not carries_output([1]) and not carries_output({"choices": 3})


@given(cuts=st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), unique=True, max_size=20))
@settings(max_examples=300, deadline=None)
def test_first_token_whatever_the_pieces(cuts):
    """The first token is stamped with the arrival of the piece that completes its data line, and the data
    events after it are counted, for every way of cutting the stream."""
    bounds = [0, *sorted(cuts), len(STREAM)]
    watch = StreamWatch()
    stamp = None
    for number, (start, end) in enumerate(zip(bounds, bounds[1:])):
        watch.feed(STREAM[start:end], float(number))
        if stamp is None and end > FIRST_TOKEN_LINE_END:
            stamp = float(number)
    assert watch.first_token_at == stamp
    assert watch.events_after_first == 4  # two more tokens, the usage chunk and [DONE]
    assert watch.tokens_after_first(None) == 3
    assert watch.tokens_after_first(3) == 2


@given(st.lists(st.binary(max_size=200), max_size=30))
@settings(max_examples=300, deadline=None)
def test_any_bytes_are_safe(pieces):
    watch = StreamWatch()
    for number, piece in enumerate(pieces):
        watch.feed(piece, float(number))
    assert watch.first_token_at is None or watch.first_token_at >= 0


def test_an_oversized_first_event_is_given_up():
    watch = StreamWatch()
    watch.feed(b"data: {" + b" " * (2 << 20), 0.0)
    watch.feed(b'"choices":[{"text":"a"}]}\n\n' + TOKENS[0], 1.0)
    assert watch.first_token_at is None
