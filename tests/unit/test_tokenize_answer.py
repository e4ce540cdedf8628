"""The bounded /tokenize answer reader: any bytes give ids or a clear error, never more than the bound."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.kv.tokenize import TokenizeError
from llmgw.kv.tokenize_answer import MAX_ID, TokenizeAnswerReader, default_max_bytes


def read(data: bytes, max_ids: int, step: int) -> TokenizeAnswerReader:
    reader = TokenizeAnswerReader(max_ids)
    for i in range(0, len(data), step):
        if reader.feed(data[i:i + step]):
            break
    else:
        reader.finish()
    return reader


ids_lists = st.lists(st.integers(0, MAX_ID), max_size=300)
steps = st.integers(1, 4096)


@settings(max_examples=300, deadline=None)
@given(ids_lists, st.integers(0, 400), steps, st.booleans(), st.sampled_from([None, "indent", "spaces"]))
def test_a_valid_answer_gives_its_ids_up_to_the_bound_in_any_pieces(ids, max_ids, step, count_first, layout):
    answer = {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": ["é", {"a": [1]}]}
    if not count_first:
        answer = {"token_strs": None, "tokens": ids, "count": len(ids)}
    data = json.dumps(answer, indent=2 if layout == "indent" else None,
                      separators=(" , ", " : ") if layout == "spaces" else None, ensure_ascii=False).encode()
    reader = read(data, max_ids, step)
    assert reader.ids == ids[:max_ids]
    assert reader.truncated == (len(ids) > max_ids) or (len(ids) == max_ids == 0)
    assert reader.count == (len(ids) if count_first else None)


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=600), st.integers(0, 50), steps)
def test_any_bytes_give_ids_or_a_clear_error_never_more_than_the_bound(data, max_ids, step):
    try:
        reader = read(data, max_ids, step)
    except TokenizeError as exc:
        assert exc.kind == "answer"
        return
    assert len(reader.ids) <= max_ids and all(type(i) is int and 0 <= i <= MAX_ID for i in reader.ids)


@settings(max_examples=300, deadline=None)
@given(ids_lists, st.integers(0, 50), steps, st.integers(0, 200), st.binary(min_size=1, max_size=8))
def test_a_corrupted_answer_gives_a_prefix_of_its_ids_or_an_error(ids, max_ids, step, at, junk):
    data = bytearray(json.dumps({"count": len(ids), "tokens": ids}).encode())
    at = min(at, len(data))
    data[at:at] = junk
    try:
        reader = read(bytes(data), max_ids, step)
    except TokenizeError as exc:
        assert exc.kind == "answer"
        return
    assert len(reader.ids) <= max_ids


@pytest.mark.parametrize("data, message", [
    (b'[1, 2]', "not a JSON object"),
    (b'{"count": 2}', "without a tokens array"),
    (b'{"tokens": "12"}', "not a list"),
    (b'{"tokens": [1, -2]}', "other than decimal ids"),
    (b'{"tokens": [1, 2.5]}', "other than decimal ids"),
    (b'{"tokens": [1, 1_000]}', "other than decimal ids"),
    (b'{"tokens": [1,,2]}', "not a list of ints"),
    (b'{"tokens": [1 2]}', "not a list of ints"),
    (b'{"tokens": [4294967296]}', r"above 2\^32"),
    (b'{"tokens": [1, 2', "ended before its tokens array did"),
])
def test_bad_answers_are_refused_with_a_reason(data, message):
    with pytest.raises(TokenizeError, match=message) as info:
        read(data, 100, 3)
    assert info.value.kind == "answer"


def test_a_huge_answer_is_read_only_up_to_the_ids_needed():
    piece = b"1234," * 13107  # 64 KiB
    reader = TokenizeAnswerReader(1000)
    assert not reader.feed(b'{"count": 12000000, "tokens": [')
    assert reader.feed(piece)
    assert reader.ids == [1234] * 1000 and reader.truncated and reader.count == 12_000_000
    assert reader.feed(piece) and reader.bytes_read == 31 + len(piece)  # nothing more is taken


def test_whitespace_without_ids_is_bounded():
    reader = TokenizeAnswerReader(10)
    reader.feed(b'{"tokens": [')
    with pytest.raises(TokenizeError, match="larger than"):
        for _ in range(default_max_bytes(10) // 4096 + 1):
            reader.feed(b" " * 4096)


def _piecewise_ids(ids_text: list[bytes]) -> list[int]:
    return [int(text) for text in ids_text]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, MAX_ID), st.integers(0, 2), st.sampled_from([b"", b" ", b"\n  ", b"\t"])),
                max_size=200),
       st.integers(0, 250), steps)
def test_ids_in_any_layout_read_as_int_reads_them(ids, max_ids, step):
    """Whatever path reads a piece (the JSON scanner for a piece of well-formed ids all needed, else ``split`` and
    ``int``), an id with leading zeros or whitespace around it gives the ``int`` of its digits."""
    texts = [pad + b"0" * zeros + str(value).encode() + pad for value, zeros, pad in ids]
    data = b'{"count": %d, "tokens": [' % len(ids) + b",".join(texts) + b"]}"
    reader = read(data, max_ids, step)
    assert reader.ids == _piecewise_ids(texts)[:max_ids]
    assert reader.truncated or len(ids) <= max_ids


@pytest.mark.parametrize("data", [b'{"tokens": [1,2,]}', b'{"tokens": [,]}', b'{"tokens": [1, 2, ]}'])
def test_an_empty_id_is_refused_whichever_piece_holds_it(data):
    for step in (1, 2, 3, 5, len(data)):
        with pytest.raises(TokenizeError, match="not a list of ints"):
            read(data, 100, step)
