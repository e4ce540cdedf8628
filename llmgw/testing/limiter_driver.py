"""A process that runs a :class:`~llmgw.tenancy.redis_limiter.RedisLimiter` and bursts admits of one key, for the
tests (and benchmarks) that need several real processes sharing limits through a real Redis.

``python -m llmgw.testing.limiter_driver --redis-url URL --cluster C --rpm 100 --burst 100 --go-file F``: it
prints ``limiter driver ready`` once its limiter runs, waits until ``F`` exists (so that every driver's burst
starts together), sends ``--burst`` admits at once, prints ``result {"admitted": N, "refused": M}``, keeps the
admitted requests unsettled for ``--hold`` seconds (``inf``: until killed), settles them with no usage, gives
its leases back and exits.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import trio

from ..cluster.link import RedisLink
from ..cluster.metrics import ClusterMetrics
from ..config.loading import parse_config
from ..tenancy.interfaces import Refusal
from ..tenancy.model import Budget, Estimate, Limits, TenancySettings, Tenant
from ..tenancy.redis_limiter import RedisLimiter
from .shared_state import state_section

READY = "limiter driver ready"


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="limiter_driver")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--origin", default="driver")
    parser.add_argument("--key", default="k-driver")
    parser.add_argument("--rpm", type=int)
    parser.add_argument("--tpm", type=int)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--budget-tokens", type=int, help="a total budget of this many tokens")
    parser.add_argument("--tokens", type=int, default=10, help="each request's estimate (prompt tokens)")
    parser.add_argument("--burst", type=int, default=100)
    parser.add_argument("--go-file", type=Path, required=True)
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--holder-ttl", type=float, default=5.0)
    return parser.parse_args(argv)


async def drive(args: argparse.Namespace) -> None:
    settings = parse_config(state_section(args.redis_url, args.cluster, timeout="2s")).state
    link = RedisLink(settings, ClusterMetrics(None, "gateway", args.cluster, args.origin))
    budgets = () if args.budget_tokens is None else (Budget("total", tokens=args.budget_tokens),)
    tenant = Tenant(key_id=args.key, name=args.key, limits=Limits(rpm=args.rpm, tpm=args.tpm,
                                                                    concurrency=args.concurrency, budgets=budgets))
    estimate = Estimate(prompt_tokens=args.tokens, max_output_tokens=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run)
        limiter = RedisLimiter(TenancySettings(), link, args.cluster, args.origin, holder_ttl=args.holder_ttl)
        await nursery.start(limiter.run)
        print(READY, flush=True)
        while not args.go_file.exists():
            await trio.sleep(0.01)
        answers: list = []

        async def one() -> None:
            answers.append(await limiter.admit(tenant, "m", estimate))

        async with trio.open_nursery() as burst:
            for _ in range(args.burst):
                burst.start_soon(one)
        admitted = [answer for answer in answers if not isinstance(answer, Refusal)]
        print("result " + json.dumps({"admitted": len(admitted), "refused": len(answers) - len(admitted),
                                      "degraded": limiter.degraded}), flush=True)
        await trio.sleep(math.inf if math.isinf(args.hold) else args.hold)
        for answer in admitted:
            answer.settle(None)
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> None:
    trio.run(drive, arguments(argv))
    sys.exit(0)


if __name__ == "__main__":
    main()
