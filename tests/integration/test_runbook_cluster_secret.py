"""The runbook's "Rotate the cluster secret" (docs/runbook.md), step by step, under a steady load, in the production
topology of :mod:`llmgw.testing.ha`: candidates A (leading) and B, a ``--role gateway`` F, a remote ``llmgw agent
--join A,B`` running two simulator engines, one Redis.

The rolling two-key rotation, each step a rolling restart of F, B, then A (as the upgrade's; the leader last, so
its lease passes once per step):

1. every process with ``secret_env: OLD, previous_secret_env: NEW`` (accepts both, signs with OLD);
2. every process with ``secret_env: NEW, previous_secret_env: OLD`` (signs with NEW, accepts OLD): the leader of
   the last term writes the node identities again and issues the engines new placement proofs, and re-signs the
   keys and teams of the admin API;
3. until every process reads no record that only OLD signed (``llmgw_tenant_previous_secret_records`` and
   ``llmgw_cluster_previous_secret_nodes`` at 0);
4. every process with ``secret_env: NEW`` alone.

The load itself runs with a key made by the admin API before the rotation (signed with OLD), so a key refused at
any step fails requests; a second key is made through F half way through step 2 (signed with NEW while the
leader still signs with OLD). What the runbook promises, asserted: not one request failed, streamed or not; the
engines were neither restarted nor replaced (the same pids: a new leader adopts them, its proofs being issued
anew); both keys still admitted everywhere once OLD is gone.
"""

from __future__ import annotations

import json
from functools import partial

import httpx
import pytest
import trio

from llmgw.bench.fault_load import LoadSettings, SteadyLoad
from llmgw.testing.cluster import Cluster
from llmgw.testing.ha import LEASE_TTL, HaCluster
from llmgw.testing.metrics import scrape_value
from llmgw.testing.processes import CLUSTER_SECRET, CLUSTER_SECRET_ENV

pytestmark = pytest.mark.slow

LOAD = LoadSettings(concurrency=6, rate=15, stream_every=3, max_tokens=16)
STEP_AFTER = 15  # requests that must end between two steps, with every gateway back in the rotation
PREVIOUS_ENV = "LLMGW_TEST_PREVIOUS_CLUSTER_SECRET"
OLD, NEW = CLUSTER_SECRET, "the new cluster secret, from openssl rand -hex 32"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_a_rolling_secret_rotation_fails_no_request_and_restarts_no_engine(ha_cluster: HaCluster, monkeypatch):
    ha = ha_cluster
    a, b = ha.candidates
    f = ha.gateway
    engines, proofs = ha.engine_pids(), placement_proofs(ha)
    assert len(engines) == ha.replicas and all(proofs.values()), proofs
    first_key = await make_key(ha.http, a, "app")
    load = SteadyLoad([p.data_url for p in ha.gateways], LoadSettings(**{**vars(LOAD), "api_key": first_key}))
    started = trio.current_time()
    async with load.running():
        await load.wait_finished(STEP_AFTER)

        load.phase = "1: OLD, previous NEW"
        use_secrets(ha, monkeypatch, OLD, NEW)
        await rolling_restart(ha, load)
        print(f"\nstep 1 done {trio.current_time() - started:.1f} s in")

        load.phase = "2: NEW, previous OLD"
        use_secrets(ha, monkeypatch, NEW, OLD)
        await ha.restart(f, load, "--role", "gateway")
        second_key = await make_key(ha.http, f, "made-during-the-rotation")  # signed NEW; the leader signs OLD
        await rolling_restart(ha, load, skip=f)
        print(f"step 2 done {trio.current_time() - started:.1f} s in")

        load.phase = "3: re-signed"
        waited = await wait_resigned(ha)
        renewed = placement_proofs(ha)
        assert all(renewed[r] != proofs[r] for r in proofs), "a placement proof was not issued anew"
        print(f"step 3: every record re-signed {waited:.2f} s after step 2")

        load.phase = "4: NEW alone"
        use_secrets(ha, monkeypatch, NEW, None)
        await rolling_restart(ha, load)
        print(f"step 4 done {trio.current_time() - started:.1f} s in")
        await load.wait_finished(STEP_AFTER)
        await load.pause()
    failed = ha.load_outcome(load)
    restarted = ha.engine_pids()
    print(f"engines before {engines}, after {restarted}")
    assert not failed, f"requests failed during the rotation: {failed}"
    assert restarted == engines, "an engine was restarted or replaced"
    for gateway in ha.gateways:
        for key in (first_key, second_key):
            assert await chat(ha.http, gateway, key) == 200, f"a key made by the admin API was lost at {gateway}"


def use_secrets(ha: HaCluster, monkeypatch, current: str, previous: str | None) -> None:
    """What the next restarts start with: the variables (every child inherits this process's environment) and
    ``state.previous_secret_env`` in every config."""
    monkeypatch.setenv(CLUSTER_SECRET_ENV, current)
    line = f"  previous_secret_env: {PREVIOUS_ENV}\n"
    if previous is None:
        monkeypatch.delenv(PREVIOUS_ENV, raising=False)
    else:
        monkeypatch.setenv(PREVIOUS_ENV, previous)
    for process in ha.gateways:
        text = process.config_path.read_text().replace(line, "")
        if previous is not None:
            text = text.replace(f"  secret_env: {CLUSTER_SECRET_ENV}\n", f"  secret_env: {CLUSTER_SECRET_ENV}\n{line}")
        process.config_path.write_text(text)


async def rolling_restart(ha: HaCluster, load: SteadyLoad, skip: Cluster | None = None) -> None:
    """F, the candidate that does not lead, then the leader (its lease passes to the other); each back in the
    load's rotation once ready, and ``STEP_AFTER`` requests ended after each."""
    if skip is not ha.gateway:
        await ha.restart(ha.gateway, load, "--role", "gateway")
        await load.wait_finished(STEP_AFTER)
    leader = await ha.wait_leader(timeout=LEASE_TTL + 5)
    (other,) = [c for c in ha.candidates if c is not leader]
    await ha.restart(other, load)
    await load.wait_finished(STEP_AFTER)
    await ha.restart(leader, load, while_down=partial(ha.wait_leader, [other], timeout=LEASE_TTL + 5))
    await ha.wait_routable(timeout=30)
    await ha.wait_converged(timeout=20)
    await load.wait_finished(STEP_AFTER)


async def wait_resigned(ha: HaCluster, timeout: float = 20.0) -> float:
    """Until no process reads a key, team or node identity that only the previous secret signed; the seconds."""
    start = trio.current_time()
    with trio.fail_after(timeout):
        while True:
            left = [await scrape_value(p.control_url, name, client=ha.http)
                    for p in ha.gateways
                    for name in ("llmgw_tenant_previous_secret_records", "llmgw_cluster_previous_secret_nodes")]
            if left == [0.0] * len(left):
                return trio.current_time() - start
            await trio.sleep(0.2)


def placement_proofs(ha: HaCluster) -> dict[str, str]:
    """``{replica: placement proof}`` of the engines in the agent's ledger."""
    proofs = {}
    for ledger in ha.agent_state.rglob("shards.json"):
        for entry in json.loads(ledger.read_text()).get("shards", {}).values():
            proofs[entry["replica_id"]] = entry["spec"].get("placement_proof", "")
    return proofs


async def make_key(http: httpx.AsyncClient, gateway: Cluster, name: str) -> str:
    made = await http.post(gateway.control_url + "/admin/keys", json={"name": name})
    assert made.status_code == 201, made.text
    return made.json()["key"]


async def chat(http: httpx.AsyncClient, gateway: Cluster, key: str) -> int:
    response = await http.post(gateway.data_url + "/v1/chat/completions", json=CHAT,
                               headers={"Authorization": f"Bearer {key}"})
    return response.status_code
