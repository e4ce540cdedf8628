"""The open-files limit: raised to the hard limit, and split into per-port connection caps that stay below it."""

from __future__ import annotations

import resource

from hypothesis import given, strategies as st

from llmgw.fdlimit import FIXED_RESERVE, connection_budget, raise_open_files_limit


def test_the_soft_limit_is_raised_to_the_hard_limit_and_the_figures_said():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        limit = raise_open_files_limit()
        assert limit.before == lowered
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == limit.soft
        if hard != resource.RLIM_INFINITY:
            assert limit.soft == hard
            assert limit.describe() == (f"open files: raised the soft limit from {lowered} to {hard} (hard limit "
                                        f"{hard})" if hard > lowered else f"open files: soft limit {hard} (hard "
                                        f"limit {hard})")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_common_limit_of_1024_leaves_engines_as_many_descriptors_as_clients():
    budget = connection_budget(1024, data_bound=10000, control_bound=1000)
    assert (budget.data, budget.control) == (336, 112)
    assert budget.reserve == 1024 - 448 >= FIXED_RESERVE + 448
    assert "data port 336" in budget.describe() and "control port 112" in budget.describe()


def test_a_high_limit_leaves_the_configured_bounds_in_force():
    budget = connection_budget(1 << 20, data_bound=10000, control_bound=1000)
    assert (budget.data, budget.control) == (10000, 1000) and not budget.too_low


@given(soft=st.integers(min_value=1, max_value=1 << 22), data_bound=st.integers(min_value=1, max_value=1_000_000),
       control_bound=st.integers(min_value=1, max_value=1_000_000))
def test_caps_stay_below_the_limit_and_within_their_bounds(soft, data_bound, control_bound):
    budget = connection_budget(soft, data_bound, control_bound)
    assert 1 <= budget.data <= data_bound and 1 <= budget.control <= control_bound
    if not budget.too_low:
        # clients' connections and as many engine connections again, plus the fixed reserve, fit in the limit
        assert 2 * (budget.data + budget.control) + FIXED_RESERVE <= soft
