"""The fault matrix: a steady load through `llmgw serve` while an engine, the agent, then the control plane is
killed with SIGKILL; real processes throughout (`llmgw serve`, a remote `llmgw agent`, simulator engines it
started, a kv_index profile with KV events).

Each test asserts, for the requests of the fault's window (the load driver is :mod:`llmgw.bench.fault_load`):

- no non-streamed request failed, except one in flight inside the `llmgw serve` process killed (it started
  before the kill); a connection refused while it was down is a request that never started, retried by the
  client; every request accepted after the restart succeeded (no HTTP error at all);
- the engines are adopted with the same pids and no restart where adoption applies;
- once settled, the kv_index tier predicts exactly the cached tokens each engine then serves.

Right after a restart the agents have not reconnected yet: a request then waits for them (the adoption window)
rather than getting a 503; the last test shows the bound of that wait when no agent comes back.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest

from llmgw.bench.fault_load import LoadSettings, SteadyLoad
from llmgw.bench.kv_truth import check_kv_truth
from llmgw.testing.cluster import AGENTS, TOKEN, all_up, shard_pids
from llmgw.testing.sims import kv_sim_profile as kv_sim

pytestmark = pytest.mark.slow

# Default engine timing (20 ms a step): a request of 16 tokens takes about 320 ms, so some are always in flight.
CONFIG = AGENTS + kv_sim('"--num-blocks", "1024"')
LOAD = LoadSettings(concurrency=4, rate=16, stream_every=4, max_tokens=16)
AFTER = 24  # requests that must end after recovery, within the fault's window


async def start(cluster) -> dict[str, dict]:
    """`llmgw serve` and one agent (a 2-GPU fixture node) running both replicas; their indexes healthy."""
    cluster.write_config(CONFIG)
    await cluster.start_serve()
    await cluster.start_agent("a", "tiny-2gpu-a")
    return await cluster.settled(2)


@contextlib.asynccontextmanager
async def fault_window(cluster):
    """A steady load; the body runs the fault, and its window ends once ``AFTER`` more requests ended."""
    async with SteadyLoad(cluster.data_url, LOAD).running() as load:
        await load.wait_finished(AFTER)
        load.phase = "fault"
        yield load
        await load.wait_finished(AFTER)
        await load.pause()


async def assert_kv_truth(cluster, replicas: dict[str, dict], tag: str) -> None:
    engines = {name: r["url"] for name, r in replicas.items()}
    checks = await check_kv_truth(cluster.http, cluster.data_url, cluster.control_url, engines, tag=tag)
    assert all(check.exact for check in checks), checks


def restarts(replicas: dict[str, dict]) -> dict[str, int]:
    return {name: r["shards"][0]["restarts"] for name, r in replicas.items()}


async def test_an_engine_killed_under_load_fails_no_request_that_had_not_started_streaming(cluster):
    replicas = await start(cluster)
    victim, other = sorted(replicas)
    pids = shard_pids(replicas)
    async with fault_window(cluster) as load:
        # Killed while it works on requests: each must be retried on the other replica, or be a stream cut.
        await cluster.replicas_where(f"{victim} busy", lambda rs: rs[victim]["inflight"] >= 2, timeout=30)
        retries = await cluster.metric("llmgw_retries_total")
        killed_at = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        replicas = await cluster.replicas_where(f"{victim} back on a new engine", lambda rs: all_up(2)(rs) and (
            rs[victim]["shards"][0]["pid"] not in (0, pids[victim])), timeout=60)
    counts = load.phases["fault"]
    said = [line for line in cluster.serve.lines if "failed after taking it" in line or "went away" in line
            or "is now down" in line or "leaves routing" in line]
    assert counts.failed("plain") == {}, (counts.as_dict(), said)
    assert set(counts.failed("stream")) <= {"stream_cut"}, counts.as_dict()  # only streams on the killed engine
    assert all(started < killed_at for started in counts.lost_started_at)
    assert counts.not_started_retries == 0
    assert await cluster.metric("llmgw_retries_total") - retries + counts.outcomes["stream"]["stream_cut"] >= 1
    assert shard_pids(replicas)[other] == pids[other] and replicas[victim]["shards"][0]["restarts"] >= 1
    assert replicas[other]["shards"][0]["restarts"] == 0
    await assert_kv_truth(cluster, replicas, "engine")


async def test_an_agent_killed_and_restarted_under_load_fails_nothing_and_adopts_its_engines(cluster):
    replicas = await start(cluster)
    pids, before = shard_pids(replicas), restarts(replicas)
    async with fault_window(cluster) as load:
        cluster.agents["a"].kill()
        await cluster.agents["a"].wait_exit()
        await cluster.wait_for("node a disconnected", lambda: cluster.node_is("a", "disconnected"), timeout=30)
        await load.wait_finished(AFTER // 2)  # served while no agent runs
        await cluster.start_agent("a", "tiny-2gpu-a")
        replicas = await cluster.replicas_where("both engines adopted", lambda rs: all_up(2)(rs) and all(
            "adopted" in r["shards"][0]["reason"] for r in rs.values()), timeout=60)
    counts = load.phases["fault"]
    assert counts.failed("plain") == {} and counts.failed("stream") == {}, counts.as_dict()
    assert counts.not_started_retries == 0
    assert shard_pids(replicas) == pids and restarts(replicas) == before
    await assert_kv_truth(cluster, replicas, "agent")


async def test_the_control_plane_killed_and_restarted_under_load_loses_only_requests_in_flight(cluster):
    replicas = await start(cluster)
    pids, before = shard_pids(replicas), restarts(replicas)
    async with fault_window(cluster) as load:
        cluster.serve.kill()
        await cluster.serve.wait_exit()
        gone_at = time.monotonic()  # a connection made before this may have been accepted by the dying process
        await cluster.start_serve()
        replicas = await cluster.replicas_where("both engines adopted", lambda rs: all_up(2)(rs) and (
            {r["origin"] for r in rs.values()} == {"adopted"}), timeout=60)
    counts = load.phases["fault"]
    # Lost: only requests the killed process had accepted. Refused while it was down: retried, then served.
    assert set(counts.failed("plain")) <= {"in_flight"}, counts.as_dict()
    assert set(counts.failed("stream")) <= {"in_flight", "stream_cut"}, counts.as_dict()
    assert all(started < gone_at for started in counts.lost_started_at)
    assert counts.not_started_retries > 0
    assert counts.outcomes["plain"]["ok"] + counts.outcomes["stream"]["ok"] >= AFTER  # served after the restart
    assert shard_pids(replicas) == pids and restarts(replicas) == before
    await assert_kv_truth(cluster, replicas, "control")


async def test_a_request_held_at_start_gets_a_503_when_no_agent_came_back(cluster):
    # Default agent timing: the adoption window is heartbeat_interval + 1 = 6 s. An agent joined before the
    # restart (its identity is stored; its engines may still run), and does not come back: the window is kept.
    cluster.write_config(f"agents:\n  token: {TOKEN}\n" + kv_sim('"--num-blocks", "64"'))
    first = await cluster.start_serve()
    agent = await cluster.start_agent("a", "tiny-2gpu-a")
    store = cluster.tmp_path / "xdg-state" / "llmgw" / "control" / "nodes.json"  # XDG_STATE_HOME: tests/conftest.py

    async def identity_stored() -> bool:
        return store.exists() and "a" in json.loads(store.read_text())["nodes"]

    await cluster.wait_for("node a's identity stored", identity_stored)
    for child in (agent, first):
        child.kill()
        await child.wait_exit()
    await cluster.start_serve()
    body = {"model": "tiny", "prompt": "anyone there?", "max_tokens": 1}
    held = await cluster.http.post(cluster.data_url + "/v1/completions", json=body, timeout=30)
    assert held.status_code == 503 and held.json()["error"]["code"] == "no_healthy_replica"
    assert await cluster.metric("llmgw_requests_held_at_start_total", 'result="none"') == 1
    assert await cluster.metric("llmgw_requests_held_at_start_total", 'result="routed"') == 0
    # After the window nothing is held: the answer is the 503 at once, and nothing more is counted.
    after = await cluster.http.post(cluster.data_url + "/v1/completions", json=body)
    assert after.status_code == 503
    assert await cluster.metric("llmgw_requests_held_at_start_total", 'result="none"') == 1
