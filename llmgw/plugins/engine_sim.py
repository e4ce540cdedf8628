"""The ``sim`` engine: ``llmgw sim`` (the vLLM-like simulator) started with the same vLLM flags as ``vllm``.

It runs ``PYTHON -m llmgw sim`` with the agent's interpreter, or ``ENGINE_BIN
sim`` when the profile sets ``engine_bin`` (an ``llmgw`` executable). Every rank
of a multi-node replica runs a whole simulator: the simulator has no headless
mode, and only rank 0's endpoint is routed to anyway. Like vLLM, it reads the
engine API key from ``VLLM_API_KEY`` and binds its ``ipc://`` KV-event sockets.
"""

from __future__ import annotations

from ..agent.engine import engine_env, kv_events_flags, openai_server_flags, resolve_executable, served_name
from ..plugin import VLLM_GAUGES, EngineGauges, Launch, LaunchContext, Readiness, StartShard, hookimpl


class SimEngine:
    name = "sim"

    def command(self, spec: StartShard, ctx: LaunchContext) -> Launch:
        if spec.profile.engine_bin:
            program = [resolve_executable(self.name, spec, "llmgw")]
        else:
            program = [ctx.python, "-m", "llmgw"]
        argv = [*program, "sim", "--model", spec.profile.model_path, *openai_server_flags(spec, ctx),
                *kv_events_flags(spec, ctx), *spec.profile.args]
        return Launch(argv, engine_env(spec, ctx))

    def readiness(self, spec: StartShard) -> Readiness:
        return Readiness(served_model_name=served_name(spec), api_key=spec.engine_api_key)

    def load_gauges(self) -> EngineGauges:
        return VLLM_GAUGES


@hookimpl
def register_engines():
    return {"sim": SimEngine}
