"""The KV-index tier wired end to end: `llmgw serve` with its embedded agent, simulator engines publishing KV events.

engine PUB -> the agent's EngineSubscription (bound by the agent before the engine starts) -> EngineMirror
-> KvChanges up the agent's stream (a FULL on connect, then deltas) -> the control plane (ownership checked)
-> the router's KvIndex -> the kv_index tier; the data plane hands each response's usage back to the tier.

The component-level cases (gaps filled by replay, resets when replay cannot fill them, AllBlocksCleared,
tokenize timeouts, unindexable requests) are in ``test_kv_pipeline.py``.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import httpx
import pytest
import trio
import trio_websocket

from helpers import next_error
from llmgw import wire
from llmgw.testing.cluster import AGENTS, BLOCK, TOKEN, all_up, complete, embedded, kv_state, kv_where, text
from llmgw.testing.processes import llmgw_command, start_child
from llmgw.testing.sims import kv_sim_profile as kv_sim
from llmgw.wire.channel import AgentCredentials

pytestmark = pytest.mark.slow

KV_SIM = kv_sim('"--num-blocks", "512", "--time-scale", "0"')


async def test_kv_events_route_to_the_holder_predict_exactly_and_only_their_owner_changes_them(cluster):
    cluster.write_config(embedded(cluster.tmp_path / "local", token=True) + KV_SIM)
    await cluster.start_serve()
    replicas = await cluster.replicas_where("two replicas up", all_up(2))
    # Each replica's FULL copy (empty) arrived through the embedded agent's stream: healthy, nothing held.
    await kv_where(cluster, "both indexes healthy", lambda s: all(
        s.get(name, {}).get("state") == "healthy" for name in replicas))

    # A long prompt once: its replica's index fills with exactly the engine's blocks, the other's stays empty.
    long_prompt = text(1, 3000)
    holder, usage = await complete(cluster, long_prompt)
    other = next(name for name in replicas if name != holder)
    prompt_blocks = usage["prompt_tokens"] // BLOCK
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    state = await kv_where(cluster, f"{holder}'s prompt blocks indexed",
                           lambda s: s[holder]["blocks"] >= prompt_blocks)
    assert state[other]["blocks"] == 0 and state[holder]["block_size"] == BLOCK

    # A request sharing the prefix goes to the holder, and the router predicted what the engine then served.
    chosen, usage = await complete(cluster, long_prompt + " and now a different question")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert chosen == holder and cached >= (prompt_blocks - 1) * BLOCK
    assert await cluster.metric("llmgw_routing_decisions_total", 'tier="kv_index",outcome="hit"') == 1
    predicted = await cluster.metric("llmgw_route_predicted_cached_tokens_total", 'model="tiny"')
    actual = await cluster.metric("llmgw_route_actual_cached_tokens_total", 'model="tiny"')
    assert predicted == actual == cached

    # A node with the right token cannot change another node's replica's index (nor invent one).
    state = await kv_where(cluster, f"{holder}'s second prompt indexed",
                           lambda s: s[holder]["blocks"] >= usage["prompt_tokens"] // BLOCK)
    held = state[holder]["blocks"]
    shard_id = replicas[holder]["shards"][0]["shard_id"]
    url = cluster.control_url.replace("http://", "ws://") + "/agent"
    async with trio_websocket.open_websocket_url(url, extra_headers=AgentCredentials(TOKEN.encode()).headers()) \
            as ws:
        await ws.send_message(wire.encode(wire.Register(node_id="crafty", token=TOKEN, address="127.0.0.1")))
        assert wire.decode(await ws.get_message()).accepted
        for shard, replica in ((shard_id, holder), ("nowhere-g1-r0", "nowhere")):
            await ws.send_message(wire.encode(wire.KvChanges(
                shard_id=shard, replica_id=replica, kind=wire.KvChangeKind.FULL, block_size=BLOCK, stored=[1, 2])))
        codes = [(await next_error(ws)).code for _ in range(2)]
    assert codes == ["kv_foreign_replica", "kv_unknown_replica"]
    assert await cluster.metric("llmgw_kv_changes_refused_total", 'node="crafty",reason="foreign_replica"') == 1
    assert await cluster.metric("llmgw_kv_changes_refused_total", 'node="crafty",reason="unknown_replica"') == 1
    state = await kv_state(cluster)
    assert state[holder]["blocks"] == held and "nowhere" not in state

    # A stream with include_usage: the data plane finds the final usage chunk among the stream's last pieces.
    body = {"model": "tiny", "prompt": long_prompt + " streamed", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    async with cluster.http.stream("POST", cluster.data_url + "/v1/completions", json=body) as response:
        assert response.headers["x-llmgw-replica"] == holder
        lines = [line async for line in response.aiter_lines()]
    final = json.loads(next(line for line in reversed(lines) if line.startswith("data: {"))[6:])
    assert final["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    cached += final["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def counted():
        actual = await cluster.metric("llmgw_route_actual_cached_tokens_total", 'model="tiny"')
        predicted = await cluster.metric("llmgw_route_predicted_cached_tokens_total", 'model="tiny"')
        return actual == predicted == cached

    await cluster.wait_for("the streamed usage counted", counted, timeout=5)
    # Normal operation: every check of a response against the index is a match, none drifted.
    checks = {r["name"]: r["drift"] for r in (await cluster.admin("/admin/kv"))["replicas"]}
    assert sum(d["match"] for d in checks.values()) >= 2, checks
    assert all(d["over"] == d["under"] == 0 and d["resyncs"] == {"full": 0, "reset": 0} for d in checks.values())
    assert await cluster.metric("llmgw_route_drift_total") == 0

    # The other replica learns a prompt sent straight to its engine.
    await complete(cluster, text(2, 1500), url=replicas[other]["url"])
    state = await kv_where(cluster, f"{other} holds blocks", lambda s: s[other]["blocks"] > 0)
    other_blocks = state[other]["blocks"]

    # The holder's engine killed: its supervisor restarts it (sequence back to 0), its index is cleared, the
    # other replica's is not touched.
    old_pid = replicas[holder]["shards"][0]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    state = await kv_where(cluster, f"{holder}'s index reset", lambda s: s[holder]["blocks"] == 0
                           and s[holder]["last_reset_reason"] == "engine_restart")
    assert state[other]["blocks"] == other_blocks and state[other]["resets"] == 0
    assert await cluster.metric("llmgw_kv_resets_total", f'replica="{holder}",reason="engine_restart"') >= 1
    replicas = await cluster.replicas_where(f"{holder} back on a new engine", lambda rs: all_up(2)(rs) and (
        rs[holder]["shards"][0]["pid"] not in (0, old_pid)))
    # The restarted engine's events reach the same subscription: the replica's index learns again.
    await complete(cluster, long_prompt, url=replicas[holder]["url"])
    await kv_where(cluster, f"{holder} relearns", lambda s: s[holder]["blocks"] >= prompt_blocks
                   and s[holder]["state"] == "healthy" and s[other]["blocks"] == other_blocks)
    agent = (await cluster.admin("/admin/kv"))["agent_subscriptions"]
    assert {s["replica_id"] for s in agent} == set(replicas)
    assert all(rank["parity"] is not False for s in agent for rank in s["ranks"])


async def static_kv_replica(nursery, start_llmgw, folder: Path, *, engine_args=(),
                            routing_options="tokenize_timeout: 2s"):
    """A simulator llmgw did not start, binding its publisher, and a gateway following it as static ``ext-0``:
    over unix sockets in a folder only this user can open (as docs/security.md advises)."""
    folder.mkdir(mode=0o700)
    events, replay = f"ipc://{folder}/ext-0.ev", f"ipc://{folder}/ext-0.rp"
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                         "replay_endpoint": replay, "topic": "kv"})
    argv = llmgw_command("sim", "--port", "0", "--served-model-name", "tiny", "--profile", "constant",
                         "--time-scale", "0",
                         "--prefix-caching-hash-algo", "sha256_cbor", "--kv-events-config", config, *engine_args)
    engine = await start_child(nursery, argv, name="sim-ext", env={"PYTHONHASHSEED": "0"})
    gateway = await start_llmgw(f"""
models:
  - name: tiny
    routing: kv_index
    routing_options: {{{routing_options}}}
    replicas:
      - url: {engine.url}
        name: ext-0
        kv_events: {events}
        kv_replay: {replay}
""")
    return engine, gateway


async def test_a_static_replica_with_kv_events_feeds_the_index(nursery, start_llmgw, tmp_path):
    """An engine llmgw did not start binds its publisher; the gateway connects (``kv_events``/``kv_replay``)."""
    engine, gateway = await static_kv_replica(nursery, start_llmgw, tmp_path / "kv")
    async with httpx.AsyncClient(timeout=10) as http:
        async def state():
            return {r["name"]: r for r in (await http.get(gateway.control_url + "/admin/kv")).json()["replicas"]}

        with trio.fail_after(20):
            while (await state()).get("ext-0", {}).get("state") != "healthy":  # the FULL copy (empty)
                await trio.sleep(0.05)
            answer = await http.post(engine.url + "/v1/completions",
                                     json={"model": "tiny", "prompt": text(3, 2000), "max_tokens": 1})
            blocks = answer.json()["usage"]["prompt_tokens"] // BLOCK
            while (await state())["ext-0"]["blocks"] < blocks:  # learnt from the engine's own events
                await trio.sleep(0.05)


async def unpublished_reset_heals(http: httpx.AsyncClient, control_url: str, data_url: str, engine_url: str,
                                  name: str) -> None:
    """The engine at ``engine_url`` (``--suppress-events AllBlocksCleared``, the replica ``name``'s only engine,
    ``drift_suspect_after: 1``) drops its cache without telling: the first drift asks for a full copy (which
    does not help: the mirror is as stale), the relapse for a reset; then the index predicts exactly again."""
    prompts = [text(40 + i, 800) for i in range(3)]

    async def entry() -> dict:
        return next(r for r in (await http.get(control_url + "/admin/kv")).json()["replicas"] if r["name"] == name)

    async def until(check) -> dict:
        with trio.fail_after(20):
            while not check(state := await entry()):
                await trio.sleep(0.05)
        return state

    async def cached(prompt: str, url: str = data_url) -> int:
        answer = await http.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for prompt in prompts:
        await cached(prompt, engine_url)
    await until(lambda e: e["blocks"] >= 3 * (800 // BLOCK))
    assert (await http.post(engine_url + "/reset_prefix_cache")).json() == {"success": True}  # unpublished

    assert await cached(prompts[0]) == 0  # the index promised 49 blocks: suspect, a full copy asked
    state = await until(lambda e: e["drift"]["resyncs"]["full"] == 1 and e["state"] == "healthy")
    assert state["drift"]["over"] == 1 and state["blocks"] > 0  # the mirror was as stale as the index
    assert await cached(prompts[1]) == 0  # again: the mirror is dropped
    state = await until(lambda e: e["last_reset_reason"] == "resync")
    assert state["drift"]["resyncs"] == {"full": 1, "reset": 1} and state["drift"]["over"] == 2
    await cached(prompts[2])  # stored again after the reset: learnt from its events
    await until(lambda e: e["state"] == "healthy" and e["blocks"] > 0)
    assert await cached(prompts[2]) > 0
    state = await until(lambda e: e["drift"]["match"] >= 1)
    assert state["drift"]["over"] == 2 and state["state"] == "healthy"


async def test_a_static_replicas_drifting_index_resyncs_its_own_subscription(nursery, start_llmgw, tmp_path):
    """The gateway follows the engine itself: a suspect index's resync goes to that subscription's mirror."""
    engine, gateway = await static_kv_replica(nursery, start_llmgw, tmp_path / "kv", engine_args=(
        "--suppress-events", "AllBlocksCleared"), routing_options="tokenize_timeout: 2s, drift_suspect_after: 1")
    async with httpx.AsyncClient(timeout=10) as http:
        await unpublished_reset_heals(http, gateway.control_url, gateway.url, engine.url, "ext-0")


async def test_a_remote_agents_drifting_replica_is_resynced_over_its_websocket(cluster):
    """A separate `llmgw agent` process: the KvResync requests travel the agent's websocket (encoded)."""
    cluster.write_config(AGENTS + kv_sim('"--num-blocks", "1024", "--time-scale", "0", "--suppress-events", '
                                         '"AllBlocksCleared"', "{tokenize_timeout: 2s, drift_suspect_after: 1}")
                         .replace("replicas: 2", "replicas: 1"))
    await cluster.start_serve()
    await cluster.start_agent("a", "tiny-2gpu-a")
    replicas = await cluster.replicas_where("the replica up", all_up(1))
    (name,) = replicas
    await kv_where(cluster, "its index healthy", lambda s: s.get(name, {}).get("state") == "healthy")
    await unpublished_reset_heals(cluster.http, cluster.control_url, cluster.data_url, replicas[name]["url"], name)
    assert "asks for a full KV resync" in cluster.agents["a"].output()
    assert "asks for a reset KV resync" in cluster.agents["a"].output()


async def test_an_agent_restart_keeps_the_engines_kv_sockets_and_the_index_is_restored(cluster):
    """The ledger keeps the engine's KV-event sockets: a new agent connects to them, and replay restores the
    index."""
    cluster.write_config(AGENTS + KV_SIM.replace("replicas: 2", "replicas: 1"))
    await cluster.start_serve()
    await cluster.start_agent("a", "tiny-2gpu-a")
    replicas = await cluster.replicas_where("the replica up", all_up(1))
    (name,) = replicas
    await kv_where(cluster, "its index healthy", lambda s: s.get(name, {}).get("state") == "healthy")
    long_prompt = text(4, 3000)
    _, usage = await complete(cluster, long_prompt)
    held = await kv_where(cluster, "its blocks indexed", lambda s: s[name]["blocks"] >= usage["prompt_tokens"] // BLOCK)

    # The agent dies: its stream ends, so the replica's index is no longer trusted (the tree routes it).
    cluster.agents["a"].kill()
    await kv_where(cluster, "the index forgotten", lambda s: s[name]["state"] == "no_events" and not s[name]["blocks"])
    assert (await cluster.replicas())[name]["state"] == "up"  # still routed

    # A new agent adopts the engine, connects to the sockets the engine bound, and replay fills its new mirror.
    await cluster.start_agent("a", "tiny-2gpu-a")
    await cluster.replicas_where("the engine adopted", lambda rs: "adopted" in rs[name]["shards"][0]["reason"])
    await kv_where(cluster, "the index restored", lambda s: s[name]["state"] == "healthy"
                   and s[name]["blocks"] == held[name]["blocks"])
    (entry,) = json.loads((cluster.tmp_path / "agent-a" / "shards.json").read_text())["shards"].values()
    sockets = [Path(entry[key].removeprefix("ipc://")) for key in ("kv_events_endpoint", "kv_replay_endpoint")]
    assert all(stat.S_ISSOCK(path.stat().st_mode) for path in sockets)
    assert sockets[0].parent == cluster.tmp_path / "agent-a" / "kv"
    chosen, usage = await complete(cluster, long_prompt + " again")
    assert chosen == name and usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert await cluster.metric("llmgw_route_predicted_cached_tokens_total", 'model="tiny"') == \
        await cluster.metric("llmgw_route_actual_cached_tokens_total", 'model="tiny"')
