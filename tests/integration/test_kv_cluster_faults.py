"""The KV-index tier's failure handling through the real product path: `llmgw serve` with its embedded agent,
simulator engines started by that agent (a `sim` profile, `kv_events: true`, `routing: kv_index`, 2 replicas).

- batches the engine deliberately leaves off its live stream (the simulator's ``--drop-event-seqs``) are replayed
  by the agent's subscription through the replay socket the engine plugin configures, and the index stays exact;
- ``POST /reset_prefix_cache`` on one engine clears that replica's index (reason ``cleared``) and no other;
- a ``/tokenize`` slower than the tier's ``tokenize_timeout`` and an unindexable request (an image part) each give
  a tree decision, counted in ``llmgw_prefix_decisions_total{tier="kv_index"}``.

Not here: a gap with replay off. The agent always gives the engine a replay endpoint (``kv_events_flags``) and
profiles have no switch to drop it; a second ``--kv-events-config`` in the profile's args would win in the
simulator's parser, but it would have to name the agent's SUB port, which is bound (port 0) only when the shard
starts. That case is proven against real simulator processes in ``test_kv_pipeline.py``.
"""

from __future__ import annotations

import pytest
import trio

from llmgw.bench import kv_truth
from cluster_helpers import BLOCK, all_up, complete, embedded, kv_sim, kv_state, kv_where, text

pytestmark = pytest.mark.slow


async def start(cluster, profile: str) -> dict[str, dict]:
    """`llmgw serve` with the embedded agent; both replicas up and their indexes healthy (the FULL copy)."""
    cluster.write_config(embedded(cluster.tmp_path / "local", token=True) + profile)
    await cluster.start_serve()
    replicas = await cluster.replicas_where("two replicas up", all_up(2))
    await kv_where(cluster, "both indexes healthy", lambda s: all(
        s.get(name, {}).get("state") == "healthy" for name in replicas))
    return replicas


async def engine_cached_blocks(cluster, url: str) -> int:
    """The engine's own count of blocks holding a hash (``llmgw_sim_cached_blocks`` on its /metrics)."""
    return await kv_truth.engine_cached_blocks(cluster.http, url)


async def decision_lines(cluster) -> list[str]:
    """Every ``llmgw_prefix_decisions_total`` series (for failure messages)."""
    body = (await cluster.http.get(cluster.control_url + "/metrics")).text
    return [line for line in body.splitlines() if line.startswith("llmgw_prefix_decisions_total")]


async def subscriptions(cluster) -> dict[str, dict]:
    """The embedded agent's subscription per replica: rank 0's blocks, last_seq, gaps, resets, parity."""
    return {s["replica_id"]: s["ranks"][0] for s in (await cluster.admin("/admin/kv"))["agent_subscriptions"]}


async def test_dropped_event_batches_are_replayed_and_the_index_stays_exact(cluster):
    # Every third batch (seq 3, 6, ...) is kept for replay but never sent live. No evictions (1024 blocks), so
    # every batch stores blocks: equal block counts mean every batch reached the index.
    replicas = await start(cluster, kv_sim('"--num-blocks", "1024", "--time-scale", "0", '
                                           '"--drop-event-seqs", "every:3"'))
    holders: dict[str, str] = {}
    with trio.fail_after(60):
        for i in range(24):  # distinct cold prompts alternate between the replicas; one batch each
            prompt = text(100 + i, 400 + 32 * i)
            holders[prompt], usage = await complete(cluster, prompt)
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0
            subs = await subscriptions(cluster)
            if all(subs[name]["gaps"] >= 1 and subs[name]["last_seq"] >= 4 for name in replicas):
                break
        assert set(holders.values()) == set(replicas)

    async def exact():
        state, subs = await kv_state(cluster), await subscriptions(cluster)
        counts = {name: (state[name]["blocks"], subs[name]["blocks"],
                         await engine_cached_blocks(cluster, replicas[name]["url"])) for name in replicas}
        ok = all(index == mirror == engine > 0 for index, mirror, engine in counts.values())
        return (state, subs, counts) if ok else None

    # A dropped last batch shows only at the idle probe (2 s): poll until index == mirror == engine.
    state, subs, counts = await cluster.wait_for("index, mirror and engine agree", exact, timeout=20)
    gaps = sum(subs[name]["gaps"] for name in replicas)
    assert all(subs[name]["gaps"] >= 1 for name in replicas), subs
    # Every hole was filled by replay: no other replay result, no reset, nothing unknown removed.
    assert await cluster.metric("llmgw_kv_replays_total", 'result="filled"') == gaps
    for result in ("incomplete", "timeout", "disabled"):
        assert await cluster.metric("llmgw_kv_replays_total", f'result="{result}"') == 0
    for name in replicas:
        assert state[name]["state"] == "healthy" and state[name]["resets"] == 0, state[name]
        assert not any(subs[name]["resets"].values()) and subs[name]["parity"] is not False, subs[name]
        assert await cluster.metric("llmgw_kv_resets_total", f'replica="{name}"') == 0

    # A request sharing the last prompt's prefix goes to its holder, predicted == the engine's cached_tokens.
    prompt = list(holders)[-1]
    chosen, usage = await complete(cluster, prompt + " and a follow-up question")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert chosen == holders[prompt] and cached >= (len(prompt) // BLOCK - 1) * BLOCK > 0
    assert await cluster.metric("llmgw_prefix_decisions_total", 'tier="kv_index",outcome="hit"') == 1
    predicted = await cluster.metric("llmgw_route_predicted_cached_tokens_total", 'model="tiny"')
    actual = await cluster.metric("llmgw_route_actual_cached_tokens_total", 'model="tiny"')
    assert predicted == actual == cached


async def test_a_prefix_cache_reset_clears_that_replicas_index_only(cluster):
    replicas = await start(cluster, kv_sim('"--num-blocks", "512", "--time-scale", "0"'))
    first, second = sorted(replicas)
    for seed, name in enumerate((first, second)):  # one prompt straight to each engine
        await complete(cluster, text(200 + seed, 1500), url=replicas[name]["url"])
    before = await kv_where(cluster, "both replicas hold blocks",
                            lambda s: s[first]["blocks"] > 0 and s[second]["blocks"] > 0)

    response = await cluster.http.post(replicas[first]["url"] + "/reset_prefix_cache")
    assert response.json() == {"success": True}
    state = await kv_where(cluster, f"{first}'s index cleared", lambda s: s[first]["blocks"] == 0
                           and s[first]["last_reset_reason"] == "cleared")
    assert state[first]["resets"] == 1
    assert state[second]["blocks"] == before[second]["blocks"] and state[second]["resets"] == 0
    assert await cluster.metric("llmgw_kv_resets_total", f'replica="{first}",reason="cleared"') == 1
    assert await cluster.metric("llmgw_kv_resets_total", f'replica="{second}"') == 0
    assert await engine_cached_blocks(cluster, replicas[first]["url"]) == 0

    # Fresh stores after the reset: the replica is healthy again and indexes exactly what its engine holds.
    await complete(cluster, text(202, 1500), url=replicas[first]["url"])
    engine_blocks = await engine_cached_blocks(cluster, replicas[first]["url"])
    state = await kv_where(cluster, f"{first} relearns", lambda s: s[first]["state"] == "healthy"
                           and s[first]["blocks"] == engine_blocks > 0)
    assert state[second]["blocks"] == before[second]["blocks"] and state[second]["resets"] == 0


async def test_a_tokenize_timeout_and_an_unindexable_request_get_counted_tree_decisions(cluster):
    # A 1 µs /tokenize deadline (nothing added per KiB), and a 250k-token prompt whose /tokenize answer (> 1 MB
    # of ids) takes several reads: the deadline has passed by the first wait, so it cuts the call whatever the
    # scheduling (a small answer can be read in the very tick the deadline expires, and be accepted).
    replicas = await start(cluster, kv_sim('"--num-blocks", "20000", "--max-model-len", "300000", '
                                           '"--time-scale", "0"',
                                           "{tokenize_timeout: 0.001ms, tokenize_timeout_per_kb: 0}"))
    decisions = 'model="tiny",tier="kv_index",outcome='

    with trio.fail_after(30):
        chosen, usage = await complete(cluster, text(300, 250_000))  # routed anyway, by the tree
    assert chosen in replicas and usage["prompt_tokens"] > 0
    assert await cluster.metric("llmgw_prefix_decisions_total", decisions + '"tokenize_timeout"') == 1, \
        await decision_lines(cluster)

    # An image part: not indexable (its hashes need the engine's multimodal processing). The tree routes it;
    # the simulator, having no vision, answers 400 as vLLM does for a text-only model.
    image = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,x"}}]}]}
    with trio.fail_after(10):
        response = await cluster.http.post(cluster.data_url + "/v1/chat/completions", json=image)
    assert response.headers.get("x-llmgw-replica") in replicas, (response.status_code, response.text)
    assert await cluster.metric("llmgw_prefix_decisions_total", decisions + '"unindexable"') == 1

    # Both were tree decisions: the index decided nothing, and no other kv_index outcome was counted.
    for outcome in ("hit", "miss", "load_override", "tokenize_error", "index_unhealthy"):
        assert await cluster.metric("llmgw_prefix_decisions_total", decisions + f'"{outcome}"') == 0, outcome
    assert await cluster.metric("llmgw_route_predicted_cached_tokens_total", 'model="tiny"') == 0
