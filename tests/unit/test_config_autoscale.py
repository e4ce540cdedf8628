"""The autoscaling keys: ``replicas: N`` or ``replicas: {min, max}``, a deployment's ``autoscale:`` section, the
top-level ``autoscale:``; their mapping to AutoscaleSettings and their errors (file, line, key)."""

from __future__ import annotations

import textwrap

import pytest

from llmgw.autoscale.model import AutoscaleSettings
from llmgw.config import ConfigError, Deployment, parse_config

HEAD = """\
agents: {token: t}
profiles:
  - {name: chat, engine: sim, model_path: tiny}
  - {name: batch, engine: sim, model_path: tiny, served_model_name: bulk}
deployments:
"""


def load(deployments: str, extra: str = ""):
    return parse_config(HEAD + textwrap.dedent(deployments) + textwrap.dedent(extra), "conf.yaml", env={})


def errors(deployments: str, extra: str = "") -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(deployments, extra)
    return [str(issue) for issue in caught.value.errors]


def test_a_fixed_count_is_as_before_and_not_autoscaled():
    config = load("  - {profile: chat, replicas: 3}\n")
    deployment = config.deployments[0]
    assert (deployment.replicas, deployment.min_replicas, deployment.max_replicas) == (3, 3, 3)
    assert not deployment.autoscaled and config.autoscale_settings() == {}


def test_a_range_is_autoscaled_starting_at_min_with_the_default_targets():
    config = load("  - {profile: chat, replicas: {min: 0, max: 4}}\n")
    deployment = config.deployments[0]
    assert deployment.autoscaled and deployment.replicas == 0
    assert config.autoscale_settings() == {"chat": AutoscaleSettings(min_replicas=0, max_replicas=4)}
    assert load("  - {profile: chat, replicas: {max: 2}}\n").deployments[0].min_replicas == 1


def test_the_autoscale_section_maps_every_field_with_durations_as_written():
    config = load("""\
      - profile: chat
        replicas: {min: 1, max: 8}
        autoscale:
          queued_per_replica: 2.5
          kv_usage: 0.7
          ttft_slo: 800ms
          attainment: 0.99
          scale_up_after: 10s
          scale_down_after: 15m
          idle_to_zero: 1h
          priority: 5
      - {profile: batch, replicas: 2}
    """, "autoscale: {interval: 500ms, history: 50}\n")
    assert config.autoscale_settings() == {"chat": AutoscaleSettings(
        min_replicas=1, max_replicas=8, queued_per_replica=2.5, kv_usage=0.7, ttft_slo=0.8, attainment=0.99,
        scale_up_after=10.0, scale_down_after=900.0, idle_to_zero=3600.0, priority=5)}
    assert (config.autoscale.interval, config.autoscale.history) == (0.5, 50)


def test_the_top_level_defaults():
    config = load("  - {profile: chat, replicas: 1}\n")
    assert (config.autoscale.interval, config.autoscale.history) == (1.0, 500)


def test_a_deployment_built_in_code_has_its_replicas_as_both_bounds():
    deployment = Deployment(profile="chat", replicas=3)
    assert (deployment.min_replicas, deployment.max_replicas, deployment.autoscaled) == (3, 3, False)


@pytest.mark.parametrize("deployments, expected", [
    ("  - profile: chat\n    replicas: {min: 5, max: 4}\n",
     "conf.yaml:7: deployments[0].replicas.min: must be at most max (4)"),
    ("  - profile: chat\n    replicas: {min: 0, max: 0}\n",
     "conf.yaml:7: deployments[0].replicas.max: must be at least 1"),
    ("  - profile: chat\n    replicas: {min: 0}\n",
     "conf.yaml:7: deployments[0].replicas.max: missing required key"),
    ("  - profile: chat\n    replicas: {min: 0, max: 2, mx: 4}\n",
     "conf.yaml:7: deployments[0].replicas.mx: unknown key (did you mean 'max'?)"),
    ("  - profile: chat\n    replicas: [1, 2]\n",
     "conf.yaml:7: deployments[0].replicas: expected a single value or a mapping of min, max, got a list"),
    ("  - profile: chat\n    replicas: 2\n    autoscale: {priority: 1}\n",
     "conf.yaml:8: deployments[0].autoscale: applies to an autoscaled deployment: write its replicas as "
     "{min: N, max: M} with M above N"),
    ("  - profile: chat\n    replicas: {min: 2, max: 2}\n    autoscale: {}\n",
     "conf.yaml:8: deployments[0].autoscale: applies to an autoscaled deployment: write its replicas as "
     "{min: N, max: M} with M above N"),
    ("  - profile: chat\n    replicas: {max: 2}\n    autoscale: {attainment: 0.9}\n",
     "conf.yaml:8: deployments[0].autoscale.attainment: needs ttft_slo: the attainment is the share of first "
     "tokens within it"),
    ("  - profile: chat\n    replicas: {max: 2}\n    autoscale:\n      kv_usage: 1.5\n",
     "conf.yaml:9: deployments[0].autoscale.kv_usage: must be above 0 and at most 1"),
    ("  - profile: chat\n    replicas: {max: 2}\n    autoscale:\n      scale_up_after: soon\n",
     "conf.yaml:9: deployments[0].autoscale.scale_up_after: expected a duration: seconds as a number, or a string "
     "like '500ms', '5s', '2m', '1h30m'"),
    ("  - profile: chat\n    replicas: {max: 2}\n    autoscale:\n      priority: 5000\n",
     "conf.yaml:9: deployments[0].autoscale.priority: must be at most 1000"),
    ("  - profile: chat\n    replicas: {max: 2}\n  - profile: chat\n    replicas: 1\n",
     "conf.yaml:8: deployments[1].profile: profile 'chat' is also deployed by deployments[0] on line 6; an "
     "autoscaled profile has one deployment"),
    ("  - profile: chat\n    replicas: 1\n  - profile: chat\n    replicas: {max: 3}\n",
     "conf.yaml:8: deployments[1].profile: profile 'chat' is also deployed by deployments[0] on line 6; an "
     "autoscaled profile has one deployment"),
])
def test_errors_name_file_line_and_key(deployments, expected):
    assert errors(deployments) == [expected]


def test_a_top_level_interval_out_of_bounds():
    assert errors("  - {profile: chat, replicas: 1}\n", "autoscale: {interval: 10ms}\n") == [
        "conf.yaml:7: autoscale.interval: must be at least 0.05"]


def test_a_fixed_profile_may_still_have_several_deployments():
    config = load("  - {profile: chat, replicas: 1, pool: a}\n  - {profile: chat, replicas: 2, pool: b}\n")
    assert [d.replicas for d in config.deployments] == [1, 2]
