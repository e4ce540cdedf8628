"""A replica's prefill rate before it answers (llmgw.router.cost: its configured ``prefill_tokens_per_s``, until its
engine reports one): the first wave of a fleet with one slow GPU among fast ones is decided on the GPUs' speeds, not
on one prior for all."""

from __future__ import annotations

from collections import Counter

import pytest

from llmgw.cluster.records import ReplicaRecord
from llmgw.cluster.state import ReplicaBuilder
from llmgw.config import ConfigError, parse_config
from llmgw.control.static import StaticReplicas
from llmgw.kv.index import KvIndex
from llmgw.metrics import Metrics
from llmgw.plugins.prefix_tree import PrefixTreeTier
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.cost import CostModel
from llmgw.router.engine_prefill import PrefillCounters
from llmgw.router.model import TierModel
from llmgw.router.replica import Replica
from llmgw.router.replicas import DEPLOYED, STATIC, ReplicaSet
from llmgw.router.tier import RouteRequest, TierServices
from llmgw.testing.deployed import deploy_ready

FAST, SLOW = 37_000.0, 14_500.0  # what the simulator's H100 and A100 40GB profiles say for Llama-3.1-8B
NAMES = ("sim-0", "sim-1", "sim-2", "sim-3")


def replica(name: str, configured: float | None = None, reported: float | None = None) -> Replica:
    r = Replica(name=name, model="m", url="http://127.0.0.1:1")
    r.prefill_tokens_per_s = configured  # set after construction: on a Replica without the field, still a rate
    if reported is not None:
        r.prefill_rate.update(PrefillCounters(reported * 10, 0, 10.0, 5))
    return r


def test_each_replica_starts_from_its_configured_rate_before_any_observation():
    model = CostModel()
    model.follow([replica("fast", FAST), replica("slow", SLOW), replica("unknown")])
    fast, slow, unknown = model.estimate(["fast", "slow", "unknown"], 3400, [0, 0, 0], [0, 0, 0])
    assert abs(fast.throughput - FAST) < 1 and abs(slow.throughput - SLOW) < 1
    assert abs(1 / unknown.throughput - (1 / FAST + 1 / SLOW) / 2) < 1e-12  # its peers' mean, as for engine rates
    assert slow.ttft - fast.ttft > 0.12  # 3,400 tokens: 0.234 s against 0.092 s
    assert model.describe("slow")["configured_prefill_tokens_per_s"] == SLOW
    assert model.describe("slow")["engine_prefill_tokens_per_s"] is None


def test_the_engines_reported_rate_replaces_the_configured_one_and_either_can_be_turned_off():
    both = replica("r", configured=SLOW, reported=9_000.0)
    model = CostModel(engine_rates=True)
    model.follow([both])
    assert abs(model.estimate(["r"], 3000, [0], [0])[0].throughput - 9_000) < 1
    assert model.describe("r")["engine_prefill_tokens_per_s"] == 9_000
    engine_off = CostModel(engine_rates=False)
    engine_off.follow([both])
    assert abs(engine_off.estimate(["r"], 3000, [0], [0])[0].throughput - SLOW) < 1
    neither = CostModel(engine_rates=False, configured_rates=False)
    neither.follow([both])
    assert abs(neither.estimate(["r"], 3000, [0], [0])[0].throughput - 20_000) < 1  # the configured prior


def test_a_rate_outside_the_cost_models_bounds_is_not_taken():
    model = CostModel()
    model.follow([replica("r", configured=1e12)])
    assert model.describe("r")["configured_prefill_tokens_per_s"] is None


def chat(system: str) -> RouteRequest:
    return RouteRequest("m", "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "hello"}]})


async def first_wave(seed: int, configured: bool) -> Counter[str]:
    """Five new ~3,500-token prompts at one instant (a closed loop's first wave: no first token yet) over an A100
    (sim-0) and three H100s; where each went."""
    options = {"seed": seed} if configured else {"seed": seed, "cost_configured_prefill": False}
    tier = PrefixTreeTier(TierModel("m", "prefix_tree", options), TierServices(model="m", clock=lambda: 1000.0))
    replicas = [replica(n, SLOW if i == 0 else FAST) for i, n in enumerate(NAMES)]
    picks: Counter[str] = Counter()
    for ticket in range(5):
        decision = await tier.pick(chat(f"Team {ticket} charter. " + "duties " * 2000), replicas)
        decision.replica.local_inflight += 1
        decision.replica.queue_prefill(ticket, decision.prefill_tokens, tier.clock())
        picks[decision.replica.name] += 1
    return picks


async def test_the_first_wave_deals_the_slow_gpu_at_most_one_new_prefix():
    """With one prior for all, the fifth prompt goes to whichever replica holds the least, the slow one as likely
    as any (and behind its own cold prefill there it waits ~2.5x an H100's). With the GPUs' rates it goes to a
    fast one: waiting behind an H100's prefill costs less than computing it alone on the A100."""
    slow_got = [(await first_wave(seed, configured=True))["sim-0"] for seed in range(12)]
    assert max(slow_got) <= 1, slow_got
    blind = [(await first_wave(seed, configured=False))["sim-0"] for seed in range(12)]
    assert max(blind) == 2, blind  # what the option restores: the slow GPU dealt two in some orders


CONFIG = """\
models:
  - name: m
    routing: kv_index
    replicas:
      - url: http://127.0.0.1:9001
        name: a100
        prefill_tokens_per_s: 14500
      - url: http://127.0.0.1:9002
        name: h100
        prefill_tokens_per_s: 37000.5
      - url: http://127.0.0.1:9003
        name: unsaid
profiles:
  - name: p
    engine: sim
    model_path: tiny
    prefill_tokens_per_s: 3000
"""


def test_the_configured_rate_reaches_the_replicas_and_a_bad_one_is_refused_with_its_key():
    config = parse_config(CONFIG, "conf.yaml", env={})
    assert [r.prefill_tokens_per_s for r in config.models[0].replicas] == [14500.0, 37000.5, None]
    assert config.profile("p").prefill_tokens_per_s == 3000.0
    metrics = Metrics()
    replicas = ReplicaSet(None, metrics, connect_timeout=1.0)
    StaticReplicas(replicas, KvIndex(), build_registry(make_plugin_manager()), metrics.registry).apply(config)
    assert {r.name: r.prefill_tokens_per_s for r in replicas} == {"a100": 14500.0, "h100": 37000.5,
                                                                       "unsaid": None}
    for bad, says in (("0", "at least 50"), ("1000000000", "at most"), ('"fast"', "number"), ("true", "number")):
        with pytest.raises(ConfigError) as caught:
            parse_config(CONFIG.replace("14500", bad), "conf.yaml", env={})
        assert "prefill_tokens_per_s" in str(caught.value) and says in str(caught.value), str(caught.value)


def test_a_follower_gateway_builds_the_replicas_with_their_configured_rates():
    """A gateway following a cluster's replica records takes each one's rate from its own config: a static
    replica's key, a deployed one's profile's."""
    config = parse_config(CONFIG, "conf.yaml", env={})
    build = ReplicaBuilder(lambda: config, build_registry(make_plugin_manager()))
    static = build(ReplicaRecord("a100", "m", "http://127.0.0.1:9001", STATIC))
    deployed = build(ReplicaRecord("p-0", "tiny", "http://127.0.0.1:9100", DEPLOYED, labels={"profile": "p"}))
    unknown = build(ReplicaRecord("q-0", "tiny", "http://127.0.0.1:9101", DEPLOYED, labels={"profile": "gone"}))
    assert (static.prefill_tokens_per_s, deployed.prefill_tokens_per_s, unknown.prefill_tokens_per_s) == \
        (14500.0, 3000.0, None)


def test_the_leader_puts_a_deployed_replica_in_routing_with_its_profiles_rate():
    registry = build_registry(make_plugin_manager())
    config = parse_config("""
agents: {token: t}
profiles:
  - {name: a100, engine: sim, model_path: tiny, served_model_name: tiny-a, prefill_tokens_per_s: 14500}
  - {name: plain, engine: sim, model_path: tiny, served_model_name: tiny-p}
deployments:
  - {profile: a100, replicas: 1}
  - {profile: plain, replicas: 1}
""", "conf.yaml", env={})
    replicas = deploy_ready(config, registry)
    assert {r.model: r.prefill_tokens_per_s for r in replicas} == {"tiny-a": 14500.0, "tiny-p": None}
