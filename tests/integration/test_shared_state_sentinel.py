"""Several gateways over Redis Sentinel: when the primary dies, the sentinel promotes its replica and every
gateway carries on against the new primary, without a restart and without losing a request.

Real processes on loopback: a primary redis-server, its replica and a sentinel (quorum 1), ``llmgw sim``
replicas with KV events, a control ``llmgw serve`` and a ``--role gateway`` follower, both configured with
``state.sentinel`` (no URL: the sentinel says where the primary is).
"""

from __future__ import annotations

from random import Random

import coredis
import httpx
import pytest
import trio

from llmgw.bench.chat_workloads import words
from llmgw.cluster.records import Keys
from llmgw.testing.redis import start_sentinel_group
from llmgw.testing.sims import MODEL

pytestmark = pytest.mark.slow


def prompt(seed: int) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": words(Random(seed), 300)}]}


async def kv_blocks(http: httpx.AsyncClient, control_url: str) -> dict[str, int]:
    return {r["name"]: r["blocks"] for r in (await http.get(control_url + "/admin/kv")).json()["replicas"]}


async def test_a_primary_killed_behind_sentinel_is_replaced_and_every_gateway_follows_the_new_one(
        nursery, tmp_path, shared_cluster, cluster_name):
    group = await start_sentinel_group(nursery, tmp_path / "redis")
    engines, control, (follower,) = await shared_cluster(redis_url=group.url)
    old_primary = group.servers[0]
    failed: list[str] = []
    sent = 0
    async with httpx.AsyncClient(timeout=30) as http:
        cluster = (await http.get(follower.control_url + "/admin/cluster")).json()
        assert "sentinel service llmgw via 127.0.0.1:" in cluster["redis"]

        async def keep_sending(until: trio.Event) -> None:
            nonlocal sent
            seed = 0
            while not until.is_set():
                for gateway in (control, follower):
                    response = await http.post(gateway.url + "/v1/chat/completions", json=prompt(seed))
                    sent += 1
                    if response.status_code != 200:
                        failed.append(f"{response.status_code} {response.text[:200]}")
                seed += 1
                await trio.sleep(0.05)

        promoted = trio.Event()
        async with trio.open_nursery() as load:
            load.start_soon(keep_sending, promoted)
            await trio.sleep(0.5)
            await old_primary.kill()
            with trio.fail_after(30):
                while (new_port := await group.primary_port()) == old_primary.port:
                    await trio.sleep(0.1)
            promoted.set()
        assert not failed and sent > 10, (failed, sent)

        # Prompts after the failover: the engines' events reach the control process, go through the new primary,
        # and the follower's index matches the control process's again.
        for seed in range(100, 106):
            assert (await http.post(control.url + "/v1/chat/completions", json=prompt(seed))).status_code == 200
        with trio.fail_after(20):
            while True:
                states = [(await http.get(g.control_url + "/health")).json()["state"] for g in (control, follower)]
                control_kv, follower_kv = (await kv_blocks(http, control.control_url),
                                           await kv_blocks(http, follower.control_url))
                if not any(s["degraded"] for s in states) and control_kv == follower_kv and sum(control_kv.values()):
                    break
                await trio.sleep(0.2)
    async with coredis.Redis("127.0.0.1", new_port, decode_responses=False) as new_primary:
        assert await new_primary.exists([Keys(cluster_name).snapshot]) == 1
        assert await new_primary.xlen(Keys(cluster_name).log) > 0
    for process in (control, follower, *engines):
        assert process.returncode is None
