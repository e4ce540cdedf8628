"""The engine plugins' command lines and environments (``vllm`` and ``sim``), without starting anything.

The ``vllm`` command lines below were also checked against vLLM 0.32's own
parser and engine configuration (``docs/engines.md`` says how).
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from pathlib import Path

import pytest

from llmgw import wire
from llmgw.agent.engine import Engine, EngineError, LaunchContext, kv_events_flags
from llmgw.agent.logs import redact_argv
from llmgw.engines.probe import VLLM_GAUGES
from llmgw.plugins.engine_sim import SimEngine
from llmgw.plugins.engine_vllm import VllmEngine
from llmgw.plugins_manager import default_registry


@pytest.fixture
def vllm_bin(tmp_path) -> str:
    """An executable file standing in for ``vllm`` (the plugin only checks that it exists)."""
    return make_executable(tmp_path / "bin" / "vllm")


def make_executable(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def shard(engine: str = "vllm", engine_bin: str | None = None, **fields) -> wire.StartShard:
    profile = {"name": "p", "engine": engine, "engine_bin": engine_bin, "model_path": "/models/llama",
               "served_model_name": "llama", **fields.pop("profile", {})}
    return wire.StartShard(shard_id="r1-0", replica_id="r1", profile=wire.ShardProfile(**profile), **fields)


CTX = LaunchContext(host="127.0.0.1", http_port=21000, node_address="10.0.0.5", state_dir=Path("/tmp/state"),
                    gpu_indices=(2, 3), python="/opt/py/bin/python")


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_both_plugins_are_registered_through_entry_points():
    registry = default_registry()
    assert {"vllm", "sim"} <= set(registry.names("engines"))
    for name in ("vllm", "sim"):
        engine = registry.get("engines", name)()
        assert isinstance(engine, Engine)
        assert engine.name == name
        assert engine.load_gauges() == VLLM_GAUGES  # the simulator exposes vLLM's gauges
    assert VLLM_GAUGES.inflight == ("vllm:num_requests_running", "vllm:num_requests_waiting")


def test_vllm_single_node_command_line(vllm_bin):
    launch = VllmEngine().command(shard(engine_bin=vllm_bin, profile={"tp": 2}), CTX)
    assert launch.argv == [vllm_bin, "serve", "/models/llama", "--host", "127.0.0.1", "--port", "21000",
                           "--served-model-name", "llama", "--tensor-parallel-size", "2",
                           "--pipeline-parallel-size", "1"]


def test_vllm_tensor_and_pipeline_parallel_sizes(vllm_bin):
    argv = VllmEngine().command(shard(engine_bin=vllm_bin, profile={"tp": 4, "pp": 2}), CTX).argv
    assert flag(argv, "--tensor-parallel-size") == "4"
    assert flag(argv, "--pipeline-parallel-size") == "2"
    assert "--nnodes" not in argv and "--headless" not in argv


def test_vllm_multi_node_leader_and_follower(vllm_bin):
    gang = {"node_count": 2, "leader_address": "10.0.0.1", "leader_port": 29500, "profile": {"tp": 8, "pp": 2}}
    leader = VllmEngine().command(shard(engine_bin=vllm_bin, rank=0, **gang), CTX).argv
    follower = VllmEngine().command(shard(engine_bin=vllm_bin, rank=1, **gang), CTX).argv
    for argv, rank in ((leader, "0"), (follower, "1")):
        assert flag(argv, "--nnodes") == "2"
        assert flag(argv, "--node-rank") == rank
        assert flag(argv, "--master-addr") == "10.0.0.1"
        assert flag(argv, "--master-port") == "29500"
    assert "--headless" not in leader
    assert "--headless" in follower


def test_vllm_readiness_probes_the_leader_only():
    gang = {"node_count": 2, "leader_address": "10.0.0.1", "leader_port": 29500}
    leader = VllmEngine().readiness(shard(rank=0, **gang))
    follower = VllmEngine().readiness(shard(rank=1, **gang))
    assert leader.serves_http and not follower.serves_http
    assert (leader.health_path, leader.models_path, leader.served_model_name) == ("/health", "/v1/models", "llama")


def test_vllm_lora_adapters(vllm_bin):
    adapters = [wire.LoraModule("sql", "/loras/sql"), wire.LoraModule("chat", "/loras/chat")]
    argv = VllmEngine().command(shard(engine_bin=vllm_bin, profile={"lora_adapters": adapters}), CTX).argv
    i = argv.index("--lora-modules")
    assert argv[i - 1] == "--enable-lora"
    assert argv[i + 1:i + 3] == ["sql=/loras/sql", "chat=/loras/chat"]


def test_sleep_mode_adds_vllms_flag_and_the_environment_its_routes_need(vllm_bin):
    for engine in (VllmEngine(), SimEngine()):
        spec = shard(engine.name, engine_bin=vllm_bin if engine.name == "vllm" else None,
                     profile={"sleep_mode": True})
        launch = engine.command(spec, CTX)
        assert launch.argv.count("--enable-sleep-mode") == 1 and launch.env["VLLM_SERVER_DEV_MODE"] == "1"
        plain = engine.command(shard(engine.name, engine_bin=spec.profile.engine_bin), CTX)
        assert "--enable-sleep-mode" not in plain.argv and "VLLM_SERVER_DEV_MODE" not in plain.env


def test_the_api_key_goes_in_the_environment_never_on_the_command_line(vllm_bin):
    """``/proc/PID/cmdline`` is world-readable; vLLM reads ``VLLM_API_KEY`` when there is no ``--api-key``."""
    for engine in (VllmEngine(), SimEngine()):
        spec = shard(engine.name, engine_bin=vllm_bin if engine.name == "vllm" else None, engine_api_key="k-123",
                     profile={"env": {"VLLM_API_KEY": "from-the-profile"}})
        launch = engine.command(spec, CTX)
        assert not any("k-123" in arg for arg in launch.argv) and "--api-key" not in launch.argv
        assert launch.env["VLLM_API_KEY"] == "k-123"  # the key the probes and the router send wins
        assert "k-123" not in repr(launch)
        assert engine.readiness(spec).api_key == "k-123"
        assert "VLLM_API_KEY" not in engine.command(shard(engine.name, engine_bin=spec.profile.engine_bin),
                                                    CTX).env
    assert redact_argv(["vllm", "--api-key", "k-123", "--api-key=k-123"]) == ["vllm", "--api-key", "***",
                                                                                "--api-key=***"]


def test_vllm_extra_args_come_last_as_given(vllm_bin):
    args = ["--max-model-len", "512", "--enforce-eager", "--port", "9999"]
    argv = VllmEngine().command(shard(engine_bin=vllm_bin, profile={"args": args}), CTX).argv
    assert argv[-len(args):] == args


def test_environment_pins_gpus_by_index_or_uuid(vllm_bin):
    env = VllmEngine().command(shard(engine_bin=vllm_bin, gpu_indices=[2, 3]), CTX).env
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    uuids = ["GPU-aaaa", "GPU-bbbb"]
    env = VllmEngine().command(shard(engine_bin=vllm_bin, gpu_indices=[2, 3], gpu_uuids=uuids), CTX).env
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa,GPU-bbbb"
    no_gpus = dataclasses.replace(CTX, gpu_indices=())
    assert VllmEngine().command(shard(engine_bin=vllm_bin), no_gpus).env["CUDA_VISIBLE_DEVICES"] == ""


def test_environment_thread_limits_only_when_cpu_threads_is_set(vllm_bin):
    env = VllmEngine().command(shard(engine_bin=vllm_bin), CTX).env
    assert "OMP_NUM_THREADS" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env
    env = VllmEngine().command(shard(engine_bin=vllm_bin, cpu_threads=6), CTX).env
    assert env["OMP_NUM_THREADS"] == "6"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_profile_env_is_passed_as_given_and_wins(vllm_bin):
    profile = {"env": {"HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "7"}}
    env = VllmEngine().command(shard(engine_bin=vllm_bin, gpu_indices=[2], profile=profile), CTX).env
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "7"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_engine_bin_resolution(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(EngineError) as missing:
        VllmEngine().command(shard(), CTX)
    assert str(missing.value) == "engine vllm: executable 'vllm' not found on PATH; set engine_bin in the profile"

    on_path = tmp_path / "path"
    found = make_executable(on_path / "vllm")
    monkeypatch.setenv("PATH", f"{empty}{os.pathsep}{on_path}")
    assert VllmEngine().command(shard(), CTX).argv[0] == found

    custom = make_executable(tmp_path / "opt" / "vllm-0.32")
    assert VllmEngine().command(shard(engine_bin=custom), CTX).argv[0] == custom
    make_executable(on_path / "vllm-nightly")
    assert VllmEngine().command(shard(engine_bin="vllm-nightly"), CTX).argv[0] == str(on_path / "vllm-nightly")

    with pytest.raises(EngineError, match="engine_bin '/nowhere/vllm' is not an executable file"):
        VllmEngine().command(shard(engine_bin="/nowhere/vllm"), CTX)
    not_executable = tmp_path / "plain-file"
    not_executable.write_text("")
    with pytest.raises(EngineError, match="is not an executable file"):
        VllmEngine().command(shard(engine_bin=str(not_executable)), CTX)
    with pytest.raises(EngineError, match="engine_bin 'vllm-missing' not found on PATH"):
        VllmEngine().command(shard(engine_bin="vllm-missing"), CTX)


def test_a_profile_without_a_model_cannot_be_started(vllm_bin):
    with pytest.raises(EngineError, match="has no model_path"):
        VllmEngine().command(shard(engine_bin=vllm_bin, profile={"model_path": ""}), CTX)


def test_served_name_defaults_to_the_model_path(vllm_bin):
    spec = shard(engine_bin=vllm_bin, profile={"served_model_name": ""})
    assert flag(VllmEngine().command(spec, CTX).argv, "--served-model-name") == "/models/llama"
    assert VllmEngine().readiness(spec).served_model_name == "/models/llama"


def test_sim_command_line_uses_the_same_flags():
    spec = shard("sim", profile={"model_path": "tiny", "served_model_name": "tiny", "args": ["--num-blocks", "256"]},
                 engine_api_key="k")
    launch = SimEngine().command(spec, CTX)
    assert launch.argv == ["/opt/py/bin/python", "-m", "llmgw", "sim", "--model", "tiny", "--host", "127.0.0.1",
                           "--port", "21000", "--served-model-name", "tiny", "--tensor-parallel-size", "1",
                           "--pipeline-parallel-size", "1", "--num-blocks", "256"]
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "2,3" and launch.env["VLLM_API_KEY"] == "k"
    assert SimEngine().readiness(spec).served_model_name == "tiny"


def test_sim_with_engine_bin_runs_that_llmgw(tmp_path):
    llmgw = make_executable(tmp_path / "llmgw")
    argv = SimEngine().command(shard("sim", engine_bin=llmgw), CTX).argv
    assert argv[:4] == [llmgw, "sim", "--model", "/models/llama"]


def test_sim_defaults_to_the_agents_interpreter():
    ctx = LaunchContext(host="127.0.0.1", http_port=1, node_address="127.0.0.1", state_dir=Path("/tmp"))
    assert SimEngine().command(shard("sim"), ctx).argv[:3] == [sys.executable, "-m", "llmgw"]


def test_kv_events_flag_only_with_the_agents_endpoints_and_the_hashing_fixed_only_for_engine_keys(vllm_bin):
    spec = shard(profile={"kv_events": True})
    assert kv_events_flags(spec, CTX) == []
    with_port = dataclasses.replace(CTX, kv_events_endpoint="ipc:///s/kv/a.ev", kv_replay_endpoint="ipc:///s/kv/a.rp")
    assert kv_events_flags(shard(), with_port) == []
    events_config = ["--kv-events-config", '{"enable_kv_cache_events":true,"publisher":"zmq",'
                     '"endpoint":"ipc:///s/kv/a.ev","topic":"kv","replay_endpoint":"ipc:///s/kv/a.rp"}']
    # Content keys (the default): the engine hashes as it likes, at its defaults.
    assert kv_events_flags(spec, with_port) == events_config
    engine_keys = {"kv_events": True, "kv_key_mode": "engine"}
    assert kv_events_flags(shard(profile=engine_keys), with_port) == [
        *events_config, "--prefix-caching-hash-algo", "sha256_cbor"]
    assert "PYTHONHASHSEED" not in SimEngine().command(shard("sim", profile=engine_keys), CTX).env
    for engine, name in ((SimEngine(), "sim"), (VllmEngine(), "vllm")):
        bin_ = vllm_bin if name == "vllm" else None
        launch = engine.command(shard(name, engine_bin=bin_, profile=engine_keys), with_port)
        assert launch.env["PYTHONHASHSEED"] == "0"
        assert launch.argv[launch.argv.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
        stock = engine.command(shard(name, engine_bin=bin_, profile={"kv_events": True}), with_port)
        assert "PYTHONHASHSEED" not in stock.env and "--prefix-caching-hash-algo" not in stock.argv
        assert "--kv-events-config" in stock.argv
