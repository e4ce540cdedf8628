"""Several gateways, one view: a control process and ``--role gateway`` processes sharing state through Redis.

Real processes on loopback: ``llmgw sim`` replicas with KV events, a control ``llmgw serve`` following their
events (static replicas with ``kv_events``), ``--role gateway`` followers, and a real ``redis-server``.
What is checked is what a user sees: ``/admin/explain``, ``/admin/kv``, ``/admin/cluster``, ``/health``,
and the engines' own reported cached tokens.
"""

from __future__ import annotations

import signal
from random import Random

import coredis
import httpx
import pytest
import trio

from llmgw.bench.chat_workloads import words
from llmgw.cluster import records
from llmgw.cluster.records import Keys
from llmgw.testing.metrics import scrape, scrape_value, series_sum
from llmgw.testing.shared_state import cluster_config, wait_replicas
from llmgw.testing.sims import KV_SIM_ENV, KV_SIM_EXTRA, MODEL, start_sims

pytestmark = pytest.mark.slow


def long_prompt(seed: int) -> dict:
    return {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": words(Random(seed), 400)}]}


async def explain(http: httpx.AsyncClient, control_url: str, body: dict) -> dict:
    answer = (await http.post(control_url + "/admin/explain", json=body)).json()
    return answer


def cached_blocks(answer: dict) -> dict[str, int]:
    return {r["name"]: r["confirmed_blocks"] for r in answer["replicas"]}


async def test_a_follower_sees_the_engines_cached_blocks_and_routes_to_the_holder(shared_cluster):
    engines, control, (follower,) = await shared_cluster()
    body = long_prompt(1)
    async with httpx.AsyncClient(timeout=30) as http:
        first = await http.post(control.url + "/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        holder = first.headers["x-llmgw-replica"]
        # The engine's BlockStored reaches the control process, then Redis, then the follower's own index (the
        # control's prediction may reach it first: only blocks confirmed by the engine's events are waited for).
        with trio.fail_after(10):
            while True:
                answer = await explain(http, follower.control_url, body)
                if cached_blocks(answer)[holder] > 0:
                    assert answer["pick"] == holder and answer.get("outcome") == "hit"
                    break
                await trio.sleep(0.05)
        second = await http.post(follower.url + "/v1/chat/completions", json=body)
        assert second.status_code == 200, second.text
        assert second.headers["x-llmgw-replica"] == holder
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0
        # Both gateways hold the same blocks per replica: the engines' truth.
        control_kv = {r["name"]: r["blocks"] for r in (await http.get(control.control_url + "/admin/kv")).json()[
            "replicas"]}
        with trio.fail_after(5):
            while True:
                follower_kv = {r["name"]: r["blocks"] for r in
                               (await http.get(follower.control_url + "/admin/kv")).json()["replicas"]}
                if follower_kv == control_kv:
                    break
                await trio.sleep(0.05)
                control_kv = {r["name"]: r["blocks"] for r in
                              (await http.get(control.control_url + "/admin/kv")).json()["replicas"]}
        assert control_kv[holder] > 0
        cluster = (await http.get(follower.control_url + "/admin/cluster")).json()
        assert cluster["role"] == "gateway" and cluster["degraded"] is False and cluster["log"]["loaded"] is True


async def test_each_gateway_counts_the_others_load_and_a_killed_gateways_load_expires(nursery, start_llmgw,
                                                                                     redis_url, cluster_name):
    # 200 output tokens at 20 ms a step: each stream stays in flight for about 4 s.
    engines = await start_sims(nursery, 2, env=KV_SIM_ENV, num_blocks=512, block_size=16, time_scale=1, seed=0,
                               extra=KV_SIM_EXTRA + ("--output-tokens", "200:200"))
    config = cluster_config(engines, redis_url, cluster_name, routing="prefix_tree")
    control = await start_llmgw(config)
    busy = await start_llmgw(config, "--role", "gateway")
    for gateway in (control, busy):
        await wait_replicas(gateway.control_url, 2)
    started = 0

    async def stream(http: httpx.AsyncClient, seed: int) -> None:
        nonlocal started
        try:
            async with http.stream("POST", busy.url + "/v1/chat/completions",
                                   json={**long_prompt(seed), "max_tokens": 200, "stream": True}) as response:
                started += 1
                async for _ in response.aiter_raw():
                    pass
        except httpx.HTTPError:
            pass  # the gateway is killed under it

    async with httpx.AsyncClient(timeout=30) as http:
        async with trio.open_nursery() as streams:
            for seed in range(4):
                streams.start_soon(stream, http, seed)
            with trio.fail_after(10):
                while True:  # the control process sees the follower's 4 requests as its peers' load
                    listed = (await http.get(control.control_url + "/admin/replicas")).json()
                    if sum(r["peer_inflight"] for r in listed) == 4:
                        break
                    await trio.sleep(0.02)
            assert sum(r["local_inflight"] for r in listed) == 0
            explained = await explain(http, control.control_url, long_prompt(99))
            assert sum(r["inflight"] for r in explained["replicas"]) == 4  # what its tier weighs
            busy.kill()  # SIGKILL: no goodbye; its reports stop
            killed_at = trio.current_time()
            with trio.fail_after(5):
                while True:
                    listed = (await http.get(control.control_url + "/admin/replicas")).json()
                    if sum(r["peer_inflight"] for r in listed) == 0:
                        break
                    await trio.sleep(0.05)
            assert trio.current_time() - killed_at <= 3.0  # load_ttl (2 s) and one expiry tick
            streams.cancel_scope.cancel()


async def test_redis_down_keeps_every_gateway_routing_then_they_heal(shared_cluster, private_redis):
    engines, control, (follower,) = await shared_cluster(redis_url=private_redis.url)
    async with httpx.AsyncClient(timeout=30) as http:
        await private_redis.kill()
        with trio.fail_after(10):
            while not (await http.get(follower.control_url + "/health")).json()["state"]["degraded"]:
                await trio.sleep(0.1)
        health = (await http.get(follower.control_url + "/health")).json()
        assert health["status"] == "degraded" and health["state"]["reason"]
        for seed in range(6):  # routed on the last known table and index, by both
            for gateway in (control, follower):
                response = await http.post(gateway.url + "/v1/chat/completions", json=long_prompt(seed))
                assert response.status_code == 200, response.text
        await private_redis.restart()
        returned = trio.current_time()
        with trio.fail_after(10):
            while True:
                states = [(await http.get(g.control_url + "/health")).json()["state"] for g in (control, follower)]
                control_kv = {r["name"]: r["blocks"] for r in
                              (await http.get(control.control_url + "/admin/kv")).json()["replicas"]}
                follower_kv = {r["name"]: r["blocks"] for r in
                               (await http.get(follower.control_url + "/admin/kv")).json()["replicas"]}
                if not any(s["degraded"] for s in states) and follower_kv == control_kv:
                    break
                await trio.sleep(0.1)
        assert trio.current_time() - returned <= 5.0
        # What the engines stored while Redis was away (6 prompts) is in the follower's index now.
        assert sum(follower_kv.values()) > 0
        for process in (control, follower):
            assert process.returncode is None


async def test_garbage_in_the_clusters_redis_is_counted_and_skipped(shared_cluster, redis_url, cluster_name):

    engines, control, (follower,) = await shared_cluster()
    keys = Keys(cluster_name)
    async with httpx.AsyncClient(timeout=30) as http:  # each reads the others' load reports: its readers follow
        with trio.fail_after(20):
            for gateway in (control, follower):
                while not (await http.get(gateway.control_url + "/admin/cluster")).json()["peers"]:
                    await trio.sleep(0.1)
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    async with coredis.Redis(host=host, port=int(port), decode_responses=False) as redis:
        await redis.xadd(keys.load, {b"o": b"intruder", b"x": b"2000", b"l": b"\xc1\xff not msgpack"})
        await redis.xadd(keys.load, {b"o": b"intruder", b"x": b"2000", b"l": b"\x92\x01\x02"})  # not [[name, n, t]]
        await redis.xadd(keys.requests, {b"o": b"intruder", b"a": b"\x00"})
        await redis.xadd(keys.log, {b"junk": b"1"})  # no writer, no batch number: stepped over
    async with httpx.AsyncClient(timeout=30) as http:
        with trio.fail_after(10):
            while True:
                follower_bad = await scrape_value(follower.control_url, "llmgw_cluster_bad_records_total",
                                                  'stream="load"', default=0.0, client=http)
                control_bad = await scrape_value(control.control_url, "llmgw_cluster_bad_records_total",
                                                 'stream="requests"', default=0.0, client=http)
                if follower_bad == 2 and control_bad == 1:
                    break
                await trio.sleep(0.1)
        body = long_prompt(7)
        for gateway in (control, follower):
            response = await http.post(gateway.url + "/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
        # The follower still follows: the control process's next changes (this prompt's blocks) reach it.
        holder = response.headers["x-llmgw-replica"]
        with trio.fail_after(10):
            while cached_blocks(await explain(http, follower.control_url, body))[holder] == 0:
                await trio.sleep(0.05)
        for process in (control, follower):
            assert process.returncode is None
            assert (await http.get(process.control_url + "/health")).json()["state"]["degraded"] is False


async def test_with_a_cluster_secret_records_not_signed_with_it_are_skipped(shared_cluster, redis_url, cluster_name):
    secret = {"LLMGW_TEST_CLUSTER_SECRET": "a secret of the cluster, 32 bytes"}  # the harness names its variable
    engines, control, (follower,) = await shared_cluster(env=secret)
    keys = Keys(cluster_name)
    host, port = redis_url.removeprefix("redis://").split("/")[0].split(":")
    async with httpx.AsyncClient(timeout=30) as http:
        position = (await http.get(follower.control_url + "/admin/cluster")).json()["log"]
        forged_replica = ["evil", MODEL, "http://127.0.0.1:1", "deployed", 1, {"profile": "p"}, "evil@1"]
        async with coredis.Redis(host=host, port=int(port), decode_responses=False) as redis:
            # The writer's id and its next batch number, a well-formed batch: only the signature is missing.
            await redis.xadd(keys.log, {b"w": position["writer"].encode(), b"n": str(position["seq"] + 1).encode(),
                                        b"t": b"0", b"e": records.pack([[records.ADD, forged_replica]])})
            await redis.xadd(keys.load, {b"o": b"intruder", b"x": b"60000",
                                         b"l": records.pack([["sim-0", 500, 10**6, 10**6, 500]])})
        with trio.fail_after(10):
            while await scrape_value(follower.control_url, "llmgw_cluster_bad_records_total", 'stream="load"',
                                     default=0.0, client=http) < 1:
                await trio.sleep(0.1)
        # The signed changes that follow the forged batch still arrive: a new prompt's blocks reach the follower.
        body = long_prompt(11)
        response = await http.post(control.url + "/v1/chat/completions", json=body)
        holder = response.headers["x-llmgw-replica"]
        with trio.fail_after(10):
            while cached_blocks(await explain(http, follower.control_url, body))[holder] == 0:
                await trio.sleep(0.05)
        listed = (await http.get(follower.control_url + "/admin/replicas")).json()
        assert {r["name"] for r in listed} == {"sim-0", "sim-1"}  # no "evil"
        # The intruder's load does not count. The control's own record may still carry the request above in
        # flight for one publishing period (a loaded machine showed it), so wait for it to settle: the intruder's
        # 500 would last its 60 s lifetime, far past this deadline.
        with trio.fail_after(10):
            while any(r["peer_inflight"] != 0 for r in listed):
                await trio.sleep(0.1)
                listed = (await http.get(follower.control_url + "/admin/replicas")).json()
        assert await scrape_value(follower.control_url, "llmgw_cluster_bad_records_total", 'stream="log"',
                                  default=0.0, client=http) >= 1


async def test_a_gateway_that_has_not_loaded_the_shared_state_answers_503_not_404(nursery, start_llmgw, redis_url,
                                                                                   cluster_name):
    """Before its first snapshot a ``--role gateway`` process knows only its own config's models: it routes their
    static replicas (fail-static), and for any other model waits for the snapshot, and if none comes says 503
    (retry, or another gateway) instead of telling the client the model does not exist."""
    engines = await start_sims(nursery, 1, env=KV_SIM_ENV, num_blocks=512, block_size=16, seed=0,
                               extra=KV_SIM_EXTRA)
    config = cluster_config(engines, redis_url, cluster_name) + (
        "agents:\n  heartbeat_interval: 0.5s\n  suspect_after: 2s\n")
    follower = await start_llmgw(config, "--role", "gateway")  # no control process: no snapshot comes
    async with httpx.AsyncClient(timeout=30) as http:
        static = await http.post(follower.url + "/v1/chat/completions", json=long_prompt(0))
        assert static.status_code == 200, static.text
        early = await http.post(follower.url + "/v1/chat/completions", json={**long_prompt(0), "model": "deployed"})
        assert early.status_code == 503 and early.json()["error"]["code"] == "state_not_loaded", early.text
        assert early.headers["retry-after"]
        control = await start_llmgw(config)
        with trio.fail_after(20):
            while not (await http.get(follower.control_url + "/health")).json()["state"]["log"]["loaded"]:
                await trio.sleep(0.05)
        late = await http.post(follower.url + "/v1/chat/completions", json=long_prompt(1))
        assert late.status_code == 200, late.text
        unknown = await http.post(follower.url + "/v1/chat/completions", json={**long_prompt(2), "model": "nope"})
        assert unknown.status_code == 404
    assert control.returncode is None



@pytest.mark.parametrize("fault", ["frozen", "killed"])
async def test_redis_down_is_one_warning_and_back_one_info_with_no_traceback(nursery, start_llmgw, private_redis,
                                                                             cluster_name, fault: str):
    # coredis logged "ERROR coredis: Connection attempt failed unexpectedly!" (with a traceback, or "NoneType:
    # None") at each connection attempt of each caller while Redis was frozen or restarting: a line every few
    # seconds per process, none an operator could act on. The link says it once each way, and counts the calls.
    (sim,) = await start_sims(nursery, 1, num_blocks=256, block_size=16)
    config = cluster_config([sim], private_redis.url, cluster_name, routing="round_robin")
    control = await start_llmgw(config, "--log-level", "info")
    follower = await start_llmgw(config, "--role", "gateway", "--log-level", "info")
    gateways = (control, follower)
    async with httpx.AsyncClient(timeout=30) as http:
        for gateway in gateways:
            await wait_replicas(gateway.control_url, 1)
        errors = [series_sum(await scrape(g.control_url, http), "llmgw_cluster_redis_errors_total") for g in gateways]
        marks = [len(gateway.lines) for gateway in gateways]
        if fault == "frozen":
            private_redis.running.kill(signal.SIGSTOP)
            await trio.sleep(8)
            private_redis.running.kill(signal.SIGCONT)
        else:
            await private_redis.kill()
            await trio.sleep(8)
            await private_redis.restart()
        with trio.fail_after(15):
            while any([(await http.get(g.control_url + "/health")).json()["state"]["degraded"] for g in gateways]):
                await trio.sleep(0.1)
        await trio.sleep(1.0)  # a late line would show
        for gateway, before, mark in zip(gateways, errors, marks):
            lines = gateway.lines[mark:]
            text = "\n".join(lines)
            assert "Traceback" not in text and "NoneType: None" not in text, text
            assert not [line for line in lines if " coredis" in line or " ERROR llmgw.cluster" in line], text
            assert sum(" WARNING llmgw.cluster.link: cluster state degraded: Redis at " in line
                       for line in lines) == 1, text
            assert sum(" INFO llmgw.cluster.link: cluster state: Redis at " in line and "is reachable" in line
                       for line in lines) == 1, text
            # Each call that failed meanwhile (every retry of every task) is counted.
            after = series_sum(await scrape(gateway.control_url, http), "llmgw_cluster_redis_errors_total")
            assert after >= before + 5, (before, after)
            assert gateway.returncode is None
