"""StreamWatch: the first SSE event carrying output and the gap before each later token, however the stream is
cut into pieces; never an exception. The gaps land in the histogram exactly as one ``observe`` per token would."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings, strategies as st
from prometheus_client import CollectorRegistry, Histogram

from llmgw.gateway.latency import StreamWatch, carries_output, events_after_last_token
from llmgw.metrics import TOKEN_LATENCY_BOUNDS, TOKEN_LATENCY_BUCKETS, Metrics, add_observations


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


ROLE = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
TOKENS = [event({"choices": [{"index": 0, "delta": {"content": word}}]}) for word in ("Hel", "lo", " there")]
FINISH = event({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}]})  # vLLM's EOS step
USAGE = event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}})
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + b"".join(TOKENS) + FINISH + USAGE + DONE
FIRST_TOKEN_LINE_END = len(ROLE) + len(TOKENS[0]) - 2  # the newline ending its data line


def watched(pieces: list[bytes], times: list[float]) -> StreamWatch:
    """A watch fed ``pieces`` at ``times`` and closed as the data plane closes it."""
    watch = StreamWatch(TOKEN_LATENCY_BOUNDS)
    for piece, now in zip(pieces, times):
        watch.feed(piece, now)
    watch.close(events_after_last_token(pieces[-4:]))
    return watch


def test_chunk_shapes():
    assert carries_output({"choices": [{"text": "a"}]})
    assert not carries_output({"choices": [{"text": ""}]})
    assert carries_output({"choices": [{"delta": {"tool_calls": [{"id": "x"}]}}]})
    assert carries_output({"choices": [{"delta": {"reasoning_content": "hmm"}}]})
    assert not carries_output({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert not carries_output({"choices": []}) and not carries_output([1]) and not carries_output({"choices": 3})


def test_what_ends_a_stream_after_its_last_token():
    assert events_after_last_token([TOKENS[0], FINISH, USAGE, DONE]) == 2  # the finish step is a token
    assert events_after_last_token([TOKENS[0] + DONE]) == 1
    assert events_after_last_token([TOKENS[0] + b'data: {"error": {"message": "x"}}\n\n', DONE]) == 2
    assert events_after_last_token([TOKENS[0] + USAGE.replace(b'"choices": []', b'"choices" :[ ]') + DONE]) == 2
    assert events_after_last_token([TOKENS[0]]) == 0 and events_after_last_token([]) == 0


TRAILER = USAGE + DONE
ENDINGS = {  # how the events after the last token may arrive: the data plane reads them from its last 4 pieces
    "glued": [], "one piece": [TRAILER], "two pieces": [USAGE, DONE],
    "cut usage": [USAGE[:7], USAGE[7:40], USAGE[40:] + DONE], "cut marker": [USAGE[:3], USAGE[3:], DONE]}


@given(cuts=st.lists(st.integers(min_value=1, max_value=len(STREAM) - len(TRAILER) - 1), unique=True, max_size=20),
       ending=st.sampled_from(sorted(ENDINGS)))
@settings(max_examples=300, deadline=None)
def test_first_token_and_gaps_whatever_the_pieces(cuts, ending):
    """The first token is stamped with the arrival of the piece that completes its data line, a later one with
    the piece that brings its ``data:``; the three tokens after the first (two words, the finish step) give
    three gaps that end with the last token, for every way of cutting the stream; the usage chunk and [DONE]
    are none."""
    body = STREAM[:-len(TRAILER)]
    bounds = [0, *sorted(cuts), len(body)]
    pieces = [body[start:end] for start, end in zip(bounds, bounds[1:])]
    if ENDINGS[ending]:
        pieces += ENDINGS[ending]
    else:
        pieces[-1] += TRAILER
    times = [float(number) for number in range(len(pieces))]
    watch = watched(pieces, times)
    first = next(number for number, end in enumerate(bounds[1:]) if end > FIRST_TOKEN_LINE_END)
    last_token_at = len(body) - len(FINISH) + len(b"data:")  # stamped when its line has begun to come
    last = next(number for number, end in enumerate(bounds[1:]) if end >= last_token_at)
    assert watch.first_token_at == first
    assert sum(watch.counts) == 3
    assert watch.last_token_at == last


@given(st.lists(st.tuples(st.floats(min_value=0, max_value=3), st.integers(min_value=1, max_value=5)),
                min_size=1, max_size=40),
       st.sampled_from([b"", DONE, USAGE + DONE]))
@settings(max_examples=300, deadline=None)
def test_per_chunk_accounting(chunks, ending):
    """For any chunk timings and token counts: as many gaps as tokens after the first, summing to the time
    from the first token to the last, each chunk's tokens sharing the wait since the one before; and added
    to a histogram, the very series one ``observe`` per gap gives."""
    times = [0.0]
    for wait, _ in chunks[1:]:
        times.append(times[-1] + wait)
    pieces = [TOKENS[0] * tokens for _, tokens in chunks]
    if ending:
        pieces.append(ending)
        times.append(times[-1] + 0.5)
    watch = watched(pieces, times)
    tokens = sum(tokens for _, tokens in chunks)
    assert sum(watch.counts) == tokens - 1
    assert watch.first_token_at == 0.0 and watch.last_token_at == times[len(chunks) - 1]

    gaps = [0.0] * (chunks[0][1] - 1)  # tokens that came with the first waited for nothing
    for (_, count), at, before in zip(chunks[1:], times[1:], times):
        gaps += [(at - before) / count] * count
    assert math.isclose(sum(gaps), watch.last_token_at - watch.first_token_at, abs_tol=1e-9)
    batched, each = (histogram_child(name) for name in ("batched", "each"))
    add_observations(batched, watch.counts, watch.last_token_at - watch.first_token_at)
    for gap in gaps:
        each.observe(gap)
    assert bucket_counts(batched) == bucket_counts(each)
    assert math.isclose(batched._sum.get(), each._sum.get(), abs_tol=1e-9)


def histogram_child(name: str):
    return Histogram(f"gaps_{name}", "", ["replica"], buckets=TOKEN_LATENCY_BUCKETS,
                     registry=CollectorRegistry()).labels("r")


def bucket_counts(child) -> list[float]:
    return [bucket.get() for bucket in child._buckets]


def test_bounds_are_the_histograms():
    child = Metrics().inter_token.labels("m", "r")
    assert list(child._upper_bounds) == list(TOKEN_LATENCY_BOUNDS)


def test_one_token_streams_have_no_gaps():
    watch = watched([ROLE, TOKENS[0], USAGE, DONE], [0.0, 1.0, 2.0, 3.0])
    assert watch.first_token_at == watch.last_token_at == 1.0 and sum(watch.counts) == 0


@pytest.mark.parametrize("split", [1, 3, 5, 6])
def test_a_data_line_cut_anywhere_is_one_token(split):
    second = TOKENS[1]
    watch = watched([TOKENS[0] + second[:split], second[split:], DONE], [0.0, 1.0, 2.0])
    assert sum(watch.counts) == 1
    assert watch.last_token_at == (0.0 if split >= len(b"data:") else 1.0)  # counted where its "data:" completed


@given(st.lists(st.binary(max_size=200), max_size=30))
@settings(max_examples=300, deadline=None)
def test_any_bytes_are_safe(pieces):
    watch = StreamWatch(TOKEN_LATENCY_BOUNDS)
    for number, piece in enumerate(pieces):
        watch.feed(piece, float(number))
    watch.close(events_after_last_token(pieces[-4:]))
    assert watch.first_token_at is None or watch.first_token_at >= 0
    assert all(count >= 0 for count in watch.counts)


def test_an_oversized_first_event_is_given_up():
    watch = StreamWatch(TOKEN_LATENCY_BOUNDS)
    watch.feed(b"data: {" + b" " * (2 << 20), 0.0)
    watch.feed(b'"choices":[{"text":"a"}]}\n\n' + TOKENS[0], 1.0)
    assert watch.first_token_at is None
