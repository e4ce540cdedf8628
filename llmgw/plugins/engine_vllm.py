"""The ``vllm`` engine: ``vllm serve MODEL`` with the shard's address, parallelism, ranks and adapters.

The engine API key is not on the command line (every local user can read
``/proc/PID/cmdline``): it is ``VLLM_API_KEY`` in the engine's environment,
which vLLM's API server reads when there is no ``--api-key``. KV events go to
``ipc://`` sockets in the agent's private directory, which vLLM binds.

Single-node replicas get ``--tensor-parallel-size``/``--pipeline-parallel-size``;
a replica spread over ``node_count`` nodes adds vLLM's multiprocessing
multi-node flags ``--nnodes N --node-rank R --master-addr LEADER --master-port
PORT`` on every rank, and ``--headless`` on ranks above 0 (they serve no HTTP;
only rank 0 is probed for readiness and routed to). The profile's ``args`` come
last, as given, so they can override anything before them.
"""

from __future__ import annotations

from ..agent.engine import (
    engine_env,
    is_follower,
    kv_events_flags,
    openai_server_flags,
    resolve_executable,
    served_name,
)
from ..plugin import VLLM_GAUGES, EngineGauges, Launch, LaunchContext, Readiness, StartShard, hookimpl


def multi_node_flags(spec: StartShard) -> list[str]:
    """vLLM's flags joining one rank to a replica spread over several nodes (nothing for one node)."""
    if spec.node_count <= 1:
        return []
    flags = ["--nnodes", str(spec.node_count), "--node-rank", str(spec.rank),
             "--master-addr", spec.leader_address, "--master-port", str(spec.leader_port)]
    if is_follower(spec):
        flags.append("--headless")
    return flags


class VllmEngine:
    name = "vllm"

    def command(self, spec: StartShard, ctx: LaunchContext) -> Launch:
        executable = resolve_executable(self.name, spec, "vllm")
        argv = [executable, "serve", spec.profile.model_path, *openai_server_flags(spec, ctx),
                *multi_node_flags(spec), *kv_events_flags(spec, ctx), *spec.profile.args]
        return Launch(argv, engine_env(spec, ctx))

    def readiness(self, spec: StartShard) -> Readiness:
        return Readiness(served_model_name=served_name(spec), serves_http=not is_follower(spec),
                         api_key=spec.engine_api_key)

    def load_gauges(self) -> EngineGauges:
        return VLLM_GAUGES


@hookimpl
def register_engines():
    return {"vllm": VllmEngine}
