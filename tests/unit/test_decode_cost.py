"""The cost model's decode and capacity charges: learnt from streams' token timings, charged per candidate."""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import given, strategies as st
from prometheus_client import generate_latest

from llmgw.engines.probe import VLLM_GAUGES, parse_load
from llmgw.metrics import Metrics
from llmgw.plugins.prefix_tree import PrefixTreeOptions
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.cost import CostModel
from llmgw.router.decode_cost import SAMPLE_TOKENS, DecodeModel, max_output_tokens
from llmgw.router.replica import EngineLoad, Replica
from llmgw.router.router import Router
from llmgw.router.tier import RouteRequest

# The "GPU" the tests' streams decode on: a step reads the weights (6 ms), then per running sequence 50 us of
# host work and 50 ns per context token it reads (an 8B model's 128 KiB per token at ~2.7 TB/s).
BASE, PER_SEQUENCE, PER_CONTEXT = 0.006, 50e-6, 50e-9


def true_itl(batch: float, context: float) -> float:
    return BASE + PER_SEQUENCE * batch + PER_CONTEXT * context


class Watch:
    """A stream's token timings as the data plane keeps them (StreamWatch's fields)."""

    def __init__(self, at: float):
        self.first_token_at = self.last_token_at = at
        self.counts = [0]

    def tokens(self, count: int, at: float) -> None:
        self.counts[0] += count
        self.last_token_at = at


def decode_side_by_side(model: DecodeModel, runs: dict[str, tuple[int, int]], output: int, start: float,
                        itl=lambda batch, context, fleet: true_itl(batch, context)) -> float:
    """On each replica ``name`` of ``runs``, ``batch`` streams of ``prompt`` tokens arrive at ``start`` and decode
    ``output`` tokens together at ``itl(batch, context, the fleet's streams)`` a token; the clock when all end."""
    keys: dict[str, list[int]] = {name: [] for name in runs}
    watches: dict[int, Watch] = {}
    for name, (batch, prompt) in runs.items():
        for _ in range(batch):
            keys[name].append(len(watches))
            model.routed(name, keys[name][-1], prompt, start)
            watches[keys[name][-1]] = Watch(start)
    for key, watch in watches.items():
        model.first_token(key, watch, start)
    fleet = sum(batch for batch, _ in runs.values())
    ends = {}
    for name, (batch, prompt) in runs.items():
        now = start
        for k in range(output - 1):
            now += itl(batch, batch * (prompt + k), fleet)
        for key in keys[name]:
            watches[key].tokens(output - 1, now)
        ends[name] = now
    for name in sorted(ends, key=ends.__getitem__):
        for key in keys[name]:
            model.finished(key, ends[name])
    return max(ends.values())


RUNS = (((1, 200), (8, 2000)), ((16, 500), (4, 200)), ((24, 200), (2, 3000)), ((4, 1000), (32, 1000)),
        ((12, 500), (1, 200)), ((2, 3000), (16, 2000)), ((8, 200), (24, 500)), ((32, 1000), (12, 3000)))


def test_the_itl_growth_with_batch_and_context_is_learnt_from_the_streams_token_timings():
    """Replicas decoding side by side with different batches: what one more sequence adds to a replica's steps
    is learnt from the differences between them."""
    model = DecodeModel()
    now = 0.0
    for a, b in RUNS:
        now = decode_side_by_side(model, {"a": a, "b": b}, 201, now + 1.0)
    _, per_context, per_sequence, _ = model.line("a")
    assert model.replica("a").observations >= 8
    for context in (500, 2000):  # what one more sequence of that context adds to every step
        learnt, true = per_sequence + per_context * context, PER_SEQUENCE + PER_CONTEXT * context
        assert abs(learnt - true) < 0.15 * true, (context, model.describe("a"))
    # Streams of 201 tokens (200 gaps after the first): the typical output length follows them from its prior.
    assert 195 < model.typical_output_tokens < 205
    assert model.live_requests("a") == 0


def test_a_slowdown_every_replica_shares_is_the_hosts_and_not_charged_to_a_replicas_batch():
    """Simulators sharing a loaded CPU: every replica's tokens slow with all the streams of the fleet (300 us
    each), whichever replica runs them. Sending a request to the replica running fewer changes nothing of
    that; the per-sequence growth learnt must be ~0, not the host's (the charge was measured moving long
    answers off their prompts' holders for nothing: docs/benchmarks/routing-workloads.md)."""
    model = DecodeModel()
    now = 0.0
    for a, b in RUNS:
        now = decode_side_by_side(model, {"a": a, "b": b}, 201, now + 1.0,
                                  itl=lambda batch, context, fleet: BASE + 300e-6 * fleet)
    _, per_context, per_sequence, _ = model.pooled_line()
    assert per_sequence + per_context * 1000 < 20e-6, model.describe("a")  # against 300 us of the host's
    host_per_context, host_per_sequence = model.host_line()  # per sequence on the mean replica of two
    assert abs(host_per_sequence + host_per_context * 1000 - 2 * 300e-6) < 0.15 * 2 * 300e-6


def test_a_long_stream_is_observed_while_it_runs():
    model = DecodeModel()
    watch = Watch(0.0)
    model.routed("a", 1, 100, 0.0)
    model.first_token(1, watch, 0.0)
    watch.tokens(SAMPLE_TOKENS - 1, (SAMPLE_TOKENS - 1) * 0.01)
    model.routed("a", 2, 100, 0.5)  # any event on the replica samples its running streams
    assert model.replica("a").observations == 0  # fewer than SAMPLE_TOKENS new tokens: not yet
    watch.tokens(1, SAMPLE_TOKENS * 0.01)
    model.routed("a", 3, 100, 0.6)
    assert model.replica("a").observations == 1
    base, per_context, per_sequence, _ = model.line("a")  # one observation: about 10 ms a token, as seen
    assert 0.005 < base + per_sequence * 1.2 + per_context * 150 < 0.0105  # (the prior still weighs as much)


def test_max_tokens_caps_the_expected_output_and_bad_values_are_ignored():
    model = DecodeModel(prior_output_tokens=300)
    assert model.typical_output_tokens == 300
    assert max_output_tokens({"max_tokens": 64}) == 64
    assert max_output_tokens({"max_completion_tokens": 32, "max_tokens": 64}) == 32
    for bad in (0, -1, True, 1.5, "9", 1 << 30):
        assert max_output_tokens({"max_tokens": bad}) is None
    charges = model.charges(["a"], 100, 64, [0], [0], [10_000.0], [None], 0.0)
    assert charges[0].output_tokens == 64


def taught(names=("a", "b"), growth: bool = True, model: DecodeModel | None = None) -> DecodeModel:
    model = model or DecodeModel(weight=1.0, source="gateway")
    rng = random.Random(1)
    for i in range(300):
        batch, context = rng.randint(1, 40), rng.randint(0, 80_000)
        itl = true_itl(batch, context) if growth else BASE
        model.observe(names[i % len(names)], batch, context, itl)
    return model


def test_a_busy_replica_is_charged_the_decode_delay_a_new_sequence_adds_and_an_idle_one_nothing():
    model = taught()
    busy, idle = model.charges(["a", "b"], 500, 256, [30, 0], [30 * 600, 0], [10_000.0] * 2, [None] * 2, 0.0)
    assert idle.decode == 0 and idle.capacity == 0
    growth = PER_SEQUENCE + PER_CONTEXT * (500 + 128)  # its mean context over its 256 tokens
    # the 30 running there decode about half a typical answer (the prior: 256 tokens) beside it
    assert abs(busy.others - 30 * 128 * growth) < 0.1 * 30 * 128 * growth
    # and they slow its own steps while they run beside it: 128 tokens
    assert abs(busy.own_beyond_fastest - 128 * (PER_SEQUENCE * 30 + PER_CONTEXT * 30 * 600)) < 0.01
    # Where steps do not grow with the batch (the simulator's constant profile), a decode costs the same anywhere.
    flat = taught(growth=False)
    busy, idle = flat.charges(["a", "b"], 500, 256, [30, 0], [30 * 600, 0], [10_000.0] * 2, [None] * 2, 0.0)
    assert busy.decode < 0.01 and idle.decode == 0


def test_before_any_decode_is_seen_the_requests_in_flight_are_charged_on_the_prior_line():
    """A burst: streams opened a few ms apart, none decoding yet when the next is placed. The charge works from
    the requests in flight there and the expected output, on the prior line (an H100 serving an 8B model), and
    moves toward what the streams show once they do; with both prior slopes at 0 nothing is charged until then."""
    model = DecodeModel()
    assert model.observations == 0 and model.weight == 1.0 and model.describe("a")["itl_source"] == "prior"
    busy, idle = model.charges(["a", "b"], 2000, 400, [10, 0], [10 * 2000, 0], [20_000.0] * 2, [None] * 2, 0.0)
    growth = 2e-5 + 5e-8 * (2000 + 128)  # the prior's per sequence and per context token at its mean context
    assert abs(busy.growth - growth) < 1e-9 and busy.output_tokens == 256  # the typical length, under max_tokens
    assert abs(busy.others - 10 * 128 * growth) < 1e-6  # the ten there each decode ~128 tokens beside it
    assert busy.decode > 0.2 and idle.decode == 0
    off = DecodeModel(prior_per_sequence=0.0, prior_per_context_token=0.0)
    busy, idle = off.charges(["a", "b"], 2000, 400, [10, 0], [10 * 2000, 0], [20_000.0] * 2, [None] * 2, 0.0)
    assert busy.decode == idle.decode == 0
    # Data outweigh the prior: a GPU whose steps do not grow with the batch is soon charged ~nothing.
    flat = taught(growth=False, model=DecodeModel(source="gateway"))
    assert flat.source_in_use == "gateway"
    busy, _ = flat.charges(["a", "b"], 2000, 400, [10, 0], [10 * 2000, 0], [20_000.0] * 2, [None] * 2, 0.0)
    assert busy.decode < 0.01


def test_a_replica_whose_kv_cache_cannot_hold_the_request_is_charged_the_preemptions_it_causes():
    model = taught(growth=False)
    full, roomy, unknown = model.charges(["a", "b", "c"], 1000, 200, [6, 6, 6], [6000] * 3, [10_000.0] * 3,
                                         [500.0, 1e6, None], 0.0)
    # needs 1,000 + 200 tokens and the six others' growth (6 x min(200, 256 / 2)): 1,968 tokens, 500 free
    assert full.preempted_tokens == 1000 + 200 + 6 * 128 - 500
    assert abs(full.capacity - full.preempted_tokens / 10_000 * 7) < 1e-9
    assert roomy.capacity == unknown.capacity == 0 and unknown.kv_free_tokens is None


def test_the_kv_usage_and_capacity_are_read_from_vllms_metrics():
    text = ('vllm:num_requests_running{engine="0"} 3.0\nvllm:num_requests_waiting{engine="0"} 0.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75\n'
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n')
    load = parse_load(text, VLLM_GAUGES, 1.0)
    assert load is not None and (load.kv_usage, load.num_blocks, load.block_size) == (0.75, 1000, 16)
    assert load.kv_free_tokens == 0.25 * 1000 * 16
    two = text + 'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25\n'  # data parallel: two caches
    load = parse_load(two, VLLM_GAUGES, 1.0)
    assert load is not None and (load.kv_usage, load.num_blocks) == (0.5, 2000)
    for bad, read in (("nan", None), ("-3", 0.0), ("7", 1.0), ("inf", None)):
        load = parse_load(text.replace("0.75", bad), VLLM_GAUGES, 1.0)
        assert load is not None and load.kv_usage == read, bad
    load = parse_load(text.replace('num_gpu_blocks="1000"', 'num_gpu_blocks="x"'), VLLM_GAUGES, 1.0)
    assert load is not None and load.kv_free_tokens is None
    assert parse_load('vllm:num_requests_running 1\n', VLLM_GAUGES, 1.0).kv_usage is None  # type: ignore[union-attr]


HEADS = ["", 'vllm:kv_cache_usage_perc{engine="0"} ', 'vllm:cache_config_info{num_gpu_blocks="',
         "vllm:num_requests_running "]


@given(st.text(max_size=300), st.sampled_from(HEADS))
def test_any_exposition_text_gives_a_bounded_kv_reading_or_none(text, head):
    load = parse_load(head + text, VLLM_GAUGES, 0.0)
    if load is not None:
        assert load.kv_usage is None or 0.0 <= load.kv_usage <= 1.0
        assert load.num_blocks is None or 0 < load.num_blocks
        free = load.kv_free_tokens
        assert free is None or 0.0 <= free


# -- the rule, on the tier ----------------------------------------------------------------------------------------

SYSTEM = "You are the support assistant of a large company; follow these rules. " * 115  # ~2,000 tokens


def chat(question: str, max_tokens: int = 256) -> RouteRequest:
    return RouteRequest("m", "/v1/chat/completions", {"model": "m", "max_tokens": max_tokens, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})


def make(options=None, growth: bool = True):
    router = Router(build_registry(make_plugin_manager(())), Metrics())
    tier = router.configure_model("m", "prefix_tree", {"seed": 3, "engine_metrics_interval": "250ms",
                                                       "cost_decode_source": "gateway", **(options or {})}).tier
    replicas = [Replica(name=n, model="m", url=f"http://127.0.0.1:{9000 + i}") for i, n in enumerate("ab")]
    for replica in replicas:
        router.add_replica(replica)
    rng = random.Random(1)
    cost: CostModel = tier.cost
    for i in range(200):  # 40 ms a step, 10,000 prompt tokens/s, 15 ms per request in flight
        tokens, requests = rng.randint(50, 4000), rng.randint(0, 12)
        cost.observe("ab"[i % 2], tokens, requests, 0.04 + tokens / 10_000 + requests * 0.015)
    taught(growth=growth, model=tier.decode)
    return router, tier, replicas


async def holder_decoding(router, replicas, running: int) -> tuple[Replica, Replica]:
    owner = (await router.pick(chat("first question"))).replica
    other = next(r for r in replicas if r is not owner)
    owner.local_inflight = running  # decoding answers of ~2,100-token contexts
    owner.local_inflight_tokens = running * 2100
    return owner, other


async def test_a_request_leaves_the_holder_of_its_prefix_when_the_decode_delay_there_exceeds_the_prefill_saved():
    """The holder runs 8 decodes: the TTFT rule keeps the question there (161 ms against a cold 2,000-token
    prefill and its recompute, 441 ms); but on a GPU whose steps grow with the batch and its context, its 256
    tokens there would slow itself and the 8 others by ~0.3 s in all: it goes to the idle replica."""
    router, tier, replicas = make()
    owner, other = await holder_decoding(router, replicas, running=8)
    explained = await router.explain(chat("second question"))
    costs = {e["name"]: e["cost"] for e in explained["replicas"]}
    assert costs[owner.name]["estimated_ttft_s"] + costs[owner.name]["delay_to_others_s"] \
        < costs[other.name]["cost_s"]  # what decided before: the holder
    assert costs[owner.name]["decode_charge_s"] > 0.25 and costs[other.name]["decode_charge_s"] == 0
    assert costs[owner.name]["decode"]["batch"] == 8
    assert costs[owner.name]["decode"]["delay_to_running_s"] > 0.1  # 8 x 128 tokens x ~156 us
    assert costs[owner.name]["total_cost_s"] > costs[other.name]["total_cost_s"]
    assert costs[owner.name]["learnt"]["itl_per_sequence_s"] > 0
    assert explained["outcome"] == "cost_override" and "decoding there adds" in explained["reason"]
    decision = await router.pick(chat("second question"))
    assert decision.replica is other and decision.outcome == "cost_override"
    assert decision.detail["cost"]["decode_charge_s"] == 0
    # The gain a decision records is the one the rule weighed: the totals with the charges (the TTFTs alone say
    # the move loses time).
    gain = costs[owner.name]["total_cost_s"] - costs[other.name]["total_cost_s"]
    assert abs(decision.detail["cost"]["expected_gain_s"] - gain) < 2e-3 and gain > 0
    assert tier.decode.moved == {"decode": 1, "capacity": 0}
    exposition = generate_latest(router.metrics.registry).decode()
    assert 'llmgw_routing_decode_moves_total{charge="decode",model="m"} 1.0' in exposition
    assert 'llmgw_routing_itl_per_sequence_seconds{model="m",replica="a"}' in exposition
    assert 'llmgw_routing_itl_host_per_sequence_seconds{model="m"}' in exposition


async def test_where_decoding_costs_the_same_anywhere_the_request_stays_with_its_cache():
    for options, growth in (({}, False), ({"cost_decode_weight": 0}, True)):
        router, tier, replicas = make(options, growth)
        owner, other = await holder_decoding(router, replicas, running=8)
        decision = await router.pick(chat("second question"))
        assert decision.replica is owner and decision.outcome == "hit", (options, growth, decision.detail)
    # Weighed at 0 (turned off), the charges are still worked out and explained: what turning them on would do.
    assert PrefixTreeOptions().cost_decode_weight == 1
    costs = {e["name"]: e["cost"] for e in (await router.explain(chat("third question")))["replicas"]}
    assert costs[owner.name]["decode_charge_s"] == 0 and costs[owner.name]["decode"]["delay_to_running_s"] > 0.1


async def test_a_holder_whose_kv_cache_is_near_full_is_charged_the_preemption_and_loses_the_request():
    router, tier, replicas = make(growth=False)  # no decode growth: only the capacity charge can move it
    owner, other = await holder_decoding(router, replicas, running=6)
    owner.engine_load = EngineLoad(6, 0, tier.clock(), block_size=16, kv_usage=0.97, num_blocks=4000)  # 1,920 free
    other.engine_load = EngineLoad(0, 0, tier.clock(), block_size=16, kv_usage=0.0, num_blocks=4000)
    owner.local_inflight = 6
    roomy = EngineLoad(6, 0, tier.clock(), block_size=16, kv_usage=0.2, num_blocks=4000)
    full, owner.engine_load = owner.engine_load, roomy  # with room in its cache, the holder keeps it
    explained = await router.explain(chat("second question"))
    assert explained["pick"] == owner.name and explained["outcome"] == "hit", explained
    owner.engine_load = full
    explained = await router.explain(chat("second question"))
    costs = {e["name"]: e["cost"] for e in explained["replicas"]}
    assert costs[owner.name]["decode"]["kv_free_tokens"] == 1920
    assert costs[owner.name]["decode"]["preempted_tokens"] > 0 and costs[owner.name]["capacity_charge_s"] > 0.5
    assert costs[other.name]["capacity_charge_s"] == 0 and costs[other.name]["decode"]["preempted_tokens"] == 0
    decision = await router.pick(chat("second question"))
    assert decision.replica is other and decision.outcome == "cost_override"
    assert tier.decode.moved["capacity"] == 1


async def test_the_router_hooks_feed_the_decode_model_from_the_streams_watch():
    router, tier, (a, b) = make()
    tier.decode = DecodeModel()
    clock = [100.0]
    tier.clock = lambda: clock[0]
    request = chat("first question")
    decision = await router.pick(request)
    router.routed(request, decision)
    name = decision.replica.name
    assert tier.decode.live_requests(name) == 1
    decision.stream = Watch(0.0)
    router.first_token(request, decision, 0.2)
    clock[0] += 1.0
    decision.stream.tokens(99, 1.0)
    router.finished(request, decision, None)
    assert tier.decode.replica(name).observations == 1 and tier.decode.live_requests(name) == 0
    assert 95 < tier.decode.typical_output_tokens < 256
    # 99 gaps in 1 s, alone with its ~2,000 tokens (on the two replicas' mean: half a request, ~1,025 tokens)
    base, per_context, per_sequence, _ = tier.decode.line(name)
    host_per_context, host_per_sequence = tier.decode.host_line()
    assert abs(base + per_sequence + per_context * 2050 + host_per_sequence * 0.5 + host_per_context * 1025
               - 0.0101) < 0.002


def test_the_decode_options_are_checked():
    _, problems, _ = PrefixTreeOptions.parse({"cost_decode_weight": -1, "cost_output_tokens": 0})
    assert len(problems) == 2 and "cost_decode_weight" in problems[0] and "cost_output_tokens" in problems[1]
    options, problems, _ = PrefixTreeOptions.parse({"cost_decode_weight": 0.5, "cost_output_tokens": 900})
    assert not problems and (options.cost_decode_weight, options.cost_output_tokens) == (0.5, 900)
    _, problems, _ = PrefixTreeOptions.parse({"cost_itl_per_sequence": -1e-5, "cost_itl_per_context_token": "x"})
    assert len(problems) == 2 and "cost_itl_per_sequence" in problems[0] \
        and "cost_itl_per_context_token" in problems[1]
    options, problems, _ = PrefixTreeOptions.parse({"cost_itl_per_sequence": 0, "cost_itl_per_context_token": 1e-7})
    assert not problems and (options.cost_itl_per_sequence, options.cost_itl_per_context_token) == (0, 1e-7)


def test_a_base_itl_close_to_the_peers_is_noise_but_another_gpus_is_charged():
    """Two identical simulators on one loaded host learnt 9.1 and 10.0 ms a token: over a long answer that
    difference would have charged one of them most of a second for nothing. A GPU twice as slow is charged."""
    for slow_base, charged in ((0.0100, False), (0.0182, True)):
        model = DecodeModel(source="gateway")
        rng = random.Random(2)
        for i in range(300):
            batch, context = rng.randint(1, 8), rng.randint(0, 20_000)
            name, base = ("fast", 0.0091) if i % 2 else ("slow", slow_base)
            model.observe(name, batch, context, base + PER_SEQUENCE * batch + PER_CONTEXT * context)
        fast, slow = model.charges(["fast", "slow"], 100, 1100, [0, 0], [0, 0], [10_000.0] * 2, [None] * 2, 0.0)
        assert fast.own_beyond_fastest == 0
        assert (slow.own_beyond_fastest > 0.5) == charged, (slow_base, slow)  # 256 tokens x ~4 ms or more
        assert charged or slow.own_beyond_fastest < 0.01


def test_replicas_that_left_are_forgotten_unless_a_request_is_still_in_flight_there():
    class Named:
        def __init__(self, name):
            self.name = self.engine_id = name

    model = DecodeModel()
    model.routed("busy", 1, 100, 0.0)
    for i in range(200):
        model.follow([Named(f"gone-{i}")])
    assert len(model.replicas) < 100 and "busy" in model.replicas


def test_replicas_of_one_model_are_charged_the_same_slopes_whatever_their_own_fits_say():
    """Four identical simulators on one loaded host learnt per-sequence slopes from 190 to 370 us; charged with
    their own, the one that looked cheapest drew half of a burst. The model's pooled slopes are charged."""
    model = DecodeModel(weight=1.0, source="gateway")
    rng = random.Random(4)
    for i in range(400):
        batch, context = rng.randint(1, 30), rng.randint(0, 20_000)
        name, slope = ("a", 190e-6) if i % 2 else ("b", 370e-6)
        model.observe(name, batch, context, 0.009 + slope * batch)
    assert model.line("a")[2] < 0.8 * model.line("b")[2]  # their own fits differ...
    a, b = model.charges(["a", "b"], 100, 300, [10, 10], [3000, 3000], [10_000.0] * 2, [None] * 2, 0.0)
    assert a.growth == b.growth and a.decode > 0.1 and abs(a.decode - b.decode) < 1e-9  # ...what is charged not
    assert model.describe("a")["own_fit"]["itl_per_sequence_s"] < model.describe("a")["itl_per_sequence_s"]


async def test_a_burst_decided_before_any_first_token_leaves_the_holder_once_its_queue_costs_more_in_every_term():
    """The issue's burst: requests sharing a long system prompt arrive together, every one decided before any
    first token, so the cost model has only its priors, whose uncertainty (hundreds of ms for a holder with a
    queue far beyond anything observed) used to gate every override: the holder took them all while the other
    replicas idled. The holder's estimate exceeds an idle replica's in every term on the same line, so its cost
    is larger whatever the parameters: the burst spreads."""
    router = Router(build_registry(make_plugin_manager(())), Metrics())
    tier = router.configure_model("m", "prefix_tree", {"seed": 3}).tier
    tier.clock = lambda: 0.0  # all at once: none of the queues has been worked through
    replicas = [Replica(name=n, model="m", url=f"http://127.0.0.1:{9000 + i}") for i, n in enumerate("abcd")]
    for replica in replicas:
        router.add_replica(replica)
    counts = dict.fromkeys("abcd", 0)
    system = {"role": "system", "content": "You are the support assistant of a large company. " * 15}  # ~190 tokens
    for i in range(40):
        question = {"role": "user", "content": f"ticket {i}: " + "the printer on floor three jams again " * 2}
        request = RouteRequest("m", "/v1/chat/completions", {"model": "m", "messages": [system, question]})
        decision = await router.pick(request)
        router.routed(request, decision)
        decision.replica.local_inflight += 1  # as the data plane counts it while the request runs
        counts[decision.replica.name] += 1
    assert tier.cost.observations == 0  # all on the priors
    assert min(counts.values()) >= 5, counts
    assert max(counts.values()) <= 15, counts


def test_an_estimate_costlier_in_every_term_on_the_same_line_is_certainly_costlier():
    from llmgw.router.cost import Estimate
    from llmgw.router.uncertainty import certainly_costlier

    holder = Estimate(2000, 100, 3000, 12, 0.02, 20_000.0, 0.0, others_weight=1.0)
    idle = Estimate(0, 2100, 0, 0, 0.02, 20_000.0, 0.0, others_weight=1.0, recomputed=2000)
    assert certainly_costlier(holder, idle)
    short_queue = Estimate(2000, 100, 200, 1, 0.02, 20_000.0, 0.0, others_weight=1.0)
    assert not certainly_costlier(short_queue, idle)  # fewer tokens to compute than the recompute: it depends
    faster = Estimate(0, 2100, 0, 0, 0.02, 30_000.0, 0.0, others_weight=1.0, recomputed=2000)
    assert certainly_costlier(holder, faster)  # more to do, on a slower line: costlier whatever they share
    slower = Estimate(0, 2100, 0, 0, 0.02, 15_000.0, 0.0, others_weight=1.0, recomputed=2000)
    assert not certainly_costlier(holder, slower)  # the holder prefills faster: by how much decides
    assert not certainly_costlier(Estimate(2000, 100, 3000, 12, 0.01, 20_000.0, 0.0, others_weight=1.0),
                                  idle)  # nor when its step is shorter


def streams_of(model: DecodeModel, name: str, lengths: Sequence[int], start: float) -> float:
    """Streams of ``lengths`` tokens, one after the other on ``name`` at 6 ms a token; the clock at the end."""
    now = start
    for key, length in enumerate(lengths, start=1 << 20):
        model.routed(name, key, 100, now)
        watch = Watch(now)
        model.first_token(key, watch, now)
        now += (length - 1) * BASE
        watch.tokens(length - 1, now)
        model.finished(key, now)
    return now


async def test_a_decode_gain_within_the_spread_of_the_answers_lengths_does_not_move_a_request_off_its_cache():
    """Answers of 1k to 4k tokens (long-output): how long the sequences on the holder will decode beside a new
    one is uncertain by about a thousand tokens each, and a decode charge one sequence of difference makes
    is well within that. The request stays with its prefix; with answers all about as long, it moves."""
    moved, explained_costs = {}, {}
    for lengths in ((1024, 4096) * 20, (2550, 2570) * 20):
        router, tier, replicas = make()
        streams_of(tier.decode, "a", lengths, 0.0)
        owner, other = await holder_decoding(router, replicas, running=1)
        explained = await router.explain(chat("second question", max_tokens=4096))
        costs = {e["name"]: e["cost"] for e in explained["replicas"]}
        explained_costs[lengths[0]] = costs[owner.name], costs[other.name]
        assert costs[owner.name]["total_cost_s"] > costs[other.name]["total_cost_s"], costs  # the charges: go
        moved[lengths[0]] = explained["pick"] == other.name
    assert moved == {1024: False, 2550: True}, explained_costs
    for holder, idle in explained_costs.values():  # the holder's running sequence and the new one; nothing idle
        assert holder["decode"]["decode_uncertainty_s"] > 0 and idle["decode"]["decode_uncertainty_s"] == 0


def _fresh_solve(observations: Sequence[tuple[tuple[float, ...], float]], prior: Sequence[float]) -> tuple:
    from llmgw.router.decode_cost import ItlFit
    fit = ItlFit()
    for f, y in observations:
        fit.add(f, y, 0.9)
    return fit.solve(prior)


@given(st.lists(st.tuples(st.integers(1, 64), st.integers(0, 50_000), st.floats(0.005, 0.2)), min_size=1,
                max_size=12),
       st.lists(st.floats(0.0, 0.05), min_size=5, max_size=5))
def test_a_fits_solution_is_reused_only_until_it_learns_or_is_asked_with_another_prior(points, other_prior):
    """A decision reads each fit several times (kept, as the picks' cost showed); what it reads is always what a
    fresh fit of the same observations solves to."""
    from llmgw.router.decode_cost import FEATURES, ItlFit
    zero = (0.0,) * FEATURES
    fit, seen = ItlFit(), []
    for batch, context, itl in points:
        f = (1.0, float(context), float(batch), float(context * 4), float(batch * 4))
        assert fit.solve(zero) == _fresh_solve(seen, zero)
        fit.add(f, itl, 0.9)
        seen.append((f, itl))
        assert fit.solve(zero) == fit.solve(zero) == _fresh_solve(seen, zero)
        assert fit.solve(other_prior) == _fresh_solve(seen, other_prior)
        assert fit.solve(zero) == _fresh_solve(seen, zero)
    merged = ItlFit()
    assert merged.solve(zero) == _fresh_solve([], zero)
    merged.merge(fit)
    assert merged.solve(zero) == _fresh_solve(seen, zero)


def test_a_decision_solves_each_fit_once_between_observations(monkeypatch):
    """The charges of four candidates read the pooled fit and each replica's several times (the host's line,
    every candidate's own and pooled line): each is solved once, and again only after it learnt."""
    import llmgw.router.decode_cost as decode_cost
    model = taught()
    names = ["a", "b", "c", "d"]
    solves = []
    real = decode_cost._solve
    monkeypatch.setattr(decode_cost, "_solve", lambda a, b: solves.append(1) or real(a, b))

    def charges():
        return model.charges(names, 500, 256, [30, 0, 2, 4], [18_000, 0, 900, 2000], [10_000.0] * 4, [None] * 4,
                             0.0)

    first = charges()
    assert len(solves) <= 1 + len(names)  # the pooled fit, and each replica's own
    solves.clear()
    assert charges() == first and not solves
    decode_side_by_side(model, {"a": (2, 300)}, 64, 100.0)  # "a" and the pooled fit learn
    charges()
    assert 1 <= len(solves) <= 1 + len(names)
