"""What ``llmgw bench limits`` limits, and the llmgw gateways it limits there.

:class:`Plan` is the whole run's set of lanes: per repeat, one key (llmgw) or one model group (LiteLLM) per
scenario, each with the limit the scenario measures, so no run inherits another's counters. Every limit is a
whole number of this client's requests (each of :func:`~.limits_workloads.request_tokens` tokens and
:meth:`Plan.request_nano` nano-dollars), so an exact limiter admits exactly ``burst_limit`` of a burst.

:func:`open_llmgw` starts the llmgw arm on loopback (:class:`~.cluster_rig.ClusterRig`): a private
``redis-server``, simulators that answer in milliseconds and never limit, a control process and ``gateways - 1``
``--role gateway`` followers on that Redis (``state.secret_env`` set), each one process or ``llmgw serve
--workers W``, all with the plan's keys, limits, budgets and prices in their config. It yields a :class:`Fleet`,
which is what the workloads need of an arm: the gateways' URLs, the lanes, how many processes hold limiter state,
and the Redis to kill.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import httpx
import trio

from ..testing.redis import PrivateRedis
from ..testing.sims import MODEL
from .cluster_rig import ClusterRig
from .limits_workloads import BUCKET, Lane, prompt_tokens, request_tokens

# The scenarios, each with a lane of its own per repeat
RPM, TPM, CONCURRENCY, BUDGET = "rpm", "tpm", "concurrency", "budget"  # bursts
RPM_STEADY, TPM_STEADY, REDIS_KILL = "rpm-steady", "tpm-steady", "redis-kill"
FREE, LIMITED = "latency-free", "latency-limited"  # the same gateways without limits, and with every kind
SCENARIOS = (RPM, TPM, CONCURRENCY, BUDGET, RPM_STEADY, TPM_STEADY, REDIS_KILL, FREE, LIMITED)
UNREACHED = 10**12  # a limit the latency lane never reaches

# Prices in USD per million tokens (input, output): what money budgets count
PRICE_INPUT, PRICE_OUTPUT = Decimal("2"), Decimal("8")
# The simulators: fixed fast timing (a step of 1 ms, prefill at a million tokens/s) and outputs that always run to
# max_tokens, so usage is exact and a request of the concurrency lane lasts about `long_tokens` ms
SIM_EXTRA = ("--prefill-tokens-per-s", "1000000", "--decode-ms-per-step", "1", "--output-tokens", "4096:4096")


@dataclass(frozen=True)
class Plan:
    repeats: int = 3
    burst: int = 100  # requests sent at once per burst
    burst_limit: int = 50  # requests a burst's limit holds (rpm, tpm and budget lanes)
    concurrency: int = 10
    steady_limit: int = 120  # rpm (and tpm in requests) of the steady and Redis-kill lanes
    max_tokens: int = 16
    long_tokens: int = 1000  # max_tokens of the concurrency lane: ~1 s on the simulators

    @property
    def request_tokens(self) -> int:
        return request_tokens(self.max_tokens)

    @property
    def request_nano(self) -> int:
        """One request's cost in nano-dollars at :data:`PRICE_INPUT` / :data:`PRICE_OUTPUT`."""
        per_token_in, per_token_out = PRICE_INPUT * 1000, PRICE_OUTPUT * 1000  # nano-dollars per token
        return int(prompt_tokens() * per_token_in + self.max_tokens * per_token_out)

    def lane(self, scenario: str, repeat: int) -> Lane:
        return Lane(f"{scenario}-{repeat}", f"sk-bench-{scenario}-{repeat}")

    def limits(self, scenario: str) -> dict:
        """The lane's limits: ``rpm``, ``tpm``, ``concurrency``, ``budget_nano`` (total), each only where set."""
        burst, steady = self.burst_limit, self.steady_limit
        return {RPM: {"rpm": burst}, TPM: {"tpm": burst * self.request_tokens},
                CONCURRENCY: {"concurrency": self.concurrency}, BUDGET: {"budget_nano": burst * self.request_nano},
                RPM_STEADY: {"rpm": steady}, TPM_STEADY: {"tpm": steady * self.request_tokens},
                REDIS_KILL: {"rpm": steady}, FREE: {},
                LIMITED: {"rpm": UNREACHED, "tpm": UNREACHED, "concurrency": 10**6,
                          "budget_nano": 10**12}}[scenario]  # a thousand dollars

    def lanes(self) -> list[tuple[str, int, Lane]]:
        return [(scenario, repeat, self.lane(scenario, repeat))
                for repeat in range(self.repeats) for scenario in SCENARIOS]


def usd(nano: int) -> float:
    """Nano-dollars as the config's USD number (whole nano-dollars below 2**53 are exact in a float's repr)."""
    return nano / 10**9


def llmgw_tenancy_config(plan: Plan) -> str:
    """The config's ``api_keys`` (a key per lane, its limits and total budget) and ``prices`` (docs/tenants.md)."""
    keys = []
    for scenario, _repeat, lane in plan.lanes():
        entry: dict = {"key": lane.key, "name": lane.name}
        limits = plan.limits(scenario)
        rates = {name: limits[name] for name in ("rpm", "tpm", "concurrency") if name in limits}
        if rates:
            entry["limits"] = rates
        if "budget_nano" in limits:
            entry["budgets"] = [{"period": "total", "usd": usd(limits["budget_nano"])}]
        keys.append(entry)
    prices = [{"model": MODEL, "input": float(PRICE_INPUT), "cached_input": float(PRICE_INPUT),
               "output": float(PRICE_OUTPUT)}]
    # JSON is YAML: one line per entry keeps the file readable at a thousand keys
    return ("api_keys:\n" + "".join(f"  - {json.dumps(k)}\n" for k in keys)
            + "prices:\n" + "".join(f"  - {json.dumps(p)}\n" for p in prices))


@dataclass
class Fleet:
    """One arm as the workloads see it."""

    label: str
    kind: str  # the exact limiter its counts are judged against (limits_workloads.BUCKET or WINDOW)
    urls: list[str]  # each gateway's (instance's) base URL
    processes: int  # processes that each keep limiter state (gateways x workers)
    redis: PrivateRedis
    lanes: dict[str, Lane]
    measures: frozenset[str]  # the scenarios this arm has a limit for
    recovered: Callable[[], Awaitable[None]]  # returns once the arm works on Redis again after a restart
    notes: list[str] = field(default_factory=list)


async def _wait_not_degraded(rig: ClusterRig, timeout: float = 60.0) -> None:
    """Until every gateway's ``/health`` says its shared state is not degraded."""
    with trio.fail_after(timeout):
        for gateway in rig.gateways:
            while True:
                with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
                    state = (await rig.http.get(gateway.control_url + "/health")).json().get("state") or {}
                    if not state.get("degraded"):
                        break
                await trio.sleep(0.2)


@contextlib.asynccontextmanager
async def open_llmgw(workdir: Path, plan: Plan, gateways: int, workers: int = 1) -> AsyncIterator[Fleet]:
    workdir.mkdir(parents=True, exist_ok=True)
    # the arm's own control state: the usage journal is kept there, and one left by an earlier run (same cluster
    # name, same keys) would be shipped into this run's usage store, and seed its budgets as spent
    private = f"agents:\n  control_state_dir: {json.dumps(str(workdir / 'control-state'))}\n"
    async with ClusterRig.open(workdir, followers=gateways - 1, sims=2, time_scale=1.0, sim_extra=SIM_EXTRA,
                               extra_config=llmgw_tenancy_config(plan) + private, workers=workers) as rig:
        label = f"llmgw N={gateways}" + (f" x{workers} workers" if workers > 1 else "")
        yield Fleet(label, BUCKET, [g.url for g in rig.gateways], gateways * workers, rig.redis,
                    {lane.name: lane for _, _, lane in plan.lanes()}, frozenset(SCENARIOS),
                    lambda: _wait_not_degraded(rig))
