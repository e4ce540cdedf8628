"""Request-body JSON within bounds (``llmgw.http.jsonbody``): depth, number of values, typed errors only."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.http.jsonbody import SLICE_BYTES, BodyError, JsonLimits, parse_json_body, read_json_body


def nested(depth: int, opening: bytes = b"[", closing: bytes = b"]", inside: bytes = b"") -> bytes:
    return opening * depth + inside + closing * depth


def test_small_bodies_parse():
    assert parse_json_body(b'{"model": "m", "messages": [{"role": "user", "content": "[[{{"}]}') == {
        "model": "m", "messages": [{"role": "user", "content": "[[{{"}]}


@pytest.mark.parametrize("depth", [11, 500, 5000, 200_000])
def test_nesting_beyond_the_bound_is_a_400(depth):
    with pytest.raises(BodyError) as exc:
        parse_json_body(b'{"model":"m","x":' + nested(depth) + b"}",
                        JsonLimits(max_depth=10, max_values=10**6, max_containers=10**6))
    assert (exc.value.status, exc.value.code) == (400, "invalid_json")
    assert "deeper than 10 levels" in str(exc.value)


def test_nesting_at_the_bound_is_taken():
    body = b'{"x":' + nested(9, b'{"a":', b"}", b"1") + b"}"  # the outer object, then 9 more: depth 10
    assert parse_json_body(body, JsonLimits(max_depth=10))["x"]["a"]["a"] is not None
    with pytest.raises(BodyError):
        parse_json_body(b'{"x":' + nested(10, b'{"a":', b"}", b"1") + b"}", JsonLimits(max_depth=10))


def test_brackets_inside_strings_do_not_count_as_depth():
    body = json.dumps({"model": "m", "prompt": "[" * 5000}).encode()
    assert parse_json_body(body, JsonLimits(max_depth=10))["prompt"] == "[" * 5000


def test_more_values_than_the_bound_is_a_413_without_parsing():
    body = b'{"model":"m","prompt":[' + b",".join([b"1"] * 1001) + b"]}"
    with pytest.raises(BodyError) as exc:
        parse_json_body(body, JsonLimits(max_values=1000))
    assert (exc.value.status, exc.value.code) == (413, "request_too_complex")
    assert parse_json_body(body, JsonLimits(max_values=1003))["prompt"][-1] == 1


@pytest.mark.parametrize("body", [b"", b"{", b"\xff\xfe", b'{"a": 1}}', b"NaN-ish", b'"\\ud800"x'])
def test_what_is_not_json_is_a_400(body):
    with pytest.raises(BodyError) as exc:
        parse_json_body(body)
    assert (exc.value.status, exc.value.code) == (400, "invalid_json")



def test_a_byte_order_mark_left_after_decoding_is_a_400_that_says_so():
    # Two UTF-8 BOMs: decoding as utf-8-sig takes one, json.loads refuses a str that still starts with one.
    with pytest.raises(BodyError) as exc:
        parse_json_body(b"\xef\xbb\xbf\xef\xbb\xbf{}")
    assert (exc.value.status, exc.value.code) == (400, "invalid_json")
    assert "BOM" in str(exc.value)
    assert parse_json_body(b"\xef\xbb\xbf{}") == {}  # one BOM is decoded away, as json.loads(bytes) does

json_ish = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None)
@given(st.one_of(
    st.binary(max_size=200),
    json_ish.map(lambda value: json.dumps(value).encode()),
    st.tuples(st.integers(0, 3000), st.sampled_from([b"[", b"{", b'{"a":', b"[1,"])).map(lambda t: t[1] * t[0]),
    st.tuples(json_ish, st.integers(0, 50), st.binary(max_size=5)).map(
        lambda t: json.dumps(t[0]).encode()[: t[1]] + t[2]),
))
def test_any_bytes_give_a_value_or_a_typed_error(body):
    try:
        value = parse_json_body(body, JsonLimits(max_depth=20, max_values=500, max_containers=200))
    except BodyError as exc:
        assert (exc.status, exc.code, exc.reason) in {
            (400, "invalid_json", "not_json"), (400, "invalid_json", "too_deep"),
            (400, "invalid_json", "non_finite_number"),
            (413, "request_too_complex", "too_many_values"), (413, "request_too_complex", "too_many_containers")}
    else:
        assert value == json.loads(body)


def _has_non_finite(value) -> bool:
    if isinstance(value, float):
        return value != value or value in (math.inf, -math.inf)
    if isinstance(value, list):
        return any(_has_non_finite(item) for item in value)
    if isinstance(value, dict):
        return any(_has_non_finite(item) for item in value.values())
    return False


@settings(max_examples=300, deadline=None)
@given(json_ish)
def test_a_body_is_refused_exactly_when_it_holds_nan_or_infinity(value):
    """json.dumps writes NaN, Infinity and -Infinity for non-finite floats, anywhere in the value."""
    body = json.dumps({"model": "m", "x": value}).encode()
    if _has_non_finite(value):
        with pytest.raises(BodyError) as exc:
            parse_json_body(body)
        assert (exc.value.status, exc.value.code, exc.value.reason) == (400, "invalid_json", "non_finite_number")
    else:
        assert parse_json_body(body) == json.loads(body)


@pytest.mark.parametrize("word", ["NaN", "Infinity", "-Infinity"])
async def test_nan_and_infinity_are_refused_in_small_and_big_bodies(word):
    small = b'{"model": "m", "temperature": ' + word.encode() + b"}"
    big = b'{"model": "m", "prompt": "' + b"a" * (2 * SLICE_BYTES) + b'", "temperature": ' + word.encode() + b"}"
    for body in (small, big):
        with pytest.raises(BodyError) as exc:
            await read_json_body(body)
        assert exc.value.reason == "non_finite_number" and word in str(exc.value)
    assert await read_json_body(b'{"model": "m", "prompt": "NaN Infinity"}') == {"model": "m",
                                                                                  "prompt": "NaN Infinity"}


def test_escapes_count_against_the_value_bound():
    body = json.dumps({"prompt": "é" * 1001}).encode()  # json.dumps escapes each as \u00e9
    with pytest.raises(BodyError) as exc:
        parse_json_body(body, JsonLimits(max_values=1000))
    assert exc.value.reason == "too_many_values"


async def test_a_big_body_is_counted_in_slices_with_the_same_result():
    prompt = list(range(100)) + ["x" * (2 * SLICE_BYTES)]
    body = json.dumps({"model": "m", "prompt": prompt, "x": [[[1]]]}).encode()
    assert await read_json_body(body, JsonLimits(max_values=200)) == json.loads(body)
    with pytest.raises(BodyError) as exc:
        await read_json_body(body, JsonLimits(max_values=50))
    assert exc.value.status == 413
    with pytest.raises(BodyError) as exc:
        await read_json_body(body, JsonLimits(max_depth=3))
    assert exc.value.reason == "too_deep"
    bad = body[:-1] + b" garbage"
    with pytest.raises(BodyError) as exc:
        await read_json_body(bad)
    assert exc.value.reason == "not_json"


def test_more_containers_than_the_bound_is_a_413_without_parsing():
    body = b'{"model":"m","x":[' + b",".join([b"{}"] * 100) + b"]}"
    with pytest.raises(BodyError) as exc:
        parse_json_body(body, JsonLimits(max_containers=100))
    assert (exc.value.status, exc.value.reason) == (413, "too_many_containers")
    assert "more than 100 JSON arrays and objects" in str(exc.value)
    assert len(parse_json_body(body, JsonLimits(max_containers=102))["x"]) == 100


async def test_other_tasks_run_between_the_steps_of_a_big_body():
    import trio

    from llmgw.http.jsonbody import WALK_STEP

    body = json.dumps({"x": [[] for _ in range(3 * WALK_STEP)], "p": "y" * (3 * SLICE_BYTES)}).encode()
    turns = 0

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        await trio.lowlevel.checkpoint()
        before = turns
        value = await read_json_body(body)
        during = turns - before
        nursery.cancel_scope.cancel()
    assert len(value["x"]) == 3 * WALK_STEP
    assert during >= 3 + 3  # at least one turn per MiB counted and per WALK_STEP containers walked


@pytest.mark.parametrize("number", ["1e400", "-1e400", "1E+999", "123456789.0e99999", "-0.5e309"])
def test_a_number_that_overflows_to_infinity_is_refused_however_it_is_written(number):
    with pytest.raises(BodyError) as exc:
        parse_json_body(b'{"model": "m", "temperature": ' + number.encode() + b"}")
    assert (exc.value.status, exc.value.code, exc.value.reason) == (400, "invalid_json", "non_finite_number")
    assert number[:40] in str(exc.value)


@pytest.mark.parametrize("number", ["1e308", "-1.7976931348623157e308", "1e-400", "0.0", "10" + "0" * 400])
def test_large_tiny_and_integer_numbers_that_a_double_or_an_int_holds_are_taken(number):
    assert parse_json_body(b'{"x": ' + number.encode() + b"}") == json.loads(number.join(['{"x": ', "}"]))
