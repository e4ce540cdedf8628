"""The simulator's request body parser (``llmgw.sim.protocol.parse_body``): a dict, or vLLM's 400, never a crash."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.sim.protocol import ApiError, parse_body

# Text with lone surrogates among ordinary characters (category Cs is the surrogates).
TEXT = st.text(st.characters(codec=None, categories=("L", "N", "P", "Zs", "Cs")), max_size=12)
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | TEXT,
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                           max_leaves=20)


def has_lone_surrogate(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    return False


@settings(max_examples=300)
@given(st.dictionaries(TEXT, JSON_VALUES, max_size=5))
def test_a_body_is_accepted_exactly_when_it_holds_no_lone_surrogate(body):
    raw = json.dumps(body).encode()  # ensure_ascii: surrogates travel as \uXXXX escapes, as on the wire
    # What the wire carries: a high surrogate escape followed by a low one is one character (U+10000 and up),
    # not two lone surrogates, for vLLM's parser as for any JSON parser.
    on_the_wire = json.loads(raw)
    if has_lone_surrogate(on_the_wire):
        with pytest.raises(ApiError, match="surrogates not allowed") as info:
            parse_body(raw)
        assert info.value.status == 400
    else:
        assert parse_body(raw) == on_the_wire


def test_an_escaped_surrogate_pair_is_one_character_not_two_lone_surrogates():
    assert parse_body(b'{"\\ud800\\udc00": null}') == {"\U00010000": None}
    with pytest.raises(ApiError, match="surrogates not allowed"):
        parse_body(b'{"\\udc00\\ud800": null}')


@settings(max_examples=300)
@given(st.binary(max_size=200) | st.builds(lambda n, s: b"[" * n + s, st.integers(0, 3000), st.binary(max_size=20)))
def test_any_bytes_give_a_dict_or_a_400(raw):
    try:
        assert isinstance(parse_body(raw), dict)
    except ApiError as exc:
        assert exc.status == 400 and exc.type_ == "BadRequestError"


def test_json_nested_beyond_the_parser_is_a_400():
    closed = b"[" * 100_000 + b"]" * 100_000
    for raw in (b"[" * 100_000, b'{"a":' * 100_000, b'{"a":"\\ud800","b":' + closed + b"}"):
        with pytest.raises(ApiError, match="deeper than 100 levels|more than 100000 JSON arrays and objects") as info:
            parse_body(raw)
        assert info.value.status == 400
