"""Block keys: vLLM's chained hash against the golden vectors, the CBOR fast path, the memo, the content chain."""

from __future__ import annotations

import gc
import hashlib
import random

import cbor2
import pytest
from hypothesis import given, settings, strategies as st

from golden import from_json, load_golden
from llmgw.kv.keys import (
    BlockKeyFunction,
    ContentChainKeys,
    MultiModalItem,
    VllmBlockKeys,
    block_digests,
    cbor_block_triple,
    event_int,
    hash_object,
    none_hash,
    normalize_hash,
    request_extra_keys,
)
from llmgw.plugins import kv_builtin

GOLDEN = load_golden("vllm_block_hashes.json")
CASES = GOLDEN["cases"]
U64 = 2**64


def test_golden_file_has_every_case():
    assert len(CASES) == 23
    assert len({case["id"] for case in CASES}) == len(CASES)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _style_for(case: dict) -> str:
    """The extra-key style of the newest release the case holds for."""
    upper = next(part[2:] for part in case["vllm_versions"].split(",") if part.startswith("<="))
    newest = _version(upper)
    if newest <= (0, 11, 0):
        return "lora_int_id"
    if newest <= (0, 18, 99):
        return "untagged_mm_id"
    if newest <= (0, 30, 99):
        return "untagged"
    return "current"


def _lookahead(case: dict) -> int:
    return (case["request_extras"] or {}).get("lookahead", 0)


def _request_extra_keys(case: dict, style: str) -> list:
    extras = case["request_extras"] or {}
    lora = extras.get("lora")
    return request_extra_keys(
        case["num_tokens"],
        case["block_size"],
        lora=(lora["lora_name"], lora["lora_path"]) if lora else None,
        lora_int_id=lora["lora_int_id"] if lora else None,
        cache_salt=extras.get("cache_salt"),
        mm_items=[MultiModalItem(m["identifier"], m["offset"], m["length"]) for m in extras.get("mm", ())],
        style=style,
        lookahead=_lookahead(case),
        token_ids=case["token_ids"],
    )


def _golden_extra_keys(case: dict) -> list:
    return [from_json(item) for item in case["extra_keys_per_block"]]


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
class TestGoldenCase:
    def test_none_hash(self, case):
        root = none_hash(case["algo"], case["pythonhashseed"])
        assert root.hex() == case["none_hash_hex"]
        assert hash_object(case["algo"], case["none_hash_seed_string"]) == root

    def test_full_digests(self, case):
        digests = block_digests(
            case["token_ids"],
            case["block_size"],
            algo=case["algo"],
            seed=case["pythonhashseed"],
            extra_keys=_golden_extra_keys(case),
            lookahead=_lookahead(case),
        )
        assert [d.hex() for d in digests] == case["expected_block_hashes_hex"]
        assert len(digests) == case["num_full_blocks"]

    def test_event_ints(self, case):
        digests = [bytes.fromhex(h) for h in case["expected_block_hashes_hex"]]
        assert [event_int(d) for d in digests] == case["expected_event_block_hashes_int"]
        assert [normalize_hash(d) for d in digests] == case["expected_event_block_hashes_int"]

    def test_vllm_key_function_equals_event_hashes(self, case):
        key_function = VllmBlockKeys(case["algo"], case["pythonhashseed"])
        extra = _golden_extra_keys(case)
        if _lookahead(case):
            digests = key_function.digests(case["token_ids"], case["block_size"], extra, lookahead=_lookahead(case))
            keys = [event_int(d) for d in digests]
        else:
            keys = key_function.keys(case["token_ids"], case["block_size"], extra)
        assert keys == case["expected_event_block_hashes_int"]

    def test_first_block_serialisation(self, case):
        if "first_block_serialized_hex" not in case:
            assert not case["algo"].endswith("_cbor")  # only the pickle algorithms lack it
            return
        block = case["token_ids"][: case["block_size"]]
        parent = bytes.fromhex(case["none_hash_hex"])
        encoded = cbor_block_triple(parent, block, _golden_extra_keys(case)[0])
        assert encoded.hex() == case["first_block_serialized_hex"]

    def test_extra_keys_built_from_the_request(self, case):
        style = _style_for(case)
        assert _request_extra_keys(case, style) == _golden_extra_keys(case)

    def test_event_extra_keys(self, case):
        # From 0.31 events publish the untagged form; before, they carry the hash input itself.
        style = _style_for(case)
        event_style = "event" if style == "current" else style
        assert _request_extra_keys(case, event_style) == [from_json(e) for e in case["event_extra_keys_per_block"]]
        lookahead_tokens = case["event_lookahead_token_ids_per_block"]
        if lookahead_tokens is not None:
            assert [list(extra[1:]) for extra in _golden_extra_keys(case)] == lookahead_tokens

    def test_first_block_parent_in_events_is_nil(self, case):
        assert case["expected_event_parent_of_first_block"] is None


# --------------------------------------------------------------------------- seed and input rules


def test_unset_seed_uses_the_fixed_default_for_sha256_algorithms():
    assert none_hash("sha256_cbor", None) == hash_object("sha256_cbor", "vllm-none-hash")
    assert none_hash("sha256", None) == hash_object("sha256", "vllm-none-hash")


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_unset_seed_is_not_reproducible_for_xxhash(algo):
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        none_hash(algo, None)
    with pytest.raises(ValueError):
        VllmBlockKeys(algo, seed=None)


def test_seed_is_the_literal_string():
    assert none_hash("sha256_cbor", "0") != none_hash("sha256_cbor", "00")
    with pytest.raises(TypeError):
        none_hash("sha256_cbor", 0)  # type: ignore[arg-type]


def test_unknown_algorithm_is_rejected():
    with pytest.raises(ValueError, match="unknown prefix-caching hash algorithm"):
        none_hash("builtin", "0")


def test_partial_tail_is_ignored_and_parent_continues_the_chain():
    tokens = list(range(1000, 1040))
    whole = block_digests(tokens, 16, seed="0")
    assert len(whole) == 2
    assert block_digests(tokens[:32], 16, seed="0") == whole
    assert block_digests(tokens[16:], 16, seed="0", parent=whole[0]) == whole[1:]


def test_extra_keys_must_be_tuples_and_cover_every_block():
    with pytest.raises(TypeError, match="tuple"):
        block_digests(list(range(16)), 16, seed="0", extra_keys=[["lora"]])
    with pytest.raises(ValueError, match="1 entries for 2 blocks"):
        block_digests(list(range(32)), 16, seed="0", extra_keys=[None])


def test_extra_key_style_rules():
    with pytest.raises(ValueError, match="unknown extra-key style"):
        request_extra_keys(32, 16, style="tagged")
    with pytest.raises(ValueError, match="0.33"):
        request_extra_keys(32, 16, style="untagged", lookahead=1, token_ids=list(range(32)))
    with pytest.raises(ValueError, match="token_ids"):
        request_extra_keys(32, 16, lookahead=1)
    with pytest.raises(ValueError, match="lora_int_id"):
        request_extra_keys(32, 16, lora=("a", "/a"), style="lora_int_id")
    assert request_extra_keys(40, 16) == [None, None]


def test_multimodal_item_on_a_later_block_only():
    keys = request_extra_keys(64, 16, mm_items=[("img", 20, 20)])
    assert keys == [None, (("mm", "img", 4),), (("mm", "img", -12),), None]


def test_normalize_hash_forms():
    assert normalize_hash(-1) == U64 - 1
    assert normalize_hash(-7631615348320973721) == -7631615348320973721 + U64
    assert normalize_hash(5) == 5
    assert normalize_hash(2**70 + 3) == 3
    assert normalize_hash(bytes(range(32))) == int.from_bytes(bytes(range(24, 32)), "big")
    with pytest.raises(TypeError):
        normalize_hash("12")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- CBOR fast path

cbor_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**140),
    st.text(max_size=40),
    st.binary(max_size=40),
)
cbor_extra = st.one_of(
    st.none(),
    st.lists(
        st.recursive(cbor_scalars, lambda inner: st.lists(inner, max_size=4).map(tuple), max_leaves=12),
        max_size=5,
    ).map(tuple),
)
token_edges = st.sampled_from(
    [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 2**64, 2**64 + 1, -1, -24, -25, -(2**64)]
)
cbor_tokens = st.lists(st.one_of(st.integers(min_value=-(2**80), max_value=2**140), token_edges), max_size=70)


@settings(max_examples=400, deadline=None)
@given(parent=st.binary(max_size=300), tokens=cbor_tokens, extra=cbor_extra)
def test_fast_cbor_path_equals_cbor2_canonical_of_the_triple(parent, tokens, extra):
    reference = cbor2.dumps((parent, tuple(tokens), extra), canonical=True)
    assert cbor_block_triple(parent, tokens, extra) == reference
    assert cbor_block_triple(parent, tuple(tokens), extra) == reference


def _reference_chain(tokens: list[int], block_size: int, seed: str) -> list[bytes]:
    """vLLM's sha256_cbor chain written the slow, obvious way."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(cbor2.dumps((parent, block, None), canonical=True)).digest()
        out.append(parent)
    return out


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=300_000), max_size=100),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.text(max_size=8),
)
def test_fast_chain_equals_reference_chain(tokens, block_size, seed):
    expected = _reference_chain(tokens, block_size, seed)
    assert block_digests(tokens, block_size, seed=seed) == expected
    assert VllmBlockKeys(seed=seed).keys(tokens, block_size) == [event_int(d) for d in expected]


# --------------------------------------------------------------------------- memo


def _prompts(rng: random.Random) -> list[list[int]]:
    """Prompts sharing system prefixes, repeated turns and unique tails, as a router sees them."""
    systems = [[rng.randrange(32000) for _ in range(64)] for _ in range(3)]
    prompts = []
    for _ in range(40):
        prompt = list(rng.choice(systems)) + [rng.randrange(32000) for _ in range(rng.randrange(0, 80))]
        prompts.append(prompt)
        if rng.random() < 0.3:
            prompts.append(prompt + [rng.randrange(32000) for _ in range(rng.randrange(0, 40))])
    return prompts


@pytest.mark.parametrize("memo_size", [1, 3, 17, 65536])
@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
def test_memo_gives_the_same_keys_as_no_memo(memo_size, algo):
    plain = VllmBlockKeys(algo, memo_size=0)
    memoised = VllmBlockKeys(algo, memo_size=memo_size)
    lora = (("lora", "a", "/a"),)
    for prompt in _prompts(random.Random(memo_size)) * 2:
        extra = [lora] * (len(prompt) // 16) if len(prompt) % 3 == 0 else None
        assert memoised.keys(prompt, 16, extra) == plain.keys(prompt, 16, extra)
        assert memoised.digests(prompt, 16, extra) == plain.digests(prompt, 16, extra)
        assert memoised.memo_entries <= memo_size
    assert plain.memo_entries == 0


def _count_block_hashes(key_function: VllmBlockKeys) -> list[int]:
    calls = [0]
    hash_block = key_function._hash_block

    def counting(*args):
        calls[0] += 1
        return hash_block(*args)

    key_function._hash_block = counting
    return calls


def test_memo_hits_skip_hashing_and_evict_the_least_recently_used():
    key_function = VllmBlockKeys(memo_size=2)
    calls = _count_block_hashes(key_function)
    hot, cold, other = list(range(16)), list(range(100, 116)), list(range(200, 216))
    key_function.keys(hot, 16)
    key_function.keys(cold, 16)
    key_function.keys(hot, 16)  # a hit, and now the most recently used
    assert calls[0] == 2
    key_function.keys(other, 16)  # evicts the least recently used: cold
    key_function.keys(hot, 16)
    assert calls[0] == 3
    key_function.keys(cold, 16)
    assert calls[0] == 4
    assert key_function.memo_entries == 2


def test_memo_is_invisible_to_the_garbage_collector():
    key_function = VllmBlockKeys()
    key_function.keys(list(range(64)), 16, [(("cache_salt", "s"),), None, None, None])
    assert key_function.memo_entries == 4
    assert not any(gc.is_tracked(memo_key) for memo_key in key_function._memo)


def test_memo_falls_back_for_ids_outside_uint32():
    tokens = [2**40, -1] + list(range(30))
    assert VllmBlockKeys().keys(tokens, 16) == VllmBlockKeys(memo_size=0).keys(tokens, 16)


def test_memo_separates_chains_by_parent_and_extra():
    key_function = VllmBlockKeys()
    block = list(range(16))
    first = key_function.keys(block * 2, 16)
    assert first[0] != first[1]  # same tokens, different parent
    assert key_function.keys(block, 16, [(("cache_salt", "s"),)]) != first[:1]


# --------------------------------------------------------------------------- content chain


def test_content_chain_is_deterministic_and_chained():
    rng = random.Random(7)
    tokens = [rng.randrange(32000) for _ in range(16 * 8 + 5)]
    keys = ContentChainKeys().keys(tokens, 16)
    assert len(keys) == 8
    assert keys == ContentChainKeys().keys(list(tokens), 16)
    assert all(0 <= key < U64 for key in keys)
    assert len(set(keys)) == 8
    assert ContentChainKeys().keys(tokens[:48], 16) == keys[:3]

    changed = list(tokens)
    changed[20] += 1  # block 1
    changed_keys = ContentChainKeys().keys(changed, 16)
    assert changed_keys[0] == keys[0]
    assert all(a != b for a, b in zip(changed_keys[1:], keys[1:]))

    assert ContentChainKeys().keys(tokens[32:], 16, parent=keys[1]) == keys[2:]
    assert ContentChainKeys(root=1).keys(tokens, 16) != keys


def test_content_chain_mixes_in_extra_keys_and_block_size():
    tokens = list(range(64))
    plain = ContentChainKeys().keys(tokens, 16)
    salted = ContentChainKeys().keys(tokens, 16, [(("cache_salt", "s"),), None, None, None])
    assert salted[0] != plain[0] and salted[1] != plain[1]
    assert ContentChainKeys().keys(tokens, 32)[0] not in plain
    with pytest.raises(ValueError):
        ContentChainKeys().keys(["a"] * 16, 16)  # type: ignore[list-item]


def test_content_chain_is_not_vllms_hash():
    tokens = list(range(1000, 1040))
    assert set(ContentChainKeys().keys(tokens, 16)).isdisjoint(VllmBlockKeys().keys(tokens, 16))


def test_key_functions_follow_the_protocol_and_are_registered():
    assert isinstance(VllmBlockKeys(), BlockKeyFunction)
    assert isinstance(ContentChainKeys(), BlockKeyFunction)
    registered = kv_builtin.register_block_key_functions()
    assert registered == {"vllm": VllmBlockKeys, "content": ContentChainKeys}
    assert {name: factory().name for name, factory in registered.items()} == {"vllm": "vllm", "content": "content"}
