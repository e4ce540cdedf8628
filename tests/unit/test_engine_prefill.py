"""The cost model's prefill rate from what the engine reports, and prompt tokens per character from usage."""

from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from llmgw.router.cost import CostModel
from llmgw.router.engine_prefill import EnginePrefillRate, PrefillCounters, read_counters
from llmgw.router.replica import Replica
from llmgw.router.token_ratio import TokensPerChar

LABELS = '{engine="0",model_name="m"}'


def vllm_text(prompt: float, hits: float, seconds: float, prefills: float) -> str:
    """The lines of vLLM's /metrics the rate is read from, among others as vLLM writes them."""
    return (f"# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
            f"# TYPE vllm:prompt_tokens_total counter\n"
            f"vllm:prompt_tokens_total{LABELS} {prompt}\n"
            f"vllm:prefix_cache_queries_total{LABELS} {prompt}\n"
            f"vllm:prefix_cache_hits_total{LABELS} {hits}\n"
            f'vllm:request_prefill_time_seconds_bucket{{engine="0",le="0.3",model_name="m"}} {prefills}\n'
            f"vllm:request_prefill_time_seconds_count{LABELS} {prefills}\n"
            f"vllm:request_prefill_time_seconds_sum{LABELS} {seconds}\n"
            f"vllm:request_prefill_time_seconds_created{LABELS} 1.7e9\n")


def test_counters_are_read_from_vllm_text_summed_over_engine_cores():
    two_cores = vllm_text(1000, 200, 0.5, 4) + vllm_text(3000, 0, 1.0, 2).replace('engine="0"', 'engine="1"')
    assert read_counters(two_cores, 7.0) == PrefillCounters(4000, 200, 1.5, 6, at=7.0, cores=2)
    assert read_counters("vllm:num_requests_running{} 1\n") is None  # no prefill histogram: an older engine
    assert read_counters(vllm_text(float("nan"), 0, 1, 1)) is None
    assert read_counters(vllm_text(100, 0, -1, 1)) is None


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("vllm:prompt_tokens_total{}=\"_sumcount 0123456789.-eE+naif\n#")),
               max_size=400))
def test_any_text_reads_as_counters_or_none_never_an_error(text):
    counters = read_counters(text)
    if counters is not None:
        assert min(counters.prompt_tokens, counters.cached_tokens, counters.seconds, counters.prefills) >= 0


def test_the_rate_comes_from_intervals_of_cold_prefills_not_from_cache_hits():
    rate = EnginePrefillRate()
    rate.update(PrefillCounters(0, 0, 0, 0, at=0.0))
    # Ten cache hits of 20 new tokens, each one 30 ms step: they tell the step, not the rate.
    rate.update(PrefillCounters(2200, 2000, 0.3, 10, at=1.0))
    assert rate.tokens_per_s is None
    # Two cold prefills of 3,000 tokens, 0.75 s each, one after the other: 4,000 tokens/s.
    rate.update(PrefillCounters(8200, 2000, 1.8, 12, at=3.0))
    assert rate.tokens_per_s == 4000
    # Two more at once, sharing their steps: 1.5 s each within one second of the engine's: not counted.
    rate.update(PrefillCounters(14_200, 2000, 4.8, 14, at=4.0))
    assert rate.tokens_per_s == 4000
    # An engine restarted (its counters went back): counted from zero, not as a negative interval.
    rate.update(PrefillCounters(4000, 0, 0.5, 1, at=5.0))
    assert 4000 < rate.tokens_per_s < 8000


def test_an_engine_that_served_before_the_gateway_tells_its_rate_at_the_first_scrape():
    rate = EnginePrefillRate()
    rate.update(PrefillCounters(50_000, 10_000, 8.0, 40))  # its history: 1,000 new tokens per prefill
    assert rate.tokens_per_s == 5000


def replica(name: str, tokens_per_s: float | None) -> Replica:
    r = Replica(name=name, model="m", url="http://127.0.0.1:1")
    if tokens_per_s is not None:
        r.prefill_rate.update(PrefillCounters(tokens_per_s * 10, 0, 10.0, 5))
    return r


def hits_only(model: CostModel, names, count: int = 60) -> None:
    """What a cache-friendly workload shows the fit: prefills of a few tens of new tokens, one 30 ms step each."""
    rng = random.Random(1)
    for i in range(count):
        tokens = rng.randint(10, 60)
        model.observe(names[i % len(names)], tokens, 0, 0.03 + tokens / 4000 + rng.gauss(0, 0.002))


def test_a_cold_prefill_is_estimated_with_the_engines_rate_where_hits_cannot_tell_the_slope():
    """The engines prefill 4,000 tokens/s; the fit saw only cache hits. A 3,000-token cold prompt then takes
    0.78 s: estimated with the engines' rate, not the 20,000 tokens/s prior (0.18 s)."""
    model = CostModel()
    replicas = [replica("a", 4000), replica("b", 4000)]
    model.follow(replicas)
    hits_only(model, ["a", "b"])
    truth = 0.03 + 3000 / 4000
    for estimate in model.estimate(["a", "b"], 3000, [0, 0], [0, 0]):
        assert abs(estimate.ttft - truth) / truth < 0.15, (estimate, model.describe("a"))
    assert model.describe("a")["engine_prefill_tokens_per_s"] == 4000
    # Without the engines' word (or with it turned off: cost_engine_prefill false) the prior stands.
    blind = CostModel(engine_rates=False)
    blind.follow(replicas)
    hits_only(blind, ["a", "b"])
    assert abs(blind.estimate(["a"], 3000, [0], [0])[0].ttft - truth) / truth > 0.25


def test_each_replica_starts_from_its_own_engines_rate_and_one_without_from_its_peers():
    model = CostModel()
    model.follow([replica("fast", 8000), replica("slow", 2000), replica("quiet", None)])
    fast, slow, quiet = model.estimate(["fast", "slow", "quiet"], 4000, [0, 0, 0], [0, 0, 0])
    assert abs(fast.throughput - 8000) < 1 and abs(slow.throughput - 2000) < 1
    assert abs(1 / quiet.throughput - (1 / 8000 + 1 / 2000) / 2) < 1e-9  # the engines' mean seconds per token
    # The gateway's own observations still move it: this engine turned out slower than it reported.
    for i in range(40):
        tokens = 1000 + 75 * i
        model.observe("fast", tokens, 0, 0.02 + tokens / 4000)
    reported, seen = 0.02 + 3000 / 8000, 0.02 + 3000 / 4000
    assert model.estimate(["fast"], 3000, [0], [0])[0].ttft > reported + (seen - reported) / 2


def test_tokens_per_character_are_learnt_from_usage():
    ratio = TokensPerChar()
    assert ratio.count(4000) == 1000  # characters / 4 until a response said otherwise
    for chars in (3000, 2500, 4000):
        ratio.observe(chars, chars + 20)  # a byte tokenizer: a token a character, and the chat template's
    assert 1.0 < ratio.ratio < 1.01 and ratio.count(4000) >= 4000
    for nonsense in ((10, 12), (3000, 0), (3000, 10**9), ("3000", 3000), (3000, 3000.5), (True, 1)):
        ratio.observe(*nonsense)
    assert ratio.observations == 3


def test_observations_recounted_in_a_new_token_count_are_the_ones_counted_so():
    """When the prefix tree learns that a character is a token, not a quarter of one, what the cost model saw in
    the old count is recounted: the same fit as if it had been counted so from the start."""
    rng = random.Random(2)
    observations = []
    for _ in range(30):  # an engine of 8,000 tokens/s, the prompts' characters counted as 4 tokens each
        chars, requests = rng.randint(100, 800), rng.randint(0, 4)
        observations.append((chars, requests, 0.03 + chars * 4 / 8000 + 0.01 * requests + rng.gauss(0, 0.003)))
    quarter, whole = CostModel(), CostModel()
    for tokens, requests, ttft in observations:
        quarter.observe("a", tokens, requests, ttft)
        whole.observe("a", tokens * 4, requests, ttft)
    quarter.rescale_tokens(4.0)
    # The same but for the priors' ridge (in tokens: 1/20,000 s a token), which the data outweigh by now.
    for got, want in zip(quarter.replica("a").line()[:3], whole.replica("a").line()[:3]):
        assert abs(got - want) <= 0.01 * abs(want) + 1e-6
    assert abs(whole.replica("a").throughput - 8000) < 400
