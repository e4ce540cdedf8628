"""The decode charge's slopes learnt from the engines' own inter-token latency histogram (``llmgw.router.engine_itl``).

Constructed ``/metrics`` sequences of an engine whose steps follow a known line: the learner must find it per
scrape window, read either of vLLM's names for the histogram (never both), start again after a counter reset,
ignore hostile values, and the decode model must charge that line (not the gateway's observed one) by default.
On main there was no such learner: the decode charge had only the gateway's observed token gaps.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings, strategies as st
from prometheus_client import generate_latest

from llmgw.engines.probe import VLLM_GAUGES, parse_load
from llmgw.metrics import Metrics
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router import engine_itl
from llmgw.router.decode_cost import (
    DEFAULT_ITL_BASE,
    DEFAULT_ITL_PER_CONTEXT_TOKEN,
    DEFAULT_ITL_PER_SEQUENCE,
    MAX_ITL,
    DecodeModel,
)
from llmgw.router.engine_itl import EngineItl, read_counters
from llmgw.router.replica import Replica
from llmgw.router.router import Router

# the engine's GPU: 8 ms a step, 20 us per running sequence, 50 ns per context token in its KV cache
BASE, PER_SEQUENCE, PER_CONTEXT = 0.008, 20e-6, 50e-9
BLOCKS, BLOCK_SIZE = 10_000, 16


def gpu_itl(batch: float, context: float) -> float:
    return BASE + PER_SEQUENCE * batch + PER_CONTEXT * context


def exposition(running: float, usage: float, itl_sum: float, itl_count: float,
               names: tuple[str, ...] = ("vllm:inter_token_latency_seconds",)) -> str:
    """An engine's ``/metrics`` as vLLM writes it (the parts read here)."""
    labels = 'engine="0",model_name="m"'
    lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
             "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{labels}}} {running}",
             "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{labels}}} 0.0",
             "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{labels}}} {usage}",
             "# TYPE vllm:cache_config_info gauge",
             f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",engine="0",num_gpu_blocks="{BLOCKS + 1}"}} 1.0']
    for name in names:
        lines += [f"# HELP {name} Histogram of inter-token latency in seconds.", f"# TYPE {name} histogram",
                  f'{name}_bucket{{{labels},le="0.01"}} 0.0', f'{name}_bucket{{{labels},le="+Inf"}} {itl_count}',
                  f"{name}_sum{{{labels}}} {itl_sum}", f"{name}_count{{{labels}}} {itl_count}"]
    return "\n".join(lines) + "\n"


def scrape(learner: EngineItl, text: str) -> None:
    learner.update(read_counters(text, parse_load(text, VLLM_GAUGES, 0.0)))


def windows(learner: EngineItl, count: int, seed: int = 1, names=("vllm:inter_token_latency_seconds",),
            total: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """``count`` scrape windows, each at one batch and context (the gauges at both ends), its tokens decoded at the
    GPU's ITL; returns the histogram's (sum, count) at the end."""
    rng = random.Random(seed)
    seconds, tokens = total
    for _ in range(count):
        batch, context = rng.randint(1, 48), rng.randint(0, 150_000)
        usage = context / (BLOCKS * BLOCK_SIZE)
        scrape(learner, exposition(batch, usage, seconds, tokens, names))  # the window's start
        gaps = batch * rng.randint(8, 40)
        seconds, tokens = seconds + gaps * gpu_itl(batch, context), tokens + gaps
        scrape(learner, exposition(batch, usage, seconds, tokens, names))
    return seconds, tokens


def engine_replicas(learnt: bool = True) -> list[Replica]:
    replicas = [Replica(name=n, model="m", url=f"http://127.0.0.1:{9000 + i}") for i, n in enumerate("ab")]
    if learnt:
        for i, replica in enumerate(replicas):
            windows(replica.engine_itl, 60, seed=i)
    return replicas


def gateway_taught(model: DecodeModel) -> DecodeModel:
    """What the gateway observed on a loaded host: 0.3 ms more a token per sequence there (the simulator process's
    own Python per stream), no context growth."""
    rng = random.Random(2)
    for i in range(300):
        batch, context = rng.randint(1, 40), rng.randint(0, 80_000)
        model.observe("ab"[i % 2], batch, context, 0.010 + 3e-4 * batch)
    return model


def test_the_itl_line_is_learnt_from_the_engines_histogram_per_scrape_window():
    learner = EngineItl()
    windows(learner, 80)
    model = DecodeModel(weight=1.0)
    model.follow([type("R", (), {"name": "a", "engine_id": None, "engine_itl": learner})()])
    base, per_context, per_sequence = model.charged_line("a")
    assert learner.windows == 80 and model.source_in_use == "engine"
    assert per_sequence == pytest.approx(PER_SEQUENCE, rel=0.1)
    assert per_context == pytest.approx(PER_CONTEXT, rel=0.1)
    assert base == pytest.approx(BASE, rel=0.05)


def test_the_name_before_vllm_0_11_is_read_and_both_names_are_read_once():
    for names in (("vllm:time_per_output_token_seconds",),
                  ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")):
        learner = EngineItl()
        windows(learner, 40, names=names)
        line = learner.data.solve((0.0,) * 5)
        assert learner.windows == 40
        assert line[2] == pytest.approx(PER_SEQUENCE, rel=0.1), names  # summed twice: twice the slopes
        assert line[0] == pytest.approx(BASE, rel=0.05), names
    assert read_counters(exposition(1, 0, 1, 1, names=()), parse_load(exposition(1, 0, 1, 1), VLLM_GAUGES, 0)) \
        is None  # no histogram: nothing to learn


def test_a_counter_reset_starts_the_windows_again_and_hostile_windows_count_nothing():
    learner = EngineItl()
    seconds, tokens = windows(learner, 10)
    scrape(learner, exposition(4, 0.1, seconds, tokens))
    scrape(learner, exposition(4, 0.1, 0.5, 40))  # the engine restarted: its counters from 0
    assert learner.windows == 10 and learner.resets == 1
    scrape(learner, exposition(4, 0.1, 0.5 + 40 * gpu_itl(4, 16_000), 80))  # a window after the restart counts
    assert learner.windows == 11
    before = (learner.windows, learner.data.w)
    for text in (exposition(4, 0.1, 1e6, 400),  # a mean gap of over an hour per token: beyond MAX_ITL
                 exposition(0, 0.1, 1e6, 401),  # 1 token: too few to tell a mean
                 exposition(0, 0.1, 1e6 + 1, 500),  # nothing running at either end
                 exposition(4, 0.1, math.nan, 600), exposition(math.inf, 0.1, 99, 700),
                 exposition(4, 0.1, 1e6 + 2, 800),
                 exposition(4, math.nan, 1e6 + 3, 900),  # no KV usage at one end: the window's context is unknown
                 exposition(-4, 0.1, 1e6 + 4, 1000), "garbage\n" * 3, ""):
        scrape(learner, text)
    assert (learner.windows, learner.data.w) == before


def test_the_decode_model_charges_the_engines_line_by_default_and_the_gateways_on_request():
    replicas = engine_replicas()
    auto = gateway_taught(DecodeModel(weight=1.0))
    auto.follow(replicas)
    assert auto.charged_line("b")[2] == pytest.approx(PER_SEQUENCE, rel=0.1)
    described = auto.describe("b")
    assert described["itl_source"] == "engine" and described["engine_itl_windows"] == 60
    assert described["itl_per_sequence_s"] == pytest.approx(PER_SEQUENCE, rel=0.1)
    gateway = gateway_taught(DecodeModel(weight=1.0, source="gateway"))
    gateway.follow(replicas)
    assert gateway.charged_line("b")[2] == pytest.approx(3e-4, rel=0.1)
    assert gateway.describe("b")["itl_source"] == "gateway"
    # a holder running 2 more answers than an idle replica is charged what the GPU's own line says (a model taught
    # that line exactly), less than half what the gateway's observed gaps say
    truth = DecodeModel(weight=1.0, source="gateway")
    rng = random.Random(3)
    for i in range(300):
        batch, context = rng.randint(1, 40), rng.randint(0, 150_000)
        truth.observe("ab"[i % 2], batch, context, gpu_itl(batch, context))
    charge = {}
    for name, model in (("engine", auto), ("gateway", gateway), ("truth", truth)):
        holder, idle = model.charges(["a", "b"], 2000, None, [2, 0], [4000, 0], [10_000.0] * 2, [None] * 2, 0.0)
        charge[name] = holder.decode - idle.decode
    assert charge["engine"] == pytest.approx(charge["truth"], rel=0.1)
    assert charge["engine"] < charge["gateway"] / 2
    # no engine reporting: auto charges the prior line, not the gateway's gaps (the host's work in them would be
    # charged as the GPU's); engine only charges nothing
    fallback = gateway_taught(DecodeModel(weight=1.0))
    fallback.follow(engine_replicas(learnt=False))
    assert fallback.source_in_use == "prior"
    assert fallback.charged_line("a") == (DEFAULT_ITL_BASE, DEFAULT_ITL_PER_CONTEXT_TOKEN, DEFAULT_ITL_PER_SEQUENCE)
    only = gateway_taught(DecodeModel(weight=1.0, source="engine"))
    only.follow(engine_replicas(learnt=False))
    assert only.source_in_use == "none" and only.charged_line("a") == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        DecodeModel(source="guess")


def test_what_was_learnt_from_the_engines_is_exported_and_the_option_is_checked():
    router = Router(build_registry(make_plugin_manager(())), Metrics())
    tier = router.configure_model("m", "prefix_tree", {"engine_metrics_interval": "250ms"}).tier
    assert tier.decode.source == "auto"
    for replica in engine_replicas():
        router.add_replica(replica)
    tier.decode.follow(router.models["m"].replicas)
    exposition_text = generate_latest(router.metrics.registry).decode()
    assert 'llmgw_routing_engine_itl_windows_total{model="m",replica="a"} 60.0' in exposition_text
    assert 'llmgw_routing_itl_source{model="m",source="engine"} 1.0' in exposition_text
    slope = [line for line in exposition_text.splitlines()
             if line.startswith('llmgw_routing_engine_itl_per_sequence_seconds{model="m",replica="b"}')]
    assert slope and float(slope[0].rsplit(" ", 1)[1]) == pytest.approx(PER_SEQUENCE, rel=0.1)
    problems = type(tier).check_options({"cost_decode_source": "somewhere"})
    assert any("cost_decode_source" in p for p in problems)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["", "vllm:inter_token_latency_seconds", "vllm:num_requests_running",
                                           "vllm:inter_token_latency_seconds_sum", "vllm:kv_cache_usage_perc",
                                           "vllm:inter_token_latency_seconds_count", "vllm:cache_config_info"]),
                          st.text(max_size=40),
                          st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))),
                max_size=12), st.integers(1, 6))
def test_any_exposition_text_gives_a_bounded_fit_or_nothing(samples, scrapes):
    """Hostile or garbled ``/metrics``: the reading is None or finite, bounded numbers, and the fit stays within the
    decode model's bounds."""
    text = "".join(f"{name}{{{labels}}} {value}\n" for name, labels, value in samples)
    learner = EngineItl()
    for i in range(scrapes):
        counters = read_counters(text, parse_load(text, VLLM_GAUGES, float(i)))
        if counters is not None:
            assert all(math.isfinite(v) and v >= 0 for v in (counters.seconds, counters.tokens, counters.running,
                                                               counters.context_tokens or 0.0))
            assert counters.running <= engine_itl.MAX_RUNNING
        learner.update(counters)
        windows(learner, 1, seed=i)
    line = learner.data.solve((0.0,) * 5)
    assert all(math.isfinite(v) and v >= 0 for v in line) and line[0] <= MAX_ITL
