"""The engines' prompt tokens per estimated one (llmgw/router/prompt_ratio.py): learnt from usage, bounded whatever
an answer's usage block holds."""

from __future__ import annotations

from hypothesis import given, strategies as st

from llmgw.router.prompt_ratio import MAX_RATIO, MIN_RATIO, PromptTokenRatio

usage_values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5),
                         st.lists(st.integers(), max_size=2))
usages = st.one_of(st.none(), st.integers(), st.dictionaries(st.sampled_from(["prompt_tokens", "other"]),
                                                             usage_values, max_size=2))


@given(st.lists(st.tuples(st.integers(-10, 10**9), usages), max_size=30))
def test_any_usage_keeps_the_ratio_within_its_bounds(answers):
    ratio = PromptTokenRatio()
    for estimated, usage in answers:
        ratio.observe(estimated, usage)
        assert MIN_RATIO <= ratio.ratio <= MAX_RATIO
    assert ratio.tokens(1000) >= 0


def test_the_ratio_follows_the_engines_count():
    ratio = PromptTokenRatio()
    assert ratio.tokens(500) == 500
    ratio.observe(500, {"prompt_tokens": 2000})
    assert ratio.tokens(500) == 2000
    for _ in range(60):
        ratio.observe(500, {"prompt_tokens": 500})
    assert abs(ratio.ratio - 1.0) < 0.01
