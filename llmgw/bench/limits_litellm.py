"""The peer of ``llmgw bench limits``: LiteLLM's proxy as N instances on one Redis, over the same simulators.

LiteLLM (PyPI ``litellm[proxy]``, :data:`LITELLM_VERSION`) is installed by the benchmark into a virtual
environment of its own, ``~/.cache/llmgw/litellm-VERSION`` (:func:`ensure_litellm`), never into the project's
``.venv``, and never under CI (``CI`` set: the arm is left out, saying so).

Its limits per key and its key budgets need its Postgres database; what runs without one is the router's: each
lane of the :class:`~.limits_rig.Plan` is a model group of one deployment (one simulator) with the lane's
``rpm``/``tpm`` in its ``litellm_params``, enforced by ``router_settings.optional_pre_call_checks:
[enforce_model_rate_limits]`` and shared across the instances through ``router_settings.redis_host``/``redis_port``
(per calendar minute: judged against :data:`~.limits_workloads.WINDOW`), and the money budget as the deployment's
``max_budget`` over ``budget_duration`` at the same prices (``input_cost_per_token``/``output_cost_per_token``),
kept in the same Redis. Its concurrency bound (a deployment's ``max_parallel_requests``) queues inside each
instance instead of refusing: that lane is not measured. Cooldowns and retries are off, so each request is
answered by the limit alone. ``LITELLM_LOCAL_MODEL_COST_MAP=True`` keeps it off the network at start. After a
Redis restart the arm waits out its Redis client's circuit breaker (:data:`BREAKER_RECOVERY`) before the next
kill. Several
workers per instance run under gunicorn (``--run_gunicorn --num_workers W``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from ..testing.processes import free_port, start_child
from ..testing.redis import start_private_redis
from ..testing.sims import MODEL, start_sims
from .limits_rig import CONCURRENCY, PRICE_INPUT, PRICE_OUTPUT, SCENARIOS, SIM_EXTRA, Fleet, Plan
from .limits_workloads import WINDOW, Lane

LITELLM_VERSION = "1.108.5"  # the newest whose [proxy] extra resolves from PyPI as mirrored here (2026-12-07)
STARTUP_TIMEOUT = 180.0
BREAKER_RECOVERY = 60.0  # litellm.constants.REDIS_CIRCUIT_BREAKER_RECOVERY_TIMEOUT (its default)
NOT_MEASURED = frozenset({CONCURRENCY})
# every lane's key: without a database the master key is the only one
MASTER_KEY = "sk-bench-litellm-2f6c0e9b4d8a41c7b3e5f1a09d7c6b2e"


class LitellmUnavailable(RuntimeError):
    """LiteLLM is not installed and may not be installed here (CI), or its install failed."""


def venv_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "llmgw" / f"litellm-{LITELLM_VERSION}"


async def ensure_litellm() -> Path:
    """The ``litellm`` command of :func:`venv_dir`, installed there first when missing (a few minutes)."""
    venv = venv_dir()
    command = venv / "bin" / "litellm"
    if command.exists():
        return command
    if os.environ.get("CI"):
        raise LitellmUnavailable(f"LiteLLM is not installed in {venv} and the benchmark installs nothing under CI")
    print(f"installing litellm[proxy]=={LITELLM_VERSION} into {venv} (once)", file=sys.stderr, flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(venv / "bin" / "pip"), "install", "--quiet", f"litellm[proxy]=={LITELLM_VERSION}"]]
    for step in steps:
        done = await trio.run_process(step, check=False, capture_stdout=True, capture_stderr=True)
        if done.returncode != 0:
            raise LitellmUnavailable(f"{' '.join(step)} failed:\n{done.stderr.decode(errors='replace')[-2000:]}")
    if not command.exists():
        raise LitellmUnavailable(f"the install left no {command}")
    return command


def litellm_config(plan: Plan, sim_urls: list[str], redis_port: int) -> str:
    """The proxy's config: a model group per measured lane (see the module's docstring), Redis shared."""
    per_token_in, per_token_out = float(PRICE_INPUT) / 1e6, float(PRICE_OUTPUT) / 1e6
    lines = ["model_list:"]
    for i, (scenario, _repeat, lane) in enumerate(plan.lanes()):
        if scenario in NOT_MEASURED:
            continue
        limits = plan.limits(scenario)
        params = [f"model: openai/{MODEL}", f"api_base: {sim_urls[i % len(sim_urls)]}/v1", "api_key: none",
                  f"input_cost_per_token: {per_token_in:.12f}", f"output_cost_per_token: {per_token_out:.12f}"]
        params += [f"{name}: {limits[name]}" for name in ("rpm", "tpm") if name in limits]
        if "budget_nano" in limits:
            params += [f"max_budget: {limits['budget_nano'] / 1e9:.9f}", "budget_duration: 30d"]
        lines += [f"  - model_name: {lane.name}", "    litellm_params:", *(f"      {p}" for p in params)]
    lines += ["router_settings:", "  routing_strategy: simple-shuffle", "  redis_host: 127.0.0.1",
              f"  redis_port: {redis_port}", "  optional_pre_call_checks: [enforce_model_rate_limits]",
              "  num_retries: 0", "  disable_cooldowns: true",
              "litellm_settings:", "  num_retries: 0", "  request_timeout: 60", "  telemetry: false",
              "general_settings:", f"  master_key: {MASTER_KEY}"]
    return "\n".join(lines) + "\n"


def lanes_of(plan: Plan) -> dict[str, Lane]:
    """The lanes as LiteLLM's client sends them: the lane's name is the model group's."""
    return {lane.name: Lane(lane.name, MASTER_KEY, lane.name) for _, _, lane in plan.lanes()}


@contextlib.asynccontextmanager
async def open_litellm(workdir: Path, plan: Plan, instances: int, workers: int = 1) -> AsyncIterator[Fleet]:
    """Simulators as :func:`~.limits_rig.open_llmgw` runs them, a private ``redis-server``, and ``instances``
    ``litellm`` proxies (each ``--num_workers workers``) on it, ready; stopped when the block ends."""
    command = await ensure_litellm()
    workdir.mkdir(parents=True, exist_ok=True)
    async with trio.open_nursery() as nursery:
        redis = await start_private_redis(nursery, workdir / "redis")
        sims = await start_sims(nursery, 2, num_blocks=2048, time_scale=1.0, seed=0, extra=SIM_EXTRA)
        config = workdir / "litellm.yaml"
        config.write_text(litellm_config(plan, [s.url for s in sims], redis.port))
        env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
               "LITELLM_TELEMETRY": "False", "DISABLE_SCHEMA_UPDATE": "True"}
        urls: list[str] = [""] * instances

        async def start(i: int) -> None:
            port = free_port()
            urls[i] = f"http://127.0.0.1:{port}"
            # several workers under uvicorn die at start without a word (1.108.5, here): gunicorn runs them
            server = ["--num_workers", str(workers), "--run_gunicorn"] if workers > 1 else []
            await start_child(nursery, [str(command), "--config", str(config), "--host", "127.0.0.1",
                                        "--port", str(port), *server],
                              name=f"litellm-{i}", ready=None, health_url=urls[i] + "/health/liveliness",
                              env=env, startup_timeout=STARTUP_TIMEOUT, stop_grace=2,
                              output_file=workdir / f"litellm-{i}.log")

        async with trio.open_nursery() as starting:
            for i in range(instances):
                starting.start_soon(start, i)
        label = f"LiteLLM N={instances}" + (f" x{workers} workers" if workers > 1 else "")

        async def recovered() -> None:
            # its Redis client opens a circuit breaker after 5 failures and tries Redis again only after
            # REDIS_CIRCUIT_BREAKER_RECOVERY_TIMEOUT (60 s): the next kill starts from a LiteLLM on Redis again
            await trio.sleep(BREAKER_RECOVERY + 5.0)

        try:
            yield Fleet(label, WINDOW, urls, instances * workers, redis, lanes_of(plan),
                        frozenset(SCENARIOS) - NOT_MEASURED, recovered,
                        notes=[f"LiteLLM {LITELLM_VERSION}: router deployment limits (no database)"])
        finally:
            nursery.cancel_scope.cancel()
