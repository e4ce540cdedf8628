"""The runbook's "Rotate the cluster secret" (docs/runbook.md), with real processes on one Redis.

llmgw signs every record in Redis with one secret (``state.secret_env``) and accepts only records signed with it, so
the candidates cannot change it one at a time: one signing with the new secret would take a lease the other calls
forged. The runbook's steps: stop every candidate, start them with the new secret, then restart the ``--role
gateway`` processes one by one (each routes on its last view until then). What that costs today, asserted here so
that the runbook cannot drift from it:

- static replicas keep serving throughout: no request fails;
- every deployed engine is started again once (its placement proof is keyed by the old secret), and its requests
  fail meanwhile; the node identities in Redis are refused too: the agent is known again when the new leader is the
  candidate that admitted it (its own identity store), else it joins again with the join token it holds;
- keys and teams made by the admin API are refused (signed with the old secret) and their names stay taken until
  their records are deleted from Redis; with ``tenancy.require_keys: true`` that refuses their clients (401) rather
  than opening ``/v1`` to everyone.
"""

from __future__ import annotations

import signal
from pathlib import Path

import coredis
import httpx
import pytest
import trio

from llmgw.bench.fault_load import LoadSettings, SteadyLoad
from llmgw.testing.ha import HaCluster
from llmgw.testing.metrics import scrape_value
from llmgw.testing.processes import CLUSTER_SECRET_ENV, Child

pytestmark = pytest.mark.slow

LOAD = LoadSettings(concurrency=6, rate=15, stream_every=3, max_tokens=16)
STEP_AFTER = 15  # requests that must end after a step
NEW_SECRET = "the new cluster secret, from openssl rand -hex 32"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_a_secret_rotation_brings_the_cluster_back_whole_but_restarts_deployed_engines(
        ha_cluster: HaCluster, monkeypatch):
    ha = ha_cluster
    a, b = ha.candidates
    engines = ha.engine_pids()
    load = SteadyLoad([p.data_url for p in ha.gateways], LOAD)
    async with load.running():
        await load.wait_finished(STEP_AFTER)
        load.phase = "rotation"
        await rotate_candidates(ha, load, monkeypatch)
        await ha.restart(ha.gateway, load, "--role", "gateway")
        await ha.wait_routable(timeout=40)
        # One leader, every process following it, the agent connected to it with the ledger's engines.
        print(f"the cluster whole again {await ha.wait_converged(timeout=20):.2f} s after F's restart")
        load.phase = "after"
        await load.wait_finished(3 * STEP_AFTER)
        await load.pause()
    ha.write_logs(ha.agent_state.parent / "logs")
    for phase, counts in load.phases.items():
        print(f"{phase}: {counts.as_dict()}")
    after = load.phases["after"]
    assert not after.failed("plain") and not after.failed("stream"), after.as_dict()
    restarted = ha.engine_pids()
    # The runbook says every deployed engine starts again once: change it with this line.
    assert set(restarted) == set(engines) and all(restarted[r][0] != engines[r][0] for r in engines), (
        engines, restarted)


async def rotate_candidates(ha: HaCluster, load: SteadyLoad, monkeypatch) -> None:
    """Every candidate stopped (SIGTERM) and started with the new secret; the balancer sends to F meanwhile."""
    candidates = ha.candidates
    load.data_urls = [ha.gateway.data_url]
    for process in candidates:
        assert process.serve is not None
        process.serve.kill(signal.SIGTERM)
    for process in candidates:
        assert process.serve is not None
        assert await process.serve.wait_exit(timeout=40) == 0, process.serve.output()
    monkeypatch.setenv(CLUSTER_SECRET_ENV, NEW_SECRET)
    started = trio.current_time()
    async with trio.open_nursery() as starting:
        for process in candidates:
            starting.start_soon(process.start_serve)
    await ha.wait_leader(timeout=30)
    print(f"\na leader under the new secret {trio.current_time() - started:.2f} s after the candidates' start")
    for process in candidates:
        await ha.wait_ready(process)
    load.data_urls = [p.data_url for p in ha.gateways]


async def test_static_replicas_serve_throughout_and_api_keys_are_made_again(shared_cluster, start_llmgw,
                                                                            redis_url, cluster_name, monkeypatch):
    _, control, (follower,) = await shared_cluster(routing="round_robin")
    config = Path(control.argv[control.argv.index("--config") + 1]).read_text()
    load = SteadyLoad([control.url, follower.url], LOAD)
    async with load.running():
        await load.wait_finished(STEP_AFTER)
        load.phase = "rotation"
        load.data_urls = [follower.url]  # the balancer's health check took the stopped control process out
        await control.stop()
        monkeypatch.setenv(CLUSTER_SECRET_ENV, NEW_SECRET)
        control = await start_llmgw(config)
        load.data_urls = [control.url, follower.url]
        await load.wait_finished(STEP_AFTER)
        load.data_urls = [control.url]
        await follower.stop()
        follower = await start_llmgw(config, "--role", "gateway")
        load.data_urls = [control.url, follower.url]
        await load.wait_finished(STEP_AFTER)
        await load.pause()
    for phase, counts in load.phases.items():
        print(f"{phase}: {counts.as_dict()}")
    assert not any(counts.failed("plain") or counts.failed("stream") for counts in load.phases.values()), {
        phase: counts.as_dict() for phase, counts in load.phases.items()}
    # The load ran keyless (no key existed yet); from here on /v1 needs one.

    async with httpx.AsyncClient(timeout=10) as http:
        key = await make_key(http, control, "app")
        assert await chat(http, follower, key) == 200
        # The next rotation: the same steps, back to the first secret.
        await follower.stop()
        await control.stop()
        monkeypatch.delenv(CLUSTER_SECRET_ENV)
        config += "tenancy: {require_keys: true}\n"  # the runbook's first hour, for keys made by the API
        control = await start_llmgw(config)
        follower = await start_llmgw(config, "--role", "gateway")
        for gateway in (control, follower):
            assert await chat(http, gateway, key) == 401, "a key signed with the old secret was admitted"
            assert await chat(http, gateway, None) == 401, "/v1 opened: tenancy.require_keys did not hold"
            refused = await scrape_value(gateway.control_url, "llmgw_tenant_refused_records_total", 'kind="key"')
            assert refused is not None and refused >= 1
        taken = await http.post(control.control_url + "/admin/keys", json={"name": "app"})
        assert (taken.status_code, taken.json()["error"]["code"]) == (409, "key_name_taken")
        # The runbook: delete the old records, make the keys again.
        prefix = f"llmgw:{cluster_name}:tenancy:"
        async with coredis.Redis.from_url(redis_url) as redis:
            await redis.delete([prefix + name for name in ("keys", "teams", "key_names")])
        key = await make_key(http, control, "app")
        assert await chat(http, control, key) == 200

        async def followed() -> bool:
            return await chat(http, follower, key) == 200

        with trio.fail_after(5):
            while not await followed():
                await trio.sleep(0.05)


async def make_key(http: httpx.AsyncClient, gateway: Child, name: str) -> str:
    made = await http.post(gateway.control_url + "/admin/keys", json={"name": name})
    assert made.status_code == 201, made.text
    return made.json()["key"]


async def chat(http: httpx.AsyncClient, gateway: Child, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return (await http.post(gateway.url + "/v1/chat/completions", json=CHAT, headers=headers)).status_code
