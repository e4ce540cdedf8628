"""The kv_index tier's decisions: hits on leading blocks, load, predictions, salts, block sizes, and every fallback."""

from __future__ import annotations

import json
import random
from functools import partial

import trio
from prometheus_client import generate_latest

from llmgw.hookspecs import hookimpl
from llmgw.http.client import UpstreamPool
from llmgw.kv.drift import classify
from llmgw.kv.index import KvIndex
from llmgw.kv.keys import VllmBlockKeys, request_extra_keys
from llmgw.kv.tokenize import CUT_MARGIN_TOKENS, TokenizeError
from llmgw.kv.tokenize_answer import default_max_bytes
from llmgw.metrics import Metrics
from llmgw.plugins.kv_index import KvIndexTier, predicted_cached_tokens
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.kv_capacity import INDEX, free_tokens
from llmgw.router.replica import EngineLoad, Replica
from llmgw.router.router import Router
from llmgw.router.tier import RouteRequest
from llmgw.wire import KvChangeKind, KvChanges

VLLM = VllmBlockKeys()


class FakeTokenizer:
    """Tokenizes like a byte tokenizer: a completion's prompt bytes; a chat's contents joined. Records calls."""

    def __init__(self):
        self.calls: list[str] = []
        self.fail: Exception | None = None

    async def tokenize(self, replica, body: bytes) -> list[int]:
        self.calls.append(replica.name)
        if self.fail is not None:
            raise self.fail
        request = json.loads(body)
        if "prompt" in request:
            return list(request["prompt"].encode())
        return list("".join(m["content"] for m in request["messages"]).encode())


class FakePlugin:
    def __init__(self):
        self.tokenizer = FakeTokenizer()

    @hookimpl
    def register_tokenizer_sources(self):
        return {"fake": lambda options: self.tokenizer}


def make(options=None, names=("a", "b", "c")):
    plugin = FakePlugin()
    router = Router(build_registry(make_plugin_manager((plugin,))), Metrics())
    route = router.configure_model("m", "kv_index", {"tokenizer": "fake", "seed": 7, "key_function": "vllm",
                                                   **(options or {})})
    replicas = [Replica(name=n, model="m", url=f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(names)]
    for replica in replicas:
        router.add_replica(replica)
    tier: KvIndexTier = route.tier
    tier.clock = tier.tree.clock = tier.index.clock = trio.current_time
    return router, tier, plugin.tokenizer, replicas


def prompt(text: str, salt: str | None = None, model: str = "m") -> RouteRequest:
    body = {"model": model, "prompt": text, "max_tokens": 4}
    if salt is not None:
        body["cache_salt"] = salt
    return RouteRequest("m", "/v1/completions", body)


def keys_of(text: str, block_size: int = 16, salt: str | None = None) -> list[int]:
    ids = list(text.encode())
    extras = request_extra_keys(len(ids), block_size, cache_salt=salt) if salt else None
    return VLLM.keys(ids, block_size, extras)


def hold(tier: KvIndexTier, name: str, keys, block_size: int = 16) -> None:
    tier.index.apply(name, KvChanges(kind=KvChangeKind.FULL, stored=list(keys), block_size=block_size))


def outcomes(router) -> dict[str, float]:
    counter = router.metrics.decisions
    names = ("hit", "miss", "load_override", "unindexable", "tokenize_timeout", "tokenize_error", "index_unhealthy")
    return {o: v for o in names if (v := counter.labels("m", "kv_index", o)._value.get())}


TEXT = "".join(f"line {i:03d} of a long shared system prompt. " for i in range(10))[:320]  # 320 tokens, 20 blocks


async def test_a_request_goes_where_its_leading_blocks_are():
    router, tier, tokenizer, (a, b, c) = make()
    keys = keys_of(TEXT)
    assert len(keys) == 20
    hold(tier, "a", keys[:10])
    hold(tier, "b", keys[:4])
    hold(tier, "c", [])
    decision = await router.pick(prompt(TEXT))
    assert decision.replica is a and decision.outcome == "hit" and decision.tier == "kv_index"
    assert decision.detail["matched_blocks"] == 10 and decision.detail["confirmed_blocks"] == 10
    assert decision.detail["predicted_cached_tokens"] == 160 and decision.detail["block_size"] == 16
    assert tokenizer.calls == ["a"]  # tokenized once, by an idle candidate
    assert outcomes(router) == {"hit": 1}


async def test_the_last_prompt_token_is_never_predicted_cached():
    assert predicted_cached_tokens(20, 16, 320) == 19 * 16
    assert predicted_cached_tokens(20, 16, 321) == 20 * 16
    assert predicted_cached_tokens(3, 16, 1000) == 48
    assert predicted_cached_tokens(5, 16, 0) == 0
    router, tier, _, (a, b, c) = make()
    for name in "abc":
        hold(tier, name, keys_of(TEXT) if name == "b" else [])
    decision = await router.pick(prompt(TEXT))
    assert decision.replica is b and decision.detail["predicted_cached_tokens"] == 304


async def test_blocks_held_but_not_from_block_0_do_not_count():
    router, tier, _, (a, b, c) = make()
    keys = keys_of(TEXT)
    hold(tier, "a", keys[1:])
    hold(tier, "b", [])
    hold(tier, "c", [])
    b.local_inflight = c.local_inflight = 1
    decision = await router.pick(prompt(TEXT))
    assert decision.replica is a and decision.outcome == "miss" and decision.detail["matched_blocks"] == 0


async def test_misses_spread_by_load_and_a_loaded_holder_is_overridden_by_the_count_guard():
    router, tier, _, (a, b, c) = make({"max_imbalance": 4})
    for name in "abc":
        hold(tier, name, [])
    a.local_inflight, b.local_inflight, c.local_inflight = 2, 0, 1
    decision = await router.pick(prompt("a brand new prompt " * 10))
    assert decision.replica is b and decision.outcome == "miss"
    hold(tier, "a", keys_of(TEXT))
    a.local_inflight, b.local_inflight, c.local_inflight = 6, 0, 1  # 7 in flight after this one, 4 is the max imbalance
    decision = await router.pick(prompt(TEXT))
    assert decision.replica is b and decision.outcome == "load_override"
    assert outcomes(router) == {"miss": 1, "load_override": 1}


async def test_requests_that_cannot_be_indexed_are_routed_by_the_tree():
    router, tier, tokenizer, _ = make()
    for name in "abc":
        hold(tier, name, [])
    image = RouteRequest("m", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]})
    decision = await router.pick(image)
    assert decision.outcome == "unindexable" and decision.tier == "kv_index"
    assert decision.detail["reason"] == "non_text_content" and decision.detail["tree_outcome"] == "miss"
    decision = await router.pick(RouteRequest("m", "/v1/embeddings", {"model": "m", "input": "x"}))
    assert decision.outcome == "unindexable" and decision.detail["reason"] == "path"
    assert tokenizer.calls == [] and outcomes(router) == {"unindexable": 2}
    assert tier.fallbacks == {"unindexable": 2}


async def test_a_slow_or_failing_tokenize_falls_back_to_the_tree():
    router, tier, tokenizer, _ = make()
    for name in "abc":
        hold(tier, name, keys_of(TEXT))
    tokenizer.fail = TokenizeError("timeout", "took longer than 50 ms")
    decision = await router.pick(prompt(TEXT))
    assert decision.outcome == "tokenize_timeout" and "50 ms" in decision.detail["reason"]
    tokenizer.fail = TokenizeError("status", "/tokenize answered 500")
    decision = await router.pick(prompt(TEXT))
    assert decision.outcome == "tokenize_error"
    assert outcomes(router) == {"tokenize_timeout": 1, "tokenize_error": 1}
    assert tier.index.predicted_keys == 0  # fallbacks predict nothing


async def test_without_a_healthy_index_the_tree_decides_and_nothing_is_tokenized():
    router, tier, tokenizer, _ = make()
    decision = await router.pick(prompt(TEXT))  # no events from anyone yet
    assert decision.outcome == "index_unhealthy" and "a=no_events" in decision.detail["reason"]
    hold(tier, "a", keys_of(TEXT))
    tier.index.apply("a", KvChanges(kind=KvChangeKind.RESET, reason="engine_restart"))
    decision = await router.pick(prompt(TEXT))
    assert decision.outcome == "index_unhealthy" and "a=resetting" in decision.detail["reason"]
    assert tokenizer.calls == [] and outcomes(router) == {"index_unhealthy": 2}


async def test_an_unhealthy_replica_is_scored_by_the_tree_for_that_decision():
    router, tier, _, (a, b, c) = make()
    long_text = TEXT + " and more"
    await tier.pick(prompt(long_text), [b])  # the tree learns that b was sent this text (no events at all yet)
    hold(tier, "a", [])  # a is healthy and holds nothing; b has no events
    decision = await tier.pick(prompt(long_text), [a, b])
    assert decision.replica is b and decision.outcome == "hit" and decision.detail["source"] == "tree"
    assert "predicted_cached_tokens" not in decision.detail  # the index predicted nothing for b
    hold(tier, "a", keys_of(long_text))  # a's index share (1.0) ties b's tree share; b had the last cold request
    decision = await tier.pick(prompt(long_text), [a, b])
    assert decision.replica is a and decision.detail["source"] == "index"


async def test_token_id_prompts_are_indexed_without_tokenizing():
    router, tier, tokenizer, (a, b, c) = make()
    ids = list(TEXT.encode())
    for name in "abc":
        hold(tier, name, VLLM.keys(ids, 16) if name == "c" else [])
    decision = await router.pick(RouteRequest("m", "/v1/completions", {"model": "m", "prompt": ids}))
    assert decision.replica is c and decision.outcome == "hit" and tokenizer.calls == []


async def test_replicas_with_different_block_sizes_are_hashed_with_their_own():
    router, tier, _, (a, b) = make(names=("a", "b"))
    hold(tier, "a", keys_of(TEXT, 16), block_size=16)
    hold(tier, "b", keys_of(TEXT, 32)[:5], block_size=32)
    explained = await tier.explain(prompt(TEXT), [a, b])
    by_name = {entry["name"]: entry for entry in explained["replicas"]}
    assert explained["blocks"] == {"16": 20, "32": 10}
    assert (by_name["a"]["matched_blocks"], by_name["a"]["share"]) == (20, 1.0)
    assert (by_name["b"]["matched_blocks"], by_name["b"]["share"]) == (5, 0.5)
    assert explained["pick"] == "a" and explained["outcome"] == "hit"


async def test_a_burst_of_a_new_prefix_co_locates_before_events_arrive(autojump_clock):
    router, tier, _, replicas = make()
    for name in "abc":
        hold(tier, name, [])
    first = await router.pick(prompt(TEXT + " question 1"))
    assert first.outcome == "miss"
    first.replica.local_inflight += 1  # still running
    second = await router.pick(prompt(TEXT + " question 2"))
    assert second.replica is first.replica and second.outcome == "hit"
    assert second.detail["confirmed_blocks"] == 0 and second.detail["matched_blocks"] == 20
    first.replica.local_inflight -= 1
    await trio.sleep(2.1)  # the predictions expired and no event confirmed them
    explained = await tier.explain(prompt(TEXT + " question 3"), replicas)
    assert explained["outcome"] == "miss"


async def test_an_attempt_the_engine_never_took_drops_its_prediction_and_a_full_hit_settles_it():
    router, tier, _, (a, b, c) = make()
    for name in "abc":
        hold(tier, name, [])
    request = prompt(TEXT + " question 1")
    failed = await router.pick(request)
    router.attempt_failed(request, failed, "connect")
    router.finished(request, failed, None)
    assert tier.index.predicted_keys == 0  # the next request is not drawn to a replica that never saw this one
    timed_out = await router.pick(request)
    router.attempt_failed(request, timed_out, "timeout")  # the engine may have taken it: kept
    router.finished(request, timed_out, None)
    assert tier.index.predicted_keys == 20
    name = timed_out.replica.name
    hold(tier, name, keys_of(TEXT))
    served = await router.pick(prompt(TEXT + " question 2"))
    assert served.replica.name == name and served.detail["predicted_cached_tokens"] == 320
    tier.index.apply(name, KvChanges(kind=KvChangeKind.DELTA, removed=[keys_of(TEXT)[19]], block_size=16))
    assert tier.index.match(keys_of(TEXT), [name]) == {name: 20}  # both requests unsettled: an ambiguous removal
    router.finished(request, served, usage(320))  # every predicted block was a hit: settled
    tier.index.unpredict(timed_out.detail["prediction"])  # (the other one's TTL, early)
    tier.index.apply(name, KvChanges(kind=KvChangeKind.DELTA, removed=[keys_of(TEXT)[18]], block_size=16))
    assert tier.index.match(keys_of(TEXT), [name]) == {name: 18}  # settled by its response: an eviction


async def test_cache_salt_separates_tenants():
    router, tier, _, (a, b) = make(names=("a", "b"))
    hold(tier, "a", keys_of(TEXT, salt="tenant-1"))
    hold(tier, "b", keys_of(TEXT))
    decision = await tier.pick(prompt(TEXT, salt="tenant-1"), [a, b])
    assert decision.replica is a and decision.outcome == "hit"
    decision = await tier.pick(prompt(TEXT, salt="tenant-2"), [a, b])
    assert decision.outcome == "miss"
    decision = await tier.pick(prompt(TEXT), [a, b])
    assert decision.replica is b and decision.outcome == "hit"


async def test_lora_requests_are_indexed_only_with_a_known_adapter_path():
    router, tier, _, (a, b) = make({"lora_adapters": {"sql": "/adapters/sql"}}, names=("a", "b"))
    ids = list(TEXT.encode())
    lora_keys = VLLM.keys(ids, 16, request_extra_keys(len(ids), 16, lora=("sql", "/adapters/sql")))
    hold(tier, "a", [])
    hold(tier, "b", lora_keys)
    decision = await tier.pick(prompt(TEXT, model="sql"), [a, b])
    assert decision.replica is b and decision.outcome == "hit"
    decision = await tier.pick(prompt(TEXT, model="other-adapter"), [a, b])
    assert decision.outcome == "unindexable" and decision.detail["reason"] == "unknown_lora"


async def test_finished_counts_predicted_next_to_actual_cached_tokens():
    router, tier, _, (a, b, c) = make()
    for name in "abc":
        hold(tier, name, keys_of(TEXT) if name == "a" else [])
    request = prompt(TEXT)
    decision = await router.pick(request)
    router.routed(request, decision)
    router.finished(request, decision, {"prompt_tokens": 320, "prompt_tokens_details": {"cached_tokens": 288}})
    assert (tier.predicted_cached_total, tier.actual_cached_total) == (304, 288)
    router.finished(request, decision, None)  # no usage seen: counts nothing
    unindexable = RouteRequest("m", "/v1/embeddings", {"input": "x"})
    fallback = await router.pick(unindexable)
    router.finished(unindexable, fallback, {"prompt_tokens_details": {"cached_tokens": 5}})  # no prediction
    text = generate_latest(router.metrics.registry).decode()
    assert 'llmgw_route_predicted_cached_tokens_total{model="m"} 304.0' in text
    assert 'llmgw_route_actual_cached_tokens_total{model="m"} 288.0' in text
    assert 'llmgw_kv_index_blocks{model="m",replica="a"} 20.0' in text


async def test_explain_changes_nothing():
    router, tier, tokenizer, replicas = make()
    for name in "abc":
        hold(tier, name, keys_of(TEXT) if name == "c" else [])
    before = tier.tree.tree.node_count
    explained = await tier.explain(prompt(TEXT), replicas)
    assert explained["pick"] == "c" and explained["outcome"] == "hit"
    assert {e["name"]: e["index"]["state"] for e in explained["replicas"]} == dict.fromkeys("abc", "healthy")
    assert tier.index.predicted_keys == 0 and tier.tree.tree.node_count == before
    fallback = await tier.explain(RouteRequest("m", "/v1/embeddings", {"input": "x"}), replicas)
    assert fallback["outcome"] == "unindexable" and fallback["tree_outcome"] == "miss"
    answer = await router.explain(prompt(TEXT))
    assert answer["tier"] == "kv_index" and answer["pick"] == "c"


async def test_tokenize_goes_to_the_least_loaded_candidate():
    router, tier, tokenizer, (a, b, c) = make()
    for name in "abc":
        hold(tier, name, [])
    a.local_inflight, b.local_inflight, c.local_inflight = 3, 1, 2
    await tier.pick(prompt("x" * 100), [a, b, c])
    assert tokenizer.calls == ["b"]


def test_options_are_checked():
    registry = build_registry(make_plugin_manager((FakePlugin(),)))
    assert KvIndexTier.check_options({"tokenizer": "fake", "tokenize_timeout": "20ms"}, registry) == []
    problems = KvIndexTier.check_options({"tokenizer": "nope", "tokenize_timeout": -1, "min_match_blocks": 0,
                                          "max_imbalance": "x", "bogus": 1}, registry)
    text = "\n".join(problems)
    assert "tokenize_timeout" in text and "min_match_blocks" in text and "max_imbalance" in text
    assert "'bogus'" in text and "nope" in text
    assert "hash_algo" in "\n".join(KvIndexTier.check_options({"key_function": "vllm", "hash_algo": "xxhash",
                                                                     "hash_seed": None}, registry))
    assert "hash_algo" in "\n".join(KvIndexTier.check_options({"hash_algo": "md5"}, registry))


async def test_the_replica_tokenizer_reports_its_latency():
    router = Router(build_registry(make_plugin_manager()), Metrics())
    tier = router.configure_model("m", "kv_index", {"tokenize_timeout": "30ms", "tokenizer": "replica"}).tier
    assert tier.tokenizer.timeout == 0.03 and tier.tokenizer.observe is not None
    tier = router.configure_model("m", "kv_index", {"tokenize_timeout": "30ms"}).tier  # auto: /tokenize without files
    assert tier.tokenizer.local is None and tier.tokenizer.replica.timeout == 0.03
    assert tier.tokenizer.observe is not None and tier.tokenizer.count_source is not None
    assert isinstance(tier.index, KvIndex)


def usage(cached: int, prompt_tokens: int = 320) -> dict:
    return {"prompt_tokens": prompt_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def drift_lines(router) -> list[str]:
    return [line for line in generate_latest(router.metrics.registry).decode().splitlines()
            if line.startswith("llmgw_route_drift")]


def test_the_drift_rule_counts_whole_blocks_against_confirmed_and_predicted():
    assert classify(actual=0, confirmed=160, predicted=304, block_size=16) == "over"
    assert classify(actual=144, confirmed=160, predicted=304, block_size=16) == "over"
    assert classify(actual=150, confirmed=160, predicted=304, block_size=16) == "match"  # a partial block
    assert classify(actual=160, confirmed=160, predicted=304, block_size=16) == "match"
    assert classify(actual=208, confirmed=160, predicted=304, block_size=16) == "match"  # predicted entries: maybe
    assert classify(actual=320, confirmed=160, predicted=304, block_size=16) == "under"
    assert classify(actual=0, confirmed=0, predicted=0, block_size=16) == "match"


async def test_finished_checks_drift_per_replica_and_excuses_a_removal_seen_before_the_response():
    router, tier, _, (a, b, c) = make({"drift_suspect_after": 2})
    keys = keys_of(TEXT)
    hold(tier, "a", keys)
    hold(tier, "b", [])
    hold(tier, "c", [])
    request = prompt(TEXT)
    decision = await router.pick(request)
    assert decision.replica is a and decision.detail["confirmed_blocks"] == 20
    router.finished(request, decision, usage(304))  # all but the last token's block: exactly as predicted
    decision = await router.pick(request)
    # The engine evicted blocks 10.. and its removal reached the index before the response: no drift.
    tier.index.apply("a", KvChanges(kind=KvChangeKind.DELTA, removed=keys[10:], block_size=16))
    router.finished(request, decision, usage(160))
    assert tier.index.state("a").value == "healthy"
    lines = drift_lines(router)
    assert 'llmgw_route_drift_checks_total{model="m",replica="a",result="match"} 2.0' in lines
    assert not any(line.startswith("llmgw_route_drift_total") for line in lines)

    # Twice the engine serves nothing of what its own events confirmed: suspect after the second, tree-scored.
    for check, state in enumerate(("healthy", "suspect")):
        decision = await router.pick(request)
        assert decision.replica is a and decision.detail["confirmed_blocks"] == 10, check
        router.finished(request, decision, usage(0))
        router.finished(request, decision, usage(0))  # told once: a decision is one check, however often it ends
        assert tier.index.state("a").value == state
    lines = drift_lines(router)
    assert 'llmgw_route_drift_total{direction="over",model="m",replica="a"} 2.0' in lines
    assert 'llmgw_route_drift_tokens_total{direction="over",model="m",replica="a"} 320.0' in lines
    assert 'llmgw_route_drift_checks_total{model="m",replica="a",result="over"} 2.0' in lines
    decision = await router.pick(request)
    assert decision.replica is a and decision.detail["source"] == "tree"  # the tree still knows the prompt
    assert "predicted_cached_tokens" not in decision.detail
    answer = await router.explain(request)
    entry = next(r for r in answer["replicas"] if r["name"] == "a")
    assert entry["source"] == "tree" and entry["index"]["state"] == "suspect"
    assert entry["index"]["drift"]["over"] == 2 and entry["index"]["drift"]["resyncs"]["full"] == 1


async def test_more_cached_than_predicted_is_counted_under_and_never_makes_a_replica_suspect():
    router, tier, _, (a, b, c) = make({"drift_suspect_after": 1, "predicted_ttl": 0})  # nothing predicted
    for name in "abc":
        hold(tier, name, [])
    request = prompt(TEXT)
    for _ in range(3):
        decision = await router.pick(request)
        router.finished(request, decision, usage(304))  # e.g. another gateway's request stored the prefix
        assert tier.index.state(decision.replica.name).value == "healthy"
    assert sum(tier.index.describe(n)["drift"]["under"] for n in "abc") == 3


def test_drift_options_are_checked():
    problems = KvIndexTier.check_options({"drift_suspect_after": -1, "drift_window": "0s",
                                          "drift_relapse_window": "soon", "drift_resync_retry": 0})
    assert len(problems) == 4 and all("drift_" in p for p in problems), problems
    assert KvIndexTier.check_options({"drift_suspect_after": 0, "drift_window": "2m"}) == []


async def test_requests_whose_cached_tokens_say_nothing_of_the_cache_are_not_drift_checks():
    router, tier, _, (a, b, c) = make({"drift_suspect_after": 1})
    hold(tier, "a", keys_of(TEXT))
    hold(tier, "b", [])
    hold(tier, "c", [])
    # prompt_logprobs: vLLM reads no cached block; the tier predicts 0, as the engine reports
    request = RouteRequest("m", "/v1/completions", {"model": "m", "prompt": TEXT, "prompt_logprobs": 1})
    decision = await router.pick(request)
    assert decision.replica is a and decision.detail["predicted_cached_tokens"] == 0
    router.finished(request, decision, usage(0))
    # truncate_prompt_tokens: the engine hashes another prompt
    request = RouteRequest("m", "/v1/completions", {"model": "m", "prompt": TEXT, "truncate_prompt_tokens": 100})
    for _ in range(3):
        decision = await router.pick(request)
        router.finished(request, decision, usage(0))
    assert tier.index.state("a").value == "healthy"
    assert tier.index.describe("a")["drift"] == {**tier.index.describe("a")["drift"], "match": 0, "over": 0}
    assert (tier.predicted_cached_total, tier.actual_cached_total) == (3 * 304, 0)


async def test_fresh_engines_co_locate_from_the_first_request_before_their_events_say_a_block_size():
    router, tier, _, (a, b, c) = make()
    for name in "abc":  # what fresh engines' first FULL copies say: nothing held, no block size yet
        tier.index.apply(name, KvChanges(kind=KvChangeKind.FULL, stored=[], block_size=0))
    first = await router.pick(prompt(TEXT))
    assert first.outcome == "miss" and first.detail["block_size"] == 16  # vLLM's default, assumed
    assert tier.index.predicted_keys == 20  # its blocks are predicted at once
    for i in range(5):  # the rest of the wave follows it
        decision = await router.pick(prompt(TEXT + f" question {i}"))
        assert decision.replica is first.replica and decision.outcome == "hit"
        assert decision.detail["matched_blocks"] == 20
    explained = await router.explain(prompt(TEXT))
    assert {e["block_size_from"] for e in explained["replicas"]} == {"default"}


async def test_an_assumed_block_size_comes_from_config_the_engine_or_the_peers():
    from llmgw.plugins.kv_index import block_size_arg
    from llmgw.router.replica import EngineLoad

    assert block_size_arg(["--block-size", "32"]) == 32 and block_size_arg(["--block-size=64"]) == 64
    assert block_size_arg(["--block-size", "x"]) is None and block_size_arg(None) is None
    router, tier, _, (a, b, c) = make({"block_size": 32})
    assert tier.assumed_block_size(a, [16]) == (32, "config")
    router, tier, _, (a, b, c) = make()
    b.engine_load = EngineLoad(0, 0, 0.0, block_size=64)
    assert tier.assumed_block_size(b, [16, 16]) == (64, "engine")
    assert tier.assumed_block_size(a, [None, 32, 16, 32]) == (32, "peers")
    hold(tier, "a", [], block_size=0)
    hold(tier, "b", keys_of(TEXT, 32)[:3], block_size=32)
    hold(tier, "c", [], block_size=0)
    decision = await router.pick(prompt(TEXT))  # b holds 3 blocks of 32; a and c assume b's size
    assert decision.replica is b and decision.outcome == "hit"
    decision = await router.pick(prompt("x" * 200))
    assert decision.detail["block_size"] == 32


async def test_a_wrongly_assumed_block_size_is_logged_once_the_events_say(caplog):
    import logging

    router, tier, _, (a, b, c) = make()
    for name in "abc":
        hold(tier, name, [], block_size=0)
    await router.pick(prompt(TEXT))  # 16 assumed for all
    hold(tier, "a", keys_of(TEXT, 32)[:2], block_size=32)
    with caplog.at_level(logging.WARNING, logger="llmgw.plugins.kv_index"):
        await router.pick(prompt(TEXT))
        await router.pick(prompt(TEXT))
    warnings = [r.getMessage() for r in caplog.records if "was assumed" in r.getMessage()]
    assert len(warnings) == 1 and "replica a " in warnings[0] and "block_size: 32" in warnings[0]


# -- bounded work per prompt, lone surrogates, where /tokenize goes -------------------------------------------

ANSWER_IDS = 12_000_000


class HugeTokenizer:
    """A /tokenize server answering every request with ``ANSWER_IDS`` ids, sent as fast as they are taken."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.sent = 0

    async def serve(self, stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        while len(body) < length:
            body += await stream.receive_some(1 << 20)
        self.bodies.append(json.loads(body))
        opening = b'{"tokens":['
        piece = b"1234," * 13107
        pieces = ANSWER_IDS // 13107
        total = len(opening) + pieces * len(piece) + len(b"1234]}")
        try:
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                                  % total + opening)
            for _ in range(pieces):
                await stream.send_all(piece)
                self.sent += len(piece)
            await stream.send_all(b"1234]}")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def huge_replica(nursery, name: str = "r") -> tuple[HugeTokenizer, Replica]:
    server = HugeTokenizer()
    listeners = await nursery.start(partial(trio.serve_tcp, server.serve, 0, host="127.0.0.1"))
    replica = Replica(name=name, model="m", url=f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
    replica.pool = UpstreamPool(replica.host, replica.port)
    return server, replica


async def test_a_huge_prompt_is_cut_before_tokenizing_and_its_answer_read_only_up_to_the_cap(nursery):
    server, replica = await huge_replica(nursery)
    router = Router(build_registry(make_plugin_manager()), Metrics())
    route = router.configure_model("m", "kv_index", {"tokenizer": "replica", "tokenize_timeout": "5s",
                                                     "max_prompt_tokens": 1000})  # max_tokenize_chars: 6000
    router.add_replica(replica)
    route.tier.index.apply("r", KvChanges(kind=KvChangeKind.FULL, stored=[], block_size=16))
    words = "word " * 200_000  # a million characters
    for request in (prompt(words), RouteRequest("m", "/v1/chat/completions", {
            "model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": words}, {"role": "user", "content": "and?"}]})):
        decision = await router.pick(request)
        assert decision.tier == "kv_index" and decision.outcome in ("hit", "miss"), decision.detail
        # the ids of the cut prompt but its last CUT_MARGIN_TOKENS, at most max_prompt_tokens: 62 full blocks
        assert decision.detail["blocks"] == 1000 // 16
        assert decision.detail["prompt_tokens"] >= 1000 + CUT_MARGIN_TOKENS
    completion, chat = server.bodies
    assert len(completion["prompt"]) <= 6000 and completion["prompt"].endswith("word ")
    assert [m["content"] for m in chat["messages"]][:1] == ["be brief"] and len(chat["messages"]) == 2
    assert len(chat["messages"][1]["content"]) <= 6000 - len("be brief")
    client = route.tier.tokenizer
    assert client.answer_bytes <= 2 * default_max_bytes(1000 + CUT_MARGIN_TOKENS)
    assert server.sent < ANSWER_IDS * 5 // 2  # the connection was closed long before the answer's end


async def test_a_lone_surrogate_routes_through_the_tier():
    router, tier, tokenizer, replicas = make()
    for name in "abc":
        hold(tier, name, keys_of(TEXT) if name == "b" else [])
    decision = await router.pick(prompt(TEXT + "\ud800 and more"))
    assert (decision.tier, decision.outcome, decision.replica.name) == ("kv_index", "hit", "b")
    chat = RouteRequest("m", "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": TEXT + "\udfff"}]})
    decision = await router.pick(chat)
    assert decision.tier == "kv_index" and decision.outcome == "hit"
    assert tier.fallbacks == {}


async def test_tokenize_goes_to_the_candidate_the_prompt_is_routed_to():
    router, tier, tokenizer, (a, b, c) = make()
    for name in "abc":
        hold(tier, name, [])
    prompts = [f"{i} " + TEXT for i in range(6)]
    for round in range(3):
        for text in prompts:
            # a new prompt is tokenized on the least loaded candidate; then where it went, however loaded
            decision = await tier.pick(prompt(text), [a, b, c])
            assert round == 0 or tokenizer.calls[-1] == decision.replica.name, (text, tokenizer.calls)
            tier.index.apply(decision.replica.name, KvChanges(kind=KvChangeKind.DELTA, stored=keys_of(text)))
            decision.replica.local_inflight += 1


async def test_a_prompt_of_one_model_is_never_tokenized_on_another_models_replica():
    router, tier, tokenizer, replicas = make(names=("a1", "a2"))
    other = router.configure_model("other", "round_robin", {})
    b = Replica(name="b1", model="other", url="http://127.0.0.1:9100")
    router.add_replica(b)
    for name in ("a1", "a2"):
        hold(tier, name, [])
    assert other.replicas and b not in router.candidates("m")
    for i in range(8):
        await router.pick(prompt(f"{i} " + TEXT))
        excluded = replicas[i % 2]  # a retry without the replica that failed: not a candidate any more
        retry = await router.pick(prompt(f"{i} " + TEXT), exclude=[excluded])
        assert tokenizer.calls[-1] == retry.replica.name != excluded.name
    assert set(tokenizer.calls) == {"a1", "a2"} and len(tokenizer.calls) == 16


# -- the capacity charge without vLLM's usage gauge (llmgw.router.kv_capacity) ------------------------------------

CAPACITY = 100  # blocks of 16 tokens: 1,600 tokens


def taught(tier) -> None:
    """40 ms a step, 10,000 prompt tokens/s, nothing per request in flight."""
    rng = random.Random(1)
    for i in range(200):
        tokens, requests = rng.randint(50, 4000), rng.randint(0, 12)
        tier.tree.cost.observe("ab"[i % 2], tokens, requests, 0.04 + tokens / 10_000)


def setting(stored_filler: int):
    router, tier, _, (a, b) = make({"cost_decode_weight": 1, "engine_metrics_interval": "250ms"}, names=("a", "b"))
    taught(tier)
    keys = keys_of(TEXT)
    hold(tier, "a", keys + [10**6 + i for i in range(stored_filler)])  # the prompt's 20 blocks and others
    hold(tier, "b", [])
    now = tier.clock()
    # An engine exporting its cache config but no vllm:kv_cache_usage_perc (the scraper keeps its capacity).
    a.engine_load = EngineLoad(6, 0, now, block_size=16, num_blocks=CAPACITY)
    b.engine_load = EngineLoad(0, 0, now, block_size=16, num_blocks=CAPACITY)
    a.local_inflight, a.local_inflight_tokens = 6, 6 * 250  # six answers decoding under 250-token prompts
    return router, tier, a, b


async def test_a_holder_whose_cache_the_index_shows_full_is_charged_the_preemption_and_loses_the_request():
    """No usage gauge: the index holds 95 of the holder's 100 blocks and its six requests in flight 1,500 tokens,
    so 100 tokens are free for a 324-token request: it would preempt, and goes to the idle replica. On main (no
    usage gauge, no charge) it stayed on the holder."""
    router, tier, a, b = setting(stored_filler=75)
    explained = await router.explain(prompt(TEXT))
    costs = {e["name"]: e["cost"] for e in explained["replicas"]}
    assert costs["a"]["decode"]["kv_free_tokens"] == 100 and costs["a"]["capacity_charge_s"] > 0.1, costs["a"]
    assert costs["b"]["decode"]["kv_free_tokens"] == 1600 and costs["b"]["capacity_charge_s"] == 0
    assert free_tokens(a.engine_load, tier.index.blocks, "a", a.inflight_tokens) == (100.0, INDEX)
    decision = await router.pick(prompt(TEXT))
    assert decision.replica is b and decision.outcome == "cost_override", decision.detail
    assert tier.tree.decode.moved["capacity"] == 1


async def test_cached_blocks_the_index_counts_but_no_request_holds_are_free():
    """The same holder's cache full of blocks finished requests left (vLLM evicts them on demand) but with one
    short request in flight: the request stays with its cache."""
    router, tier, a, b = setting(stored_filler=75)
    a.local_inflight, a.local_inflight_tokens = 1, 200
    decision = await router.pick(prompt(TEXT))
    assert decision.replica is a and decision.outcome == "hit", decision.detail


async def test_strict_tokenize_routes_a_prompt_to_the_replica_whose_tokenize_saw_it():
    # b holds the prompt; the tree does not know it yet, so the prompt is tokenized on the least loaded, a.
    for strict, expected, outcome in ((False, "b", "hit"), (True, "a", "tokenize_pinned")):
        router, tier, tokenizer, (a, b, c) = make({"strict_tokenize": strict})
        hold(tier, "a", [])
        hold(tier, "b", keys_of(TEXT))
        hold(tier, "c", [])
        a.local_inflight, b.local_inflight, c.local_inflight = 0, 1, 2
        explained = await tier.explain(prompt(TEXT), [a, b, c])  # says why, and changes nothing
        assert explained["pick"] == expected and ("strict_tokenize" in explained["reason"]) == strict
        decision = await router.pick(prompt(TEXT))
        assert tokenizer.calls == ["a", "a"]
        assert (decision.replica.name, decision.outcome) == (expected, outcome), decision.detail
        assert router.metrics.decisions.labels("m", "kv_index", outcome)._value.get() == 1
        if strict:  # its blocks are predicted where it went
            assert decision.detail["prediction"] is not None and decision.detail["matched_blocks"] == 0


async def test_strict_tokenize_pins_a_fallback_too_and_not_a_prompt_no_replica_saw():
    router, tier, tokenizer, (a, b, c) = make({"strict_tokenize": True})
    for name in "abc":
        hold(tier, name, [])
    a.local_inflight, b.local_inflight, c.local_inflight = 1, 0, 2
    tokenizer.fail = TokenizeError("timeout", "took longer than 50 ms")
    decisions = [await router.pick(prompt(f"{i} {TEXT}")) for i in range(4)]
    assert {d.replica.name for d in decisions} == {"b"} and tokenizer.calls == ["b"] * 4
    assert all(d.outcome == "tokenize_timeout" for d in decisions)
    # A source that says when it asked a replica: a prompt answered without one (its cache, the router's own
    # tokenizer) is routed by the index as usual.
    tokenizer.fail = None
    tokenizer.reports_asked = True
    hold(tier, "c", keys_of(TEXT))
    decision = await router.pick(prompt(TEXT))
    assert (decision.replica.name, decision.outcome) == ("c", "hit")


async def test_the_replica_tokenizer_says_which_replica_it_asked(nursery):
    from llmgw.plugins.replica_tokenizer import ASKED, TokenizeClient

    _, replica = await huge_replica(nursery)
    client = TokenizeClient({"tokenize_timeout": 5, "max_ids": 100})
    body = json.dumps({"model": "m", "prompt": "hello there"}).encode()
    assert await client.tokenize(replica, body) and ASKED.get() is replica
    ASKED.set(None)
    assert await client.tokenize(replica, body) and ASKED.get() is None  # the cache answered: nobody was asked
