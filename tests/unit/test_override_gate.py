"""The uncertainty of cost estimates (llmgw.router.uncertainty) and the gate it puts on cost_override decisions."""

from __future__ import annotations

import random

from llmgw.metrics import Metrics
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.cost import CostModel
from llmgw.router.replica import Replica
from llmgw.router.router import Router
from llmgw.router.tier import RouteRequest

# What the fits see: 40 ms a step, 15 ms per request in flight, 30,000 prompt tokens/s, 10 ms of noise.
STEP, PER_REQUEST, THROUGHPUT, NOISE = 0.04, 0.015, 30_000.0, 0.01
SYSTEM = "You are the support assistant of a large company; follow these rules. " * 115  # ~8,000 chars, ~2,000 tokens


def teach(model: CostModel, names, most_tokens: int, count: int = 300, seed: int = 1) -> None:
    """Observations of requests with 20 to ``most_tokens`` tokens of prefill and 0 to 12 in flight."""
    rng = random.Random(seed)
    for i in range(count):
        tokens, requests = rng.randint(20, most_tokens), rng.randint(0, 12)
        ttft = STEP + tokens / THROUGHPUT + requests * PER_REQUEST + rng.gauss(0, NOISE)
        model.observe(names[i % len(names)], tokens, requests, max(ttft, 0.0))


def make(most_tokens: int, options: dict | None = None):
    """The gate on the time to first token and the delay to others alone: the holder's eight or ten requests in
    flight would also be charged their decode (on by default: test_decode_cost.py)."""
    router = Router(build_registry(make_plugin_manager(())), Metrics())
    tier = router.configure_model("m", "prefix_tree", {"seed": 3, "cost_decode_weight": 0, **(options or {})}).tier
    replicas = [Replica(name=n, model="m", url=f"http://127.0.0.1:{9000 + i}") for i, n in enumerate("ab")]
    for replica in replicas:
        router.add_replica(replica)
    teach(tier.cost, "ab", most_tokens)
    return router, tier, replicas


def chat(question: str) -> RouteRequest:
    return RouteRequest("m", "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})


async def busy_holder(router, replicas: list[Replica], inflight: int) -> tuple[Replica, Replica]:
    """The prompt's holder with ``inflight`` requests in flight and 300 tokens of prefill queued (what its fit has
    seen), and the idle other replica, which would have to compute the whole ~2,000-token prompt."""
    owner = (await router.pick(chat("first question"))).replica
    owner.local_inflight, owner.local_queued_tokens = inflight, 300
    return owner, next(r for r in replicas if r is not owner)


async def test_an_override_that_rests_on_extrapolating_the_prefill_throughput_is_not_taken():
    """The issue's case: the fit saw only cached requests (at most 400 new tokens) and extrapolates to a
    2,000-token cold prefill, plus its recompute charge: ~4,000 tokens (its fit finds 42,000 tokens/s where the
    data's truth is 30,000). Without the gate the rule moves the request to the idle replica on an expected gain of
    ~34 ms; the uncertainty of that extrapolation is ~55 ms, so it stays."""
    router, tier, replicas = make(most_tokens=400)
    owner, idle = await busy_holder(router, replicas, inflight=8)
    explained = await router.explain(chat("second question"))
    costs = {e["name"]: e["cost"] for e in explained["replicas"]}
    gain = costs[owner.name]["cost_s"] - costs[idle.name]["cost_s"]
    # What the rule without the gate saw: the idle replica cheaper by more than any tie margin (5 %, half the noise)
    assert gain > max(0.05 * costs[idle.name]["cost_s"], 0.5 * costs[idle.name]["learnt"]["noise_s"]), costs
    spread = (costs[owner.name]["uncertainty_s"] ** 2 + costs[idle.name]["uncertainty_s"] ** 2) ** 0.5
    assert costs[idle.name]["uncertainty_s"] > 3 * costs[owner.name]["uncertainty_s"]  # the extrapolated one
    assert gain < spread, costs
    assert explained["outcome"] == "hit" and explained["pick"] == owner.name
    assert "within the uncertainty" in explained["reason"] and explained["rule"]["cost_override_sigmas"] == 1.0
    decision = await router.pick(chat("second question"))
    assert decision.replica is owner and decision.outcome == "hit"
    assert decision.detail["estimates"][idle.name] < decision.detail["estimates"][owner.name]
    text = router.metrics.registry.get_sample_value("llmgw_cost_overrides_gated_total", {"model": "m"})
    assert text == 1  # the pick counted, the explanation did not
    # cost_override_sigmas 0 turns the gate off: the rule as it was, which moves the request
    router, tier, replicas = make(most_tokens=400, options={"cost_override_sigmas": 0})
    owner, idle = await busy_holder(router, replicas, inflight=8)
    decision = await router.pick(chat("second question"))
    assert decision.replica is idle and decision.outcome == "cost_override"


async def test_a_gain_larger_than_the_uncertainty_still_overrides():
    """The same queue and prompt, with a fit that has seen prefills as long as the cold one: the estimate of the
    ~29 ms gain is sure to ~5 ms, and the request moves."""
    router, tier, replicas = make(most_tokens=4500)
    owner, idle = await busy_holder(router, replicas, inflight=10)
    explained = await router.explain(chat("second question"))
    costs = {e["name"]: e["cost"] for e in explained["replicas"]}
    gain = costs[owner.name]["cost_s"] - costs[idle.name]["cost_s"]
    spread = (costs[owner.name]["uncertainty_s"] ** 2 + costs[idle.name]["uncertainty_s"] ** 2) ** 0.5
    assert 0 < spread < gain / 2, costs
    decision = await router.pick(chat("second question"))
    assert decision.replica is idle and decision.outcome == "cost_override"
    cost = decision.detail["cost"]
    assert abs(cost["expected_gain_s"] - gain) < 2e-3 and 0 < cost["gain_uncertainty_s"] < cost["expected_gain_s"]


def test_the_gate_option_is_checked():
    from llmgw.plugins.prefix_tree import PrefixTreeOptions, PrefixTreeTier

    for bad in (-1, True, "1", float("nan")):
        assert "cost_override_sigmas" in "; ".join(PrefixTreeTier.check_options({"cost_override_sigmas": bad}))
    assert PrefixTreeOptions.parse({})[0].cost_override_sigmas == 1.0
    assert PrefixTreeOptions.parse({"cost_override_sigmas": 2})[0].cost_override_sigmas == 2.0


def test_the_uncertainty_grows_with_the_distance_beyond_the_observed_tokens_and_with_the_noise():
    from llmgw.router.uncertainty import Uncertainty

    quiet, noisy = CostModel(others_weight=0), CostModel(others_weight=0)  # the estimates' TTFTs alone
    teach(quiet, "a", 400)
    rng = random.Random(2)
    for _ in range(300):
        tokens, requests = rng.randint(20, 400), rng.randint(0, 12)
        noisy.observe("a", tokens, requests, STEP + tokens / THROUGHPUT + requests * PER_REQUEST + rng.gauss(0, 0.05))
    spreads = {}
    for label, model in (("quiet", quiet), ("noisy", noisy)):
        gate = Uncertainty(model)
        spreads[label] = [gate.of("a", e) for e in model.estimate(["a"] * 4, 2000, [1800, 1000, 0, 0],
                                                                  [4, 4, 4, 40])]
    near, half, cold, crowded = spreads["quiet"]
    assert near < half < cold and near < crowded  # 200, 1,000, 2,000 new tokens; 40 requests beyond the 12 seen
    assert near < NOISE / 2 < cold  # within the data: much less than one observation's noise
    assert all(n > 3 * q for n, q in zip(spreads["noisy"], spreads["quiet"]))
    # No data: the priors alone, and a 2,000-token estimate is uncertain by several prior step times (20 ms each);
    # it shrinks as observations of such prefills come in.
    blank = CostModel(others_weight=0)
    first = Uncertainty(blank).of("a", blank.estimate(["a"], 2000, [0], [0])[0])
    teach(blank, "a", 4500, count=10)
    assert first > 0.05 and Uncertainty(blank).of("a", blank.estimate(["a"], 2000, [0], [0])[0]) < first / 3
