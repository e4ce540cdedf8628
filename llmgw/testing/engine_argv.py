"""An engine plugin's command line for a profile, as an agent would launch it, without starting anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import wire
from ..plugin import LaunchContext

CTX = LaunchContext(host="127.0.0.1", http_port=21000, node_address="10.0.0.5", state_dir=Path("/tmp/state"))


def launch_argv(engine: Any, **profile: Any) -> list[str]:
    """``engine``'s argv for a profile of ``/models/llama`` with ``args: [--seed, 1]`` and ``profile``'s fields."""
    shard_profile = wire.ShardProfile(name="p", engine=engine.name, model_path="/models/llama",
                                      served_model_name="llama", args=["--seed", "1"], **profile)
    return engine.command(wire.StartShard(shard_id="r1-0", replica_id="r1", profile=shard_profile), CTX).argv


def fake_vllm_on_path(monkeypatch: Any, folder: Path) -> None:
    """An executable ``vllm`` in ``folder``, first on ``PATH`` (the vLLM plugin looks it up)."""
    vllm = folder / "vllm"
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:/usr/bin:/bin")
