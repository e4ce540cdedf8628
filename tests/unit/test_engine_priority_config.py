"""An engine in vLLM's priority scheduling: the ``scheduling_policy`` key of a profile or replica (its config errors,
the engine's command line, the fingerprint, the replicas built from it) and the ``priority`` the gateway sends
(:mod:`llmgw.gateway.engine_priority`)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from llmgw.cluster.records import ReplicaRecord
from llmgw.cluster.state import ReplicaBuilder
from llmgw.config import ConfigError, parse_config
from llmgw.control.fingerprint import profile_fingerprint
from llmgw.control.reconciler import shard_profile
from llmgw.control.static import StaticReplicas
from llmgw.flow.model import PriorityClass
from llmgw.gateway.engine_priority import BOUND, engine_priority, prioritized_body
from llmgw.kv.index import KvIndex
from llmgw.metrics import Metrics
from llmgw.plugins.engine_sim import SimEngine
from llmgw.plugins.engine_vllm import VllmEngine
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.replicas import DEPLOYED, STATIC, ReplicaSet
from llmgw.tenancy.model import Team, Tenant
from llmgw.testing.deployed import deploy_ready
from llmgw.testing.engine_argv import fake_vllm_on_path, launch_argv

CONFIG = """\
agents: {token: t}
models:
  - name: m
    replicas:
      - {url: "http://127.0.0.1:9001", name: prio, scheduling_policy: priority}
      - {url: "http://127.0.0.1:9002", name: plain}
profiles:
  - {name: p, engine: sim, model_path: tiny, served_model_name: tiny-p, scheduling_policy: priority}
  - {name: q, engine: sim, model_path: tiny, served_model_name: tiny-q}
deployments:
  - {profile: p, replicas: 1}
  - {profile: q, replicas: 1}
flow:
  classes:
    - {name: interactive, rank: 0, max_wait: 2s}
    - {name: batch, rank: 2, max_wait: 60s, engine_priority: -5}
  default_class: batch
"""


def test_the_keys_are_read_and_a_bad_value_names_its_file_line_and_key():
    config = parse_config(CONFIG, "conf.yaml", env={})
    assert [r.scheduling_policy for r in config.models[0].replicas] == ["priority", "fcfs"]
    assert (config.profile("p").scheduling_policy, config.profile("q").scheduling_policy) == ("priority", "fcfs")
    assert [c.engine_rank for c in config.flow.settings().classes] == [0, -5]  # its rank unless it says its own
    for good, bad in (("scheduling_policy: priority}\n  - {name: q", "scheduling_policy: lifo}\n  - {name: q"),
                      ("name: prio, scheduling_policy: priority", "name: prio, scheduling_policy: 1"),
                      ("engine_priority: -5", "engine_priority: 1.5"),
                      ("engine_priority: -5", "engine_priority: 2000000")):
        with pytest.raises(ConfigError) as caught:
            parse_config(CONFIG.replace(good, bad), "conf.yaml", env={})
        message = str(caught.value)
        key = "engine_priority" if "engine_priority" in bad else "scheduling_policy"
        line = CONFIG.replace(good, bad)[:CONFIG.replace(good, bad).index(bad)].count("\n") + 1
        assert key in message and f"conf.yaml:{line}" in message, message


@pytest.mark.parametrize("engine", [SimEngine(), VllmEngine()], ids=["sim", "vllm"])
def test_the_engine_plugins_pass_the_policy_and_nothing_for_fcfs(engine, monkeypatch, tmp_path):
    fake_vllm_on_path(monkeypatch, tmp_path)
    argv = launch_argv(engine, scheduling_policy="priority")
    at = argv.index("--scheduling-policy")
    assert argv[at + 1] == "priority" and at < argv.index("--seed")  # the profile's own args come last
    assert "--scheduling-policy" not in launch_argv(engine, scheduling_policy="fcfs")
    # a value off the wire it does not know
    assert "--scheduling-policy" not in launch_argv(engine, scheduling_policy="lifo")


def test_the_control_plane_sends_it_and_only_priority_changes_the_fingerprint():
    config = parse_config(CONFIG, "conf.yaml", env={})
    assert shard_profile(config.profile("p")).scheduling_policy == "priority"
    assert shard_profile(config.profile("q")).scheduling_policy == "fcfs"
    plain = parse_config(CONFIG.replace(", scheduling_policy: priority}\n  - {name: q", "}\n  - {name: q"),
                         "conf.yaml", env={})
    assert profile_fingerprint(plain.profile("q")) == profile_fingerprint(config.profile("q"))
    assert profile_fingerprint(plain.profile("p")) != profile_fingerprint(config.profile("p"))
    # the fcfs fingerprint is the one it had before the key existed: running shards are adopted, not restarted
    explicit = parse_config(CONFIG.replace("served_model_name: tiny-q}", "served_model_name: tiny-q, "
                                           "scheduling_policy: fcfs}"), "conf.yaml", env={})
    assert profile_fingerprint(explicit.profile("q")) == profile_fingerprint(config.profile("q"))


def test_every_way_a_replica_is_built_carries_it():
    config = parse_config(CONFIG, "conf.yaml", env={})
    registry = build_registry(make_plugin_manager())
    metrics = Metrics()
    static = ReplicaSet(None, metrics, connect_timeout=1.0)
    StaticReplicas(static, KvIndex(), registry, metrics.registry).apply(config)
    assert {r.name: r.priority_scheduling for r in static} == {"prio": True, "plain": False}
    assert {r.model: r.priority_scheduling for r in deploy_ready(config, registry)} == {"tiny-p": True,
                                                                                        "tiny-q": False}
    build = ReplicaBuilder(lambda: config, registry)  # a follower gateway, from the cluster's records
    assert build(ReplicaRecord("prio", "m", "http://127.0.0.1:9001", STATIC)).priority_scheduling
    assert build(ReplicaRecord("p-0", "tiny-p", "http://127.0.0.1:9100", DEPLOYED,
                               labels={"profile": "p"})).priority_scheduling
    assert not build(ReplicaRecord("q-0", "tiny-q", "http://127.0.0.1:9101", DEPLOYED,
                                   labels={"profile": "q"})).priority_scheduling


BATCH = PriorityClass("batch", 2, 60.0)
PLAIN = Tenant("cfg-plain", "plain", priority="batch")
TRUSTED = Tenant("cfg-trusted", "trusted", team=Team("ops", priority_header=True))


def test_the_priority_sent_is_the_classes_unless_a_trusted_client_asks_for_a_lower_one():
    assert engine_priority(BATCH, None, {}) == 2
    assert engine_priority(PriorityClass("x", 1, 1.0, engine_priority=-3), None, {}) == -3
    assert engine_priority(BATCH, PLAIN, {"priority": 9}) == 2  # its key may not change it
    assert engine_priority(BATCH, TRUSTED, {"priority": 9}) == 9
    assert engine_priority(BATCH, TRUSTED, {"priority": -9}) == 2  # never more urgent than its class
    for odd in (True, 9.0, "9", None, [9], BOUND):
        assert engine_priority(BATCH, TRUSTED, {"priority": odd}) == 2


@given(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4)),
       st.sampled_from([None, PLAIN, TRUSTED]))
def test_whatever_a_client_sends_the_priority_is_an_integer_no_more_urgent_than_its_class(asked, tenant):
    value = engine_priority(BATCH, tenant, {"priority": asked})
    assert type(value) is int and BATCH.engine_rank <= value < BOUND


def test_the_body_carries_it_and_still_asks_for_a_streams_usage_when_the_gateway_needs_it():
    body = {"model": "m", "messages": [{"role": "user", "content": "caf\u00e9 \ud800"}], "priority": -1,
            "stream": True}
    sent = prioritized_body("/v1/chat/completions", body, 4, force_usage=False)
    assert sent.isascii() and json.loads(sent) == {**body, "priority": 4}
    forced = json.loads(prioritized_body("/v1/chat/completions", body, 4, force_usage=True))
    assert forced["priority"] == 4 and forced["stream_options"] == {"include_usage": True}
