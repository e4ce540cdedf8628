"""A process's share of one limit (llmgw.tenancy.leases) without Redis: what each lease call asks, gives back and
charges, its demand-sized leases, its fallback while Redis is away; and the lease script's reply parser against
anything a hostile Redis could answer."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from llmgw.tenancy.admission import BUDGET_USD, CONCURRENCY, KEY, REQUESTS, TOKENS, Subject
from llmgw.tenancy.lease_script import BUCKET, BUDGET, SLOTS, Answer, Operation, Unseeded, decode
from llmgw.tenancy.leases import FALLBACK, LeasedPool


class Owner:
    """What a pool asks of its limiter, recorded."""

    def __init__(self, live: int = 1):
        self.degraded = False
        self.budgets_fail_closed = True
        self.lease_seconds = 0.5
        self.lease_idle_seconds = 2.0
        self.holder = "h1"
        self.holder_ttl_ms = 5000
        self.live = live
        self.refills: list[LeasedPool] = []
        self.gives: list[LeasedPool] = []

    def refill_soon(self, pool: LeasedPool) -> None:
        self.refills.append(pool)

    def give_soon(self, pool: LeasedPool) -> None:
        self.gives.append(pool)

    def fallback_capacity(self, capacity: int) -> int:
        return max(1, capacity // self.live)


ALICE = Subject(KEY, "k-alice", "alice")


def pool(dimension: str = TOKENS, capacity: int = 6000, owner: Owner | None = None) -> LeasedPool:
    period = "total" if dimension == BUDGET_USD else None
    return LeasedPool(owner or Owner(), "llmgw:c:tenancy:", ALICE, dimension, period, capacity, now=0.0)


def grant(leased: LeasedPool, amount: int, now: float = 0.0) -> Operation:
    operation = leased.operation(now, idle=False)
    assert operation is not None
    leased.answered(Answer(amount, 0.0), leased.asked, now, operation)
    return operation


def test_a_waiter_asks_for_what_it_lacks_and_the_least_one_request_needs():
    leased = pool()
    leased.ask(100)
    leased.ask(30)
    operation = leased.operation(0.0, idle=False)
    assert (operation.kind, operation.need, operation.want) == (BUCKET, 30, 130)
    assert operation.keys == ("llmgw:c:tenancy:key:k-alice:tokens",)
    leased.answered(Answer(130, 500.0), 130, 0.0)
    assert leased.held == 130 and leased.asked == 0 and leased.room(0.0) == 130


def test_a_usage_over_the_reservation_is_a_debt_charged_at_the_next_call():
    leased = pool()
    leased.ask(200)
    grant(leased, 200)
    stamp = leased.reserve(200, 0.0)
    leased.adjust(200, 5100, stamp, 0.0)
    assert leased.held == -4900
    operation = leased.operation(0.1, idle=False)
    assert operation.charge == 4900 and leased.held == 0


def test_leases_are_sized_to_the_demand_and_refilled_before_they_run_out():
    owner = Owner()
    leased = pool(owner=owner)
    for tenth in range(200):  # 100 tokens a second, steadily
        leased.held = 10_000
        leased.reserve(10, tenth / 10)
    assert leased.lease_size() == pytest.approx(50, rel=0.1)  # 0.5 s of the demand
    leased.held = 45
    leased.reserve(10, 20.0)
    assert owner.refills == []  # 35 left, more than half a lease
    leased.reserve(10, 20.0)
    assert owner.refills == [leased]  # less than half a lease left: the next is taken in the background


def test_near_the_end_of_a_limit_a_lease_ahead_takes_a_fair_share_of_what_is_left():
    leased = pool(owner=Owner(live=4))
    for tenth in range(50):
        leased.held = 10_000
        leased.reserve(100, tenth / 10)
    leased.held = 0
    leased.answered(Answer(0, 80.0), 0, 5.0)  # Redis had 80 tokens left
    assert leased.operation(5.0, idle=False).want == 10  # 80 / (2 x 4), not 0.5 s of 1000 a second
    leased.ask(30)
    assert leased.operation(5.0, idle=False).want == 30  # what a waiting request lacks, whatever is left


def test_an_idle_share_is_given_back_whole():
    leased = pool()
    leased.ask(50)
    grant(leased, 50)
    assert leased.idle(10.0, 2.0)
    operation = leased.operation(10.0, idle=True)
    assert (operation.give, operation.want, leased.held) == (50, 0, 0)


def test_a_failed_call_keeps_what_it_would_have_given_and_charged():
    leased = pool()
    leased.held = -30
    operation = leased.operation(0.0, idle=False)
    leased.unanswered(operation, 0)
    assert leased.held == -30


def test_slots_say_how_many_the_process_holds_and_a_freed_one_goes_back_when_none_was_free():
    owner = Owner()
    leased = pool(CONCURRENCY, 3, owner)
    leased.ask(2)
    operation = leased.operation(0.0, idle=False)
    assert (operation.kind, operation.have, operation.want, operation.extra) == (SLOTS, 0, 2, "h1")
    leased.answered(Answer(2, 0.0), 2, 0.0, operation)
    stamps = [leased.reserve(1, 0.0), leased.reserve(1, 0.0)]
    assert leased.in_use == 2 and leased.held == 0
    assert leased.operation(0.1, idle=False).have == 2  # the heartbeat renews both
    leased.adjust(1, 0, stamps[0], 0.2)
    assert owner.gives == [leased] and leased.held == 1


def test_slots_a_late_answer_grants_are_not_lent_beside_those_the_fallback_lent_since_the_call():
    owner = Owner(live=2)
    leased = pool(CONCURRENCY, 10, owner)
    leased.ask(10)
    operation = leased.operation(0.0, idle=False)  # Redis runs it (holder: 10 slots); its answer is lost
    owner.degraded = True
    for _ in range(5):  # the fallback's share meanwhile
        leased.reserve(1, 0.1)
    owner.degraded = False
    leased.answered(Answer(10, 0.0), 10, 0.2, operation, late=True)  # sent again: answered with its first answer
    assert (leased.in_use, leased.held) == (5, 0)  # the grant predates the others' fallbacks: not lent, given back
    assert leased.operation(0.3, idle=False).have == 5


def test_slots_reserved_while_a_call_is_made_are_among_what_it_says_the_process_holds():
    leased = pool(CONCURRENCY, 10)
    leased.ask(3)
    leased.answered(Answer(3, 0.0), 3, 0.0, leased.operation(0.0, idle=False))
    leased.reserve(1, 0.1)
    operation = leased.operation(0.1, idle=False)  # says 3 held, asks nothing
    leased.reserve(1, 0.2)  # from the 2 held, while the call is made
    leased.answered(Answer(0, 7.0), 0, 0.3, operation)
    assert (leased.in_use, leased.held) == (2, 1)


def test_redis_away_rate_limits_are_the_limit_divided_by_the_live_processes():
    owner = Owner(live=4)
    requests = pool(REQUESTS, 100, owner)
    owner.degraded = True
    assert requests.room(0.0) == 25
    assert requests.reserve(1, 0.0) == FALLBACK
    slots = pool(CONCURRENCY, 8, owner)
    assert slots.room(0.0) == 2


@given(st.one_of(st.none(), st.integers(), st.binary(max_size=20), st.text(max_size=20),
                 st.lists(st.one_of(st.integers(), st.binary(max_size=8), st.floats(),
                                    st.lists(st.one_of(st.integers(-(2 ** 70), 2 ** 70), st.binary(max_size=12),
                                                       st.floats(), st.none()), max_size=4)), max_size=3)))
def test_any_reply_is_parsed_into_answers_within_what_was_asked_or_refused(reply):
    count = len(reply) if isinstance(reply, list) else 1
    operations = [Operation((BUCKET, BUDGET, SLOTS)[i % 3], ("k",), 100, 1, 10) for i in range(count)]
    try:
        answers = decode(reply, operations)
    except (ValueError, TypeError, Unseeded):
        return
    for answer in answers:
        assert 0 <= answer.granted <= 10
        assert -1e15 <= answer.left <= 100 and not math.isnan(answer.left)
        assert answer.left <= answer.unused <= 100 and not math.isnan(answer.unused)
        assert 0 <= answer.dropped <= 1000


def test_a_budget_reports_what_its_settled_answers_used_and_keeps_it_when_the_call_fails():
    budget = pool(BUDGET_USD, capacity=1000)
    budget.ask(300)
    grant(budget, 300)
    stamp = budget.reserve(300, 0.0)
    budget.adjust(300, 120, stamp, 0.1)
    operation = budget.operation(0.2, idle=False)
    assert operation.consumed == 120
    counter = "llmgw:c:tenancy:key:k-alice:budget_usd:total:0"
    assert operation.keys == (counter, counter + ":used", counter + ":held", counter + ":holders")
    budget.unanswered(operation, 0)
    assert budget.operation(0.3, idle=False).consumed == 120


def test_a_budget_says_what_it_holds_and_renews_it_until_it_holds_nothing():
    budget = pool(BUDGET_USD, capacity=1000)
    budget.ask(300)
    grant(budget, 300)
    first = budget.reserve(200, 0.0)
    budget.reserve(50, 0.0)
    operation = budget.operation(0.1, idle=False)
    assert (operation.have, operation.ttl_ms) == (300, 5000)  # 50 of lease, 250 in flight
    budget.answered(Answer(0, 700.0, 1000.0), 0, 0.1)
    budget.adjust(200, 80, first, 0.2)
    assert budget.operation(0.3, idle=True).have == 50 + 0  # 170 of lease given back, 80 used, 50 in flight
    budget.answered(Answer(0, 950.0, 920.0), 0, 0.3)
    assert budget.owes() and budget.operation(0.4, idle=False) is not None  # renewed while 50 are in flight
    budget.answered(Answer(0, 950.0, 920.0), 0, 0.4)
    budget.adjust(50, 50, first, 0.5)
    assert budget.operation(0.6, idle=True).have == 0
    budget.answered(Answer(0, 1000.0, 870.0), 0, 0.6)
    assert not budget.owes() and budget.operation(0.7, idle=True) is None


def test_redis_away_a_budget_admits_from_its_lease_only_while_its_holder_record_lives():
    owner = Owner()
    budget = pool(BUDGET_USD, capacity=1000, owner=owner)
    budget.ask(300)
    grant(budget, 300, now=10.0)
    owner.degraded = True
    assert budget.room(14.9) == 300
    assert budget.room(15.0) == 0  # Redis dropped the holder 5 s after the call that renewed it


def test_a_budget_short_only_of_what_leases_and_requests_hold_is_not_exhausted():
    budget = pool(BUDGET_USD, capacity=1000)
    budget.ask(600)
    operation = budget.operation(0.0, idle=False)
    budget.answered(Answer(600, 400.0, 1000.0), 600, 0.0)
    assert operation.need == 600
    budget.reserve(600, 0.0)
    assert not budget.exhausted(600, 0.0) and budget.wait(600, 0.0) == 2.0  # the 600 may come back
    budget.answered(Answer(0, 400.0, 700.0), 0, 0.1)  # 300 used elsewhere: 700 still unused
    assert not budget.exhausted(700, 0.1) and budget.exhausted(701, 0.1)
    budget.consumed = 100  # this process's answers used 100 more, not reported yet
    assert budget.exhausted(700, 0.1) and math.isinf(budget.wait(700, 0.1))


def test_a_starved_budget_puts_its_piece_back_and_asks_for_the_whole():
    budget = pool(BUDGET_USD, capacity=1000)
    budget.held = 300  # a piece left from earlier leases
    budget.ask(400)  # a request of 700 lacks 400
    budget.answered(Answer(0, 0.0, 800.0), budget.asked, 0.0)  # none left in Redis: refused
    assert budget.starved
    budget.ask(400)
    operation = budget.operation(0.5, idle=False)
    assert (operation.give, operation.need, operation.want) == (300, 700, 700) and budget.held == 0
    budget.answered(Answer(700, 100.0, 800.0), 400, 0.5)
    assert not budget.starved and budget.room(0.5) == 700


def test_the_script_saying_unseeded_is_its_own_answer():
    with pytest.raises(Unseeded):
        decode(b"unseeded", [])
