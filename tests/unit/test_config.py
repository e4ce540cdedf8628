"""The config file: loading, every kind of error with its line and key, units, env, the CLI, the docs."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmgw.config import (
    ConfigError,
    ConfigIssue,
    HostPort,
    Limits,
    load_config,
    parse_config,
    parse_duration,
    parse_size,
)
from llmgw.config.fields import issue_at
from llmgw.flow.model import FlowSettings
from llmgw.router.output_allowance import DEFAULT_QUANTILE

REPO = Path(__file__).resolve().parents[2]
LLMGW = Path(sys.executable).parent / "llmgw"

# The two configs of issues 2 and 4, exactly as written there.
STATIC_EXAMPLE = """\
listen: 127.0.0.1:8000            # the OpenAI data plane
control_listen: 127.0.0.1:8001    # /health, /metrics, /admin/*, later the agents
models:
  - name: tiny
    routing: round_robin
    replicas:
      - url: http://127.0.0.1:9001
      - url: http://127.0.0.1:9002
        api_key: engine-secret
api_keys:                          # optional; when present every /v1 call needs one
  - key: sk-test-123
"""

CLUSTER_EXAMPLE = """\
listen: 127.0.0.1:8000
control_listen: 127.0.0.1:8001
agents:
  token: s3cret                  # the join token; agents present it
  embedded: true                 # run this machine's agent inside `llmgw serve`
profiles:
  - name: tiny-sim
    engine: sim                  # or vllm
    model_path: tiny             # what the engine loads
    served_model_name: tiny      # the model name clients ask for
    tp: 1
    kv_events: true
    routing: kv_index            # round_robin | prefix_tree | kv_index
    args: ["--num-blocks", "256"]
    env: {}
deployments:
  - profile: tiny-sim
    replicas: 2
"""

SECRETS = ("engine-secret", "sk-test-123", "s3cret")


def errors_of(text: str, env: dict[str, str] | None = None) -> list[ConfigIssue]:
    with pytest.raises(ConfigError) as caught:
        parse_config(textwrap.dedent(text), "conf.yaml", env=env or {})
    return caught.value.errors


def only_error(text: str, env: dict[str, str] | None = None) -> ConfigIssue:
    errors = errors_of(text, env)
    assert len(errors) == 1, "\n".join(map(str, errors))
    return errors[0]


# -- the examples ---------------------------------------------------------------


def test_static_example_loads_as_written():
    config = parse_config(STATIC_EXAMPLE, "static.yaml")
    assert config.source == "static.yaml"
    assert config.listen == HostPort("127.0.0.1", 8000)
    assert config.control_listen == HostPort("127.0.0.1", 8001)
    [model] = config.models
    assert (model.name, model.routing, model.routing_options) == ("tiny", "round_robin", {})
    assert [r.url for r in model.replicas] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert [r.api_key for r in model.replicas] == [None, "engine-secret"]
    assert [r.name for r in model.replicas] == ["127.0.0.1:9001", "127.0.0.1:9002"]
    assert [key.key for key in config.api_keys] == ["sk-test-123"]
    assert config.model_names() == ["tiny"]
    assert config.profiles == [] and config.deployments == []


def test_cluster_example_loads_as_written():
    config = parse_config(CLUSTER_EXAMPLE, "cluster.yaml")
    assert config.agents.token == "s3cret" and config.agents.embedded is True
    profile = config.profile("tiny-sim")
    assert (profile.engine, profile.model_path, profile.served_model_name) == ("sim", "tiny", "tiny")
    assert (profile.tp, profile.pp, profile.nodes, profile.gpus_per_node) == (1, 1, 1, 1)
    assert profile.kv_events is True and profile.routing == "kv_index"
    assert profile.args == ["--num-blocks", "256"] and profile.env == {}
    [deployment] = config.deployments
    assert (deployment.profile, deployment.replicas, deployment.pool) == ("tiny-sim", 2, None)
    assert deployment.placement.spread is True and deployment.placement.nodes == []
    assert config.model_names() == ["tiny"]
    with pytest.raises(KeyError):
        config.profile("nope")


def test_defaults_of_an_empty_file():
    config = parse_config("", "empty.yaml")
    assert str(config.listen) == "127.0.0.1:8000" and str(config.control_listen) == "127.0.0.1:8001"
    assert config.limits == Limits(
        max_body_bytes=16 * 1024 * 1024, max_header_bytes=64 * 1024, client_header_timeout=10.0,
        client_body_timeout=30.0, keepalive_timeout=75.0, connect_timeout=3.0, first_byte_timeout=600.0,
        idle_timeout=300.0, retries=2, shutdown_grace=30.0, max_connections=10000, control_max_connections=1000,
    )
    health = config.health
    assert (health.interval, health.timeout, health.failures_to_down, health.successes_to_up,
            health.passive_failures_to_down, health.path) == (2.0, 2.0, 2, 1, 3, "/health")
    agents = config.agents
    assert (agents.token, agents.embedded, agents.heartbeat_interval, agents.suspect_after,
            agents.disconnected_after, agents.node_id, agents.state_dir) == (None, False, 5.0, 15.0, 60.0, None, None)
    assert config.metrics.enabled is True and config.log_level == "info"
    assert config.models == config.api_keys == config.profiles == config.deployments == []


def test_load_config_reads_a_file(tmp_path):
    path = tmp_path / "llmgw.yaml"
    path.write_text(CLUSTER_EXAMPLE)
    config = load_config(path)
    assert config.source == str(path)
    assert config.deployments[0].line_of("profile") == 17


def test_load_config_on_a_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(missing)
    assert str(caught.value) == f"{missing}: cannot read the file: No such file or directory"


# -- secrets --------------------------------------------------------------------


@pytest.mark.parametrize("example", [STATIC_EXAMPLE, CLUSTER_EXAMPLE])
def test_secrets_never_appear_in_repr_or_str(example):
    text = example + ("profiles:\n"
                      "  - {name: p, engine: vllm, model_path: m, api_key: eng-key-1, env: {HF_TOKEN: hf-42}}\n")
    if "profiles:" in example:  # the cluster example already has a profile list
        text = example.replace("    env: {}", "    env: {HF_TOKEN: hf-42}\n    api_key: eng-key-1")
    config = parse_config(text)
    shown = repr(config) + str(config) + "".join(map(repr, config.models + config.profiles + config.api_keys))
    for secret in (*SECRETS, "eng-key-1", "hf-42"):
        assert secret not in shown


def test_secrets_never_appear_in_errors():
    errors = errors_of(
        """\
        api_keys:
          - key: sk-dup-1
          - key: sk-dup-1
        models:
          - name: m
            replicas:
              - url: http://user:pw-in-url@host:9000
              - url: http://host:9001
                weight: ${WEIGHT}
                api_key: [tok-in-list]
        agents:
          token: {nested: agent-tok}
        """,
        env={"WEIGHT": "env-secret-weight"},
    )
    rendered = "\n".join(map(str, errors))
    assert len(errors) == 5, rendered
    for secret in ("sk-dup-1", "pw-in-url", "env-secret-weight", "tok-in-list", "agent-tok"):
        assert secret not in rendered


def test_syntax_errors_do_not_quote_the_line():
    issue = only_error('models:\n  - name: m\n    replicas:\n      - url: http://h:1\n        api_key: "hunter2\n')
    assert issue.line == 5 and "hunter2" not in str(issue)


# -- every kind of error, with its line and key -----------------------------------

ERROR_CASES = {
    "yaml syntax": ("listen: 127.0.0.1:8000\nmodels: [\n", 3, "", "invalid YAML"),
    "two documents": ("listen: 127.0.0.1:8000\n---\nlisten: 127.0.0.1:9000\n", 2, "", "single document"),
    "document not a mapping": ("- 1\n- 2\n", 1, "", "the file must be a mapping"),
    "duplicate key": ("models:\n  - name: a\n    name: b\n    replicas: [{url: 'http://h:1'}]\n",
                      3, "models[0].name", "duplicate key (first set on line 2)"),
    "unknown key with suggestion": ("limits:\n  retires: 3\n", 2, "limits.retires",
                                    "unknown key (did you mean 'retries'?)"),
    "metrics auth without tokens": ("metrics:\n  require_auth: true\n", 2, "metrics.require_auth",
                                    "needs admin_tokens"),
    "unknown key listing choices": ("metrics:\n  colour: red\n", 2, "metrics.colour",
                                    "unknown key (expected one of: enabled, require_auth)"),
    "missing required key": ("models:\n  - name: a\n", 2, "models[0].replicas", "missing required key"),
    "required key set to null": ("profiles:\n  - name: p\n    engine:\n    model_path: m\n", 3,
                                 "profiles[0].engine", "must have a value"),
    "integer expected": ("limits:\n  retries: three\n", 2, "limits.retries",
                         "expected an integer, got a string 'three'"),
    "boolean is not an integer": ("limits:\n  retries: true\n", 2, "limits.retries",
                                  "expected an integer, got a boolean"),
    "boolean expected": ("metrics:\n  enabled: 1\n", 2, "metrics.enabled",
                         "expected true or false, got an integer '1'"),
    "list expected": ("models:\n  name: a\n", 1, "models", "expected a list, got a mapping"),
    "mapping expected": ("health: [1]\n", 1, "health", "expected a mapping, got a list"),
    "scalar expected": ("profiles:\n  - {name: p, engine: sim, model_path: m, args: [[1]]}\n", 2,
                        "profiles[0].args[0]", "expected a single value, got a list"),
    "bad duration": ("health:\n  interval: 2 fortnights\n", 2, "health.interval", "expected a duration"),
    "zero duration": ("limits:\n  connect_timeout: 0s\n", 2, "limits.connect_timeout", "must be greater than 0"),
    "bad size": ("limits:\n  max_body_bytes: 16 megs\n", 2, "limits.max_body_bytes", "expected a size"),
    "bad listen address": ("listen: localhost\n", 1, "listen", "expected HOST:PORT"),
    "bad port": ("control_listen: 127.0.0.1:70000\n", 1, "control_listen", "from 0 to 65535"),
    "unbracketed ipv6": ("listen: '::1:8000'\n", 1, "listen", "IPv6 address in brackets"),
    "same listeners": ("listen: 127.0.0.1:8000\ncontrol_listen: 127.0.0.1:8000\n", 2, "control_listen",
                       "must not be the same address as listen"),
    "bad url scheme": ("models:\n  - name: a\n    replicas:\n      - url: ftp://h:1\n", 4,
                       "models[0].replicas[0].url", "http:// or https://"),
    "url with /v1": ("models:\n  - name: a\n    replicas:\n      - url: http://h:1/v1/\n", 4,
                     "models[0].replicas[0].url", "leave /v1 out"),
    "no replicas": ("models:\n  - name: a\n    replicas: []\n", 3, "models[0].replicas",
                    "a model needs at least one replica"),
    "duplicate replica url": ("models:\n  - name: a\n    replicas:\n      - url: http://h:1\n      - url: http://h:1/\n",
                              5, "models[0].replicas[1].url",
                              "duplicate replica URL: same as models[0].replicas[0].url on line 4"),
    "kv_replay without kv_events": ("models:\n  - name: a\n    replicas:\n      - url: http://h:1\n"
                                    "        kv_replay: tcp://h:5558\n", 5, "models[0].replicas[0].kv_replay",
                                    "needs kv_events"),
    "kv endpoint with wildcard": ("models:\n  - name: a\n    replicas:\n      - url: http://h:1\n"
                                  "        kv_events: tcp://*:5557\n", 5, "models[0].replicas[0].kv_events",
                                  "cannot be '*'"),
    "weight below one": ("models:\n  - name: a\n    replicas:\n      - {url: 'http://h:1', weight: 0}\n", 4,
                         "models[0].replicas[0].weight", "must be at least 1"),
    "routing not a name": ("models:\n  - name: a\n    routing: round robin\n    replicas: [{url: 'http://h:1'}]\n",
                           3, "models[0].routing", "must be a name"),
    "duplicate model": ("models:\n  - {name: a, replicas: [{url: 'http://h:1'}]}\n"
                        "  - {name: a, replicas: [{url: 'http://h:2'}]}\n", 3, "models[1].name",
                        "duplicate model name: same as models[0].name on line 2"),
    "empty api key": ("api_keys:\n  - key: ''\n", 2, "api_keys[0].key", "must not be empty"),
    "duplicate api key": ("api_keys:\n  - key: k1\n  - key: k1\n", 3, "api_keys[1].key",
                          "duplicate API key: same as api_keys[0].key on line 2"),
    "key written as key and as its hash": (
        "api_keys:\n  - key: test\n  - key_sha256: 9F86D081884C7D659A2FEAA0C55AD015A3BF4F1B2B0B822CD15D6C15B0F00A08\n",
        3, "api_keys[1].key_sha256", "duplicate API key: same as api_keys[0].key on line 2"),
    "key and key_sha256 both": ("api_keys:\n  - key: k\n    key_sha256: " + "a" * 64 + "\n", 2, "api_keys[0].key",
                                "give exactly one of key and key_sha256"),
    "neither key nor key_sha256": ("api_keys:\n  - name: web\n", 2, "api_keys[0].key",
                                   "give exactly one of key and key_sha256"),
    "key_sha256 not hex": ("api_keys:\n  - key_sha256: abc\n", 2, "api_keys[0].key_sha256",
                           "a SHA-256 as 64 hex digits"),
    "unknown team": ("teams:\n  - name: search\napi_keys:\n  - {key: k, team: serch}\n", 4, "api_keys[0].team",
                     "no team named 'serch' under teams (did you mean 'search'?)"),
    "team without teams": ("api_keys:\n  - {key: k, team: search}\n", 2, "api_keys[0].team",
                           "no team named 'search' under teams (no teams are defined)"),
    "duplicate team": ("teams:\n  - name: a\n  - name: a\n", 3, "teams[1].name",
                       "duplicate team name: same as teams[0].name on line 2"),
    "priority not a name": ("api_keys:\n  - {key: k, priority: 'high prio'}\n", 2, "api_keys[0].priority",
                            "must be a name"),
    "priority naming no class": ("teams:\n  - {name: t, priority: interactve}\n", 2, "teams[0].priority",
                                 "no priority class named 'interactve' under flow.classes (did you mean "
                                 "'interactive'?)"),
    "priority of a class the flow section does not define": (
        "flow:\n  classes: [{name: gold, rank: 0, max_wait: 1s}]\n  default_class: gold\n"
        "api_keys:\n  - {key: k, priority: standard}\n", 5, "api_keys[0].priority",
        "no priority class named 'standard' under flow.classes"),
    "flow default class": ("flow:\n  default_class: normal\n", 2, "flow.default_class",
                           "no priority class named 'normal' under flow.classes"),
    "flow duplicate class": ("flow:\n  classes:\n    - {name: a, rank: 0, max_wait: 1s}\n"
                             "    - {name: a, rank: 1, max_wait: 1s}\n  default_class: a\n", 4,
                             "flow.classes[1].name", "duplicate class name: same as flow.classes[0].name on line 3"),
    "flow duplicate rank": ("flow:\n  classes:\n    - {name: a, rank: 0, max_wait: 1s}\n"
                            "    - {name: b, rank: 0, max_wait: 1s}\n  default_class: a\n", 4,
                            "flow.classes[1].rank", "duplicate class rank"),
    "flow max_fill": ("flow:\n  classes: [{name: standard, rank: 0, max_wait: 1s, max_fill: 0}]\n", 2,
                      "flow.classes[0].max_fill", "must be above 0 and at most 1"),
    "flow retry-after bounds": ("flow:\n  retry_after_min: 10\n  retry_after_max: 5\n", 3,
                                "flow.retry_after_max", "must be at least retry_after_min"),
    "flow kv target": ("flow:\n  kv_high: 0.9\n  kv_target: 0.95\n", 3, "flow.kv_target", "must be below kv_high"),
    "flow kv high": ("flow:\n  kv_high: 0.7\n", 2, "flow.kv_high", "must be above kv_target"),
    "flow output quantile": ("flow:\n  output_quantile: 1.5\n", 2, "flow.output_quantile", "must be at most 1"),
    "flow priority header": ("flow:\n  priority_header: 'x prio'\n", 2, "flow.priority_header",
                             "an HTTP header name"),
    "rpm below one": ("api_keys:\n  - key: k\n    limits: {rpm: 0}\n", 3, "api_keys[0].limits.rpm",
                      "must be at least 1"),
    "budget period": ("teams:\n  - name: t\n    budgets: [{period: week, usd: 5}]\n", 3,
                      "teams[0].budgets[0].period", "must be one of: day, month, total"),
    "budget of nothing": ("teams:\n  - name: t\n    budgets: [{period: day}]\n", 3,
                          "teams[0].budgets[0].period", "a budget needs tokens, usd or both"),
    "two budgets of one period": ("api_keys:\n  - key: k\n    budgets:\n      - {period: day, usd: 1}\n"
                                  "      - {period: day, tokens: 5}\n", 5, "api_keys[0].budgets[1].period",
                                  "duplicate budget period: same as api_keys[0].budgets[0].period on line 4"),
    "budget finer than a nano-dollar": ("api_keys:\n  - key: k\n    budgets: [{period: day, usd: 0.0000000001}]\n",
                                        3, "api_keys[0].budgets[0].usd", "USD with at most 9 decimals"),
    "price finer than a nano-dollar per token": ("prices:\n  - {model: m, input: 0.0001}\n", 2, "prices[0].input",
                                                 "USD per million tokens with at most 3 decimals"),
    "negative price": ("prices:\n  - {model: m, output: -1}\n", 2, "prices[0].output", "must be at least 0"),
    "duplicate price": ("prices:\n  - {model: m}\n  - {model: m}\n", 3, "prices[1].model",
                        "duplicate price of model: same as prices[0].model on line 2"),
    "cached input weight": ("tenancy:\n  cached_input_weight: 1.5\n", 2, "tenancy.cached_input_weight",
                            "must be between 0 and 1"),
    "tp below one": ("profiles:\n  - {name: p, engine: sim, model_path: m, tp: 0}\n", 2, "profiles[0].tp",
                     "must be at least 1"),
    "tp x pp not divisible by nodes": ("profiles:\n  - name: p\n    engine: vllm\n    model_path: m\n"
                                       "    tp: 3\n    nodes: 2\n", 6, "profiles[0].nodes",
                                       "tp x pp = 3 GPUs cannot be split evenly over 2 nodes"),
    "gpus_per_node mismatch": ("profiles:\n  - name: p\n    engine: vllm\n    model_path: m\n    tp: 4\n"
                               "    nodes: 2\n    gpus_per_node: 4\n", 7, "profiles[0].gpus_per_node",
                               "gpus_per_node x nodes = 8, but tp x pp = 4"),
    "bad env name": ("profiles:\n  - name: p\n    engine: sim\n    model_path: m\n    env:\n      BAD-NAME: x\n",
                     6, "profiles[0].env.BAD-NAME", "valid environment variable name"),
    "duplicate lora": ("profiles:\n  - name: p\n    engine: sim\n    model_path: m\n    lora_adapters:\n"
                       "      - {name: a, path: /x}\n      - {name: a, path: /y}\n", 7,
                       "profiles[0].lora_adapters[1].name", "duplicate LoRA adapter name"),
    "duplicate profile": ("profiles:\n  - {name: p, engine: sim, model_path: m}\n"
                          "  - {name: p, engine: sim, model_path: m}\n", 3, "profiles[1].name",
                          "duplicate profile name"),
    "odd label key path": ("profiles:\n  - name: p\n    engine: sim\n    model_path: m\n    labels:\n"
                           "      gpu.example.com/class: [a]\n", 6, 'profiles[0].labels["gpu.example.com/class"]',
                           "expected a single value, got a list"),
    "unknown deployment profile": ("agents: {embedded: true}\n"
                                   "profiles:\n  - {name: tiny-sim, engine: sim, model_path: m}\n"
                                   "deployments:\n  - profile: tiny-sm\n", 5, "deployments[0].profile",
                                   "no profile named 'tiny-sm' (did you mean 'tiny-sim'?)"),
    "negative replicas": ("agents: {embedded: true}\nprofiles:\n  - {name: p, engine: sim, model_path: m}\n"
                          "deployments:\n  - profile: p\n    replicas: -1\n", 6, "deployments[0].replicas",
                          "must be at least 0"),
    "routing differs between model and profile": (
        "agents: {embedded: true}\nmodels:\n  - {name: tiny, replicas: [{url: 'http://h:1'}]}\n"
        "profiles:\n  - name: p\n    engine: sim\n    model_path: m\n    served_model_name: tiny\n"
        "    routing: kv_index\n",
        9, "profiles[0].routing",
        "model 'tiny' is also declared by models[0].name on line 3 with routing 'round_robin'"),
    "routing options differ": (
        "profiles:\n  - {name: a, engine: sim, model_path: m, served_model_name: x, routing_options: {k: 1}}\n"
        "  - {name: b, engine: sim, model_path: m, served_model_name: x, routing_options: {k: 2}}\n",
        3, "profiles[1].routing_options", "with different routing_options"),
    "agent token required (agents written)": (
        "agents:\n  embedded: false\nprofiles:\n  - {name: p, engine: sim, model_path: m}\n"
        "deployments:\n  - profile: p\n",
        1, "agents.token", "agents.token is required for remote agents"),
    "agent token required (no agents section)": (
        "profiles:\n  - {name: p, engine: sim, model_path: m}\ndeployments:\n  - profile: p\n",
        3, "agents.token", "agents.token is required for remote agents"),
    "agent timings out of order": ("agents:\n  heartbeat_interval: 5s\n  suspect_after: 4s\n", 3,
                                   "agents.suspect_after", "must be longer than heartbeat_interval"),
    "health path": ("health:\n  path: health\n", 2, "health.path", "a path starting with '/'"),
    "log level": ("log_level: verbose\n", 1, "log_level", "must be one of: debug, info"),
    "unset environment variable": ("agents:\n  token: ${JOIN_TOKEN}\n", 2, "agents.token",
                                   "environment variable JOIN_TOKEN is not set"),
    "bad environment reference": ("log_level: ${1X}\n", 1, "log_level", "bad environment reference"),
    "unterminated environment reference": ("log_level: 'x${'\n", 1, "log_level", "unterminated '${'"),
    "non-string key": ("? [a, b]\n: 1\n", 1, "", "mapping keys must be strings"),
    "recursive alias": ("profiles: &p [*p]\n", 1, "profiles[0]", "recursive alias"),
    "unknown tag": ("log_level: !custom info\n", 1, "log_level", "cannot read a value tagged !custom"),
}


@pytest.mark.parametrize("text, line, key, message", ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_each_error_names_file_line_and_key(text, line, key, message):
    errors = errors_of(text)
    assert any(
        (issue.file, issue.line, issue.key) == ("conf.yaml", line, key) and message in issue.message
        for issue in errors
    ), "\n".join(map(str, errors))
    relevant = [issue for issue in errors if issue.key == key]
    assert len(relevant) == 1, "\n".join(map(str, errors))


def test_every_error_is_reported_in_file_order():
    errors = errors_of(
        """\
        listen: nowhere
        models:
          - name: a
            replicas:
              - url: gopher://x
        limits:
          retries: -1
          bogus: 1
        log_level: loud
        """
    )
    assert [str(e) for e in errors] == [
        "conf.yaml:1: listen: expected HOST:PORT, e.g. 127.0.0.1:8000 or \"[::1]:8000\"",
        "conf.yaml:5: models[0].replicas[0].url: the URL must start with http:// or https://",
        "conf.yaml:7: limits.retries: must be at least 0",
        "conf.yaml:8: limits.bogus: unknown key (expected one of: max_body_bytes, max_header_bytes, "
        "client_header_timeout, client_body_timeout, keepalive_timeout, connect_timeout, first_byte_timeout, "
        "idle_timeout, retries, shutdown_grace, max_connections, control_max_connections, max_json_depth, "
        "max_json_values, max_json_containers)",
        "conf.yaml:9: log_level: must be one of: debug, info, warning, error, critical",
    ]


def test_an_invalid_profile_does_not_cause_a_second_error_in_its_deployment():
    issue = only_error(
        """\
        agents: {embedded: true}
        profiles:
          - name: p
            engine: sim
        deployments:
          - profile: p
        """
    )
    assert (issue.line, issue.key, issue.message) == (3, "profiles[0].model_path", "missing required key")


def test_config_issue_renders_without_line_or_key():
    assert str(ConfigIssue("f.yaml", 3, "a.b", "bad")) == "f.yaml:3: a.b: bad"
    assert str(ConfigIssue("f.yaml", 3, "", "bad")) == "f.yaml:3: bad"
    assert str(ConfigIssue("f.yaml", 0, "", "bad")) == "f.yaml: bad"


# -- positions for callers: issue_at, line_of, key_of ------------------------------


def test_issue_at_points_at_a_field_of_a_loaded_object():
    config = parse_config(STATIC_EXAMPLE, "static.yaml")
    model = config.models[0]
    assert str(issue_at(model, "routing", "unknown routing tier 'x'")) == \
        "static.yaml:5: models[0].routing: unknown routing tier 'x'"
    replica = model.replicas[1]
    assert (replica.line_of(), replica.key_of("api_key"), replica.line_of("api_key")) == \
        (8, "models[0].replicas[1].api_key", 9)
    # A key that was not written is reported on the line of its object.
    assert replica.line_of("weight") == 8 and not replica.was_written("weight")
    assert str(issue_at(config.limits, "retries", "x")) == "static.yaml:1: limits.retries: x"


def test_positions_are_not_part_of_equality():
    assert parse_config(STATIC_EXAMPLE, "a.yaml").models == parse_config("\n\n" + STATIC_EXAMPLE, "b.yaml").models


# -- values -----------------------------------------------------------------------


@pytest.mark.parametrize("written, seconds", [
    (5, 5.0), (0.25, 0.25), ("500ms", 0.5), ("5s", 5.0), ("2m", 120.0), ("1h30m", 5400.0),
    ("1.5s", 1.5), ("10", 10.0), (" 2 m ", 120.0), ("1m30s500ms", 90.5),
])
def test_durations(written, seconds):
    assert parse_duration(written) == seconds


@pytest.mark.parametrize("written", ["", "5 seconds", "-1s", -1, True, "1d", "ms", "1.s", [1], float("inf")])
def test_bad_durations(written):
    with pytest.raises(ValueError):
        parse_duration(written)


@pytest.mark.parametrize("written, size", [
    (1024, 1024), ("16MiB", 16 * 2**20), ("64KiB", 65536), ("1GB", 10**9), ("1.5GiB", 3 * 2**29),
    ("512B", 512), ("2ki", 2048), ("1 mb", 10**6), ("7", 7), ("1TiB", 2**40),
])
def test_sizes(written, size):
    assert parse_size(written) == size


@pytest.mark.parametrize("written", ["16 megs", "-1", -1, 1.5, "1.5B", "1K", "MiB", True, None])
def test_bad_sizes(written):
    with pytest.raises(ValueError):
        parse_size(written)


def test_units_in_a_file():
    config = parse_config(
        "limits:\n  max_body_bytes: 32MiB\n  max_header_bytes: 8192\n  first_byte_timeout: 15m\n"
        "  idle_timeout: 1.5\n  shutdown_grace: 0\n"
    )
    assert config.limits.max_body_bytes == 32 * 2**20 and config.limits.max_header_bytes == 8192
    assert config.limits.first_byte_timeout == 900.0 and config.limits.idle_timeout == 1.5
    assert config.limits.shutdown_grace == 0.0


@pytest.mark.parametrize("written, host, port, shown", [
    ("127.0.0.1:8000", "127.0.0.1", 8000, "127.0.0.1:8000"),
    ("0.0.0.0:0", "0.0.0.0", 0, "0.0.0.0:0"),
    ("[::1]:8000", "::1", 8000, "[::1]:8000"),
    ("gateway.local:443", "gateway.local", 443, "gateway.local:443"),
])
def test_host_port(written, host, port, shown):
    address = HostPort.parse(written)
    assert (address.host, address.port, str(address)) == (host, port, shown)


@pytest.mark.parametrize("written", ["8000", ":8000", "host", "host:port", "[]:80", "::1:80", "h:-1", 8000])
def test_bad_host_port(written):
    with pytest.raises(ValueError):
        HostPort.parse(written)


def test_ipv6_listener_in_a_file():
    assert parse_config('listen: "[::1]:0"\n').listen == HostPort("::1", 0)


def test_replica_urls_are_normalised():
    config = parse_config(
        "models:\n  - name: a\n    replicas:\n      - url: HTTP://Example.COM:8000/\n"
        "      - url: https://h/prefix/\n      - url: 'http://[::1]:9000'\n        name: local\n"
    )
    first, second, third = config.models[0].replicas
    assert (first.url, first.name) == ("http://example.com:8000", "example.com:8000")
    assert (second.url, second.name, second.address) == ("https://h/prefix", "h:443", HostPort("h", 443))
    assert (third.url, third.name, third.address) == ("http://[::1]:9000", "local", HostPort("::1", 9000))


def test_strings_take_any_scalar_as_written():
    config = parse_config(
        "agents: {embedded: true}\nprofiles:\n  - name: p\n    engine: sim\n    model_path: 7b\n"
        "    served_model_name: yes\n    args: [--n, 256, 0.5]\n    env: {OMP_NUM_THREADS: 4}\n"
        "deployments: [{profile: p}]\n"
    )
    profile = config.profiles[0]
    assert (profile.model_path, profile.served_model_name) == ("7b", "yes")
    assert profile.args == ["--n", "256", "0.5"] and profile.env == {"OMP_NUM_THREADS": "4"}


def test_null_takes_the_default():
    config = parse_config("listen:\nlimits:\n  retries: ~\n"
                          "models:\n  - name: a\n    replicas: [{url: 'http://h:1', api_key: null}]\n")
    assert config.listen == HostPort("127.0.0.1", 8000) and config.limits.retries == 2
    assert config.models[0].replicas[0].api_key is None


def test_derived_defaults():
    config = parse_config(
        "profiles:\n  - {name: big, engine: vllm, model_path: m, tp: 8, pp: 2, nodes: 2}\n"
        "  - {name: odd, engine: vllm, model_path: m, tp: 4, nodes: 2, gpus_per_node: 2}\n"
    )
    big, odd = config.profiles
    assert (big.served_model_name, big.gpus_per_node, big.gpus) == ("big", 8, 16)
    assert odd.gpus_per_node == 2


def test_free_form_routing_options_and_merge_keys():
    config = parse_config(
        "profiles:\n"
        "  - &base {name: a, engine: sim, model_path: m, routing: prefix_tree,\n"
        "           routing_options: {weights: {load: 0.5}, block_size: 16, note: null}}\n"
        "  - <<: *base\n    name: b\n"
    )
    a, b = config.profiles
    assert a.routing_options == {"weights": {"load": 0.5}, "block_size": 16, "note": None}
    assert (b.name, b.routing, b.routing_options, b.served_model_name) == ("b", "prefix_tree", a.routing_options, "b")


def test_same_model_in_models_and_a_profile_with_the_same_routing_is_allowed():
    config = parse_config(
        "agents: {embedded: true}\nmodels:\n  - {name: tiny, replicas: [{url: 'http://h:1'}]}\n"
        "profiles:\n  - {name: p, engine: sim, model_path: m, served_model_name: tiny}\n"
        "deployments: [{profile: p}]\n"
    )
    assert config.model_names() == ["tiny"]


def test_embedded_agent_needs_no_token():
    config = parse_config(CLUSTER_EXAMPLE.replace("  token: s3cret", "  token:"))
    assert config.agents.token is None and config.agents.embedded


def test_placement():
    config = parse_config(
        "agents: {token: t}\nprofiles: [{name: p, engine: sim, model_path: m}]\n"
        "deployments:\n  - profile: p\n    replicas: 0\n    pool: batch\n    placement:\n"
        "      node_selector: {rack: r1}\n      nodes: [n1, n2]\n      spread: false\n"
    )
    deployment = config.deployments[0]
    assert (deployment.replicas, deployment.pool) == (0, "batch")
    assert deployment.placement.node_selector == {"rack": "r1"}
    assert deployment.placement.nodes == ["n1", "n2"] and deployment.placement.spread is False
    assert config.model_names() == ["p"]


# -- environment variables ----------------------------------------------------------


def test_environment_interpolation():
    config = parse_config(
        "listen: ${HOST:-127.0.0.1}:${PORT}\n"
        "api_keys:\n  - key: ${CLIENT_KEY}\n"
        "admin_tokens:\n  - token: t\n    name: 'price: $$5 and $${literal}'\n"
        "limits: {retries: \"${RETRIES:-1}\", first_byte_timeout: '${FBT:-2m}'}\n"
        "agents:\n  token: ${EMPTY:-fallback}\n  node_id: ${UNSET:-}\n",
        env={"PORT": "9000", "CLIENT_KEY": "from-env", "EMPTY": ""},
    )
    assert config.listen == HostPort("127.0.0.1", 9000)
    assert config.api_keys[0].key == "from-env"
    assert config.admin_tokens[0].name == "price: $$5 and ${literal}"
    assert config.limits.retries == 1 and config.limits.first_byte_timeout == 120.0
    assert config.agents.token == "fallback" and config.agents.node_id is None


def test_environment_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("LLMGW_TEST_TOKEN", "from-os")
    assert parse_config("agents: {token: '${LLMGW_TEST_TOKEN}'}\n").agents.token == "from-os"


def test_environment_values_are_typed_after_substitution():
    issue = only_error("limits:\n  retries: ${RETRIES}\n", env={"RETRIES": "many"})
    assert (issue.line, issue.key, issue.message) == (2, "limits.retries", "expected an integer, got a string")


def test_keys_are_not_interpolated():
    config = parse_config("profiles:\n  - {name: p, engine: sim, model_path: m, labels: {'${X}': y}}\n", env={"X": "z"})
    assert config.profiles[0].labels == {"${X}": "y"}


# -- the CLI --------------------------------------------------------------------------


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LLMGW), "config", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_cli_check_good_files(tmp_path):
    (tmp_path / "static.yaml").write_text(STATIC_EXAMPLE)
    (tmp_path / "cluster.yaml").write_text(CLUSTER_EXAMPLE)
    result = run_cli("check", "static.yaml", "cluster.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    out = result.stdout
    assert "static.yaml: ok\n" in out and "cluster.yaml: ok\n" in out
    assert "models: 1 (tiny)" in out and "replicas: 2 external, 0 deployed" in out
    assert "profiles: 1 (tiny-sim)" in out and "deployments: 1 (tiny-sim x2)" in out
    assert "replicas: 0 external, 2 deployed" in out
    for secret in SECRETS:
        assert secret not in out


def test_cli_check_bad_file(tmp_path):
    (tmp_path / "bad.yaml").write_text(
        "listen: 127.0.0.1:8000\nmodels:\n  - name: tiny\n    rplicas:\n      - url: http://127.0.0.1:9001\n"
        "limits:\n  first_byte_timeout: 10 minutes\nagents: {embedded: true}\n"
        "profiles:\n  - {name: tiny-sim, engine: sim, model_path: tiny}\n"
        "deployments:\n  - profile: tiny-sm\n"
    )
    result = run_cli("check", "bad.yaml", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "bad.yaml:3: models[0].replicas: missing required key",
        "bad.yaml:4: models[0].rplicas: unknown key (did you mean 'replicas'?)",
        "bad.yaml:7: limits.first_byte_timeout: expected a duration: seconds as a number, "
        "or a string like '500ms', '5s', '2m', '1h30m'",
        "bad.yaml:12: deployments[0].profile: no profile named 'tiny-sm' (did you mean 'tiny-sim'?)",
    ]


def test_cli_usage_errors(tmp_path):
    assert run_cli(cwd=tmp_path).returncode == 2
    assert run_cli("check", cwd=tmp_path).returncode == 2
    missing = run_cli("check", "missing.yaml", cwd=tmp_path)
    assert missing.returncode == 1
    assert missing.stderr.strip() == "missing.yaml: cannot read the file: No such file or directory"


# -- the documentation -------------------------------------------------------------------


def test_docs_show_both_examples():
    """configuration.md shows the two examples these tests load (every key documented, and every example there
    checked with `llmgw config check`: tests/unit/test_docs_configuration.py, tests/unit/test_docs_examples.py)."""
    docs = (REPO / "docs" / "configuration.md").read_text()
    assert STATIC_EXAMPLE in docs and CLUSTER_EXAMPLE in docs


def test_config_objects_are_frozen():
    config = parse_config(STATIC_EXAMPLE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.models[0].name = "other"  # type: ignore[misc]


TWO_MODELS = """
    models:
      - name: a
        replicas: [{url: "http://127.0.0.1:9001"}]
        lora_adapters: [{name: %s, path: /x}]
      - name: b
        replicas: [{url: "http://127.0.0.1:9002"}]
        lora_adapters: [%s]
    """


@pytest.mark.parametrize("first, second, line, key, message", [
    ("b", "", 5, "models[0].lora_adapters[0].name", "has the name of a model"),
    ("sql", "{name: sql, path: /y}", 8, "models[1].lora_adapters[0].name", "also an adapter of model 'a'"),
], ids=["adapter named as a model", "adapter of two models"])
def test_lora_adapter_names_are_model_names_to_clients(first, second, line, key, message):
    error = only_error(TWO_MODELS % (first, second))
    assert (error.line, error.key) == (line, key) and message in error.message


ENGINE_NAMES = """
    models:
      - name: %s
        replicas: [{url: "http://127.0.0.1:9001"}]
        lora_adapters: [{name: %s, path: /x}]
    profiles:
      - {name: p, engine: sim, model_path: m, served_model_name: %s, lora_adapters: [{name: %s, path: /y}]}
    deployments:
      - profile: %s
    agents: {embedded: true}
    """
GOOD_NAMES = ("tiny", "sql-lora", "org/Model-7B_v1.5", "p", "p")


@pytest.mark.parametrize("position, bad, line, key", [
    (0, '"my model"', 3, "models[0].name"),
    (1, "--served-model-name", 5, "models[0].lora_adapters[0].name"),
    (2, '"a=b"', 7, "profiles[0].served_model_name"),
    (3, '"sql\\tlora"', 7, "profiles[0].lora_adapters[0].name"),
    (3, '"-x"', 7, "profiles[0].lora_adapters[0].name"),
], ids=["space", "a flag", "equals", "control character", "leading dash"])
def test_names_that_would_break_an_engine_command_line_are_refused(position, bad, line, key):
    names = list(GOOD_NAMES)
    names[position] = bad
    errors = errors_of(ENGINE_NAMES % tuple(names))
    assert any((issue.file, issue.line, issue.key) == ("conf.yaml", line, key) and "command line" in issue.message
               for issue in errors), "\n".join(map(str, errors))


def test_engine_safe_names_pass():
    parse_config(textwrap.dedent(ENGINE_NAMES % GOOD_NAMES), "conf.yaml", env={})


def test_the_flow_section_maps_to_flow_settings():
    config = parse_config(textwrap.dedent("""\
        flow:
          classes:
            - {name: chat, rank: 0, max_wait: 500ms}
            - {name: bulk, rank: 5, max_wait: 2m, max_fill: 0.5}
          default_class: bulk
          priority_header: X-Priority
          max_queued: 50
          retry_after_max: 30
        """), "conf.yaml", env={})
    settings = config.flow.settings()
    assert [(c.name, c.rank, c.max_wait, c.max_fill) for c in settings.classes] == \
        [("chat", 0, 0.5, 1.0), ("bulk", 5, 120.0, 0.5)]
    assert (settings.default_class, settings.priority_header, settings.max_queued, settings.retry_after_max) == \
        ("bulk", "x-priority", 50, 30)
    assert parse_config("", "conf.yaml", env={}).flow.settings() == FlowSettings()  # the defaults are model.py's


def test_sleep_mode_is_a_boolean_named_by_file_line_and_key():
    issue = only_error(
        """\
        agents: {embedded: true}
        profiles:
          - name: p
            engine: vllm
            model_path: m
            sleep_mode: sometimes
        deployments:
          - profile: p
        """
    )
    assert (issue.file, issue.line, issue.key) == ("conf.yaml", 6, "profiles[0].sleep_mode"), str(issue)


def test_the_output_quantile_defaults_to_the_allowances_own_and_learning_may_be_turned_off():
    assert parse_config("", "conf.yaml", env={}).flow.output_quantile == DEFAULT_QUANTILE
    assert parse_config("", "conf.yaml", env={}).flow.reserved_output_quantile() == DEFAULT_QUANTILE
    assert parse_config("flow:\n  learn_output: false\n", "conf.yaml", env={}).flow.reserved_output_quantile() is None
    assert parse_config("flow:\n  output_quantile: 0.5\n", "conf.yaml", env={}).flow.output_quantile == 0.5
