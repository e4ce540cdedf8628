"""A profile's ``long_prefill_token_threshold``: its config errors, the engine's command line (vLLM's and the
simulator's, which accepts what the plugin builds), the wire to the agent and the fingerprint."""

from __future__ import annotations

import pytest

from llmgw.config import ConfigError, parse_config
from llmgw.control.fingerprint import profile_fingerprint
from llmgw.control.reconciler import shard_profile
from llmgw.plugins.engine_sim import SimEngine
from llmgw.plugins.engine_vllm import VllmEngine
from llmgw.sim.cli import _strip_ignored, build_parser, config_from_args
from llmgw.testing.engine_argv import fake_vllm_on_path, launch_argv

CONFIG = """\
agents: {token: t}
profiles:
  - {name: p, engine: sim, model_path: tiny, served_model_name: tiny-p, long_prefill_token_threshold: 256}
  - {name: q, engine: sim, model_path: tiny, served_model_name: tiny-q}
deployments:
  - {profile: p, replicas: 1}
  - {profile: q, replicas: 1}
"""


def test_the_key_is_read_and_a_bad_value_names_its_file_line_and_key():
    config = parse_config(CONFIG, "conf.yaml", env={})
    assert config.profile("p").long_prefill_token_threshold == 256
    assert config.profile("q").long_prefill_token_threshold is None
    for bad in ("0", "-3", "1.5", "many", "200000000"):
        text = CONFIG.replace("long_prefill_token_threshold: 256", f"long_prefill_token_threshold: {bad}")
        with pytest.raises(ConfigError) as caught:
            parse_config(text, "conf.yaml", env={})
        assert "long_prefill_token_threshold" in str(caught.value) and "conf.yaml:3" in str(caught.value), bad


@pytest.mark.parametrize("engine", [SimEngine(), VllmEngine()], ids=["sim", "vllm"])
def test_the_engine_plugins_pass_it_and_nothing_without_it(engine, monkeypatch, tmp_path):
    fake_vllm_on_path(monkeypatch, tmp_path)
    argv = launch_argv(engine, long_prefill_token_threshold=256)
    at = argv.index("--long-prefill-token-threshold")
    assert argv[at + 1] == "256" and at < argv.index("--seed")  # the profile's own args come last
    assert "--long-prefill-token-threshold" not in launch_argv(engine, long_prefill_token_threshold=0)


def test_the_simulator_runs_with_the_command_line_the_plugin_builds():
    argv = launch_argv(SimEngine(), long_prefill_token_threshold=256)
    kept, _ignored = _strip_ignored(argv[argv.index("sim") + 1:])  # as its main() does
    config = config_from_args(build_parser().parse_args(kept)).resolve()
    assert config.long_prefill_token_threshold == 256


def test_the_control_plane_sends_it_and_only_a_set_threshold_changes_the_fingerprint():
    config = parse_config(CONFIG, "conf.yaml", env={})
    assert shard_profile(config.profile("p")).long_prefill_token_threshold == 256
    assert shard_profile(config.profile("q")).long_prefill_token_threshold == 0
    plain = parse_config(CONFIG.replace(", long_prefill_token_threshold: 256}", "}"), "conf.yaml", env={})
    assert profile_fingerprint(plain.profile("q")) == profile_fingerprint(config.profile("q"))
    assert profile_fingerprint(plain.profile("p")) != profile_fingerprint(config.profile("p"))
    other = parse_config(CONFIG.replace("threshold: 256", "threshold: 512"), "conf.yaml", env={})
    assert profile_fingerprint(other.profile("p")) != profile_fingerprint(config.profile("p"))
