"""The fast CBOR block messages (llmgw.kv.block_messages) and VllmBlockKeys' chain equal vLLM's definition.

The reference here is vLLM's own formula written the obvious way: per block,
``digest(serialise((parent, tuple(tokens), extra)))`` with cbor2 (canonical)
or pickle protocol 5, SHA-256 or XXH3-128, for every algorithm and every
extra-key style, memo on and off.
"""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest
import xxhash
from hypothesis import given, settings, strategies as st

from llmgw.kv.block_messages import CborBlockMessages, extra_cbor
from llmgw.kv.keys import (
    ALGORITHMS,
    EXTRA_KEY_STYLES,
    MultiModalItem,
    VllmBlockKeys,
    event_int,
    none_hash,
    request_extra_keys,
)

SERIALISE = {
    "sha256_cbor": lambda triple: cbor2.dumps(triple, canonical=True),
    "xxhash_cbor": lambda triple: cbor2.dumps(triple, canonical=True),
    "sha256": lambda triple: pickle.dumps(triple, protocol=5),
    "xxhash": lambda triple: pickle.dumps(triple, protocol=5),
}
DIGEST = {
    "sha256_cbor": lambda data: hashlib.sha256(data).digest(),
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "xxhash_cbor": xxhash.xxh3_128_digest,
    "xxhash": xxhash.xxh3_128_digest,
}


def reference_chain(algo, parent, tokens, block_size, extras, lookahead=0):
    out = []
    for i in range(max(len(tokens) - lookahead, 0) // block_size):
        triple = (parent, tuple(tokens[i * block_size : (i + 1) * block_size]), None if extras is None else extras[i])
        parent = DIGEST[algo](SERIALISE[algo](triple))
        out.append(parent)
    return out


token_edges = st.sampled_from([0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                               2**64, -1, -24, -25, -(2**31), -(2**31) - 1, -(2**64) - 1])
any_tokens = st.lists(st.one_of(st.integers(min_value=0, max_value=300_000), st.integers(), token_edges),
                      max_size=90)
vocab_tokens = st.lists(st.integers(min_value=0, max_value=160_000), max_size=90)
mm_items = st.lists(st.builds(MultiModalItem, st.text(max_size=6), st.integers(0, 90), st.integers(1, 40)),
                    max_size=3)


@st.composite
def requests(draw, tokens=any_tokens):
    """(tokens, block size, per-block extras or None, lookahead) of one request, extras in any style."""
    ids = draw(tokens)
    block_size = draw(st.sampled_from([1, 2, 3, 4, 5, 16]))
    style = draw(st.sampled_from(sorted(EXTRA_KEY_STYLES)))
    lookahead = draw(st.sampled_from([0, 0, 1, 3])) if style in ("current", "event") else 0
    kind = draw(st.sampled_from(["none", "lora", "salt", "mm", "all"]))
    if kind == "none":
        return ids, block_size, None, lookahead
    lora = ("adapter", draw(st.text(max_size=5))) if kind in ("lora", "all") else None
    extras = request_extra_keys(
        len(ids), block_size, style=style, lookahead=lookahead, token_ids=ids,
        lora=lora, lora_int_id=draw(st.integers(0, 300)) if lora else None,
        cache_salt=draw(st.text(min_size=1, max_size=5)) if kind in ("salt", "all") else None,
        mm_items=draw(mm_items) if kind in ("mm", "all") else ())
    return ids, block_size, extras, lookahead


@pytest.mark.parametrize("algo", ALGORITHMS)
@settings(max_examples=150, deadline=None)
@given(request=requests(), memo_size=st.sampled_from([0, 2, 65536]),
       parent=st.one_of(st.none(), st.binary(max_size=40)))
def test_chain_equals_vllms_formula(algo, request, memo_size, parent):
    tokens, block_size, extras, lookahead = request
    key_function = VllmBlockKeys(algo, seed="0", memo_size=memo_size)
    root = none_hash(algo, "0") if parent is None else parent
    expected = reference_chain(algo, root, tokens, block_size, extras, lookahead)
    for _ in range(2):  # the second time from the memo
        assert key_function.digests(tokens, block_size, extras, parent=parent, lookahead=lookahead) == expected
        if parent is None and not lookahead:
            assert key_function.keys(tokens, block_size, extras) == [event_int(d) for d in expected]


@settings(max_examples=300, deadline=None)
@given(request=requests(), parent=st.sampled_from([16, 32]).flatmap(lambda n: st.binary(min_size=n, max_size=n)))
def test_each_cbor_message_is_cbor2s_encoding_of_the_triple(request, parent):
    messages = CborBlockMessages()
    tokens, block_size, extras, lookahead = request
    count = max(len(tokens) - lookahead, 0) // block_size
    payloads = messages.payloads(tokens, count, block_size, extras)
    heads = messages.heads(len(parent), payloads)  # (an endless repeat for CBOR)
    assert len(payloads) == count
    for i, (head, payload) in enumerate(zip(heads, payloads)):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        expected = cbor2.dumps((parent, block, None if extras is None else extras[i]), canonical=True)
        assert head + parent + payload == expected


def test_the_fast_path_builds_sha256_cbor_messages_without_the_reference():
    key_function = VllmBlockKeys(memo_size=0)
    key_function._messages.reference = None  # any call of the per-block encoder would fail
    tokens = list(range(16, 16 + 64))
    assert key_function.digests(tokens, 16) == reference_chain("sha256_cbor", key_function.none_hash, tokens, 16,
                                                               None)


def test_extra_cbor_tells_equal_values_of_other_types_apart():
    assert extra_cbor((1, "a")) == cbor2.dumps((1, "a"), canonical=True)
    assert extra_cbor((True, "a")) == cbor2.dumps((True, "a"), canonical=True) != extra_cbor((1, "a"))
    assert extra_cbor((1.0,)) == cbor2.dumps((1.0,), canonical=True)
    assert extra_cbor((MultiModalItem("x", 1, 2),)) == cbor2.dumps((("x", 1, 2),), canonical=True)


def test_a_bool_token_counts_as_its_int():
    key_function = VllmBlockKeys(memo_size=0)
    assert key_function.keys([True, False] * 8, 16) == key_function.keys([1, 0] * 8, 16)


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash"])
def test_long_prompts_give_every_blocks_event_int(algo):
    tokens = [(i * 7919) % 150_000 for i in range(300 * 4 + 3)]  # 300 blocks: the ints are unpacked in chunks
    expected = [event_int(d) for d in reference_chain(algo, none_hash(algo, "0"), tokens, 4, None)]
    key_function = VllmBlockKeys(algo)
    assert key_function.keys(tokens, 4) == expected
    assert key_function.keys(tokens[:256 * 4], 4) == expected[:256]
    assert key_function.keys(tokens, 4) == expected  # from the memo


def test_the_memos_event_ints_follow_its_evictions():
    key_function = VllmBlockKeys(memo_size=3)
    for start in range(0, 200, 7):
        tokens = list(range(start, start + 40))
        assert key_function.keys(tokens, 8) == key_function.keys(tokens, 8)  # the second from the memo
        assert len(key_function._event_ints) == key_function.memo_entries <= 3
    key_function.clear_memo()
    assert not key_function._event_ints
