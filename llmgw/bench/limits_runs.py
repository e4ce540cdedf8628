"""One repeat of ``llmgw bench limits`` on one arm: every scenario of the :class:`~.limits_rig.Plan`, measured.

:func:`run_repeat`, in order, each on the repeat's own lanes: a burst per limit (rpm, tpm, budget, concurrency);
the steady rpm and tpm lanes at once (a burst of the limit first, which spends it, then open-loop load at
``overload`` times the limit for ``steady_seconds``); the added latency (a closed loop alternating the unlimited
and the limited lane). :func:`run_redis_kill`, once every repeat ran (so no repeat's limits run on a Redis just
restarted): the steady load on its lane, Redis killed with SIGKILL ``before`` seconds in, started again, empty,
``away`` seconds later, the load going on ``after`` seconds more, after which the arm is given time to work on
Redis again (:attr:`~.limits_rig.Fleet.recovered`). What each returns is plain JSON (:mod:`.limits_report`
reads it).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import trio

from .limits_rig import (
    BUDGET,
    CONCURRENCY,
    FREE,
    LIMITED,
    REDIS_KILL,
    RPM,
    RPM_STEADY,
    TPM,
    TPM_STEADY,
    Fleet,
    Plan,
)
from .limits_workloads import (
    Answer,
    Client,
    Lane,
    burst,
    closed_loop,
    count,
    count_in,
    decided,
    expected,
    fits,
    latency_ms,
    most_in_flight,
    steady,
)


@dataclass(frozen=True)
class Timing:
    steady_seconds: float = 60.0
    overload: float = 1.2  # steady load as a multiple of the limit
    redis_before: float = 5.0
    redis_away: float = 10.0
    redis_after: float = 10.0
    latency_requests: int = 200  # per lane
    latency_concurrency: int = 4


async def run_repeat(fleet: Fleet, client: Client, plan: Plan, timing: Timing, repeat: int) -> dict:
    result: dict = {}

    def lane(scenario: str) -> Lane:
        return fleet.lanes[plan.lane(scenario, repeat).name]

    for scenario in (RPM, TPM, BUDGET, CONCURRENCY):
        if scenario in fleet.measures:
            result[scenario] = await _burst(fleet, client, plan, scenario, lane(scenario))
    steadies = [s for s in (RPM_STEADY, TPM_STEADY) if s in fleet.measures]
    async with trio.open_nursery() as nursery:
        for scenario in steadies:
            async def one(scenario: str = scenario) -> None:
                result[scenario] = await _steady(fleet, client, plan, timing, scenario, lane(scenario))
            nursery.start_soon(one)
    answered = await closed_loop(client, [lane(FREE), lane(LIMITED)], timing.latency_requests,
                                  timing.latency_concurrency, plan.max_tokens)
    free, limited = latency_ms(answered[lane(FREE).name]), latency_ms(answered[lane(LIMITED).name])
    result["latency"] = {"free": free, "limited": limited,
                         "added_p50_ms": limited["p50_ms"] - free["p50_ms"],
                         "added_p99_ms": limited["p99_ms"] - free["p99_ms"]}
    return result


async def run_redis_kill(fleet: Fleet, client: Client, plan: Plan, timing: Timing, repeat: int) -> dict:
    """The Redis kill of one repeat, on its own lane; the arm given time to work on Redis again after it."""
    return await _redis_kill(fleet, client, plan, timing, fleet.lanes[plan.lane(REDIS_KILL, repeat).name])


def _requests_limit(plan: Plan, scenario: str) -> int:
    """The lane's limit in this client's requests (an rpm, or a tpm over one request's tokens)."""
    limits = plan.limits(scenario)
    return limits["rpm"] if "rpm" in limits else limits["tpm"] // plan.request_tokens


async def _burst(fleet: Fleet, client: Client, plan: Plan, scenario: str, lane: Lane) -> dict:
    max_tokens = plan.long_tokens if scenario == CONCURRENCY else plan.max_tokens
    answers = await burst(client, lane, plan.burst, max_tokens)
    limits = plan.limits(scenario)
    sends = decided(answers)
    if scenario == RPM:
        admits = expected(fleet.kind, limits["rpm"], sends)
    elif scenario == TPM:
        admits = expected(fleet.kind, limits["tpm"], sends, cost=plan.request_tokens)
    else:
        holds = plan.concurrency if scenario == CONCURRENCY else fits(limits["budget_nano"], plan.request_nano)
        admits = [i < holds for i in range(len(answers))]
    counted = count(answers, admits)
    out = {**counted.as_dict(), "processes": fleet.processes}
    admitted = [a for a in answers if a.admitted]
    if scenario == TPM:
        tokens = sum(a.tokens or plan.request_tokens for a in admitted)
        exact = counted.expected * plan.request_tokens  # the limit, and what refilled while the burst was read
        out.update(tokens_admitted=tokens, tokens_limit=limits["tpm"], tokens_expected=exact,
                   tokens_over=max(0, tokens - exact))
    if scenario == BUDGET:
        nano = len(admitted) * plan.request_nano
        out.update(nano_admitted=nano, nano_budget=limits["budget_nano"],
                   nano_over=max(0, nano - limits["budget_nano"]))
    if scenario == CONCURRENCY:
        out["most_in_flight"] = most_in_flight(answers)
    return out


async def _load(client: Client, plan: Plan, timing: Timing, scenario: str, lane: Lane, seconds: float,
                started: trio.Event | None = None) -> tuple[list[Answer], float]:
    """A burst of the lane's limit (which spends it), then open-loop load at ``overload`` times the limit for
    ``seconds`` (``started`` set as it begins); the answers of both in sending order, and when the open loop
    started."""
    per_minute = _requests_limit(plan, scenario)
    first = await burst(client, lane, per_minute, plan.max_tokens)
    start = time.time()
    if started is not None:
        started.set()
    rest = await steady(client, lane, timing.overload * per_minute / 60.0, seconds, plan.max_tokens)
    return first + rest, start


def _admits(fleet: Fleet, plan: Plan, scenario: str, answers: list[Answer]) -> list[bool]:
    limits = plan.limits(scenario)
    sends = decided(answers)
    if "tpm" in limits:
        return expected(fleet.kind, limits["tpm"], sends, cost=plan.request_tokens)
    return expected(fleet.kind, limits["rpm"], sends)


async def _steady(fleet: Fleet, client: Client, plan: Plan, timing: Timing, scenario: str, lane: Lane) -> dict:
    answers, start = await _load(client, plan, timing, scenario, lane, timing.steady_seconds)
    counted = count_in(answers, _admits(fleet, plan, scenario, answers), start, float("inf"))
    return {**counted.as_dict(), "seconds": timing.steady_seconds, "processes": fleet.processes}


async def _redis_kill(fleet: Fleet, client: Client, plan: Plan, timing: Timing, lane: Lane) -> dict:
    marks: dict[str, float] = {}
    started = trio.Event()

    async def fault() -> None:
        await started.wait()
        await trio.sleep(timing.redis_before)
        marks["killed"] = time.time()
        await fleet.redis.kill(signal.SIGKILL)
        await trio.sleep(timing.redis_away)
        await fleet.redis.restart()
        marks["back"] = time.time()

    seconds = timing.redis_before + timing.redis_away + timing.redis_after
    loaded: list[tuple[list[Answer], float]] = []

    async def load() -> None:
        loaded.append(await _load(client, plan, timing, REDIS_KILL, lane, seconds, started))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(load)
        await fault()
    ((answers, start),) = loaded
    admits = _admits(fleet, plan, REDIS_KILL, answers)
    killed, back = marks.get("killed", float("inf")), marks.get("back", float("inf"))
    await fleet.recovered()
    return {"before": count_in(answers, admits, start, killed).as_dict(),
            "away": count_in(answers, admits, killed, back).as_dict(),
            "after": count_in(answers, admits, back, float("inf")).as_dict(),
            "away_s": back - killed, "processes": fleet.processes}
