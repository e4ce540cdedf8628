"""The runbook's "A node lost" (docs/runbook.md), as an operator runs it against a real ``llmgw serve`` with two
remote agents, each running one of a deployment's two simulator replicas: node ``a`` is lost with its engine (the
agent and the engine killed, as a machine that died), its replica leaves routing and the other keeps serving.

The control plane does not move a lost node's replicas by itself (docs/cluster.md: a disconnected node is never
declared lost), so the runbook's steps are: forget the node (``POST /admin/nodes/a/forget``), then restart the
control process (SIGTERM and start; with several candidates, the leader), whose new reconciler adopts what runs and
places what is missing on the nodes that are connected. Asserted: both replicas serve again, both on node ``b``, and
the engine that never stopped is adopted with its pid.
"""

from __future__ import annotations

import signal

import pytest

from llmgw.testing.cluster import AGENTS, all_up, kill_group, shard_pids
from llmgw.testing.sims import kv_sim_profile

pytestmark = pytest.mark.slow


async def test_a_lost_nodes_replica_is_placed_again_after_forget_and_a_control_restart(cluster):
    cluster.write_config(AGENTS + kv_sim_profile('"--num-blocks", "256"', replicas=0))
    serve = await cluster.start_serve()
    await cluster.start_agent("a", "tiny-2gpu-a")
    await cluster.start_agent("b", "tiny-2gpu-b")
    cluster.write_config(AGENTS + kv_sim_profile('"--num-blocks", "256"', replicas=2))  # both nodes seen: spread
    assert (await cluster.http.post(cluster.control_url + "/admin/reload")).json()["reloaded"]
    replicas = await cluster.settled(2)
    assert {r["node"] for r in replicas.values()} == {"a", "b"}
    lost = next(name for name, r in replicas.items() if r["node"] == "a")
    survivor = next(name for name, r in replicas.items() if r["node"] == "b")
    survivor_pid = shard_pids(replicas)[survivor]

    # The machine dies: its agent and its engine at once.
    cluster.agents["a"].kill(signal.SIGKILL)
    kill_group(shard_pids(replicas)[lost])
    await cluster.replicas_where(f"{lost} out of routing", lambda rs: rs[lost]["state"] != "up", timeout=10)
    await cluster.wait_for("node a disconnected", lambda: cluster.node_is("a", "disconnected"), timeout=10)
    assert {await cluster.chat() for _ in range(4)} == {survivor}

    # The runbook: forget the node, restart the control process.
    forgot = await cluster.http.post(cluster.control_url + "/admin/nodes/a/forget")
    assert forgot.status_code == 200, forgot.text
    serve.kill(signal.SIGTERM)
    assert await serve.wait_exit(timeout=40) == 0
    await cluster.start_serve()
    replicas = await cluster.replicas_where("both replicas up on node b", lambda rs: all_up(2)(rs) and all(
        r["node"] == "b" for r in rs.values()), timeout=30)
    assert shard_pids(replicas)[survivor] == survivor_pid, "the engine that never stopped was not adopted"
    assert sorted({await cluster.chat() for _ in range(6)}) == sorted(replicas)
    nodes = await cluster.nodes()
    assert "a" not in nodes or nodes["a"]["state"] != "connected", nodes
