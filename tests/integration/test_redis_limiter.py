"""The limiter of a cluster with a real redis-server: several limiters (each with its own Redis connection, in this
process, or real processes of llmgw.testing.limiter_driver) admit as one; concurrency slots of a process killed
with kill -9 come back; Redis killed: each process falls back to its share of the limits, budgets closed."""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
import uuid
from types import SimpleNamespace

import trio
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from llmgw.cluster.link import RedisLink, Unavailable
from llmgw.cluster.metrics import ClusterMetrics
from llmgw.config.loading import parse_config
from llmgw.tenancy.interfaces import OUT_OF_QUOTA, RATE_LIMITED, Refusal
from llmgw.tenancy.lease_script import BUDGET, CALL_MEMORY_MS, LEASE, REMEMBERED, Operation, calls_key, decode, encode
from llmgw.tenancy.leases import budget_keys
from llmgw.tenancy.limiter_metrics import LimiterMetrics
from llmgw.tenancy.local_limiter import Spent
from llmgw.tenancy.model import Budget, Estimate, Limits, Team, TenancySettings, Tenant, Usage
from llmgw.tenancy.redis_limiter import RedisLimiter, cluster_limiter, tenancy_prefix
from llmgw.testing.limiter_driver import READY
from llmgw.testing.processes import start_child
from llmgw.testing.shared_state import state_section

SMALL = Estimate(prompt_tokens=10, max_output_tokens=0)


async def start_limiter(nursery, redis_url: str, cluster: str, origin: str, settings: TenancySettings | None = None,
                        **options) -> RedisLimiter:
    state = parse_config(state_section(redis_url, cluster)).state  # state.timeout as configured by default
    link = RedisLink(state, ClusterMetrics(None, "gateway", cluster, origin))
    await nursery.start(link.run)
    limiter = RedisLimiter(settings or TenancySettings(), link, cluster, origin, metrics=LimiterMetrics(), **options)
    await nursery.start(limiter.run)
    return limiter


def tenant(limits: Limits, name: str = "alice", team: Team | None = None) -> Tenant:
    return Tenant(key_id=f"k-{name}", name=name, limits=limits, team=team)


async def burst(limiter: RedisLimiter, who: Tenant, count: int, estimate: Estimate = SMALL) -> list:
    answers: list = []

    async def one() -> None:
        answers.append(await limiter.admit(who, "m", estimate))

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    return answers


def admitted(answers: list) -> list:
    return [answer for answer in answers if not isinstance(answer, Refusal)]


async def test_four_limiters_bursting_100_each_admit_exactly_the_rpm(nursery, redis_url, cluster_name):
    limiters = [await start_limiter(nursery, redis_url, cluster_name, f"g{i}") for i in range(4)]
    alice = tenant(Limits(rpm=150))
    results: list[list] = [[] for _ in limiters]
    async with trio.open_nursery() as bursts:
        for i, limiter in enumerate(limiters):
            bursts.start_soon(lambda i=i, limiter=limiter: _into(results[i], burst(limiter, alice, 100)))
    counts = [len(admitted(answers)) for answers in results]
    assert sum(counts) == 150, counts  # never more; and every request a lease covered was admitted
    refused = [answer for answers in results for answer in answers if isinstance(answer, Refusal)]
    assert refused[0].error_type == RATE_LIMITED and "150 requests per minute" in refused[0].message
    assert sum(limiter.metrics.lease_waits._value.get() for limiter in limiters) == 400


async def _into(target: list, answers) -> None:
    target.extend(await answers)


async def test_a_share_not_used_goes_back_to_the_others_when_idle(nursery, redis_url, cluster_name):
    settings = TenancySettings(lease_seconds=5.0, lease_idle_seconds=0.5)
    first = await start_limiter(nursery, redis_url, cluster_name, "g1", settings)
    second = await start_limiter(nursery, redis_url, cluster_name, "g2", settings)
    alice = tenant(Limits(rpm=60))
    for _ in range(5):  # a steady demand makes its leases larger than one request
        for answer in admitted(await burst(first, alice, 4)):
            answer.settle(None)
    held = next(iter(first._pools())).held
    assert held > 0  # it leased ahead of its demand
    assert len(admitted(await burst(second, alice, 60))) == 60 - 20 - held
    with trio.fail_after(5):
        while next(iter(first._pools())).held:
            await trio.sleep(0.05)
    assert len(admitted(await burst(second, alice, held))) == held


async def test_tokens_settled_above_their_reservation_are_charged_to_the_shared_bucket(nursery, redis_url,
                                                                                        cluster_name):
    first = await start_limiter(nursery, redis_url, cluster_name, "g1")
    second = await start_limiter(nursery, redis_url, cluster_name, "g2")
    alice = tenant(Limits(tpm=6000))
    (answer,) = await burst(first, alice, 1, Estimate(prompt_tokens=100, max_output_tokens=100))
    answer.settle(Usage(prompt_tokens=100, completion_tokens=5000))  # 4900 over: a debt the next call pays
    with trio.fail_after(5):
        while next(iter(first._pools())).held < 0:
            await trio.sleep(0.05)
    refused = await second.admit(alice, "m", Estimate(prompt_tokens=2000, max_output_tokens=0))
    assert isinstance(refused, Refusal), "5100 of 6000 tokens are spent; 2000 more do not fit"
    missing = 2000 - (6000 - 5100 - next(iter(first._pools())).held)  # first holds a share leased ahead
    assert missing / 100 - 2.0 < refused.retry_after <= missing / 100 + 0.01  # at 100 tokens/s, less what refilled


async def test_concurrency_is_shared_and_a_settled_slot_frees_up(nursery, redis_url, cluster_name):
    first = await start_limiter(nursery, redis_url, cluster_name, "g1")
    second = await start_limiter(nursery, redis_url, cluster_name, "g2")
    alice = tenant(Limits(concurrency=3))
    held = admitted(await burst(first, alice, 2)) + admitted(await burst(second, alice, 5))
    assert len(held) == 3
    assert all(isinstance(answer, Refusal) for answer in await burst(second, alice, 3))
    held[0].settle(Usage(1, 1))
    with trio.fail_after(5):  # the slot goes back to Redis when idle, or serves its own process at once
        while not admitted(await burst(second, alice, 1)):
            await trio.sleep(0.1)


async def test_budgets_are_shared_and_charged_per_period(nursery, redis_url, cluster_name):
    first = await start_limiter(nursery, redis_url, cluster_name, "g1")
    second = await start_limiter(nursery, redis_url, cluster_name, "g2")
    team = Team("ml", limits=Limits(budgets=(Budget("day", nano_usd=1000),)))
    alice, bob = tenant(Limits(), "alice", team), tenant(Limits(), "bob", team)
    one = await first.admit(alice, "m", Estimate(1, 1, nano_usd=600))
    assert not isinstance(one, Refusal)
    # 600 of 1000 reserved by a request in flight on the other process: not spent, it may come back. The request
    # waits for it a while (lease_idle_seconds and a call), then is told to retry shortly.
    refused = await second.admit(bob, "m", Estimate(1, 1, nano_usd=600))
    assert isinstance(refused, Refusal) and refused.error_type == RATE_LIMITED
    assert refused.retry_after == TenancySettings().lease_idle_seconds
    assert "budget of 1e-06 USD per day of the team 'ml' is held by requests in flight" in refused.message
    assert second.metrics.budget_waits._value.get() == 1
    waiting: list = []
    async with trio.open_nursery() as both:
        both.start_soon(lambda: _into(waiting, burst(second, bob, 1, Estimate(1, 1, nano_usd=600))))
        await trio.sleep(0.2)
        one.settle(Usage(1, 1, nano_usd=100))  # first's unused 500 go back when idle: the waiting request gets them
    [two] = admitted(waiting)
    two.settle(Usage(1, 1, nano_usd=600))
    third = await first.admit(alice, "m", Estimate(1, 1, nano_usd=600))  # 100 + 600 used: spent, whoever asks
    assert isinstance(third, Refusal) and third.error_type == OUT_OF_QUOTA
    assert "has spent its budget of 1e-06 USD per day" in third.message


async def test_a_budget_in_pieces_over_processes_is_pooled_for_a_request_none_covers(nursery, redis_url,
                                                                                      cluster_name):
    """What is left of a budget held in two processes' shares, each piece less than a request: both processes'
    waiting requests put their piece back with the rest and ask for the whole, so one of them is admitted at the
    next lease calls (not after lease_idle_seconds, not refused as spent); the other, once that one's use is
    counted, is refused as spent."""
    settings = TenancySettings(lease_idle_seconds=5.0)
    first, second = [await start_limiter(nursery, redis_url, cluster_name, f"g{i}", settings) for i in range(2)]
    alice = tenant(Limits(budgets=(Budget("total", nano_usd=1000),)))
    for limiter, reserve in ((first, 600), (second, 300)):
        answer = await limiter.admit(alice, "m", Estimate(1, 1, nano_usd=reserve))
        assert not isinstance(answer, Refusal)
        answer.settle(Usage(1, 1, nano_usd=100))  # each keeps its unused part (and any refill) as its share
    answers: list = []
    started = trio.current_time()

    async def one(limiter: RedisLimiter) -> None:
        answer = await limiter.admit(alice, "m", Estimate(1, 1, nano_usd=700))  # 800 unused, in two pieces
        answers.append((trio.current_time() - started, answer))
        if not isinstance(answer, Refusal):
            answer.settle(Usage(1, 1, nano_usd=700))

    async with trio.open_nursery() as both:
        both.start_soon(one, first)
        both.start_soon(one, second)
    (took, winner), (_, loser) = answers
    assert not isinstance(winner, Refusal) and took < settings.lease_idle_seconds, answers
    assert isinstance(loser, Refusal) and loser.error_type == OUT_OF_QUOTA and "has spent" in loser.message


async def test_limits_far_from_reached_never_refuse_requests_racing_for_one_grant(nursery, redis_url, cluster_name):
    """Four loops of requests over two processes on a key with every kind of limit, none near its end (as the
    latency lane of ``llmgw bench limits``): a request whose lease call's grant another request of its process
    reserved first asks again, and none is refused (it was: rpm, tpm and the $1,000 budget at once)."""
    limiters = [await start_limiter(nursery, redis_url, cluster_name, f"g{i}") for i in range(2)]
    alice = tenant(Limits(rpm=10**12, tpm=10**12, concurrency=10**6, budgets=(Budget("total", nano_usd=10**12),)))
    refusals: list = []

    async def loop(limiter: RedisLimiter) -> None:
        for _ in range(100):
            answer = await limiter.admit(alice, "m", Estimate(166, 16, nano_usd=460_000))
            if isinstance(answer, Refusal):
                refusals.append(answer.message)
            else:
                await trio.sleep(0.005)
                answer.settle(Usage(96, 16, nano_usd=320_000))

    async with trio.open_nursery() as loops:
        for i in range(4):
            loops.start_soon(loop, limiters[i % 2])
    assert refusals == []


async def test_what_a_hostile_writer_leaves_in_redis_is_clamped(nursery, redis_url, cluster_name):
    limiter = await start_limiter(nursery, redis_url, cluster_name, "g1")
    prefix = tenancy_prefix(cluster_name)

    async def write(command) -> None:
        await limiter.link.call("test_write", command)

    await write(lambda c: c.hset(prefix + "key:k-alice:requests", {"l": "1e300", "t": "-5"}))
    await write(lambda c: c.rpush(prefix + "key:k-alice:tokens", ["not a bucket"]))
    await write(lambda c: c.hset(prefix + "key:k-bob:concurrency", {"forged": "1000000"}))
    await write(lambda c: c.zadd(prefix + "key:k-bob:concurrency:holders", {"forged": 1e15}))
    await write(lambda c: c.set(prefix + "key:k-carol:budget_tokens:total:0", "-1e30"))
    await write(lambda c: c.hset(prefix + "key:k-carol:budget_tokens:total:0:held", {"forged": "1e30"}))
    await write(lambda c: c.zadd(prefix + "key:k-carol:budget_tokens:total:0:holders", {"forged": 1e15}))
    await write(lambda c: c.hset(limiter.calls_key, {"1": "not an answer"}))
    alice = tenant(Limits(rpm=20, tpm=1000), "alice")
    assert len(admitted(await burst(limiter, alice, 50))) == 20
    bob = tenant(Limits(concurrency=5), "bob")
    assert len(admitted(await burst(limiter, bob, 50))) == 5  # the endless forged holder is dropped
    carol = tenant(Limits(budgets=(Budget("total", tokens=100),)), "carol")
    assert len(admitted(await burst(limiter, carol, 20))) == 10
    assert not limiter.degraded


async def test_real_processes_bursting_together_admit_at_most_the_rpm(nursery, redis_url, cluster_name, tmp_path):
    go = tmp_path / "go"
    drivers = [await start_driver(nursery, redis_url, cluster_name, f"d{i}", go, "--rpm", "120")
               for i in range(3)]
    go.touch()
    results = [await result_of(driver) for driver in drivers]
    assert sum(result["admitted"] for result in results) == 120, results
    assert sum(result["refused"] for result in results) == 180


async def test_the_slots_of_a_process_killed_with_kill_9_come_back_within_the_ttl(nursery, redis_url,
                                                                                  cluster_name, tmp_path):
    go = tmp_path / "go"
    holder = await start_driver(nursery, redis_url, cluster_name, "holder", go, "--concurrency", "3", "--burst",
                                "3", "--hold", "inf", "--holder-ttl", "1")
    go.touch()
    assert (await result_of(holder))["admitted"] == 3
    other = await start_limiter(nursery, redis_url, cluster_name, "other", holder_ttl=1.0)
    alice = Tenant(key_id="k-driver", name="k-driver", limits=Limits(concurrency=3))
    assert isinstance(await other.admit(alice, "m", SMALL), Refusal)
    holder.process.send_signal(signal.SIGKILL)
    killed = trio.current_time()
    with trio.fail_after(10):
        while isinstance(await other.admit(alice, "m", SMALL), Refusal):
            await trio.sleep(0.1)
    assert trio.current_time() - killed < 1.0 + 2.0  # the TTL, and the other's wait for its next call
    assert other.metrics.lapsed_holders.labels("concurrency")._value.get() == 1


async def test_the_budget_share_of_a_process_killed_with_kill_9_goes_back_to_the_budget(nursery, redis_url,
                                                                                      cluster_name, tmp_path):
    go = tmp_path / "go"
    holder = await start_driver(nursery, redis_url, cluster_name, "holder", go, "--budget-tokens", "1000",
                                "--tokens", "50", "--burst", "10", "--hold", "inf", "--holder-ttl", "1")
    go.touch()
    assert (await result_of(holder))["admitted"] == 10  # 500 tokens in flight, and a lease ahead
    other = await start_limiter(nursery, redis_url, cluster_name, "other", holder_ttl=1.0)
    alice = Tenant(key_id="k-driver", name="k-driver", limits=Limits(budgets=(Budget("total", tokens=1000),)))
    fifty = Estimate(prompt_tokens=50, max_output_tokens=0)
    holder.process.send_signal(signal.SIGKILL)
    admitted_here = []
    with trio.move_on_after(20):
        while len(admitted_here) < 20:
            answer = await other.admit(alice, "m", fifty)
            if isinstance(answer, Refusal):
                await trio.sleep(0.2)
            else:
                admitted_here.append(answer)
    # none of the killed process's requests settled: its share and its reservations in flight are the budget's again
    assert len(admitted_here) == 20
    assert other.metrics.lapsed_holders.labels("budget_tokens")._value.get() == 1
    refusal = await other.admit(alice, "m", fifty)
    assert isinstance(refusal, Refusal)  # its 20 requests in flight hold the whole budget


async def test_a_lease_call_made_twice_with_one_id_is_applied_once(nursery, redis_url, cluster_name):
    limiter = await start_limiter(nursery, redis_url, cluster_name, "g1")
    counter = tenancy_prefix(cluster_name) + "key:k-alice:budget_tokens:total:0"
    report = Operation(BUDGET, budget_keys(counter), 1000, need=0, want=100, extra=0, have=0, ttl_ms=5000,
                       consumed=7)
    calls = calls_key(limiter.prefix, "h1")

    async def lease(call_id: int) -> object:
        keys, args = encode([report], limiter.marker, False, "h1", calls, call_id)
        return await limiter.link.call("test", lambda client: client.eval(LEASE, keys=keys, args=args))

    first = await lease(1)
    assert await lease(1) == first  # the repeat: the first answer, nothing applied again
    assert int(await limiter.link.call("test", lambda client: client.get(counter + ":used"))) == 7
    assert decode(first, [report])[0].granted == 100
    assert int(await limiter.link.call("test", lambda client: client.get(counter))) == 7 + 100
    await lease(2)  # a new call: applied
    assert int(await limiter.link.call("test", lambda client: client.get(counter + ":used"))) == 14
    remembered = await limiter.link.call("test", lambda client: client.hlen(calls))
    ttl = await limiter.link.call("test", lambda client: client.pttl(calls))
    assert remembered == 2 and 0 < ttl <= CALL_MEMORY_MS
    for call_id in range(3, 20):
        await lease(call_id)
    assert await limiter.link.call("test", lambda client: client.hlen(calls)) == REMEMBERED  # the last ones only


async def test_a_budget_counts_each_holders_share_and_what_was_used_in_whatever_order_they_report(
        nursery, redis_url, cluster_name):
    limiter = await start_limiter(nursery, redis_url, cluster_name, "g1")
    counter = tenancy_prefix(cluster_name) + "key:k-alice:budget_tokens:total:0"
    call_ids = [0]

    async def lease(holder: str, have: int, want: int, consumed: int = 0) -> int:
        call_ids[0] += 1
        report = Operation(BUDGET, budget_keys(counter), 1000, need=0, want=want, extra=0, have=have, ttl_ms=5000,
                           consumed=consumed)
        keys, args = encode([report], limiter.marker, False, holder, calls_key(limiter.prefix, holder), call_ids[0])
        reply = await limiter.link.call("test", lambda client: client.eval(LEASE, keys=keys, args=args))
        return decode(reply, [report])[0].granted

    async def committed() -> tuple[int, int]:
        values = await limiter.link.call("test", lambda client: client.mget([counter, counter + ":used"]))
        return int(values[0]), int(values[1])

    assert await lease("h1", 0, 100) == 100
    assert await lease("h2", 0, 300) == 300
    assert await committed() == (400, 0)
    await lease("h1", have=50, want=0, consumed=50)  # h1 used 50 of its 100: committed still holds them
    assert await committed() == (400, 50)
    await lease("h2", have=0, want=0)  # h2 gives its 300 back
    assert await committed() == (100, 50)
    assert await lease("h3", 0, 1000) == 900  # the rest: 50 used, 50 held by h1


async def test_a_lease_call_whose_answer_was_lost_counts_the_use_it_reports_once(nursery, redis_url, cluster_name):
    limiter = await start_limiter(nursery, redis_url, cluster_name, "g1")
    alice = tenant(Limits(budgets=(Budget("total", tokens=1000),)))
    admission = await limiter.admit(alice, "m", SMALL)
    assert not isinstance(admission, Refusal)
    await trio.sleep(limiter.tick * 2)  # the refill its reservation asked for is made
    real_call = limiter.link.call
    lost: list[object] = []

    async def losing_an_answer(operation, command, timeout=None):
        result = await real_call(operation, command, timeout)
        if operation == "tenancy_lease" and not lost:  # Redis ran it; its answer never comes back
            lost.append(result)
            raise Unavailable("no answer within 0.5s")
        return result

    limiter.link.call = losing_an_answer
    admission.settle(Usage(prompt_tokens=10, completion_tokens=0))  # the next call reports 10 used
    with trio.fail_after(10):
        while not lost or limiter.degraded:
            await trio.sleep(0.05)
    await trio.sleep(limiter.tick * 3)
    counter = tenancy_prefix(cluster_name) + "key:k-alice:budget_tokens:total:0:used"
    assert int(await real_call("test", lambda client: client.get(counter))) == 10


async def test_a_lost_give_back_is_sent_again_though_nothing_else_is_to_be_said(nursery, redis_url, cluster_name):
    settings = TenancySettings(lease_idle_seconds=0.5)
    limiter = await start_limiter(nursery, redis_url, cluster_name, "g1", settings)
    alice = tenant(Limits(budgets=(Budget("total", tokens=1000),)))
    admission = await limiter.admit(alice, "m", SMALL)
    assert not isinstance(admission, Refusal)
    admission.settle(Usage(prompt_tokens=10, completion_tokens=0))
    real_call = limiter.link.call
    sent_after_the_loss: list[str] = []

    class Peek:
        """What a lease call would send."""

        async def eval(self, script, keys, args):
            self.args = args

    async def losing_the_give_back(operation, command, timeout=None):
        result = await real_call(operation, command, timeout)
        if operation != "tenancy_lease":
            return result
        peek = Peek()
        await command(peek)
        # one budget operation: [count, seeded, id, "g", capacity, need, want, have, ...]: want and have 0
        if peek.args[0] == 1 and peek.args[6:8] == [0, 0]:
            if not sent_after_the_loss:
                sent_after_the_loss.append("lost")  # the call that gave the last share back: its answer is lost
                raise Unavailable("no answer within 0.5s")
            sent_after_the_loss.append("again")
        return result

    limiter.link.call = losing_the_give_back
    with trio.fail_after(15):  # given back once idle, lost, and sent again: nothing else makes a call
        while "again" not in sent_after_the_loss:
            await trio.sleep(0.05)
    counter = tenancy_prefix(cluster_name) + "key:k-alice:budget_tokens:total:0"
    assert await real_call("test", lambda client: client.hlen(counter + ":held")) == 0
    assert int(await real_call("test", lambda client: client.get(counter))) == 10  # only what was used


async def test_slots_lost_calls_granted_are_not_lent_again_beside_those_the_fallbacks_lent(nursery, redis_url,
                                                                                          cluster_name):
    """Two processes' takes of a burst are run by Redis (the first gets all 10 slots) but their answers are lost:
    each falls back to its share (5 of 10 at 2 live processes); sent again, each call is answered with its first
    answer. In flight over both, ever: 10."""
    limiters = [await start_limiter(nursery, redis_url, cluster_name, f"g{i}", live_processes=lambda: 2)
                for i in range(2)]
    alice = tenant(Limits(concurrency=10))
    lost: list[object] = []
    for limiter in limiters:
        real_call = limiter.link.call

        async def losing_the_first_answer(operation, command, timeout=None, real_call=real_call, limiter=limiter):
            result = await real_call(operation, command, timeout)
            if operation == "tenancy_lease" and limiter not in lost:  # Redis ran it; its answer never comes back
                lost.append(limiter)
                raise Unavailable("no answer within 2s")
            return result

        limiter.link.call = losing_the_first_answer
    in_flight = []
    for limiter in limiters:
        in_flight += admitted(await burst(limiter, alice, 10))
    assert len(lost) == 2 and len(in_flight) == 10  # each fallback's share, Redis away as far as they know
    with trio.fail_after(10):  # Redis answers again: each lost call is sent again, and answered
        while any(limiter.degraded or limiter.metrics.lease_calls.labels("take", "ok")._value.get() < 1
                  for limiter in limiters):
            await trio.sleep(0.05)
    for limiter in limiters * 2:
        in_flight += admitted(await burst(limiter, alice, 10))
        assert len(in_flight) == 10


async def test_redis_away_rate_limits_fall_back_to_a_share_and_budgets_close(nursery, private_redis, cluster_name,
                                                                             caplog):
    caplog.set_level(logging.INFO, "llmgw.tenancy")
    live = [4]
    limiter = await start_limiter(nursery, private_redis.url, cluster_name, "g1", live_processes=lambda: live[0])
    rated = tenant(Limits(rpm=100), "rated")
    budgeted = tenant(Limits(budgets=(Budget("total", tokens=1000),)), "budgeted")
    assert len(admitted(await burst(limiter, rated, 10))) == 10
    lease = await limiter.admit(budgeted, "m", Estimate(10, 0))
    assert not isinstance(lease, Refusal)
    lease.settle(None)  # its 10 stay in this process's lease
    await trio.sleep(limiter.tick * 2)  # it counted the live processes while Redis answered
    await private_redis.kill()
    live[0] = 1  # the peers' load reports come through Redis: they lapse with it
    with trio.fail_after(10):
        while not limiter.degraded:
            await trio.sleep(0.05)
    assert limiter.metrics.degraded._value.get() == 1
    await trio.sleep(limiter.tick * 2)
    assert len(admitted(await burst(limiter, rated, 50))) == 25  # the limit divided by the 4 live processes
    assert len(admitted(await burst(limiter, budgeted, 3, Estimate(5, 0)))) == 2  # only its lease in hand
    refused = await limiter.admit(budgeted, "m", Estimate(5, 0))
    assert refused.error_type == OUT_OF_QUOTA
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "tenant limits degraded" in r.message]
    assert len(warnings) == 1 and "divided by the 4 live processes" in warnings[0].message
    await private_redis.restart()
    with trio.fail_after(15):
        while limiter.degraded:
            await trio.sleep(0.05)
    assert limiter.metrics.degraded._value.get() == 0
    assert any("Redis answers again" in r.message for r in caplog.records)
    assert not isinstance(await limiter.admit(budgeted, "m", Estimate(5, 0)), Refusal)  # shared again


async def test_budgets_are_seeded_from_the_usage_store_and_again_when_redis_returns_empty(nursery, private_redis,
                                                                                          cluster_name):
    async def spent() -> list[Spent]:
        return [Spent("team", "ml", "day", tokens=990, nano_usd=0)]

    limiter = await start_limiter(nursery, private_redis.url, cluster_name, "g1", spent=spent)
    bob = tenant(Limits(), "bob", Team("ml", limits=Limits(budgets=(Budget("day", tokens=1000),))))
    assert isinstance(await limiter.admit(bob, "m", Estimate(6, 6)), Refusal)
    assert not isinstance(await limiter.admit(bob, "m", Estimate(5, 5)), Refusal)
    await private_redis.kill()
    await private_redis.restart()  # without persistence: the day's counter is gone (the link may not notice)
    with trio.fail_after(15):
        while limiter.degraded or limiter._reseed or not limiter.link.healthy:
            await limiter.admit(bob, "m", Estimate(1, 0))
            await trio.sleep(0.05)
    assert isinstance(await limiter.admit(bob, "m", Estimate(6, 6)), Refusal)  # 990 again, not 0


async def test_redis_away_budgets_open_when_configured_so(nursery, private_redis, cluster_name):
    settings = TenancySettings(budgets_fail_closed=False)
    limiter = await start_limiter(nursery, private_redis.url, cluster_name, "g1", settings)
    budgeted = tenant(Limits(budgets=(Budget("total", tokens=100),)), "budgeted")
    await private_redis.kill()
    with trio.fail_after(10):
        while not limiter.degraded:
            await limiter.admit(budgeted, "m", Estimate(1, 0))
            await trio.sleep(0.05)
    assert len(admitted(await burst(limiter, budgeted, 5, Estimate(100, 0)))) == 5


async def start_driver(nursery, redis_url: str, cluster: str, origin: str, go, *options: str):
    argv = [sys.executable, "-m", "llmgw.testing.limiter_driver", "--redis-url", redis_url, "--cluster", cluster,
            "--origin", origin, "--go-file", str(go), *options]
    return await start_child(nursery, argv, name=origin, ready=READY, stop_grace=2)


async def result_of(driver) -> dict:
    with trio.fail_after(20):
        while True:
            for line in driver.lines:
                if line.startswith("result "):
                    return json.loads(line.removeprefix("result "))
            await trio.sleep(0.05)


# Any interleaving of admits (alone or in bursts), settles (with any usage, or none) and pauses, over three
# limiters sharing one key through Redis, never admits more requests than the rpm bucket gave (its capacity plus
# its refill since the start), never has more in flight than the concurrency limit, and never admits more tokens
# than the tpm bucket gave plus what answers used beyond their reservations.
PROCESSES = 3
STEPS = st.lists(st.one_of(
    st.tuples(st.just("burst"), st.integers(0, PROCESSES - 1), st.integers(1, 12), st.integers(0, 400)),
    st.tuples(st.just("settle"), st.integers(0, 1000), st.one_of(st.none(), st.integers(0, 900)), st.just(0)),
    st.tuples(st.just("pause"), st.floats(0, 0.05), st.just(0), st.just(0)),
), min_size=1, max_size=25)


@hsettings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(STEPS, st.integers(1, 30), st.integers(100, 3000), st.integers(1, 6))
def test_no_interleaving_over_processes_admits_over_the_limits(redis_url, steps, rpm, tpm, concurrency):
    trio.run(_interleave, redis_url, steps, Limits(rpm=rpm, tpm=tpm, concurrency=concurrency))


async def _interleave(redis_url: str, steps: list, limits: Limits) -> None:
    cluster = "hyp-" + uuid.uuid4().hex[:12]
    settings = TenancySettings(lease_seconds=1.0)
    async with trio.open_nursery() as nursery:
        limiters = [await start_limiter(nursery, redis_url, cluster, f"p{i}", settings) for i in range(PROCESSES)]
        who = tenant(limits)
        started = time.monotonic()
        in_flight: list[tuple[object, int]] = []
        requests = tokens = over = 0
        for step, a, b, c in steps:
            if step == "burst":
                estimate = Estimate(prompt_tokens=c, max_output_tokens=0)
                for answer in admitted(await burst(limiters[a], who, b, estimate)):
                    in_flight.append((answer, c))
                    requests += 1
                    tokens += c
            elif step == "settle" and in_flight:
                answer, reserved = in_flight.pop(a % len(in_flight))
                answer.settle(None if b is None else Usage(prompt_tokens=0, completion_tokens=b))
                used = 0 if b is None else b
                tokens += used - reserved
                over += max(0, used - reserved)
            elif step == "pause":
                await trio.sleep(a)
            elapsed = time.monotonic() - started
            assert len(in_flight) <= limits.concurrency
            assert requests <= limits.rpm + elapsed * limits.rpm / 60
            assert tokens <= limits.tpm + elapsed * limits.tpm / 60 + over
        nursery.cancel_scope.cancel()


async def test_a_gateways_limiter_counts_its_load_peers_as_live_processes(nursery, redis_url, cluster_name):
    state = parse_config(state_section(redis_url, cluster_name)).state
    link = RedisLink(state, ClusterMetrics(None, "gateway", cluster_name, "g1"))
    shared = SimpleNamespace(link=link, settings=state, origin="g1", load=SimpleNamespace(peers={"g2": 0, "g3": 0}))
    limiter = cluster_limiter(shared, TenancySettings(), LimiterMetrics())  # type: ignore[arg-type]
    assert limiter.prefix == f"llmgw:{cluster_name}:tenancy:" and limiter.holder.startswith("g1:")
    assert limiter.live_processes() == 3

