"""The output allowance (llmgw/router/output_allowance.py): of a request's max_tokens, what the room reserves, learnt
from the answers' usage; within [0, max_tokens] whatever the answers say, converging on what they hold."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from llmgw.router.output_allowance import BLOCK, BLOCKS, MIN_BLOCKS, OutputAllowance


@given(st.floats(-1.0, 2.0, allow_nan=False),
       st.lists(st.tuples(st.one_of(st.none(), st.integers(-10, 10**7)), st.integers(-5, 10**7)), max_size=100),
       st.lists(st.integers(-10, 10**7), min_size=1, max_size=5))
def test_the_allowance_is_always_within_zero_and_the_cap(quantile, answers, caps):
    allowance = OutputAllowance(quantile)
    for cap, completion in answers:
        allowance.observe(cap, {"completion_tokens": completion})
        assert 0.0 <= allowance.fraction <= 1.0
        for asked in caps:
            assert 0 <= allowance.tokens(asked) <= max(asked, 0)


@settings(max_examples=30, deadline=None)
@given(st.floats(0.05, 1.0), st.floats(0.0, 1.0), st.integers(0, 2**32))
def test_it_converges_on_the_quantile_of_a_stationary_distribution(quantile, mean, seed):
    """Answers whose lengths are drawn from one distribution (uniform around ``mean`` of the cap, capped): after
    enough of them, the fraction is the quantile of what groups of BLOCK answers hold, within sampling noise."""
    rng = random.Random(seed)
    cap = 256
    low, high = max(0.0, mean - 0.3), min(1.0, mean + 0.3)

    def answer() -> int:
        return round(cap * rng.uniform(low, high))

    allowance = OutputAllowance(quantile)
    for _ in range(BLOCKS * BLOCK * 4):
        allowance.observe(cap, {"completion_tokens": answer()})
    # The truth, by simulation: the quantile of many groups' share.
    groups = sorted(sum(answer() for _ in range(BLOCK)) / (BLOCK * cap) for _ in range(4000))
    truth = groups[min(len(groups) - 1, int(quantile * len(groups)))]
    assert abs(allowance.fraction - truth) < 0.12
    assert low - 1e-9 <= allowance.fraction <= high + 1e-9


def test_the_whole_cap_until_enough_answers_then_the_learnt_share():
    allowance = OutputAllowance(0.9)
    for _ in range(MIN_BLOCKS * BLOCK - 1):
        allowance.observe(256, {"completion_tokens": 64})
    assert allowance.tokens(256) == 256  # one answer short of MIN_BLOCKS samples: nothing learnt yet
    allowance.observe(256, {"completion_tokens": 64})
    assert allowance.fraction == 0.25 and allowance.tokens(256) == 64 and allowance.tokens(1000) == 250
    assert allowance.tokens(1) == 1  # rounded up: never 0 of a cap of 1
    # Answers longer than their cap (an engine ignoring it) count as the cap; those without a cap or usage, or
    # with a usage that is no count, teach nothing.
    before = allowance.answers
    for cap, usage in ((None, {"completion_tokens": 5}), (0, {"completion_tokens": 5}), (256, None),
                       (256, {"completion_tokens": "many"}), (256, {"completion_tokens": True}),
                       (256, {"completion_tokens": -1}), (256, {})):
        allowance.observe(cap, usage)
    assert allowance.answers == before
    for _ in range(BLOCKS * BLOCK):
        allowance.observe(32, {"completion_tokens": 10**6})
    assert allowance.fraction == 1.0 and allowance.tokens(256) == 256


def test_a_high_quantile_follows_the_longest_groups():
    """Half the groups hold a quarter of their caps, half all of it: the 90th percentile reserves the whole cap, the
    median a quarter."""
    high, median = OutputAllowance(0.9), OutputAllowance(0.5)
    for group in range(BLOCKS):
        used = 64 if group % 2 else 256
        for _ in range(BLOCK):
            high.observe(256, {"completion_tokens": used})
            median.observe(256, {"completion_tokens": used})
    assert high.tokens(256) == 256
    assert median.tokens(256) == 64


def test_turned_off_it_reserves_the_whole_cap_and_keeps_learning_for_when_it_is_on_again():
    allowance = OutputAllowance(None)
    for _ in range(BLOCKS * BLOCK):
        allowance.observe(100, {"completion_tokens": 30})
    assert allowance.fraction == 1.0 and allowance.tokens(100) == 100
    allowance.set_quantile(0.9)
    assert allowance.tokens(100) == 30
