"""The cost model (llmgw.router.cost) and the cost rule of the prefix_tree and kv_index tiers, on constructed cases."""

from __future__ import annotations

import random
import time

from llmgw.metrics import Metrics
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.cost import CostModel
from llmgw.router.replica import EngineLoad, Replica
from llmgw.router.router import Router
from llmgw.router.tier import RouteRequest

# The "hardware" the tests' observations come from: 40 ms per step, 10,000 prompt tokens/s, 15 ms per request
# already in flight.
STEP, THROUGHPUT, PER_REQUEST = 0.04, 10_000.0, 0.015


def true_ttft(tokens: float, requests: float) -> float:
    return STEP + tokens / THROUGHPUT + requests * PER_REQUEST


def teach(model: CostModel, names, count: int = 200, seed: int = 1, noise: float = 0.0) -> None:
    rng = random.Random(seed)
    for i in range(count):
        tokens, requests = rng.randint(50, 4000), rng.randint(0, 12)
        model.observe(names[i % len(names)], tokens, requests, true_ttft(tokens, requests) + rng.gauss(0, noise))


def test_throughput_step_and_per_request_cost_are_learnt_from_observed_ttfts():
    model = CostModel()  # priors: 20,000 tokens/s, 20 ms, nothing per request
    teach(model, ["a", "b"], noise=0.002)
    for name in ("a", "b"):
        learnt = model.replica(name)
        assert abs(learnt.throughput - THROUGHPUT) / THROUGHPUT < 0.05, model.describe(name)
        assert abs(learnt.step - STEP) < 0.01 and abs(learnt.per_request - PER_REQUEST) < 0.002
        assert 0.001 < learnt.noise < 0.004
    # A replica that has seen nothing looks like its peers, not like the priors.
    fresh = model.replica("c")
    assert abs(fresh.throughput - THROUGHPUT) / THROUGHPUT < 0.05 and fresh.observations == 0


def test_the_priors_hold_before_any_observation_and_when_the_data_cannot_tell_the_terms_apart():
    model = CostModel(prior_throughput=5000, prior_step=0.05)
    assert model.replica("a").throughput == 5000 and model.replica("a").step == 0.05
    for _ in range(50):  # every request the same size, nothing in flight: only the sum is known
        model.observe("a", 1000, 0, 0.25)
    (estimate,) = model.estimate(["a"], 1000, [0], [0])
    assert abs(estimate.ttft - 0.25) < 0.01  # what was seen is predicted
    assert 50 <= model.replica("a").throughput <= 1e8 and model.replica("a").step >= 0


def steady(model: CostModel, names, count: int, ttft: float = 0.03, seed: int = 1) -> None:
    rng = random.Random(seed)
    for _ in range(count):
        for name in names:
            model.observe(name, 300, 0, ttft + rng.gauss(0, ttft / 10))


def test_one_slow_first_token_does_not_make_a_replica_look_slow():
    """An engine's warm-up, an adapter's first load, a neighbour's burst: one TTFT of 5 s among 30 ms ones."""
    model = CostModel()
    steady(model, "ab", 60)
    model.observe("a", 300, 0, 5.0)
    (a, b) = model.estimate(["a", "b"], 300, [0, 0], [0, 0])
    assert a.ttft < 0.06 and abs(b.ttft - 0.03) < 0.005, (a, b)  # unclipped, a's estimate would be ~0.2 s
    assert model.describe("a")["clipped_observations"] == 1 and model.describe("b")["clipped_observations"] == 0


def test_a_replica_that_really_turns_slower_is_learnt_within_forty_observations():
    model = CostModel()
    steady(model, "ab", 100)
    rng = random.Random(2)
    learnt_after = None
    for seen in range(1, 41):
        model.observe("a", 300, 0, 0.3 + rng.gauss(0, 0.03))  # ten times slower from now on
        model.observe("b", 300, 0, 0.03 + rng.gauss(0, 0.003))
        if model.estimate(["a"], 300, [0], [0])[0].ttft > 0.15:
            learnt_after = seen
            break
    assert learnt_after is not None, model.describe("a")


async def test_a_replica_back_on_a_new_engine_starts_again_from_its_peers_fit():
    """Its engine was killed and restarted: the replica left routing and came back as a new object under its
    name. What was learnt of the old process is dropped; the pooled fit (and the other replica's) is kept."""
    router, tier, (a, b) = make()
    await router.pick(chat("q"))  # the tier meets both replicas
    before = tier.cost.describe("b")
    pooled = tier.cost.pooled_line()
    assert tier.cost.describe("a")["observations"] == 100
    router.remove_replica(a)
    restarted = Replica(name="a", model="m", url=a.url, engine_id="a/g1/pid4242/17.000")  # as deployed.py names it
    router.add_replica(restarted)
    await router.pick(chat("q2"))
    assert tier.cost.describe("a")["observations"] == 0 and tier.cost.describe("b") == before
    assert tier.cost.replica("a").line() == tier.cost.pooled_line() == pooled
    await router.pick(chat("q3"))  # the same engine again: nothing more is forgotten
    tier.cost.observe("a", 300, 0, 0.07)
    await router.pick(chat("q4"))
    assert tier.cost.describe("a")["observations"] == 1
    # The same engine on a new object (the control plane re-adopted it after its restart; another gateway follows
    # it) keeps what was learnt of it.
    router.remove_replica(restarted)
    router.add_replica(Replica(name="a", model="m", url=a.url, engine_id="a/g1/pid4242/17.000"))
    await router.pick(chat("q5"))
    assert tier.cost.describe("a")["observations"] == 1


def test_observations_outside_sane_bounds_are_ignored():
    model = CostModel()
    for ttft in (-1.0, float("nan"), 1e9):
        model.observe("a", 100, 0, ttft)
    model.observe("a", -5, 0, 0.1)
    assert model.replica("a").observations == 0


def make(options=None, names=("a", "b")):
    router = Router(build_registry(make_plugin_manager(())), Metrics())
    route = router.configure_model("m", "prefix_tree", {"seed": 3, **(options or {})})
    replicas = [Replica(name=n, model="m", url=f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(names)]
    for replica in replicas:
        router.add_replica(replica)
    teach(route.tier.cost, names)
    return router, route.tier, replicas


SYSTEM = "You are the support assistant of a large company; follow these rules. " * 115  # ~8,000 chars, ~2,000 tokens


def chat(question: str, system: str = SYSTEM) -> RouteRequest:
    return RouteRequest("m", "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]})


async def owner_of_the_prompt(router) -> Replica:
    decision = await router.pick(chat("first question"))
    assert decision.outcome == "miss"
    return decision.replica


async def test_a_long_cached_prefix_on_a_busy_replica_beats_an_idle_cold_one():
    router, tier, replicas = make()
    owner = await owner_of_the_prompt(router)
    idle = next(r for r in replicas if r is not owner)
    owner.local_inflight = 6  # six requests in flight, their prefills done but a few hundred tokens
    owner.local_queued_tokens = 300
    decision = await router.pick(chat("second question"))
    # owner: 40 ms + (300 + ~10) / 10k + 6 x 15 ms = ~161 ms; idle: 40 ms + ~2,010 / 10k = ~241 ms
    assert decision.replica is owner and decision.outcome == "hit"
    assert 0.12 < decision.detail["cost"]["estimated_ttft_s"] < 0.2
    explained = await router.explain(chat("second question"))
    costs = {e["name"]: e["cost"] for e in explained["replicas"]}
    assert costs[owner.name]["cached_tokens"] > 1900 and costs[owner.name]["queued_tokens"] == 300
    assert costs[idle.name]["cached_tokens"] == 0 and costs[idle.name]["new_tokens"] > 1900
    assert costs[idle.name]["estimated_ttft_s"] > costs[owner.name]["estimated_ttft_s"]
    # What the count guard did instead: 6 + 1 - 0 > 4 in-flight requests, so a cold 2,000-token prefill.
    router, tier, replicas = make({"rule": "scores", "max_imbalance": 4})
    owner = await owner_of_the_prompt(router)
    owner.local_inflight = 6
    decision = await router.pick(chat("second question"))
    assert decision.outcome == "load_override" and decision.replica is not owner


async def test_an_idle_cold_replica_beats_a_cached_one_whose_queue_is_longer_than_the_prefill():
    router, tier, replicas = make()
    owner = await owner_of_the_prompt(router)
    idle = next(r for r in replicas if r is not owner)
    owner.local_inflight = 10
    owner.local_queued_tokens = 6000  # long prompts of other conversations being prefilled
    explained = await router.explain(chat("second question"))
    assert explained["outcome"] == "cost_override" and explained["preferred"] == owner.name
    assert "6000 prefill tokens, 10 requests" in explained["reason"]
    decision = await router.pick(chat("second question"))
    # owner: 40 ms + 6,010 / 10k + 10 x 15 ms = ~791 ms; idle: ~241 ms
    assert decision.replica is idle and decision.outcome == "cost_override"
    assert 0.2 < decision.detail["cost"]["estimated_ttft_s"] < 0.3
    assert router.metrics.decisions.labels("m", "prefix_tree", "cost_override")._value.get() == 1


async def test_a_difference_within_the_noisier_replicas_noise_is_a_tie_and_the_cached_one_wins():
    """Seen with two real vLLM replicas on one CPU: fits of 112 and 212 ms steps, noise 174 and 294 ms; the one
    holding 288 cached tokens lost on a difference its own noise could not tell from chance."""
    router = Router(build_registry(make_plugin_manager(())), Metrics())
    tier = router.configure_model("m", "prefix_tree", {"seed": 3}).tier
    quiet, noisy = (Replica(name=n, model="m", url=f"http://127.0.0.1:{9000 + i}") for i, n in enumerate("qn"))
    for replica in (quiet, noisy):
        router.add_replica(replica)
    rng = random.Random(5)
    for _ in range(60):  # a tiny model: the prefill is lost in the noise, the fits find it free
        tier.cost.observe("q", rng.randint(50, 4000), 0, 0.10 + rng.gauss(0, 0.02))
        tier.cost.observe("n", rng.randint(50, 4000), 0, max(0.0, 0.16 + rng.gauss(0, 0.15)))
    quiet.local_queued_tokens = 100_000  # busy for a moment: the prompt's first request goes to n
    assert (await router.pick(chat("first question"))).replica is noisy
    quiet.local_queued_tokens = 0
    explained = {e["name"]: e["cost"] for e in (await router.explain(chat("asked again")))["replicas"]}
    q, n = (explained[name]["estimated_ttft_s"] for name in "qn")
    q_noise, n_noise = (explained[name]["learnt"]["noise_s"] for name in "qn")
    # q's estimate is the smaller by more than half q's noise (which alone made q the pick), by less than half n's
    assert q_noise / 2 < n - q < n_noise / 2, explained
    decision = await router.pick(chat("asked again"))
    assert decision.replica is noisy and decision.outcome == "hit"


async def test_a_cold_prefill_is_charged_the_delay_it_adds_to_the_requests_running_there():
    """The holder's queue costs this request 200 ms more than a cold prefill elsewhere, but there four requests are
    running and each would wait the 200 ms the prefill takes, as would the next to come while it recomputes what
    the holder has: the request stays with its cache. An idle replica pays only the recompute's own time, less
    than the 200 ms gained here, and the greedy rule (cost_others_weight 0) moves it in both cases."""
    for weight, running_elsewhere, stays in ((1.0, 4, True), (1.0, 0, False), (0.0, 4, False)):
        router, tier, replicas = make({"cost_others_weight": weight})
        owner = await owner_of_the_prompt(router)
        other = next(r for r in replicas if r is not owner)
        owner.local_inflight, other.local_inflight = 10, running_elsewhere
        owner.local_queued_tokens = 3000
        # owner: 40 ms + 3,010 / 10k + 10 x 15 ms = ~491 ms (+ 10 x ~1 ms of others' delay);
        # other: 40 ms + 2,010 / 10k + 4 x 15 ms = ~301 ms, + 4 x 201 ms of others' delay + ~201 ms of recompute
        explained = {e["name"]: e["cost"] for e in (await router.explain(chat("second question")))["replicas"]}
        delay = explained[other.name]["delay_to_others_s"]
        assert abs(delay - weight * (running_elsewhere + 1) * 0.201) < 0.01, explained
        assert abs(explained[other.name]["cost_s"] - explained[other.name]["estimated_ttft_s"] - delay) < 2e-4
        decision = await router.pick(chat("second question"))
        assert (decision.replica is owner) == stays, (weight, running_elsewhere, decision.detail)
        assert decision.outcome == ("hit" if stays else "cost_override")


async def test_a_short_prompt_is_worth_less_queueing_than_a_long_one():
    router, tier, replicas = make()
    short = "Be brief. " * 30  # ~75 tokens: a cold prefill costs ~8 ms, less than one request in flight
    owner = (await router.pick(chat("q", system=short))).replica
    owner.local_inflight = 2
    decision = await router.pick(chat("q2", system=short))
    assert decision.replica is not owner and decision.outcome == "cost_override"
    # With the long prompt the same queue is worth waiting for.
    owner = await owner_of_the_prompt(router)
    owner.local_inflight = 2
    assert (await router.pick(chat("again"))).replica is owner


async def test_waiting_requests_of_other_gateways_count_as_queued_prefill():
    router, tier, replicas = make({"engine_metrics_interval": "250ms"})
    owner = await owner_of_the_prompt(router)
    tier.cost.replica(owner.name).mean_new_tokens = 2000
    owner.engine_load = EngineLoad(running=1, waiting=5, at=tier.clock())  # 5 x 2,000 tokens to prefill first
    decision = await router.pick(chat("second question"))
    assert decision.replica is not owner and decision.outcome == "cost_override"
    assert decision.detail["cost"]["queued_tokens"] == 0


async def test_the_router_hooks_keep_the_queue_and_teach_the_model():
    router, tier, (a, b) = make()
    request = chat("first question")
    decision = await router.pick(request)
    router.routed(request, decision)
    replica = decision.replica  # the queue is the replica's own ledger (shared with a cluster's other gateways)
    learnt = tier.cost.replica(replica.name)
    assert decision.prefill_tokens == decision.detail["cost"]["new_tokens"] > 1900
    assert (replica.local_queued_requests, replica.local_queued_tokens) == (1, decision.prefill_tokens)
    assert (replica.queued_requests, replica.queued_tokens) == (1, decision.prefill_tokens)
    seen = learnt.observations
    router.first_token(request, decision, 0.25)
    router.first_token(request, decision, 9.0)  # once only
    assert replica.local_queued_requests == 0 and replica.local_queued_tokens == 0
    assert learnt.observations == seen + 1 and learnt.awaiting == 0
    router.finished(request, decision, None)
    assert replica.local_queued_requests == 0 and learnt.observations == seen + 1
    # A request that ends without a first token (an error) leaves the queue and teaches nothing.
    request = chat("another")
    decision = await router.pick(request)
    router.routed(request, decision)
    router.finished(request, decision, None)
    assert decision.replica.local_queued_requests == 0 and decision.replica.local_queued_tokens == 0
    assert tier.cost.replica(decision.replica.name).awaiting == 0


def test_replicas_that_left_are_forgotten():
    model = CostModel()
    for i in range(200):
        model.estimate([f"gone-{i}"], 100, [0], [0])
    model.routed("busy", {"new_tokens": 10})
    model.estimate(["a", "b"], 100, [0, 0], [0, 0])
    assert len(model.replicas) <= 64 + 2 * 2 + 3 and "busy" in model.replicas  # awaiting a first token: kept


async def test_a_burst_under_a_new_prompt_waits_for_its_first_prefill_and_spills_once_the_queue_outweighs_two():
    """The first request of a new ~2,000-token prompt is prefilled on its holder; the next ones wait for that
    prefill there rather than compute the whole prompt again on the idle replica (which would answer them about as
    soon, and take 200 ms of its GPU from whatever comes to it next). Once the holder's queue outweighs a cold
    prefill and the GPU time it takes (here: other conversations' prompts queued on it), the next one spills.
    The time to first token alone: the decode charge (on by default) would move some sooner, by the batch."""
    router, tier, (a, b) = make({"cost_decode_weight": 0})
    picks = []
    for i in range(6):  # all routed, none has its first token yet
        request = chat(f"question {i}")
        decision = await router.pick(request)
        router.routed(request, decision)
        decision.replica.local_inflight += 1  # as the data plane counts it
        picks.append((decision.replica, decision.outcome))
    owner = picks[0][0]
    other = b if owner is a else a
    assert picks[0] == (owner, "miss") and picks[1:] == [(owner, "hit")] * 5
    owner.local_queued_tokens += 2500  # two other conversations' long prompts, queued behind the burst
    decision = await router.pick(chat("question 6"))
    assert decision.replica is other and decision.outcome == "cost_override"


async def test_a_replica_that_looks_idle_does_not_take_the_second_request_of_a_prompt_being_prefilled():
    """What a gateway of a cluster sees in a burst: its own first request of a new prompt queued on the holder, the
    other replicas idle as far as it knows (the other gateways' load reports are a few tens of ms old). Waiting
    there for the prefill under way costs the second request about what computing the whole prompt elsewhere
    would (~2 ms more here), and saves a whole prefill of GPU time: it stays, and the engine serves it from the
    blocks the first one computes."""
    router, tier, replicas = make(names="abcd")
    first = chat("first question")
    decision = await router.pick(first)
    router.routed(first, decision)
    owner = decision.replica
    owner.local_inflight = 1
    explained = await router.explain(chat("second question"))
    costs = {e["name"]: e["cost"] for e in explained["replicas"]}
    idle = [name for name in costs if name != owner.name]
    # owner: 40 ms + (~2,020 queued + 5 new) / 10k + 15 ms = ~257 ms; idle: 40 ms + 2,020 / 10k = ~242 ms
    assert all(costs[name]["estimated_ttft_s"] < costs[owner.name]["estimated_ttft_s"] for name in idle), costs
    decision = await router.pick(chat("second question"))
    assert decision.replica is owner and decision.outcome == "hit"


def test_the_cost_options_are_checked_and_naming_scorers_selects_the_scores_rule():
    from llmgw.plugins.prefix_tree import PrefixTreeOptions, PrefixTreeTier

    problems = PrefixTreeTier.check_options({"rule": "fastest", "cost_decay": 0, "cost_prefill_tokens_per_s": -1,
                                             "cost_step_time": "soon", "cost_others_weight": -1})
    text = "; ".join(problems)
    for key in ("rule", "cost_decay", "cost_prefill_tokens_per_s", "cost_step_time", "cost_others_weight"):
        assert key in text, text
    for bad in (True, "1", float("inf"), 1e12):
        assert PrefixTreeTier.check_options({"cost_others_weight": bad}), bad
    assert PrefixTreeOptions.parse({"cost_others_weight": 0})[0].cost_others_weight == 0.0
    defaults = PrefixTreeOptions.parse({})[0]
    assert defaults.rule == "cost" and defaults.max_imbalance is None  # the count guard is off by default
    scored = PrefixTreeOptions.parse({"scorers": {"prefix": 1.0}})[0]
    assert scored.rule == "scores" and scored.max_imbalance == 4  # the scores rule keeps its guard
    explicit = PrefixTreeOptions.parse({"rule": "cost", "max_imbalance": 8, "cost_step_time": "50ms"})[0]
    assert explicit.max_imbalance == 8 and explicit.cost_step_time == 0.05


async def test_prefill_queued_by_the_other_gateways_of_a_cluster_counts_as_much_as_this_ones():
    router, tier, replicas = make()
    owner = await owner_of_the_prompt(router)
    owner.local_inflight, owner.peer_inflight = 2, 8
    owner.peer_queued_tokens, owner.peer_queued_requests = 6000, 3  # another gateway's long prefills there
    explained = await router.explain(chat("second question"))
    assert explained["outcome"] == "cost_override" and explained["preferred"] == owner.name
    assert {e["name"]: e["cost"]["queued_tokens"] for e in explained["replicas"]}[owner.name] == 6000
    owner.peer_queued_tokens = owner.peer_queued_requests = owner.peer_inflight = 0  # their report expired
    assert (await router.explain(chat("second question")))["outcome"] == "hit"


async def test_only_what_is_left_of_the_queue_counts_once_the_engine_has_worked_on_it():
    """6,000 tokens were queued on the holder 0.6 s ago; at its 10k tokens/s the engine is through them: the
    request waits for nothing but its own few new tokens there, and stays with its cache."""
    router, tier, replicas = make()
    owner = await owner_of_the_prompt(router)
    owner.local_inflight = 10
    owner.queue_prefill(1, 6000, time.monotonic())
    assert (await router.explain(chat("second question")))["outcome"] == "cost_override"  # all of it ahead
    owner.unqueue_prefill(1, 6000)
    owner.queue_prefill(2, 6000, time.monotonic() - 0.6)
    explained = await router.explain(chat("second question"))
    assert explained["outcome"] == "hit", explained["reason"]
    assert {e["name"]: e["cost"]["queued_tokens"] for e in explained["replicas"]}[owner.name] < 300
    owner.unqueue_prefill(2, 6000)
    assert owner.queued_since is None and owner.queued_tokens == 0


def test_another_gateways_observation_counts_only_for_the_engine_it_was_made_of():
    model = CostModel()
    model.follow([Replica(name="a", model="m", url="http://127.0.0.1:1", engine_id="a/g1/pid7/1.0")])
    model.observe_engine("a/g1/pid7/1.0", "a", 2000, 1, 0.2)
    model.observe_engine("a/g1/pid6/0.5", "a", 2000, 1, 9.0)  # the engine before a restart: not this one
    model.observe_engine("b/g1/pid3/1.0", "b", 2000, 1, 9.0)  # a replica this model does not route to
    assert model.replica("a").observations == 1 and model.observations == 1


class QuietLearning:
    """A cluster's tier learning that carries nothing: only that the tier is in a cluster."""

    def publish(self, kind, payload):
        pass

    def subscribe(self, kind, handler):
        pass


def gateway_of_a_cluster(seed: int):
    router = Router(build_registry(make_plugin_manager(())), Metrics())
    router.learning = type("Bus", (), {"for_model": lambda self, model: QuietLearning()})()
    tier = router.configure_model("m", "prefix_tree", {"seed": seed}).tier
    replicas = [Replica(name=n, model="m", url=f"http://127.0.0.1:{9000 + i}") for i, n in enumerate("abcd")]
    for replica in replicas:
        router.add_replica(replica)
    teach(tier.cost, "abcd")
    return router


async def test_gateways_of_a_cluster_send_a_new_prefix_to_the_same_replica_without_hearing_of_each_other():
    """Two gateways (different random seeds, nothing shared yet) meet the same new prompts at the same moment:
    each prompt goes to the same replica through both, and different prompts spread over the replicas."""
    first, second = gateway_of_a_cluster(1), gateway_of_a_cluster(2)
    picks = set()
    for group in range(12):
        system = f"Group {group}: you answer questions about product number {group * 7919}. " * 40
        one = await first.explain(chat("q", system=system))
        other = await second.explain(chat("another q", system=system))
        assert one["outcome"] == other["outcome"] == "miss"
        assert one["pick"] == other["pick"], group
        picks.add(one["pick"])
    assert len(picks) >= 3  # hashed, not piled up
    # Alone (no cluster), a gateway breaks such ties by its own load and its random draw, as before.
    alone = [await make(names=tuple("abcd"), options={"seed": s})[0].explain(chat("q")) for s in range(8)]
    assert len({answer["pick"] for answer in alone}) > 1


def test_only_a_recompute_of_what_another_candidate_holds_is_charged_beyond_the_requests_in_flight():
    """A prompt nobody holds costs each replica what it did before the recompute term (so new prompts spread as
    before); one a candidate holds charges every other candidate the GPU time of computing that part again."""
    model = CostModel(prior_throughput=10_000, prior_step=0.04)
    fresh = model.estimate(["a", "b"], 2000, [0, 0], [0, 3])
    assert [e.recomputed for e in fresh] == [0, 0]
    assert [round(e.delay_to_others, 4) for e in fresh] == [0.0, round(3 * 2000 / 10_000, 4)]
    held = model.estimate(["a", "b", "c"], 2000, [1600, 400, 0], [1, 0, 0])
    assert [e.recomputed for e in held] == [0, 1200, 1600]
    assert [round(e.delay_to_others, 4) for e in held] == [0.04, 0.12, 0.16]
