"""The seats a profile's engine args declare (llmgw.autoscale.seats): the busy signal's denominator before the
flow room has learnt them."""

from __future__ import annotations

from hypothesis import given, strategies as st

from llmgw.autoscale.seats import MAX_SEATS, declared_seats


def test_the_flag_in_either_form_and_the_last_one_wins():
    assert declared_seats(["--profile", "h100", "--max-num-seqs", "2"]) == 2
    assert declared_seats(["--max-num-seqs=64"]) == 64
    assert declared_seats(["--max-num-seqs", "8", "--max-num-seqs=16"]) == 16


def test_absent_or_not_a_count_is_unknown():
    assert declared_seats([]) is None
    assert declared_seats(["--max-num-seqs"]) is None  # no value
    for bad in ("0", "-2", "2.5", "lots", "", str(MAX_SEATS + 1), "1e3", "\u00b2", "\u0663"):
        assert declared_seats(["--max-num-seqs", bad]) is None, bad
    assert declared_seats(["--max-num-seqs-other", "4"]) is None


@given(st.lists(st.text(max_size=30), max_size=12))
def test_any_args_give_none_or_a_bounded_count(args):
    seats = declared_seats(args)
    assert seats is None or 1 <= seats <= MAX_SEATS
