"""Gateways sharing state through Redis, as child processes: a control ``llmgw serve`` and ``--role gateway`` followers
routing one model with the ``kv_index`` tier over simulators with KV events (docs/testing.md)."""

from __future__ import annotations

from typing import Awaitable, Callable, Sequence

import httpx
import trio

from .processes import CLUSTER_SECRET_ENV, Child
from .redis import SENTINEL_SERVICE
from .sims import KV_SIM_ENV, KV_SIM_EXTRA, gateway_config, kv_sources, start_sims

StartServe = Callable[..., Awaitable[Child]]  # (config text, *extra argv) -> a running `llmgw serve`


def state_section(redis_url: str, cluster: str, **options: str) -> str:
    """The config's ``state:`` section for gateways of ``cluster`` sharing state through the Redis at
    ``redis_url``, or behind the sentinel of a :class:`~.redis.SentinelGroup` (its ``url``, ``sentinel:PORT``),
    signed with the secret every child of :mod:`.processes` has (``CLUSTER_SECRET_ENV``); ``options``: more
    ``state`` keys (``snapshot_interval="1s"``...; an empty one is left out: ``secret_env=""`` for a baseline
    checkout that runs without a secret)."""
    options.setdefault("secret_env", CLUSTER_SECRET_ENV)
    options = {key: value for key, value in options.items() if value}
    if redis_url.startswith("sentinel:"):
        where = (f"  sentinel:\n    service: {SENTINEL_SERVICE}\n"
                 f"    addresses: [\"127.0.0.1:{redis_url.removeprefix('sentinel:')}\"]\n")
    else:
        where = f"  url: {redis_url}\n"
    return f"state:\n  backend: redis\n{where}  cluster: {cluster}\n" + "".join(
        f"  {key}: {value}\n" for key, value in options.items())


def cluster_config(sims: Sequence[Child], redis_url: str, cluster: str, routing: str = "kv_index",
                   state: str = "", routing_options: dict | None = None) -> str:
    """The config every process of the cluster runs (:func:`state_section`'s ``redis_url``); ``state``: more
    ``state:`` keys (YAML lines indented by 2); ``routing_options``: more of the tier's options."""
    options = {"tokenize_timeout": "2s"} if routing == "kv_index" else {}
    options.update(routing_options or {})
    return gateway_config([s.url for s in sims], routing=routing, routing_options=options,
                          kv_sources=[kv_sources(s) for s in sims] if routing == "kv_index" else None) + (
        state_section(redis_url, cluster, snapshot_interval="1s") + state)


async def start_cluster(nursery: trio.Nursery, start_serve: StartServe, redis_url: str, cluster: str, *,
                        followers: int = 1, sims: int = 2, time_scale: float = 0, sim_extra: Sequence[str] = (),
                        state: str = "", env: dict[str, str] | None = None, routing: str = "kv_index",
                        routing_options: dict | None = None,
                        sim_env: dict[str, str] | None = KV_SIM_ENV) -> tuple[list[Child], Child, list[Child]]:
    """``(simulators, control, followers)``, every gateway's KV index healthy for every simulator.

    ``start_serve(config_text, *argv, env=...)`` starts one ``llmgw serve`` (the tests' ``start_llmgw`` fixture);
    ``env``: added to every gateway's environment (e.g. the variable ``state.secret_env`` names); ``sim_env``: to
    the simulators' (None: a stock engine's, no ``PYTHONHASHSEED`` of ours).
    """
    engines = await start_sims(nursery, sims, env=sim_env, num_blocks=512, block_size=16, time_scale=time_scale,
                               seed=0, extra=KV_SIM_EXTRA + tuple(sim_extra))
    config = cluster_config(engines, redis_url, cluster, routing=routing, state=state,
                            routing_options=routing_options)
    control = await start_serve(config, env=env)
    gateways = [await start_serve(config, "--role", "gateway", env=env) for _ in range(followers)]
    for gateway in [control, *gateways]:
        if routing == "kv_index":
            await wait_kv_healthy(gateway.control_url, sims)
        else:
            await wait_replicas(gateway.control_url, sims)
    return engines, control, gateways


async def wait_kv_healthy(control_url: str, replicas: int, timeout: float = 20.0) -> None:
    """Until the gateway lists ``replicas`` replicas, each with a healthy KV index."""
    async with httpx.AsyncClient(timeout=5) as http:
        with trio.fail_after(timeout):
            while True:
                kv = (await http.get(control_url + "/admin/kv")).json()["replicas"]
                listed = (await http.get(control_url + "/admin/replicas")).json()
                if len(listed) == replicas and sum(r["state"] == "healthy" for r in kv) == replicas:
                    return
                await trio.sleep(0.1)


async def wait_replicas(control_url: str, count: int, timeout: float = 20.0) -> None:
    """Until the gateway lists at least ``count`` replicas."""
    async with httpx.AsyncClient(timeout=5) as http:
        with trio.fail_after(timeout):
            while len((await http.get(control_url + "/admin/replicas")).json()) < count:
                await trio.sleep(0.1)
