"""The KV-index tier's failure handling through the real product path: `llmgw serve` with its embedded agent,
simulator engines started by that agent (a `sim` profile, `kv_events: true`, `routing: kv_index`, 2 replicas).

- batches the engine deliberately leaves off its live stream (the simulator's ``--drop-event-seqs``) are replayed
  by the agent's subscription through the replay socket the engine plugin configures, and the index stays exact;
- ``POST /reset_prefix_cache`` on one engine clears that replica's index (reason ``cleared``) and no other;
- after that reset the replica's *predicted* entries are gone too: the next identical request is predicted 0
  cached tokens, as the engine then reports;
- an engine that never publishes its ``AllBlocksCleared`` (the simulator's ``--suppress-events``: no sequence gap,
  the agent cannot notice) leaves the index promising blocks the engine dropped; the responses' cached tokens
  drift from the prediction, the replica's index turns suspect, the agent is asked for a full copy and, when that
  does not help (its mirror is as wrong), for a reset: the index heals by itself and predicts exactly again;
- a burst of concurrent requests sharing a new prefix (routed by predicted entries before any event) counts
  no ``over`` drift: the rule compares the engine's answer with confirmed blocks only;
- a ``/tokenize`` slower than the tier's ``tokenize_timeout`` and an unindexable request (an image part) each give
  a tree decision, counted in ``llmgw_routing_decisions_total{tier="kv_index"}``.

Not here: a gap with replay off. The agent always gives the engine a replay endpoint (``kv_events_flags``) and
profiles have no switch to drop it; a second ``--kv-events-config`` in the profile's args would win in the
simulator's parser, but it would have to name the agent's SUB port, which is bound (port 0) only when the shard
starts. That case is proven against real simulator processes in ``test_kv_pipeline.py``.
"""

from __future__ import annotations

import pytest
import trio

from llmgw.bench import kv_truth
from llmgw.testing.cluster import BLOCK, all_up, complete, embedded, kv_state, kv_where, text
from llmgw.testing.sims import kv_sim_profile as kv_sim

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
    """Every ``llmgw_routing_decisions_total`` series (for failure messages)."""
    body = (await cluster.http.get(cluster.control_url + "/metrics")).text
    return [line for line in body.splitlines() if line.startswith("llmgw_routing_decisions_total")]


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
            # last_seq is None while a subscription's first gap is being filled (nothing applied yet): not yet 4
            if all(subs[name]["gaps"] >= 1 and (subs[name]["last_seq"] or 0) >= 4 for name in replicas):
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
    assert await cluster.metric("llmgw_routing_decisions_total", 'tier="kv_index",outcome="hit"') == 1
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
    assert await cluster.metric("llmgw_routing_decisions_total", decisions + '"tokenize_timeout"') == 1, \
        await decision_lines(cluster)

    # An image part: not indexable (its hashes need the engine's multimodal processing). The tree routes it;
    # the simulator, having no vision, answers 400 as vLLM does for a text-only model.
    image = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,x"}}]}]}
    with trio.fail_after(10):
        response = await cluster.http.post(cluster.data_url + "/v1/chat/completions", json=image)
    assert response.headers.get("x-llmgw-replica") in replicas, (response.status_code, response.text)
    assert await cluster.metric("llmgw_routing_decisions_total", decisions + '"unindexable"') == 1

    # Both were tree decisions: the index decided nothing, and no other kv_index outcome was counted.
    for outcome in ("hit", "miss", "load_override", "tokenize_error", "index_unhealthy"):
        assert await cluster.metric("llmgw_routing_decisions_total", decisions + f'"{outcome}"') == 0, outcome
    assert await cluster.metric("llmgw_route_predicted_cached_tokens_total", 'model="tiny"') == 0


async def learn_block_sizes(cluster, replicas: dict[str, dict]) -> None:
    """One unrelated prompt straight to each engine: its events tell the index the engine's block size."""
    for seed, name in enumerate(sorted(replicas)):
        await complete(cluster, text(700 + seed, 200), url=replicas[name]["url"])
    await kv_where(cluster, "every index knows its block size", lambda s: all(
        s[name]["block_size"] for name in replicas))


async def routed_prediction(cluster) -> tuple[float, float]:
    """(predicted, actual) cached tokens counted so far by the kv_index tier."""
    return (await cluster.metric("llmgw_route_predicted_cached_tokens_total", 'model="tiny"'),
            await cluster.metric("llmgw_route_actual_cached_tokens_total", 'model="tiny"'))


async def test_a_prefix_cache_reset_drops_the_replicas_predicted_entries_too(cluster):
    # Predicted entries live a minute here: without the drop they would outlive the reset for sure.
    replicas = await start(cluster, kv_sim('"--num-blocks", "512", "--time-scale", "0"',
                                           "{tokenize_timeout: 2s, predicted_ttl: 60s}"))
    prompt = text(400, 1200)
    await learn_block_sizes(cluster, replicas)
    holder, usage = await complete(cluster, prompt)
    again, usage = await complete(cluster, prompt)  # routed by the holder's blocks (events or predicted entries)
    assert again == holder and usage["prompt_tokens_details"]["cached_tokens"] > 0
    await kv_where(cluster, f"{holder} indexed the prompt", lambda s: s[holder]["blocks"] > 0)

    response = await cluster.http.post(replicas[holder]["url"] + "/reset_prefix_cache")
    assert response.json() == {"success": True}
    await kv_where(cluster, f"{holder}'s index cleared", lambda s: s[holder]["last_reset_reason"] == "cleared")
    # Once the reset window is over the index scores the replica again (and would count predicted entries).
    await kv_where(cluster, f"{holder} healthy again", lambda s: s[holder]["state"] == "healthy")
    before = await routed_prediction(cluster)
    chosen, usage = await complete(cluster, prompt)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    after = await cluster.wait_for("the response's usage counted", lambda: _counted(cluster, before))
    assert after == before, (chosen, holder, before, after)  # predicted 0, and the engine reported 0


async def _counted(cluster, before):
    """The counters once the third response reached finished() (its drift check is counted then)."""
    state = await kv_state(cluster)
    checks = sum(r["drift"][result] for r in state.values() for result in ("match", "over", "under"))
    return await routed_prediction(cluster) if checks >= 3 else None


async def test_drift_from_an_unpublished_reset_makes_the_index_suspect_and_it_heals_itself(cluster):
    replicas = await start(cluster, kv_sim('"--num-blocks", "2048", "--time-scale", "0", '
                                           '"--suppress-events", "AllBlocksCleared"',
                                           "{tokenize_timeout: 2s, drift_suspect_after: 2}"))
    await learn_block_sizes(cluster, replicas)
    first = sorted(replicas)[0]
    url = replicas[first]["url"]
    prompts = [text(500 + i, 800) for i in range(6)]
    for prompt in prompts:  # straight to the engine: only its events tell the router
        await complete(cluster, prompt, url=url)
    engine_blocks = await engine_cached_blocks(cluster, url)
    await kv_where(cluster, f"{first} indexed its prompts", lambda s: s[first]["blocks"] == engine_blocks > 0)

    # The engine drops its cache and publishes nothing: the agent's mirror and the index still hold every block.
    assert (await cluster.http.post(url + "/reset_prefix_cache")).json() == {"success": True}
    assert await engine_cached_blocks(cluster, url) == 0
    suppressed = [line for line in (await cluster.http.get(url + "/metrics")).text.splitlines()
                  if line.startswith("llmgw_sim_kv_events_suppressed_total")]
    assert suppressed and float(suppressed[0].rsplit(" ", 1)[1]) >= 1
    assert (await kv_state(cluster))[first]["blocks"] == engine_blocks

    async def drifted(prompt: str, over: int) -> dict:
        chosen, usage = await complete(cluster, prompt)
        assert chosen == first and usage["prompt_tokens_details"]["cached_tokens"] == 0  # the index's pick: empty
        return await kv_where(cluster, f"{over} over drifts on {first}", lambda s: s[first]["drift"]["over"] == over)

    await drifted(prompts[0], 1)
    state = await drifted(prompts[1], 2)  # two within the window: suspect, the agent is asked for a full copy
    assert state[first]["drift"]["resyncs"]["full"] == 1
    # The agent's FULL copy answers (healthy again), but its mirror is as stale as the index was.
    await kv_where(cluster, f"{first} healthy after the full copy", lambda s: s[first]["state"] == "healthy")
    await drifted(prompts[2], 3)
    state = await drifted(prompts[3], 4)  # a relapse: the agent is asked to drop its mirror
    assert state[first]["drift"]["resyncs"] == {"full": 1, "reset": 1}, state[first]
    state = await kv_where(cluster, f"{first}'s mirror reset", lambda s: s[first]["last_reset_reason"] == "resync")
    subs = await subscriptions(cluster)
    assert subs[first]["resets"].get("resync") == 1, subs[first]
    assert await cluster.metric("llmgw_kv_index_resyncs_total", f'replica="{first}",mode="reset"') == 1
    assert await cluster.metric("llmgw_route_drift_total", f'replica="{first}",direction="over"') == 4
    assert await cluster.metric("llmgw_kv_resets_total", f'replica="{first}",reason="resync"') == 1

    # Healed: a prompt no engine holds is predicted 0 and gets 0; a repeated one is predicted exactly.
    for prompt in (prompts[4], text(600, 800)):
        chosen, usage = await complete(cluster, prompt)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        await kv_where(cluster, "both indexes healthy and holding what was stored", lambda s: all(
            s[n]["state"] == "healthy" for n in replicas) and s[chosen]["blocks"] > 0)
        before = await routed_prediction(cluster)
        again, usage = await complete(cluster, prompt)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert again == chosen and cached > 0
        after = await cluster.wait_for("the response's usage counted", lambda: _moved(cluster, before))
        assert after[0] - before[0] == after[1] - before[1] == cached
    assert await cluster.metric("llmgw_route_drift_total", f'replica="{first}",direction="over"') == 4
    assert (await kv_state(cluster))[first]["state"] == "healthy"


async def _moved(cluster, before):
    now = await routed_prediction(cluster)
    return now if now != before else None


async def test_a_burst_of_concurrent_requests_sharing_a_new_prefix_counts_no_over_drift(cluster):
    # Modelled time (prefill 20k tokens/s, 1 ms per step), 12 requests at once sharing a prefix no engine holds:
    # most are routed by the predicted entries of the first ones, before any event confirmed a block, and may
    # reach the engine before or after those blocks are computed (fewer or more cached tokens than predicted).
    # `over` is about confirmed blocks only: none of that is drift towards suspect (the threshold here is 1).
    replicas = await start(cluster, kv_sim('"--num-blocks", "2048", "--time-scale", "1", "--decode-ms-per-step", "1"',
                                           "{tokenize_timeout: 2s, drift_suspect_after: 1}"))
    await learn_block_sizes(cluster, replicas)
    shared = text(800, 400)
    with trio.fail_after(60):
        async with trio.open_nursery() as burst:
            for i in range(12):
                burst.start_soon(complete, cluster, shared + f" question {i}")

    async def checked():
        state = await kv_state(cluster)
        drift = {name: state[name]["drift"] for name in replicas}
        return drift if sum(d["match"] + d["over"] + d["under"] for d in drift.values()) >= 12 else None

    drift = await cluster.wait_for("every response checked", checked)
    assert all(d["over"] == 0 for d in drift.values()), drift
    assert all(s["state"] == "healthy" for s in (await kv_state(cluster)).values())
    assert await cluster.metric("llmgw_route_drift_total", 'direction="over"') == 0
