"""The prefix_tree tier's decisions (hit, miss, load_override), its scorers, explain, and the router's load counters."""

from __future__ import annotations

from collections import Counter

import pytest
from prometheus_client import generate_latest

from llmgw.config import ConfigError, parse_config
from llmgw.hookspecs import hookimpl
from llmgw.metrics import Metrics
from llmgw.plugins.prefix_tree import PrefixTreeTier
from llmgw.plugins_manager import build_registry, check_config_plugins, make_plugin_manager
from llmgw.router.canonical import canonical_text
from llmgw.router.replica import EngineLoad, Replica
from llmgw.router.router import Router
from llmgw.router.tier import RouteRequest

SYSTEM = "You are a careful assistant. " * 20  # 580 characters, well above min_match_chars


def make_router(options=None, *plugins, tier="prefix_tree", names=("a", "b", "c", "d")):
    router = Router(build_registry(make_plugin_manager(plugins)), Metrics())
    router.configure_model("m", tier, {"seed": 7, **(options or {})})
    replicas = [Replica(name=n, model="m", url=f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(names)]
    for replica in replicas:
        router.add_replica(replica)
    return router, replicas


def chat(*turns: str, system: str = SYSTEM) -> RouteRequest:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return RouteRequest("m", "/v1/chat/completions", {"model": "m", "messages": messages})


def outcomes(router) -> dict[str, float]:
    counter = router.metrics.decisions
    return {outcome: counter.labels("m", "prefix_tree", outcome)._value.get()
            for outcome in ("hit", "miss", "load_override")}


async def test_each_turn_of_a_conversation_goes_where_the_previous_turn_went():
    router, _ = make_router()
    first = {}
    for conversation in range(8):
        system = f"conversation {conversation}: " + SYSTEM
        decision = await router.pick(chat("hello", system=system))
        assert decision.outcome == "miss" and decision.tier == "prefix_tree"
        first[conversation] = decision.replica
    for conversation in range(8):
        system = f"conversation {conversation}: " + SYSTEM
        decision = await router.pick(chat("hello", "hi! how can I help?", "tell me more", system=system))
        assert decision.outcome == "hit" and decision.replica is first[conversation]
        assert decision.detail["matched_chars"] > len(system)
    assert outcomes(router) == {"hit": 8, "miss": 8, "load_override": 0}


async def test_misses_spread_over_the_least_loaded_replicas_evenly():
    router, replicas = make_router()
    picks = Counter()
    for i in range(12):
        picks[(await router.pick(chat(f"question {i}", system=f"fresh system prompt {i} " * 30))).replica.name] += 1
    assert picks == {"a": 3, "b": 3, "c": 3, "d": 3}  # the least recently given a new prefix goes next


async def test_new_prefixes_are_dealt_out_evenly_whichever_replica_is_idle_when_they_arrive():
    """A replica whose requests finish first is idle whenever a new prefix arrives: dealt by momentary load, it
    would collect every new prefix (and all their later requests); dealt by what each replica holds, the twelve
    groups end three per replica. Every one goes within two of its own prefills' time of the cheapest. That takes
    a deal_load_margin of 1 (b runs one request fewer than the others); by default (0) the deal keeps to the
    replicas running the least, and b takes them all, as by cost alone."""
    async def deal(options) -> tuple[Router, Counter]:
        router, replicas = make_router(options)
        picks = Counter()
        for i in range(12):
            for replica in replicas:
                replica.local_inflight = 0 if replica.name == "b" else 1
            decision = await router.pick(chat(f"question {i}", system=f"fresh system prompt {i} " * 30))
            assert decision.outcome == "miss"
            picks[decision.replica.name] += 1
        return router, picks

    router, picks = await deal({"deal_load_margin": 1})
    assert picks == {"a": 3, "b": 3, "c": 3, "d": 3}
    assert (await deal({"new_prefixes": "cheapest"}))[1] == {"b": 12}  # by cost alone: the idle one takes all
    assert (await deal({}))[1] == {"b": 12}  # the default margin: only the least running are dealt among
    deals = {how: sample.value for sample in router.metrics.registry.collect() for sample in sample.samples
             if sample.name == "llmgw_routing_new_prefixes_total" for how in [sample.labels["how"]]}
    assert deals["cheapest"] + deals["dealt"] == 12 and deals["dealt"] >= 8  # b was the cheapest every time


async def test_the_deal_never_sends_a_new_prefix_to_a_replica_too_busy_to_afford_it():
    router, (a, b, c, d) = make_router({"deal_load_margin": None})  # the affordability step alone
    a.local_inflight = 10  # ten requests in flight: far more than two prefills of a new prompt behind the others
    for i in range(4):
        decision = await router.pick(chat("hello", system=f"fresh system prompt {i} " * 30))
        assert decision.outcome == "miss" and decision.replica is not a  # a holds the least, but is too busy
    tier = router.models["m"].tier
    assert tier.tree.replica_chars.get("a", 0) == 0
    a.local_inflight = 1  # one request in flight: within the slack, and it holds the least
    request = chat("hello", system="fresh system prompt 9 " * 30)
    explained = tier.explain(request, [a, b, c, d])
    assert explained["pick"] == "a" and "not one of the cheapest" in explained["reason"], explained
    assert [r["deal"] for r in explained["replicas"]][0] == {"held_chars": 0, "affordable": True,
                                                                  "within_load_margin": True}
    decision = await router.pick(request)
    assert decision.outcome == "miss" and decision.replica is a


async def test_the_deal_sends_a_new_prefix_to_the_idle_replica_over_a_busier_one_holding_less():
    """Issue 19: both can afford the new prompt and a holds less of the tree, but a runs two requests and b none:
    dealt by holdings alone it went to a, where every running request then decodes slower."""
    router, (a, b) = make_router(names=("a", "b"))
    tier = router.models["m"].tier
    tier.tree.insert("system\x1fan earlier group's charter " * 40, "b", tier.clock())
    a.local_inflight, b.local_inflight = 1, 0
    request = chat("hello", system="fresh system prompt " * 30)
    explained = tier.explain(request, [a, b])
    assert [r["deal"]["affordable"] for r in explained["replicas"]] == [True, True], explained  # a could afford it
    assert [r["deal"]["within_load_margin"] for r in explained["replicas"]] == [False, True], explained
    assert explained["pick"] == "b" and "1 of them left out" in explained["reason"], explained
    decision = await router.pick(request)
    assert decision.outcome == "miss" and decision.replica is b
    router, (a, b) = make_router({"deal_load_margin": None}, names=("a", "b"))  # the deal before: by holdings alone
    tier = router.models["m"].tier
    tier.tree.insert("system\x1fan earlier group's charter " * 40, "b", tier.clock())
    a.local_inflight, b.local_inflight = 1, 0
    assert (await router.pick(request)).replica is a


async def test_a_miss_does_not_go_to_the_first_replica_by_default():
    first_picks = Counter()
    for seed in range(40):
        router, _ = make_router({"seed": seed})
        first_picks[(await router.pick(chat("hello"))).replica.name] += 1
    assert len(first_picks) == 4, first_picks  # every replica is chosen by some seed, "a" is not special
    assert first_picks["a"] < 20


async def test_an_overloaded_best_match_loses_to_the_least_loaded_beyond_max_imbalance():
    router, (a, b, c, d) = make_router({"max_imbalance": 4})
    owner = (await router.pick(chat("the conversation so far"))).replica
    others = [r for r in (a, b, c, d) if r is not owner]
    for r in others:
        r.local_inflight = 1
    owner.local_inflight = 4  # taking the request puts it 4 above the least loaded: allowed
    decision = await router.pick(chat("the conversation so far", "and more"))
    assert decision.outcome == "hit" and decision.replica is owner
    owner.local_inflight = 5  # would be 5 above: the guard routes by load
    decision = await router.pick(chat("the conversation so far", "and more", "still more"))
    assert decision.outcome == "load_override" and decision.replica in others


async def test_the_sigma_rule_overrides_a_best_match_far_above_the_mean():
    router, (a, b, c, d) = make_router({"max_imbalance": None, "load_sigma_k": 1.0})
    owner = (await router.pick(chat("shared"))).replica
    for r in (a, b, c, d):
        r.local_inflight = 3
    owner.local_inflight = 4  # mean 3.25, sigma 0.43: 4 > 3.68
    decision = await router.pick(chat("shared", "more"))
    assert decision.outcome == "load_override" and decision.replica is not owner


async def test_one_shared_system_prompt_does_not_pile_every_request_onto_one_replica():
    async def burst(options) -> tuple[Counter, int]:
        router, replicas = make_router(options)
        for i in range(40):  # all in flight at once: nobody finishes
            decision = await router.pick(chat(f"user question number {i}"))
            decision.replica.local_inflight += 1
            spread = max(r.inflight for r in replicas) - min(r.inflight for r in replicas)
            assert options.get("max_imbalance") is None or spread <= options["max_imbalance"]
        return Counter({r.name: r.inflight for r in replicas}), outcomes(router)["load_override"]

    counts, overrides = await burst({"max_imbalance": 4})
    assert max(counts.values()) - min(counts.values()) <= 4 and overrides > 0
    # The hot spot the guard prevents: prefix affinity alone sends everything to one replica.
    counts, _ = await burst({"max_imbalance": None, "scorers": {"prefix": 1.0}})
    assert sorted(counts.values()) == [0, 0, 0, 40]


async def test_engine_reported_queues_count_as_load_when_fresh():
    router, (a, b, c, d) = make_router({"rule": "scores", "engine_metrics_interval": "250ms", "max_imbalance": 4})
    owner = (await router.pick(chat("long running conversation"))).replica
    tier = router.models["m"].tier
    owner.engine_load = EngineLoad(running=8, waiting=3, at=tier.clock() - 10)  # stale (max age 0.75 s): ignored
    decision = await router.pick(chat("long running conversation", "next"))
    assert decision.outcome == "hit" and decision.replica is owner
    owner.engine_load = EngineLoad(running=8, waiting=3, at=tier.clock())  # other gateways keep it busy
    decision = await router.pick(chat("long running conversation", "next", "again"))
    assert decision.outcome == "load_override" and decision.replica is not owner


class PinnedScorer:
    """A third party's scorer: prefer replicas labelled pinned=yes (the label is an option it declares)."""

    name = "pinned"
    option_keys = ("pinned_label",)

    def __init__(self, options):
        self.label = options.get("pinned_label", "pinned")

    def score(self, request, candidates, context):
        return [1.0 if r.labels.get(self.label) == "yes" else 0.0 for r in candidates]


class PinnedPlugin:
    @hookimpl
    def register_scorers(self):
        return {"pinned": PinnedScorer}


async def test_a_third_party_scorer_is_registered_by_a_plugin_and_weighted_by_name():
    options = {"scorers": {"prefix": 1.0, "pinned": 2.0}, "pinned_label": "pin"}
    registry = build_registry(make_plugin_manager((PinnedPlugin(),)))
    assert PrefixTreeTier.check_options(options, registry) == []  # its declared key is not "unknown"
    router, (a, b, c, d) = make_router(options, PinnedPlugin())
    c.labels["pin"] = "yes"
    owner = (await router.pick(chat("first turn"))).replica
    assert owner is c
    d.labels["pin"] = "yes"
    c.local_inflight = 1
    decision = await router.pick(chat("first turn", "second"))
    assert decision.replica is c  # the prefix weight keeps it on c
    decision = await router.pick(chat("unrelated", system="different prompt " * 40))
    assert decision.replica is d  # pinned and less loaded than c
    explained = await router.explain(chat("first turn", "second"))
    assert {e["name"]: e["scores"]["pinned"] for e in explained["replicas"]} == {"a": 0, "b": 0, "c": 1, "d": 1}


def test_an_unknown_scorer_or_a_bad_option_is_a_config_error_at_its_line():
    text = """
models:
  - name: m
    routing: prefix_tree
    routing_options:
      scorers: {prefix: 1.0, nope: 1.0}
      max_imbalance: -1
      tree_ttl: forever
      max_imbalnce: 3
    replicas:
      - url: http://127.0.0.1:9000
"""
    config = parse_config(text, filename="bad.yaml")
    with pytest.raises(ConfigError) as raised:
        check_config_plugins(config, build_registry(make_plugin_manager()))
    message = str(raised.value)
    assert "bad.yaml:5: models[0].routing_options: " in message
    for expected in ("no scorer named 'nope' (known: load, prefix)", "max_imbalance", "tree_ttl",
                     "unknown key 'max_imbalnce'"):
        assert expected in message


async def test_explain_changes_nothing_and_predicts_the_next_pick():
    router, replicas = make_router()
    await router.pick(chat("hello"))
    tier = router.models["m"].tier
    nodes = tier.tree.node_count
    request = chat("hello", "hi", "what next?")
    explained = await router.explain(request)
    assert tier.tree.node_count == nodes  # nothing learnt
    assert explained["tier"] == "prefix_tree" and explained["outcome"] == "hit"
    entries = {e["name"]: e for e in explained["replicas"]}
    assert set(entries) == {"a", "b", "c", "d"}
    pick = entries[explained["pick"]]
    assert pick["matched_chars"] > 0 and explained["rule"]["rule"] == "cost"
    assert pick["cost"]["cached_tokens"] > 0
    assert pick["cost"]["estimated_ttft_s"] == min(e["cost"]["estimated_ttft_s"] for e in entries.values())
    assert (await router.pick(request)).replica.name == explained["pick"]
    # Misses too: the random tie-break is replayed, not consumed.
    fresh = chat("x", system="never seen " * 50)
    predicted = (await router.explain(fresh))["pick"]
    assert (await router.explain(fresh))["pick"] == predicted
    assert (await router.pick(fresh)).replica.name == predicted


async def test_round_robin_explains_without_taking_its_turn():
    router, _ = make_router(tier="round_robin")
    await router.pick(chat("x"))
    assert (await router.explain(chat("x")))["pick"] == "b"
    assert (await router.explain(chat("x")))["pick"] == "b"
    assert (await router.pick(chat("x"))).replica.name == "b"


async def test_a_tier_without_explain_reports_replicas_but_no_pick():
    class Opaque:
        name = "opaque"

        def __init__(self, model, services):
            pass

        async def pick(self, request, candidates):
            return None

    class OpaquePlugin:
        @hookimpl
        def register_routing_tiers(self):
            return {"opaque": Opaque}

    router, _ = make_router(None, OpaquePlugin(), tier="opaque")
    explained = await router.explain(chat("x"))
    assert explained["pick"] is None and explained["outcome"] == "not_explainable"
    assert [e["name"] for e in explained["replicas"]] == ["a", "b", "c", "d"]


@pytest.mark.parametrize("tier", ["prefix_tree", "round_robin"])
async def test_the_router_keeps_inflight_prompt_tokens_for_every_tier(tier):
    router, _ = make_router(tier=tier)
    request = chat("tokens please")
    decision = await router.pick(request)
    router.routed(request, decision)
    expected = len(request.canonical_text) // 4 + 1
    assert decision.replica.inflight_tokens == expected == decision.inflight_tokens
    router.finished(request, decision, None)
    router.finished(request, decision, None)  # a second call takes nothing more off
    assert decision.replica.inflight_tokens == 0


async def test_tree_gauges_survive_reconfiguring_the_model():
    router, _ = make_router()
    await router.pick(chat("hello"))
    router.configure_model("m", "prefix_tree", {"seed": 1})  # a second tier, same metrics registry
    await router.pick(chat("hello"))
    text = generate_latest(router.metrics.registry).decode()
    assert 'llmgw_prefix_tree_nodes{model="m"} 1.0' in text
    assert f'llmgw_prefix_tree_chars{{model="m"}} {float(len(canonical_text(chat("hello"))))}' in text
    assert 'llmgw_prefix_tree_evictions_total{model="m",reason="size"} 0.0' in text
