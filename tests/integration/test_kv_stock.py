"""Stock engines at their defaults: the kv_index tier keyed by content routes them, and keys that cannot match
are loud (issue 20, item 1).

Simulators started as a stock vLLM is (no ``PYTHONHASHSEED``; ``sha256``, vLLM's default algorithm, or
``xxhash``, whose root is random per process without a seed), followed by a gateway as static replicas with
``kv_events``: with the default ``content`` keys the router predicts exactly what the engines then report as
cached; with ``key_function: vllm`` (whose ``sha256_cbor``/``"0"`` the engines do not use) or events without
``token_ids`` the replica's index state says ``unusable_keys`` with the fix, in ``/admin/kv``, the state metric
and ``llmgw status``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import trio

from llmgw.testing.cluster import BLOCK, text
from llmgw.testing.metrics import metric_value, scrape
from llmgw.testing.shared_state import cluster_config
from llmgw.testing.sims import KV_SIM_EXTRA, gateway_config, kv_sources, start_sims

pytestmark = pytest.mark.slow

NO_PREDICTIONS = {"predicted_ttl": 0, "tokenize_timeout": "2s"}  # what the index says, nothing predicted


def stock_kv_flags(algo: str | None) -> list[str]:
    """The simulator's KV-event flags with vLLM's default hash algorithm (``algo`` None) or ``algo``."""
    config = list(KV_SIM_EXTRA[2:])  # --kv-events-config ...: no --prefix-caching-hash-algo of ours
    return config if algo is None else ["--prefix-caching-hash-algo", algo, *config]


@pytest.fixture
def stock(monkeypatch, nursery, start_llmgw):
    """``await stock(algos, routing_options, *sim_flags)`` -> (gateway, sims): one stock simulator per algorithm
    (None: vLLM's default), no PYTHONHASHSEED, as static replicas ``sim-i`` of model ``tiny`` whose KV events
    the gateway follows."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)

    async def start(algos, routing_options, *sim_flags):
        sims = await start_sims(nursery, len(algos), num_blocks=512, time_scale=0,
                                per_replica=lambda i: {"extra": [*stock_kv_flags(algos[i]), *sim_flags]})
        config = gateway_config([sim.url for sim in sims], routing="kv_index", routing_options=routing_options,
                                kv_sources=[kv_sources(sim) for sim in sims])
        return await start_llmgw(config), sims

    return start


async def kv_replicas(http: httpx.AsyncClient, gateway) -> dict[str, dict]:
    return {r["name"]: r for r in (await http.get(gateway.control_url + "/admin/kv")).json()["replicas"]}


async def wait_kv(http: httpx.AsyncClient, gateway, check, timeout: float = 20.0) -> dict[str, dict]:
    with trio.fail_after(timeout):
        while not check(state := await kv_replicas(http, gateway)):
            await trio.sleep(0.05)
    return state


async def completion(http: httpx.AsyncClient, url: str, prompt: str) -> httpx.Response:
    response = await http.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return response


async def test_stock_engines_with_any_algorithm_and_seed_route_by_content_and_predict_exactly(stock):
    gateway, sims = await stock([None, "xxhash"], NO_PREDICTIONS)
    async with httpx.AsyncClient(timeout=20) as http:
        await wait_kv(http, gateway, lambda s: all(s.get(f"sim-{i}", {}).get("state") == "healthy" for i in (0, 1)))
        for turn in range(2):  # a prompt held by each engine in turn (sent to it, not through the gateway)
            prompt = text(10 + turn, 1600)
            blocks = (await completion(http, sims[turn].url, prompt)).json()["usage"]["prompt_tokens"] // BLOCK
            await wait_kv(http, gateway, lambda s: s[f"sim-{turn}"]["blocks"] >= blocks)
            # No predictions: only the index's keys, made from the events' token ids, can find the holder.
            response = await completion(http, gateway.url, prompt + " and a question about it")
            cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert response.headers["x-llmgw-replica"] == f"sim-{turn}" and cached >= (blocks - 1) * BLOCK
        metrics = await scrape(gateway.control_url, http)
        predicted = metric_value(metrics, "llmgw_route_predicted_cached_tokens_total", 'model="tiny"')
        actual = metric_value(metrics, "llmgw_route_actual_cached_tokens_total", 'model="tiny"')
        assert predicted == actual > 0
        assert metric_value(metrics, "llmgw_routing_decisions_total", 'tier="kv_index",outcome="hit"') == 2
        state = await kv_replicas(http, gateway)
        assert all(state[f"sim-{i}"]["state"] == "healthy" and state[f"sim-{i}"]["problem"] is None for i in (0, 1))


def llmgw_status(control_url: str) -> str:
    """``llmgw status`` against the gateway, its tables (run in a worker thread: it blocks)."""
    result = subprocess.run([sys.executable, "-m", "llmgw", "status", "--control", control_url],
                            capture_output=True, text=True, timeout=30, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    return result.stdout


async def test_engine_hashes_that_differ_from_the_routers_make_the_index_state_loud(stock):
    gateway, sims = await stock([None], {**NO_PREDICTIONS, "key_function": "vllm"})
    async with httpx.AsyncClient(timeout=20) as http:
        await wait_kv(http, gateway, lambda s: s.get("sim-0", {}).get("state") == "healthy")
        await completion(http, sims[0].url, text(20, 800))  # the engine's first chain: its hashes are checked
        state = (await wait_kv(http, gateway, lambda s: s["sim-0"]["state"] == "unusable_keys"))["sim-0"]
        problem = state["problem"]
        assert "differ from the router's" in problem and "key_function" in problem and "hash_seed" in problem
        metrics = await scrape(gateway.control_url, http)
        assert metric_value(metrics, "llmgw_kv_index_state", 'replica="sim-0",state="unusable_keys"') == 1
        assert metric_value(metrics, "llmgw_kv_hash_parity_checks_total", 'replica="sim-0",result="mismatch"') >= 1
        # The tier does not trust it: the prefix tree routes the model while its only index is unusable.
        response = await completion(http, gateway.url, text(20, 800))
        assert response.headers["x-llmgw-replica"] == "sim-0"
        metrics = await scrape(gateway.control_url, http)
        assert metric_value(metrics, "llmgw_routing_decisions_total",
                            'tier="kv_index",outcome="index_unhealthy"') == 1
        status = await trio.to_thread.run_sync(llmgw_status, gateway.control_url)
        row = next(line for line in status.splitlines() if line.startswith("sim-0") and "unusable_keys" in line)
        assert "hash_algo and hash_seed" in row


async def test_events_without_token_ids_make_content_keys_loud(stock):
    gateway, sims = await stock([None], NO_PREDICTIONS, "--no-event-token-ids")
    async with httpx.AsyncClient(timeout=20) as http:
        await wait_kv(http, gateway, lambda s: s.get("sim-0", {}).get("state") == "healthy")
        await completion(http, sims[0].url, text(30, 800))
        state = (await wait_kv(http, gateway, lambda s: s["sim-0"]["state"] == "unusable_keys"))["sim-0"]
        assert "no token_ids" in state["problem"] and "key_function: vllm" in state["problem"]
        metrics = await scrape(gateway.control_url, http)
        assert metric_value(metrics, "llmgw_kv_index_state", 'replica="sim-0",state="unusable_keys"') == 1
        assert metric_value(metrics, "llmgw_kv_ignored_total", 'replica="sim-0",reason="no_token_ids"') > 0


async def test_through_redis_every_gateway_sees_unusable_keys_live_and_from_the_snapshot(
        monkeypatch, shared_cluster, start_llmgw, redis_url, cluster_name):
    """The cluster's shared state carries the state: a follower reading the log gets the control process's problem
    and fix; one started later reads the state from the snapshot."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    options = {"key_function": "vllm"}
    engines, control, (follower,) = await shared_cluster(sims=1, sim_env=None, routing_options=options)
    async with httpx.AsyncClient(timeout=20) as http:
        await completion(http, engines[0].url, text(40, 800))  # sha256_cbor without a seed: not the tier's "0"
        problems = []
        for gateway in (control, follower):
            entry = (await wait_kv(http, gateway, lambda s: s["sim-0"]["state"] == "unusable_keys"))["sim-0"]
            problems.append(entry["problem"])
        assert problems[0] == problems[1] and "hash_seed" in problems[0]
        await trio.sleep(2.5)  # a snapshot (every 1 s) was written since
        late = await start_llmgw(cluster_config(engines, redis_url, cluster_name, routing_options=options),
                                 "--role", "gateway")
        entry = (await wait_kv(http, late, lambda s: s.get("sim-0", {}).get("state") == "unusable_keys"))["sim-0"]
        assert "/admin/kv" in entry["problem"]
