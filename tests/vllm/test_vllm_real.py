"""The real-vLLM tier end to end: ``llmgw serve`` with its embedded agent running two real vLLM CPU replicas.

One cluster for the module (``vllm_cluster``: tiny model made at test time,
``kv_events``, ``kv_index``, a LoRA adapter, prompt token details on, a KV
cache of 64 blocks of 32 tokens so that the workload evicts). Clients use the
OpenAI SDK through the gateway. What only the real engine shows is checked
here: vLLM's block size 32 on CPU, its LoRA extra keys, that the engines run
at vLLM's own hashing defaults (no ``--prefix-caching-hash-algo``, no
``PYTHONHASHSEED``: a stock vLLM, issue 20) and the router still predicts
exactly (content keys, the default), that the last prompt token is never a hit, that ``AllBlocksCleared`` is
published only on the engine's next step after a reset, and that its HTTP
head comes before its first token.

Tests run in file order: the destructive ones (reset, kill -9, the agent's
restart) last. Each test's numbers are printed (``-s`` or the CI log shows them).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from llmgw.bench.vllm_real import BLOCK_SIZE, LORA, MODEL, VLLM_ROOT, Gateway

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


@dataclass
class Sent:
    """One request sent through the gateway and what came back."""

    kind: str
    request_id: str
    replica: str
    prompt_tokens: int
    cached_tokens: int
    explained_pick: str | None = None
    explanation: dict | None = None  # the whole /admin/explain answer just before it was sent


def sdk(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.data_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def prefix(group: int) -> str:
    return " ".join(f"import module{group}_{i} as alias{i}" for i in range(28))  # about 280 tokens: 8 blocks


def question(group: int, number: int) -> str:
    return " ".join(f"def q{group}_{number}_{k}(x): return x" for k in range(3))


def body_of(kind: str, group: int, number: int, model: str = MODEL) -> dict:
    """A request of ``kind`` (``chat``/``completion``, ``-stream`` for streamed) sharing ``group``'s prefix."""
    body: dict = {"model": model, "max_tokens": 4}
    if kind.startswith("chat"):
        body["messages"] = [{"role": "system", "content": prefix(group)},
                            {"role": "user", "content": question(group, number)}]
    else:
        body["prompt"] = prefix(group) + "\n" + question(group, number)
    if kind.endswith("-stream"):
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def send(client: openai.OpenAI, kind: str, body: dict) -> Sent:
    """``body`` through the SDK (chat or completions, streamed or not): the replica, ids and usage."""
    api = client.chat.completions if kind.startswith("chat") else client.completions
    if body.get("stream"):
        with api.with_streaming_response.create(**body) as response:
            headers = response.headers
            chunks = list(response.parse())
        usage = chunks[-1].usage
        assert any((c.choices[0].delta.content if kind.startswith("chat") else c.choices[0].text)
                   for c in chunks if c.choices), f"no token streamed: {chunks}"
    else:
        response = api.with_raw_response.create(**body)
        headers, usage = response.headers, response.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None, usage
    return Sent(kind, headers["x-request-id"], headers["x-llmgw-replica"], usage.prompt_tokens,
                usage.prompt_tokens_details.cached_tokens or 0)


def explain(gateway: Gateway, kind: str, body: dict) -> dict:
    """What the kv_index tier would do with ``body`` now (``POST /admin/explain``: no state changed)."""
    path = "/v1/chat/completions" if kind.startswith("chat") else "/v1/completions"
    answer = gateway.http.post(gateway.control_url + "/admin/explain", params={"path": path}, json=body)
    answer.raise_for_status()
    explained = answer.json()
    assert explained["tier"] == "kv_index" and explained.get("outcome") not in (
        "unindexable", "index_unhealthy", "tokenize_timeout", "tokenize_error"), explained
    return explained


def predictions(gateway: Gateway, sent: list[Sent]) -> list[tuple[Sent, int | None]]:
    """Each request with the cached tokens the tier predicted for it (its access-log line; the gateway writes a
    streamed request's line once the stream ends, so wait for all of them)."""
    lines = access_lines(gateway, [s.request_id for s in sent])
    out = []
    for s in sent:
        predicted = lines[s.request_id].number("predicted_cached_tokens")
        assert lines[s.request_id].number("cached_tokens") == s.cached_tokens
        out.append((s, None if predicted is None else int(predicted)))
    return out


def access_lines(gateway: Gateway, request_ids: list[str]) -> dict:
    """The gateway's access-log lines of ``request_ids`` (a streamed request's line comes once its stream ends)."""
    def complete():
        lines = gateway.access()
        return lines if all(i in lines for i in request_ids) else None

    return gateway.wait_for("every request's access-log line", complete, timeout=30)


def report(title: str, pairs: list[tuple[Sent, int | None]]) -> float:
    """Print the match rate and every request whose prediction differed; the rate."""
    differing = [(s, p) for s, p in pairs if p != s.cached_tokens]
    rate = 1 - len(differing) / len(pairs)
    print(f"\n{title}: predicted == vLLM's cached_tokens for {len(pairs) - len(differing)}/{len(pairs)} requests "
          f"({rate:.1%}); cached tokens served {sum(s.cached_tokens for s, _ in pairs)}")
    for s, p in differing:
        print(f"  differs: {s.kind} {s.request_id} on {s.replica}: predicted {p}, vLLM {s.cached_tokens} "
              f"(prompt {s.prompt_tokens} tokens)")
    return rate


def workload(rounds: int = 3, groups: int = 14, seed: int = 7) -> list[tuple[str, int, int]]:
    """(kind, group, question): ``groups`` shared prefixes (even ones chats, odd ones completions, streamed every
    other time), each asked 1-2 questions per round in a shuffled order; questions repeat across rounds. The 14
    prefixes of 9-10 blocks and their questions need more than the two replicas' 2 x 64: blocks are evicted."""
    rng = random.Random(seed)
    plan = []
    for _ in range(rounds):
        order = list(range(groups))
        rng.shuffle(order)
        for group in order:
            for _ in range(rng.choice((1, 2))):
                family = "chat" if group % 2 == 0 else "completion"
                plan.append((family + rng.choice(("", "-stream")), group, rng.randrange(3)))
    return plan


def run(gateway: Gateway, plan, model: str = MODEL, think_time: float = 0.0) -> list[Sent]:
    client = sdk(gateway)
    sent = []
    for kind, group, number in plan:
        body = body_of(kind, group, number, model)
        explained = explain(gateway, kind, body)
        s = send(client, kind, body)
        s.explained_pick, s.explanation = explained["pick"], explained
        sent.append(s)
        time.sleep(think_time)
    return sent


def engine_url(gateway: Gateway, replica: str) -> str:
    return gateway.replicas()[replica]["url"]


def indexed(kv: dict[str, dict]) -> dict[str, dict] | None:
    return kv if all(r["blocks"] for r in kv.values()) else None


# -- the tests, in order -----------------------------------------------------------------------------------------


def test_the_sdk_gets_chat_and_completions_streamed_and_not_and_the_index_learns_block_size_32_from_stock_vllm(
        vllm_cluster):
    client = sdk(vllm_cluster)
    assert {m.id for m in client.models.list()} >= {MODEL, LORA}
    for kind in ("chat", "chat-stream", "completion", "completion-stream"):
        s = send(client, kind, body_of(kind, 1000, 0))
        assert s.prompt_tokens > 2 * BLOCK_SIZE and s.replica in vllm_cluster.replicas()
    # The CPU build forces blocks of 32 tokens: each replica's index learns it from its engine's first events.
    for replica in vllm_cluster.replicas().values():
        httpx.post(replica["url"] + "/v1/completions", json=body_of("completion", 1001, 0), timeout=60)
    kv = vllm_cluster.wait_for("blocks indexed", lambda: indexed(vllm_cluster.kv()))
    assert {r["block_size"] for r in kv.values()} == {BLOCK_SIZE}
    # Content keys (the default): the agent starts vLLM at its own hashing defaults, and keys the engines' blocks
    # from their events' token ids. Every test below predicts against these stock engines.
    for name, replica in vllm_cluster.replicas().items():
        pid = replica["shards"][0]["pid"]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"--kv-events-config" in argv and b"--prefix-caching-hash-algo" not in argv, (name, argv)
        assert not [e for e in environ if e.startswith(b"PYTHONHASHSEED=")], name
    ranks = [rank for s in vllm_cluster.admin("/admin/kv")["agent_subscriptions"] for rank in s["ranks"]]
    assert [(r["key_mode"], r["problem"]) for r in ranks] == [("content", None)] * 2
    assert all(r["state"] == "healthy" and r["problem"] is None for r in kv.values())
    assert vllm_cluster.metric("llmgw_kv_hash_parity_checks_total") == 0  # content keys have no hash to check


def check_workload(gateway: Gateway, title: str, think_time: float, seed: int) -> tuple[float, list, list]:
    """Run the shared-prefix workload (``think_time`` seconds between a response and the next request): the
    cache was hit and evicted, every request was routed by the index; the match rate, the pairs, the requests
    that did not go where ``/admin/explain`` said just before."""
    removed_before = gateway.metric("llmgw_kv_events_total", 'type="BlockRemoved"')
    sent = run(gateway, workload(seed=seed), think_time=think_time)
    pairs = predictions(gateway, sent)
    rate = report(title, pairs)
    removed = gateway.metric("llmgw_kv_events_total", 'type="BlockRemoved"') - removed_before
    hits = sum(1 for s in sent if s.cached_tokens)
    print(f"  {len(sent)} requests, {hits} with cached tokens, {removed:.0f} blocks evicted (BlockRemoved)")
    assert removed > 0, "the workload must overflow the KV cache, or evictions are not tested"
    assert hits >= len(sent) // 3, "the workload must hit the cache, or predictions are not tested"
    # The last prompt token is never a hit: a repeated prompt is served from cache up to the last full block
    # before its last token.
    assert all(s.cached_tokens <= (s.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE for s in sent)
    misrouted = [(s.request_id, s.replica, s.explained_pick) for s in sent if s.replica != s.explained_pick]
    print(f"  {len(sent) - len(misrouted)}/{len(sent)} went to the replica /admin/explain predicted just before")
    unpredicted = [s.request_id for s, p in pairs if p is None]
    assert not unpredicted, f"every request was routed by the index: {why_unpredicted(gateway, unpredicted)}"
    return rate, pairs, misrouted


def why_unpredicted(gateway: Gateway, request_ids: list[str]) -> list[dict]:
    """For a failure message: the routing decisions of ``request_ids`` (outcome, source, the fallback's reason)
    and each replica's index state now, so a request the index did not predict says why."""
    decisions = {d["request_id"]: d for d in gateway.admin("/admin/decisions")["decisions"]}
    states = {name: (r["state"], r.get("problem")) for name, r in gateway.kv().items()}
    return [{"request_id": i, "index_states_now": states,
             **{k: v for k, v in decisions.get(i, {}).items() if k in ("replica", "outcome", "detail")}}
            for i in request_ids]


def test_a_shared_prefix_workload_that_evicts_is_routed_and_predicted_exactly(vllm_cluster):
    """A client with a little think time (150 ms): the engine's events have reached the index."""
    rate, _, misrouted = check_workload(vllm_cluster, "shared-prefix workload, 150 ms think time",
                                         think_time=0.15, seed=7)
    assert not misrouted
    assert rate >= 0.99


def test_back_to_back_requests_are_mispredicted_only_by_evictions_still_in_flight(vllm_cluster):
    """No think time: a request may be routed before the events of the previous one's evictions reach the index
    (engine -> agent -> 25 ms flush -> router). Such a request is over-predicted, never under-predicted: a block
    evicted and stored again by the previous request stays predicted between the two events (the settle rule,
    llmgw.kv.index)."""
    rate, pairs, _ = check_workload(vllm_cluster, "shared-prefix workload, back to back", think_time=0, seed=8)
    assert all(p > s.cached_tokens for s, p in pairs if p != s.cached_tokens)
    assert rate >= 0.9


def test_lora_requests_are_routed_by_adapter_and_predicted_with_its_extra_keys(vllm_cluster):
    plan = [(kind, 2000 + group, number) for group in range(3) for number in range(3)
            for kind in ("chat", "completion-stream")]
    sent = run(vllm_cluster, plan, model=LORA)
    pairs = predictions(vllm_cluster, sent)
    rate = report("LoRA adapter requests", pairs)
    assert sum(1 for s in sent if s.cached_tokens) >= len(sent) // 2
    # The base model's blocks for the same text are different blocks (the adapter is part of the hash): a base
    # request after the adapter's is not predicted a hit on the adapter's blocks, and vLLM agrees.
    base = run(vllm_cluster, [("chat", 2000, 0)], model=MODEL)
    (base_pair,) = predictions(vllm_cluster, base)
    assert base_pair == (base[0], 0) and base[0].cached_tokens == 0
    assert all(s.replica == s.explained_pick for s in sent)
    assert rate == 1.0


def test_ttft_is_the_first_token_and_the_head_comes_before_it(vllm_cluster):
    """llmgw's TTFT (its access log, per request) against the client's own, for streamed chats. The client is a
    plain HTTP client reading lines (an SDK's parsing of each chunk would add its own time to the client's side)."""
    ttfb, client_ttft, gateway_ids = [], [], []
    with httpx.Client(base_url=vllm_cluster.data_url, timeout=120) as client:
        for i in range(40):
            body = {"model": MODEL, "max_tokens": 8, "stream": True,
                    "messages": [{"role": "user", "content": prefix(3000 + i)}]}  # no cache hit: a full prefill
            started = time.perf_counter()
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                ttfb.append(time.perf_counter() - started)
                first = None
                for line in response.iter_lines():
                    if first is None and '"content":"' in line and '"content":""' not in line:
                        first = time.perf_counter() - started
                client_ttft.append(first)
                gateway_ids.append(response.headers["x-request-id"])
    lines = access_lines(vllm_cluster, gateway_ids)
    gateway_ttft = [lines[i].number("ttft_ms") / 1000 for i in gateway_ids]
    ms = lambda values: round(statistics.median(values) * 1000, 2)  # noqa: E731
    diffs = [c - g for c, g in zip(client_ttft, gateway_ttft)]
    print(f"\nTTFT p50: client {ms(client_ttft)} ms, llmgw {ms(gateway_ttft)} ms, per-request difference p50 "
          f"{ms(diffs)} ms; client time to first byte p50 {ms(ttfb)} ms")

    def mean(name: str) -> float:
        return vllm_cluster.metric(name + "_sum") / vllm_cluster.metric(name + "_count") * 1000

    print(f"  session means: llmgw_time_to_first_token_seconds {mean('llmgw_time_to_first_token_seconds'):.1f} ms, "
          f"llmgw_time_to_first_byte_seconds {mean('llmgw_time_to_first_byte_seconds'):.1f} ms")
    # Agreement per request (the pairs share the engine's prefill and the machine's noise; the medians of two
    # noisy samples of 20-500 ms differ by more than the measure itself): the client sees llmgw's TTFT plus its
    # own path to and from the gateway.
    assert 0 <= statistics.median(diffs) <= 0.010
    assert statistics.median(ttfb) < statistics.median(client_ttft)


def test_vllm_bench_serve_runs_through_llmgw(vllm_cluster):
    model_dir = vllm_cluster.config_path.parent / MODEL
    result = subprocess.run(
        [str(VLLM_ROOT / "venv" / "bin" / "vllm"), "bench", "serve", "--backend", "openai-chat",
         "--endpoint", "/v1/chat/completions", "--base-url", vllm_cluster.data_url, "--model", MODEL,
         "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", "128",
         "--random-output-len", "16", "--num-prompts", "40", "--max-concurrency", "4", "--seed", "1"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    summary = result.stdout[result.stdout.find("============"):]
    print("\nvllm bench serve through llmgw:\n" + summary)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Successful requests:                     40" in summary


def test_a_prefix_cache_reset_leaves_no_stale_prediction(vllm_cluster):
    plan = [("completion", 4000 + group, 0) for group in range(3)]
    sent = run(vllm_cluster, plan)
    replica = sent[0].replica
    url = engine_url(vllm_cluster, replica)
    def settled_blocks() -> int:  # indexed, and no event still on its way (two equal readings 0.5 s apart)
        before = vllm_cluster.kv()[replica]["blocks"]
        time.sleep(0.5)
        return before if before and vllm_cluster.kv()[replica]["blocks"] == before else 0

    held = vllm_cluster.wait_for(f"{replica}'s blocks indexed and settled", settled_blocks)
    resets_before = vllm_cluster.kv()[replica]["resets"]

    assert httpx.post(url + "/reset_prefix_cache", timeout=30).json() == {"success": True}
    # vLLM queues AllBlocksCleared and publishes it on its next step: with no request, the index still holds them.
    time.sleep(1.5)
    assert vllm_cluster.kv()[replica]["blocks"] == held
    # One step (a request straight to the engine, sharing nothing) publishes it: the index drops every block.
    httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x = 1", "max_tokens": 1}, timeout=60)
    cleared = vllm_cluster.wait_for("AllBlocksCleared applied to the router's index", lambda: (
        entry if (entry := vllm_cluster.kv()[replica])["resets"] > resets_before else None), timeout=30)
    assert cleared["blocks"] == 0 and cleared["last_reset_reason"] == "cleared", cleared
    # The same prompts again: nothing from before the reset is predicted, and vLLM serves nothing from cache.
    again = run(vllm_cluster, plan)
    pairs = predictions(vllm_cluster, again)
    report("after reset_prefix_cache", pairs)
    assert all((p or 0) == s.cached_tokens for s, p in pairs)  # None: the tier had no index to predict from
    assert all(s.cached_tokens == 0 for s in again if s.replica == replica)


def test_a_killed_vllm_is_restarted_its_index_reset_and_relearnt_and_no_request_fails(vllm_cluster):
    replicas = vllm_cluster.replicas()
    victim = sorted(replicas)[0]
    old_pid = replicas[victim]["shards"][0]["pid"]
    client = sdk(vllm_cluster)
    resets_before = vllm_cluster.metric("llmgw_kv_resets_total", f'replica="{victim}",reason="engine_restart"')
    os.kill(old_pid, signal.SIGKILL)
    # Non-streamed requests all the while it is down and restarting: every one answered (by the other replica).
    sent, deadline = [], time.monotonic() + 900
    while True:
        sent.append(send(client, "chat", body_of("chat", 5000 + len(sent) % 4, 0)))
        now = vllm_cluster.replicas()
        if now[victim]["state"] == "up" and now[victim]["shards"][0]["pid"] not in (0, old_pid):
            break
        assert time.monotonic() < deadline, f"{victim} was not restarted: {now[victim]}"
        time.sleep(0.2)
    print(f"\n{len(sent)} non-streamed requests while {victim} was killed and restarted: all answered")
    assert vllm_cluster.metric("llmgw_kv_resets_total",
                               f'replica="{victim}",reason="engine_restart"') > resets_before
    vllm_cluster.wait_for(f"{victim}'s index healthy again", lambda: vllm_cluster.kv()[victim]["state"] == "healthy")
    # Relearnt from the new engine's events: requests straight to it are indexed, then predicted exactly.
    url = engine_url(vllm_cluster, victim)
    httpx.post(url + "/v1/completions", json=body_of("completion", 5100, 0), timeout=60).raise_for_status()
    vllm_cluster.wait_for(f"{victim} relearns", lambda: vllm_cluster.kv()[victim]["blocks"] >= 8)
    after = run(vllm_cluster, [("completion", 5100, 1), ("completion-stream", 5100, 2)])
    pairs = predictions(vllm_cluster, after)
    report("after kill -9", pairs)
    for entry in after[0].explanation["replicas"]:
        cost, learnt = entry["cost"], entry["cost"]["learnt"]
        print(f"  first request, {entry['name']}: cached {cost['cached_tokens']}, est. TTFT "
              f"{cost['estimated_ttft_s'] * 1000:.1f} ms (step {learnt['step_s'] * 1000:.1f} ms, "
              f"{learnt['prefill_tokens_per_s']:.0f} tokens/s, noise {learnt['noise_s'] * 1000:.1f} ms, "
              f"{learnt['observations']} observations)")
    # The relearnt index draws the first request to the restarted engine, with its blocks served from cache. The
    # second may go elsewhere: the cost rule weighs the restarted engine's first (warm-up) TTFT against the
    # cached tokens (docs/routing.md); wherever it goes, it goes where /admin/explain said and is predicted exactly.
    assert after[0].replica == victim and after[0].cached_tokens >= 8 * BLOCK_SIZE, (victim, after[0])
    assert all(s.replica == s.explained_pick for s in after)
    assert all(p == s.cached_tokens for s, p in pairs)


def test_a_restarted_agent_adopts_the_engines_and_the_index_is_restored(vllm_cluster):
    """The embedded agent restarts with ``llmgw serve``: killed, then started again on the same state folder."""
    sent = run(vllm_cluster, [("chat", 6000, 0), ("completion", 6001, 0)])
    vllm_cluster.wait_for("both prompts indexed", lambda: all(vllm_cluster.kv()[s.replica]["blocks"] for s in sent))
    time.sleep(1)  # let the last batches land
    before_pids = {n: r["shards"][0]["pid"] for n, r in vllm_cluster.replicas().items()}
    before_blocks = {n: r["blocks"] for n, r in vllm_cluster.kv().items()}

    vllm_cluster.kill()
    vllm_cluster.start()
    def adopted():
        replicas = vllm_cluster.replicas()
        return len(replicas) == 2 and all(r["state"] == "up" and r["origin"] == "adopted" for r in replicas.values())

    vllm_cluster.wait_for("the engines adopted", adopted, timeout=300, interval=0.5)
    assert {n: r["shards"][0]["pid"] for n, r in vllm_cluster.replicas().items()} == before_pids
    def restored_index():
        kv = vllm_cluster.kv()
        healthy = all(r["state"] == "healthy" for r in kv.values())
        return kv if healthy and {n: r["blocks"] for n, r in kv.items()} == before_blocks else None

    restored = vllm_cluster.wait_for("the indexes restored", restored_index, timeout=120)
    # The new agent subscribed late: what the engines published before it is a gap its replay filled.
    replays = vllm_cluster.metric("llmgw_kv_replays_total", 'result="filled"')
    assert replays >= 1
    print(f"\nafter the agent's restart: same pids {before_pids}, blocks {before_blocks} restored by "
          f"{replays:.0f} filled replays (last reset reasons {[r['last_reset_reason'] for r in restored.values()]})")
    again = run(vllm_cluster, [("chat", 6000, 1), ("completion", 6001, 1)])
    pairs = predictions(vllm_cluster, again)
    report("after the agent's restart", pairs)
    assert [s.replica for s in again] == [s.replica for s in sent]
    assert all(p == s.cached_tokens and s.cached_tokens > 0 for s, p in pairs)
