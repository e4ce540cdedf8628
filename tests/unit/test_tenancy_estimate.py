"""The estimate an admission reserves (llmgw/tenancy/estimate.py): high, bounded, never raising."""

from __future__ import annotations

import json

from hypothesis import given, strategies as st

from llmgw.sim.tokenizer import encode_chat
from llmgw.tenancy.estimate import MAX_CHOICES, Estimator
from llmgw.tenancy.model import Price, PriceList, TenancySettings

SETTINGS = TenancySettings(default_max_tokens=1000, max_prompt_estimate=50_000)
PRICES = PriceList({"m": Price(input=2_000, cached_input=500, output=8_000)})


def estimator(**max_model_len: int) -> Estimator:
    return Estimator(SETTINGS, PRICES, max_model_len)


def test_max_tokens_or_the_configured_default_and_the_cost_at_the_uncached_price():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    raw = json.dumps(body).encode()
    e = estimator().estimate("m", "/v1/chat/completions", body, len(raw))
    assert (e.prompt_tokens, e.max_output_tokens) == (len(raw), 20)
    assert e.nano_usd == len(raw) * 2_000 + 20 * 8_000
    del body["max_tokens"]
    assert estimator().estimate("m", "/v1/chat/completions", body, len(raw)).max_output_tokens == 1000
    body["max_completion_tokens"] = 7
    body["max_tokens"] = 30  # the chat API's newer name wins
    assert estimator().estimate("m", "/v1/chat/completions", body, len(raw)).max_output_tokens == 7
    assert estimator().estimate("free", "/v1/chat/completions", body, len(raw)).nano_usd == 0


def test_n_choices_and_the_model_context_cap():
    body = {"model": "m", "prompt": "x" * 5000, "max_tokens": 3000, "n": 3}
    e = estimator(m=4096).estimate("m", "/v1/completions", body, 5030)
    assert e.prompt_tokens == 4096  # no prompt is longer than the model's context
    assert e.max_output_tokens == 3 * 3000
    assert estimator(m=2048).estimate("m", "/v1/completions", body, 10).max_output_tokens == 3 * 2048


def test_a_tokenizer_count_replaces_the_body_bound():
    body = {"model": "m", "input": "a b c"}
    e = estimator().estimate("m", "/v1/embeddings", body, 100, prompt_tokens=4)
    assert (e.prompt_tokens, e.max_output_tokens) == (4, 0)  # embeddings generate nothing


def test_a_prompt_of_token_ids_counts_them():
    e = estimator().estimate("m", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1}, 10_000)
    assert e.prompt_tokens == 3
    assert estimator().estimate("m", "/v1/completions", {"prompt": [[1, 2], [3]]}, 10_000).prompt_tokens == 3
    assert estimator().estimate("m", "/v1/completions", {"prompt": ["a", 2]}, 100).prompt_tokens == 100


def test_the_prompt_estimate_is_bounded_by_the_setting():
    assert estimator().estimate("m", "/v1/completions", {}, 10**12).prompt_tokens == 50_000


@given(st.lists(st.tuples(st.sampled_from(["user", "system", "assistant"]), st.text(max_size=200)),
                min_size=1, max_size=8))
def test_the_body_bound_is_at_least_what_a_byte_tokenizer_makes_of_a_chat(messages):
    """The simulator's tokenizer is byte-level (one token per UTF-8 byte, plus its template's): the worst case of
    the tokenizers engines use. The estimate from the body's size is never below its count."""
    body = {"model": "m", "messages": [{"role": role, "content": text} for role, text in messages]}
    for ensure_ascii in (True, False):
        raw = json.dumps(body, ensure_ascii=ensure_ascii, separators=(",", ":")).encode()
        e = estimator().estimate("m", "/v1/chat/completions", body, len(raw))
        assert e.prompt_tokens >= len(encode_chat(body["messages"]))


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=4), max_leaves=20)
LIMIT_KEYS = st.sampled_from(["max_tokens", "max_completion_tokens", "max_output_tokens", "n", "model", "prompt",
                              "x"])


@given(st.dictionaries(LIMIT_KEYS, JSON | st.integers(min_value=-2**70, max_value=2**70)),
       st.integers(min_value=-10, max_value=2**62), st.sampled_from(["/v1/completions", "/v1/embeddings", "/x"]),
       st.one_of(st.none(), st.integers(min_value=1, max_value=10**9)))
def test_any_json_body_gives_a_bounded_non_negative_estimate(body, size, path, context):
    e = Estimator(SETTINGS, PRICES, {"m": context} if context else {}).estimate("m", path, body, size)
    assert 0 <= e.prompt_tokens <= max(SETTINGS.max_prompt_estimate, len(json.dumps(body)))
    assert 0 <= e.max_output_tokens <= MAX_CHOICES * (context or 2**40)
    assert e.nano_usd == PRICES.of("m").cost(e.prompt_tokens, 0, e.max_output_tokens) >= 0
