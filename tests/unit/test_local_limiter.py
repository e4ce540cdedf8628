"""The limiter of one process: token buckets, concurrency, budgets by UTC period, settling, refusals' retry_after
and OpenAI's headers, on trio's mock clock (``mock_clock.jump`` moves time; the limiter reads it as a wall clock)."""

from __future__ import annotations

import calendar

import pytest
import trio
from hypothesis import given, settings as hsettings, strategies as st

from llmgw.tenancy.interfaces import OUT_OF_QUOTA, RATE_LIMITED, Refusal
from llmgw.tenancy.limiter_metrics import LimiterMetrics
from llmgw.tenancy.local_limiter import LocalLimiter, Spent
from llmgw.tenancy.model import NO_LIMITS, Budget, Estimate, Limits, Team, TenancySettings, Tenant, Usage
from llmgw.tenancy.pools import TokenBucket, period_end, period_start
from llmgw.tenancy.ratelimit_headers import format_reset

NOON = calendar.timegm((2026, 12, 7, 12, 0, 0))  # a Monday, 12:00 UTC
SETTINGS = TenancySettings()
SMALL = Estimate(prompt_tokens=10, max_output_tokens=10, nano_usd=100)


def limiter(settings: TenancySettings = SETTINGS, start: float = NOON) -> LocalLimiter:
    return LocalLimiter(settings, clock=lambda: start + trio.current_time(), metrics=LimiterMetrics())


def key(limits: Limits = NO_LIMITS, team: Team | None = None, name: str = "alice") -> Tenant:
    return Tenant(key_id=f"cfg-{name}", name=name, team=team, limits=limits)


async def admit_many(lim: LocalLimiter, tenant: Tenant, count: int, estimate: Estimate = SMALL) -> list:
    return [await lim.admit(tenant, "m", estimate) for _ in range(count)]


def admitted(answers: list) -> list:
    return [a for a in answers if not isinstance(a, Refusal)]


async def test_a_burst_admits_at_most_the_rpm_then_refills_continuously(mock_clock):
    lim, alice = limiter(), key(Limits(rpm=60))
    answers = await admit_many(lim, alice, 100)
    assert len(admitted(answers)) == 60
    refused = answers[60]
    assert refused.error_type == RATE_LIMITED and refused.status == 429
    assert refused.retry_after == pytest.approx(1.0)  # 60 per minute: one more every second
    assert "key 'alice'" in refused.message and "60 requests per minute" in refused.message
    assert (b"retry-after", b"1") in refused.headers
    mock_clock.jump(0.5)
    assert isinstance(await lim.admit(alice, "m", SMALL), Refusal)
    mock_clock.jump(0.5)
    assert not isinstance(await lim.admit(alice, "m", SMALL), Refusal)
    mock_clock.jump(3600)
    assert len(admitted(await admit_many(lim, alice, 100))) == 60  # refilled to the limit, never above


async def test_tpm_reserves_the_estimate_and_settle_returns_what_was_not_used(mock_clock):
    lim, alice = limiter(), key(Limits(tpm=1000))
    big = Estimate(prompt_tokens=100, max_output_tokens=400)
    first, second = await admit_many(lim, alice, 2, big)
    third = await lim.admit(alice, "m", big)
    assert isinstance(third, Refusal) and third.error_type == RATE_LIMITED
    assert third.retry_after == pytest.approx(500 / (1000 / 60))  # 500 more tokens at 1000 per minute
    first.settle(Usage(prompt_tokens=100, completion_tokens=50))  # 350 of its 500 come back
    first.settle(Usage(prompt_tokens=100, completion_tokens=0))  # a second settle does nothing
    assert dict(second.headers).get(b"x-ratelimit-remaining-tokens") == b"0"
    assert not isinstance(await lim.admit(alice, "m", Estimate(prompt_tokens=300, max_output_tokens=50)), Refusal)
    assert isinstance(await lim.admit(alice, "m", Estimate(prompt_tokens=1, max_output_tokens=0)), Refusal)


async def test_a_usage_above_its_reservation_is_charged_in_full_and_later_requests_wait(mock_clock):
    lim, alice = limiter(), key(Limits(tpm=600))
    one = await lim.admit(alice, "m", Estimate(prompt_tokens=100, max_output_tokens=100))
    one.settle(Usage(prompt_tokens=100, completion_tokens=1000))  # 1100 used of 200 reserved: 500 in debt
    refused = await lim.admit(alice, "m", Estimate(prompt_tokens=10, max_output_tokens=0))
    assert isinstance(refused, Refusal)
    assert refused.retry_after == pytest.approx(510 / 10)  # the debt and the request, at 10 tokens per second
    mock_clock.jump(51)
    assert not isinstance(await lim.admit(alice, "m", Estimate(prompt_tokens=10, max_output_tokens=0)), Refusal)


async def test_no_usage_gives_the_tokens_back_but_the_request_still_counts(mock_clock):
    lim, alice = limiter(), key(Limits(rpm=2, tpm=100))
    one = await lim.admit(alice, "m", Estimate(prompt_tokens=50, max_output_tokens=50))
    one.settle(None)
    two = await lim.admit(alice, "m", Estimate(prompt_tokens=50, max_output_tokens=50))
    assert not isinstance(two, Refusal)
    three = await lim.admit(alice, "m", SMALL)
    assert isinstance(three, Refusal) and "2 requests per minute" in three.message


async def test_cached_input_counts_at_its_weight(mock_clock):
    lim = limiter(TenancySettings(cached_input_weight=0.25))
    alice = key(Limits(tpm=100))
    one = await lim.admit(alice, "m", Estimate(prompt_tokens=80, max_output_tokens=20))
    one.settle(Usage(prompt_tokens=80, completion_tokens=0, cached_tokens=80))  # counts 20
    assert not isinstance(await lim.admit(alice, "m", Estimate(prompt_tokens=80, max_output_tokens=0)), Refusal)


async def test_a_request_larger_than_the_tpm_is_refused_saying_it_never_fits(mock_clock):
    lim, alice = limiter(), key(Limits(tpm=100))
    refused = await lim.admit(alice, "m", Estimate(prompt_tokens=90, max_output_tokens=4096))
    assert isinstance(refused, Refusal) and "can never be admitted" in refused.message


async def test_concurrency_counts_requests_in_flight(mock_clock):
    lim, alice = limiter(), key(Limits(concurrency=2))
    one, two = await admit_many(lim, alice, 2)
    refused = await lim.admit(alice, "m", SMALL)
    assert isinstance(refused, Refusal) and refused.error_type == RATE_LIMITED
    assert "2 concurrent requests" in refused.message and refused.retry_after == pytest.approx(1.0)
    one.settle(Usage(prompt_tokens=1, completion_tokens=1))
    three = await lim.admit(alice, "m", SMALL)
    assert not isinstance(three, Refusal)
    two.settle(None)
    three.settle(None)
    assert len(admitted(await admit_many(lim, alice, 3))) == 2


async def test_a_request_passes_its_key_and_its_team(mock_clock):
    team = Team("ml", limits=Limits(rpm=3))
    lim = limiter()
    alice, bob = key(Limits(rpm=2), team, "alice"), key(Limits(), team, "bob")
    assert len(admitted(await admit_many(lim, alice, 5))) == 2
    answers = await admit_many(lim, bob, 5)
    assert len(admitted(answers)) == 1
    assert "team 'ml'" in answers[1].message
    # a refusal by one pool reserves nothing in the others: the key's own bucket is untouched
    carol = key(Limits(rpm=10), team, "carol")
    assert all(isinstance(a, Refusal) for a in await admit_many(lim, carol, 3))
    mock_clock.jump(60)
    assert len(admitted(await admit_many(lim, carol, 10))) == 3


async def test_token_budgets_by_utc_day_refuse_as_insufficient_quota_until_midnight(mock_clock):
    lim, alice = limiter(), key(Limits(budgets=(Budget("day", tokens=1000),)))
    one = await lim.admit(alice, "m", Estimate(prompt_tokens=500, max_output_tokens=400))
    one.settle(Usage(prompt_tokens=500, completion_tokens=450))  # 950 spent
    refused = await lim.admit(alice, "m", Estimate(prompt_tokens=40, max_output_tokens=20))
    assert isinstance(refused, Refusal) and refused.error_type == OUT_OF_QUOTA
    assert refused.retry_after == pytest.approx(12 * 3600)  # until 00:00 UTC
    assert "budget of 1000 tokens per day" in refused.message
    assert not isinstance(await lim.admit(alice, "m", Estimate(prompt_tokens=40, max_output_tokens=10)), Refusal)
    mock_clock.jump(12 * 3600)
    assert not isinstance(await lim.admit(alice, "m", Estimate(prompt_tokens=500, max_output_tokens=400)), Refusal)


async def test_money_budgets_by_month_and_total(mock_clock):
    budgets = (Budget("month", nano_usd=1000), Budget("total", nano_usd=1500))
    lim, alice = limiter(), key(Limits(budgets=budgets))
    one = await lim.admit(alice, "m", Estimate(1, 1, nano_usd=900))
    one.settle(Usage(1, 1, nano_usd=800))
    refused = await lim.admit(alice, "m", Estimate(1, 1, nano_usd=300))
    assert refused.error_type == OUT_OF_QUOTA
    assert refused.retry_after == pytest.approx(calendar.timegm((2027, 1, 1, 0, 0, 0)) - NOON)
    mock_clock.jump(calendar.timegm((2027, 1, 1, 0, 0, 0)) - NOON)
    two = await lim.admit(alice, "m", Estimate(1, 1, nano_usd=600))
    assert not isinstance(two, Refusal)
    # 800 + 600 + 200 > 1500, but the 600 are only reserved: the request in flight may give them back
    held = await lim.admit(alice, "m", Estimate(1, 1, nano_usd=200))
    assert held.error_type == RATE_LIMITED and held.retry_after == 1.0
    assert "total budget" in held.message and "held by requests in flight" in held.message
    two.settle(Usage(1, 1, nano_usd=600))
    refused = await lim.admit(alice, "m", Estimate(1, 1, nano_usd=200))  # 800 + 600 used + 200 > 1500 ever
    assert refused.error_type == OUT_OF_QUOTA
    assert "total budget" in refused.message and "only raising it frees it" in refused.message
    assert refused.retry_after == 86_400.0


async def test_a_budget_reserved_by_requests_in_flight_is_not_spent(mock_clock):
    """Four requests at a time on a budget that holds four: a fifth is told to retry shortly (their reservations
    may come back), and is admitted once one settled for less than it reserved."""
    lim, alice = limiter(), key(Limits(budgets=(Budget("day", nano_usd=4000),)))
    flying = [await lim.admit(alice, "m", Estimate(1, 1, nano_usd=1000)) for _ in range(4)]
    assert not any(isinstance(one, Refusal) for one in flying)
    fifth = await lim.admit(alice, "m", Estimate(1, 1, nano_usd=1000))
    assert fifth.error_type == RATE_LIMITED and fifth.retry_after == 1.0
    flying[0].settle(Usage(1, 1, nano_usd=10))
    assert not isinstance(await lim.admit(alice, "m", Estimate(1, 1, nano_usd=900)), Refusal)


async def test_a_reservation_settled_after_its_period_ended_counts_its_usage_in_the_new_one(mock_clock):
    lim, alice = limiter(start=calendar.timegm((2026, 12, 7, 23, 59, 59))), key(Limits(budgets=(Budget("day", 100),)))
    one = await lim.admit(alice, "m", Estimate(50, 50))
    mock_clock.jump(2)
    one.settle(Usage(50, 30))
    assert isinstance(await lim.admit(alice, "m", Estimate(10, 11)), Refusal)
    assert not isinstance(await lim.admit(alice, "m", Estimate(10, 10)), Refusal)


async def test_budget_spend_seeded_from_the_usage_store_survives_a_restart(mock_clock):
    lim = limiter()
    team = Team("ml", limits=Limits(budgets=(Budget("day", tokens=1000, nano_usd=10_000),)))
    alice = key(Limits(), team)
    lim.seed([Spent("team", "ml", "day", tokens=990, nano_usd=0)])
    refused = await lim.admit(alice, "m", Estimate(10, 10))
    assert isinstance(refused, Refusal) and refused.error_type == OUT_OF_QUOTA
    lim.seed([Spent("team", "ml", "day", tokens=0, nano_usd=9_950)])  # after the pools exist too
    assert isinstance(await lim.admit(alice, "m", Estimate(5, 5, nano_usd=100)), Refusal)
    assert not isinstance(await lim.admit(alice, "m", Estimate(5, 5, nano_usd=50)), Refusal)


async def test_changed_limits_resize_the_pools_keeping_what_was_used(mock_clock):
    lim = limiter()
    await admit_many(lim, key(Limits(rpm=10)), 8)
    assert len(admitted(await admit_many(lim, key(Limits(rpm=20)), 20))) == 12  # 8 of 20 used
    assert len(admitted(await admit_many(lim, key(Limits(rpm=5)), 5))) == 0


async def test_headers_say_the_tightest_limit_and_its_reset(mock_clock):
    team = Team("ml", limits=Limits(rpm=100, tpm=1200))
    lim, alice = limiter(), key(Limits(rpm=10), team)
    answer = await lim.admit(alice, "m", Estimate(100, 20))
    headers = dict(answer.headers)
    assert headers[b"x-ratelimit-limit-requests"] == b"10"
    assert headers[b"x-ratelimit-remaining-requests"] == b"9"
    assert headers[b"x-ratelimit-reset-requests"] == b"6s"
    assert headers[b"x-ratelimit-limit-tokens"] == b"1200"
    assert headers[b"x-ratelimit-remaining-tokens"] == b"1080"
    assert headers[b"x-ratelimit-reset-tokens"] == b"6s"
    assert (await lim.admit(key(), "m", SMALL)).headers == []  # nothing limits it: no headers


def test_reset_is_written_as_openai_writes_it():
    assert format_reset(0.02) == "20ms"
    assert format_reset(0) == "0ms"
    assert format_reset(1) == "1s"
    assert format_reset(1.5) == "1.5s"
    assert format_reset(360) == "6m0s"
    assert format_reset(3723.25) == "1h2m3.25s"


def test_periods_follow_the_utc_calendar():
    assert period_start("day", NOON) == calendar.timegm((2026, 12, 7, 0, 0, 0))
    assert period_end("month", NOON) == calendar.timegm((2027, 1, 1, 0, 0, 0))
    assert period_start("month", NOON) == calendar.timegm((2026, 12, 1, 0, 0, 0))
    assert period_start("total", NOON) == 0.0


async def test_metrics_count_admitted_and_limited_by_team_and_limit(mock_clock):
    metrics = LimiterMetrics()
    lim = LocalLimiter(SETTINGS, clock=lambda: NOON + trio.current_time(), metrics=metrics)
    await admit_many(lim, key(Limits(rpm=1), Team("ml")), 3)
    assert metrics.admitted.labels("ml")._value.get() == 1
    assert metrics.limited.labels("ml", "requests")._value.get() == 2


# Any interleaving of admits, settles (with any usage) and time steps never admits more requests than the bucket
# allowed: at most the rpm plus what refilled, and never more in flight than the concurrency limit.
OPS = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 300), st.integers(0, 300)),
    st.tuples(st.just("settle"), st.integers(0, 50), st.one_of(st.none(), st.integers(0, 2000))),
    st.tuples(st.just("wait"), st.floats(0, 5), st.just(0)),
), max_size=120)


@hsettings(max_examples=200, deadline=None)
@given(OPS, st.integers(1, 20), st.integers(1, 2000), st.integers(1, 5))
def test_no_interleaving_admits_over_the_limits(ops, rpm, tpm, concurrency):
    now = [float(NOON)]
    lim = LocalLimiter(SETTINGS, clock=lambda: now[0])
    alice = key(Limits(rpm=rpm, tpm=tpm, concurrency=concurrency))
    open_ = []
    admitted_requests = 0
    admitted_tokens = 0  # reserved by the requests in flight and used by those settled
    charged_over = 0  # tokens used beyond their reservation (the estimates' misses)
    for op, a, b in ops:
        if op == "admit":
            answer = lim.admit_now(alice, Estimate(a, b))
            if not isinstance(answer, Refusal):
                admitted_requests += 1
                admitted_tokens += a + b
                open_.append((answer, a + b))
                assert len(open_) <= concurrency
        elif op == "settle" and open_:
            answer, reserved = open_.pop(a % len(open_))
            answer.settle(None if b is None else Usage(0, b))
            used = 0 if b is None else b
            admitted_tokens += used - reserved
            charged_over += max(0, used - reserved)
        elif op == "wait":
            now[0] += a
        elapsed = now[0] - NOON
        assert admitted_requests <= rpm + elapsed * rpm / 60 + 1e-6
        assert admitted_tokens <= tpm + elapsed * tpm / 60 + 1e-6 + charged_over


def test_a_bucket_never_holds_more_than_its_capacity():
    bucket = TokenBucket(10, now=0.0)
    bucket.adjust(reserved=5, used=0, stamp=0, now=1.0)
    assert bucket.room(1000.0) == 10
