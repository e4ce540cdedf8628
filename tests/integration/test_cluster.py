"""A cluster on loopback: `llmgw serve` and `llmgw agent` as real processes, simulator engines on fixture GPUs.

Engines outlive agents and the control plane by design, so every test reaps
them at the end (the ledgers in its folder and every pid the admin API showed).
"""

from __future__ import annotations

import json
import os
import signal
from datetime import datetime, timedelta

import openai
import trio
import trio_websocket

from helpers import next_error
from llmgw import wire
from llmgw.testing.cluster import AGENTS, CHAT, TOKEN, alive, all_up, embedded, environ_of, shard_pids
from llmgw.testing.processes import free_port
from llmgw.wire.channel import AgentCredentials

TINY_SIM = """
profiles:
  - name: tiny-sim
    engine: sim
    model_path: tiny
    served_model_name: tiny
    tp: 1
    kv_events: true
    routing: kv_index
    args: ["--num-blocks", "256"]
    env: {}
deployments:
  - profile: tiny-sim
    replicas: 2
"""


async def test_two_agents_run_a_deployment_and_keep_it_through_restarts(cluster):
    # Both nodes join before the deployment asks for replicas, so that placement sees both (and spreads).
    cluster.write_config(AGENTS + TINY_SIM.replace("replicas: 2", "replicas: 0"))
    serve = await cluster.start_serve()
    async with trio.open_nursery() as starting:
        starting.start_soon(cluster.start_agent, "a", "tiny-2gpu-a")
        starting.start_soon(cluster.start_agent, "b", "tiny-2gpu-b")
    cluster.write_config(AGENTS + TINY_SIM)
    reloaded = (await cluster.http.post(cluster.control_url + "/admin/reload")).json()
    assert (reloaded["reloaded"], reloaded["errors"]) == (True, [])
    assert reloaded["summary"]["deployments"] == {"added": [], "removed": [], "changed": ["tiny-sim"]}
    replicas = await cluster.settled(2)

    # Placed one per node, on GPU 0, pinned by UUID in the engine's environment.
    nodes = await cluster.nodes()
    assert {r["node"] for r in replicas.values()} == {"a", "b"}
    for replica in replicas.values():
        (shard,) = replica["shards"]
        node = nodes[replica["node"]]
        assert (shard["rank"], shard["gpu_indices"], shard["state"]) == (0, [0], "ready")
        assert replica["url"] == shard["endpoint"] and replica["model"] == "tiny"
        assert environ_of(shard["pid"])["CUDA_VISIBLE_DEVICES"] == node["gpus"][0]["uuid"]
    for node in nodes.values():
        assert (node["state"], node["used_gpus"], len(node["gpus"])) == ("connected", [0], 2)
        assert "token" not in node

    # Both answer through the OpenAI endpoint (the openai client, as a user would).
    def ask_twice():
        client = openai.OpenAI(base_url=cluster.data_url + "/v1", api_key="unused", max_retries=0)
        return [client.chat.completions.with_raw_response.create(**CHAT).headers["x-llmgw-replica"]
                for _ in range(2)]

    answered = await trio.to_thread.run_sync(ask_twice)
    assert sorted(answered) == sorted(replicas), (replicas, serve.output())

    # An engine killed: out of routing while down (every request goes to the other), restarted by its agent.
    victim, other = sorted(replicas, key=lambda name: replicas[name]["node"])
    old_pid = replicas[victim]["shards"][0]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    await cluster.replicas_where(f"{victim} out of routing", lambda rs: rs[victim]["state"] != "up", timeout=5)
    assert [await cluster.chat() for _ in range(4)] == [other] * 4
    replicas = await cluster.replicas_where(f"{victim} back with a new engine", lambda rs: all_up(2)(rs) and (
        rs[victim]["shards"][0]["pid"] not in (0, old_pid)))
    assert replicas[victim]["shards"][0]["restarts"] >= 1
    pids = shard_pids(replicas)

    # The control plane killed and restarted: the engines are adopted, not restarted.
    serve.kill()
    await serve.wait_exit()
    assert all(alive(pid) for pid in pids.values())
    serve = await cluster.start_serve()
    replicas = await cluster.replicas_where("both replicas adopted", all_up(2))
    assert shard_pids(replicas) == pids
    assert {r["origin"] for r in replicas.values()} == {"adopted"}
    assert sorted({await cluster.chat() for _ in range(4)}) == sorted(replicas)

    # An agent killed: its node is disconnected but its replica keeps serving; a new agent adopts its engine.
    agent_node = replicas[victim]["node"]
    cluster.agents[agent_node].kill()
    await cluster.wait_for(f"node {agent_node} disconnected",
                           lambda: cluster.node_is(agent_node, "disconnected"), timeout=10)
    assert alive(pids[victim])
    assert sorted({await cluster.chat() for _ in range(4)}) == sorted(replicas)  # still routed
    assert (await cluster.replicas())[victim]["state"] == "up"
    await cluster.start_agent(agent_node, f"tiny-2gpu-{agent_node}")
    replicas = await cluster.replicas_where("the engine adopted from the ledger", lambda rs: all_up(2)(rs) and (
        "adopted" in rs[victim]["shards"][0]["reason"]))
    assert shard_pids(replicas) == pids
    assert (await cluster.nodes())[agent_node]["state"] == "connected"


async def test_an_agent_starts_its_engines_on_the_ports_of_engine_ports(cluster):
    port = free_port()
    cluster.write_config(AGENTS + TINY_SIM.replace("replicas: 2", "replicas: 1"))
    await cluster.start_serve()
    await cluster.start_agent("a", "tiny-2gpu-a", extra=["--engine-ports", f"{port}-{port}"])
    (replica,) = (await cluster.settled(1)).values()
    assert replica["url"] == f"http://127.0.0.1:{port}"
    assert await cluster.chat() == replica["name"]


async def test_the_embedded_agent_starts_its_engines_on_the_ports_of_agents_engine_ports(cluster):
    port = free_port()
    base = embedded(cluster.tmp_path / "local").replace("agents:\n", f"agents:\n  engine_ports: {port}-{port}\n", 1)
    cluster.write_config(base + TINY_SIM.replace("replicas: 2", "replicas: 1"))
    await cluster.start_serve()
    (replica,) = (await cluster.settled(1)).values()
    assert replica["url"] == f"http://127.0.0.1:{port}"
    assert await cluster.chat() == replica["name"]


def logged_at(line: str) -> datetime:
    """The time of one of ``llmgw serve``'s log lines (``2026-12-07 08:11:08,930 INFO ...``)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


async def test_a_fresh_start_with_nothing_to_adopt_places_without_waiting_for_the_adoption_window(cluster):
    # A join token (remote agents may join) at the default heartbeat: the adoption window is 5 + 1 = 6 s. Nothing
    # ever joined and the embedded agent's ledger is empty: nothing can be waiting for adoption.
    base = embedded(cluster.tmp_path / "local").replace("agents:\n", f"agents:\n  token: {TOKEN}\n", 1)
    cluster.write_config(base + TINY_SIM)
    serve = await cluster.start_serve()
    await cluster.wait_for("/ready", lambda: _ready(cluster), timeout=60)
    lines = list(serve.lines)
    (waiting,) = [i for i, line in enumerate(lines) if "6s for agents to report running shards" in line]
    placed = [i for i, line in enumerate(lines) if "llmgw.control.plane: place replica" in line]
    assert len(placed) == 2, lines
    # The order of events: the replicas were placed well before the window's end (its deadline is set a moment
    # before the "waiting" line: a second spares that), once it was ended for good reason.
    assert max(logged_at(lines[i]) for i in placed) < logged_at(lines[waiting]) + timedelta(seconds=6 - 1), lines
    early = [i for i, line in enumerate(lines) if "not at the adoption window's end: a fresh start" in line]
    assert len(early) == 1 and waiting < early[0] < min(placed), lines


async def _ready(cluster) -> bool:
    return (await cluster.http.get(cluster.data_url + "/ready")).status_code == 200


FAST_AND_SLOW = """
profiles:
  - name: fast
    engine: sim
    model_path: tiny
    served_model_name: tiny
  - name: slow
    engine: sim
    model_path: slow
    served_model_name: slow
    args: ["--profile", "constant", "--decode-ms-per-step", "100"]
deployments:
  - profile: fast
    replicas: 1
"""


async def test_a_removed_deployment_drains_without_cutting_a_stream(cluster, start_fake_upstream):
    base = embedded(cluster.tmp_path / "local")
    external = await start_fake_upstream("ext", model="ext")
    static = f"models:\n  - name: ext\n    replicas:\n      - url: {external.url}\n        name: ext-0\n"
    cluster.write_config(base + static + FAST_AND_SLOW + "  - profile: slow\n    replicas: 1\n")
    serve = await cluster.start_serve()
    replicas = await cluster.replicas_where("ext, fast and slow up", all_up(3))
    assert {name: r["source"] for name, r in replicas.items()} == {"ext-0": "static", "fast-0": "deployed",
                                                                   "slow-0": "deployed"}
    fast_pid, slow_pid = replicas["fast-0"]["shards"][0]["pid"], replicas["slow-0"]["shards"][0]["pid"]

    # A config with an error is not applied.
    cluster.config_path.write_text(cluster.config_path.read_text().replace("replicas: 1", "replicas: many", 1))
    refused = await cluster.http.post(cluster.control_url + "/admin/reload")
    assert refused.status_code == 422 and "replicas" in refused.json()["errors"][0]
    assert refused.json()["error"]["code"] == "invalid"
    assert set(await cluster.replicas()) == {"ext-0", "fast-0", "slow-0"}

    body = {"model": "slow", "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 30,
            "ignore_eos": True, "stream": True}
    events: list[str] = []
    async with cluster.http.stream("POST", cluster.data_url + "/v1/chat/completions", json=body) as stream:
        lines = stream.aiter_lines()
        while not events:
            line = await lines.__anext__()
            if line.startswith("data: "):
                events.append(line[6:])
        # Mid-stream: the slow deployment is removed, and the config reloaded with SIGHUP.
        cluster.write_config(base + FAST_AND_SLOW)
        serve.kill(signal.SIGHUP)
        draining = await cluster.replicas_where("slow-0 draining", lambda rs: rs["slow-0"]["state"] == "draining",
                                                timeout=5)
        assert draining["slow-0"]["inflight"] == 1 and draining["slow-0"]["retiring"]
        gone = await cluster.http.post(cluster.data_url + "/v1/chat/completions", json=CHAT | {"model": "slow"})
        assert gone.status_code == 404  # no new request for a removed model
        async for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert sum(1 for c in chunks for choice in c["choices"] if choice["delta"].get("content")) == 30
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the whole answer: nothing was cut

    replicas = await cluster.replicas_where("slow-0 retired", lambda rs: set(rs) == {"fast-0"}, timeout=10)
    models = (await cluster.http.get(cluster.data_url + "/v1/models")).json()["data"]
    assert [m["id"] for m in models] == ["tiny"]  # the static model went with the reload too
    await cluster.wait_for("the slow engine to exit", lambda: trio.to_thread.run_sync(lambda: not alive(slow_pid)),
                           timeout=10)
    assert replicas["fast-0"]["shards"][0]["pid"] == fast_pid and replicas["fast-0"]["state"] == "up"
    assert await cluster.chat() == "fast-0"


async def test_a_wrong_token_and_reports_about_foreign_shards_are_refused(cluster):
    cluster.write_config(embedded(cluster.tmp_path / "local", token=True) + TINY_SIM.replace("replicas: 2",
                                                                                              "replicas: 1"))
    await cluster.start_serve()
    replicas = await cluster.replicas_where("the local replica up", all_up(1))
    (shard,) = replicas["tiny-sim-0"]["shards"]
    assert shard["node"] == "local"

    intruder = await cluster.start_agent("intruder", "tiny-2gpu-b", token="guess", ready=" refused by ")
    assert await intruder.wait_exit() == 3
    # refused at the websocket upgrade: its Register is never read
    assert await cluster.metric("llmgw_agent_upgrades_refused_total", 'reason="bad_token"') == 1
    assert "guess" not in intruder.output().replace("--token guess", "")

    # A node with the right token speaks only for its own shards: it can neither claim nor change local's.
    foreign = wire.ShardReport(shard_id=shard["shard_id"], replica_id="tiny-sim-0", state=wire.ShardState.READY,
                               endpoint="http://127.0.0.1:9", fingerprint="x", pid=1)
    url = cluster.control_url.replace("http://", "ws://") + "/agent"
    async with trio_websocket.open_websocket_url(url, extra_headers=AgentCredentials(TOKEN.encode()).headers()) \
            as ws:
        await ws.send_message(wire.encode(wire.Register(node_id="crafty", token=TOKEN, address="127.0.0.1",
                                                        shards=[foreign])))
        assert wire.decode(await ws.get_message()).accepted
        refusals = [await next_error(ws)]
        stopped = wire.ShardReport(shard_id=shard["shard_id"], replica_id="tiny-sim-0",
                                   state=wire.ShardState.STOPPED)
        await ws.send_message(wire.encode(wire.ShardStatus(shard=stopped)))
        refusals.append(await next_error(ws))
    assert [(e.code, e.about) for e in refusals] == [("foreign_shard", shard["shard_id"])] * 2
    assert "placed on node local" in refusals[0].message
    assert await cluster.metric("llmgw_agent_refused_total", 'reason="foreign_shard"') == 2
    replicas = await cluster.replicas()
    assert replicas["tiny-sim-0"]["url"] == shard["endpoint"] and replicas["tiny-sim-0"]["state"] == "up"
    assert replicas["tiny-sim-0"]["shards"][0]["state"] == "ready"
    assert (await cluster.nodes())["crafty"]["shards"] == []
    assert await cluster.chat() == "tiny-sim-0"


GANG = """
profiles:
  - name: tiny-gang
    engine: sim
    model_path: tiny
    served_model_name: tiny
    tp: 2
    nodes: 2
deployments:
  - profile: tiny-gang
    replicas: 1
"""


async def test_a_two_node_profile_is_placed_as_a_gang_or_not_at_all(cluster):
    cluster.write_config(AGENTS + GANG)
    await cluster.start_serve()
    await cluster.start_agent("a", "tiny-2gpu-a")
    replicas = await cluster.replicas_where("the gang unplaced", lambda rs: rs["tiny-gang-0"]["state"] == "unplaced")
    assert "gang needs 2 nodes, 1 fits" in replicas["tiny-gang-0"]["reason"]
    assert replicas["tiny-gang-0"]["shards"] == []
    assert await cluster.metric("llmgw_placement_failures_total") == 1

    await cluster.start_agent("b", "tiny-2gpu-b")
    # The replica routes as soon as rank 0 is Ready; rank 1 (a whole simulator here) may still be loading then.
    replicas = await cluster.replicas_where(
        "the gang up with every rank ready",
        lambda rs: all_up(1)(rs) and all(s["state"] == "ready" for s in rs["tiny-gang-0"]["shards"]))
    gang = replicas["tiny-gang-0"]
    shards = sorted(gang["shards"], key=lambda s: s["rank"])
    assert [(s["rank"], s["node"], s["gpu_indices"], s["state"]) for s in shards] == [
        (0, "a", [0], "ready"), (1, "b", [0], "ready")]
    assert {(s["leader_address"], s["leader_port"]) for s in shards} == {("127.0.0.1", 29500)}
    assert len({s["shard_id"].rsplit("-r", 1)[0] for s in shards}) == 1  # one replica, one generation
    assert gang["url"] == shards[0]["endpoint"] and gang["node"] == "a"  # rank 0 is the endpoint
    assert await cluster.chat() == "tiny-gang-0"
