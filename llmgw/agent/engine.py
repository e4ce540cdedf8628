"""The engine interface an agent runs shards through, and the command-line helpers engine plugins share.

An engine plugin (hook ``register_engines``) turns a :class:`~llmgw.wire.StartShard`
into a :class:`Launch` (argv and the environment variables it adds), says how
to tell that the shard is ready (:class:`Readiness`) and which of its
``/metrics`` gauges count running and waiting requests
(:class:`~llmgw.engines.probe.EngineGauges`: the supervisor waits for them to
reach 0 when draining, the router's load-aware tiers read them). It never
spawns or watches processes itself: the shard supervisor does that, the same
way for every engine.

``vllm`` and ``sim`` both speak vLLM's flags, so :func:`openai_server_flags`
builds the part of the command line they have in common.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

from .. import wire
from ..engines.probe import EngineGauges


class EngineError(Exception):
    """A shard's command line cannot be built (missing executable, impossible spec). Restarting will not help."""


@dataclass(frozen=True)
class LaunchContext:
    """What the agent decided for one launch of a shard, beyond the StartShard itself."""

    host: str  # the address the engine binds its HTTP server to
    http_port: int  # 0 when the engine serves no HTTP (a headless follower rank)
    node_address: str  # how other machines dial this node (the endpoint's host)
    state_dir: Path
    gpu_indices: Sequence[int] = ()
    kv_events_endpoint: str | None = None  # the ipc:// endpoint the engine binds its KV-event PUB to
    kv_replay_endpoint: str | None = None  # the one it binds its replay socket to
    python: str = sys.executable  # the interpreter for Python-module engines (sim)


@dataclass(frozen=True)
class Launch:
    """A command line and the environment variables it sets on top of the agent's own environment.

    Secrets go in ``env`` (never logged, readable only by the engine's user in ``/proc/PID/environ``), never
    in ``argv`` (``/proc/PID/cmdline`` and ``ps`` show it to every local user)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Readiness:
    """How the supervisor probes a shard: Ready = ``health_path`` answers 200 and ``models_path`` lists the name."""

    served_model_name: str
    health_path: str = "/health"
    models_path: str = "/v1/models"
    metrics_path: str = "/metrics"
    serves_http: bool = True  # False for ranks that run headless: alive is all that can be checked
    api_key: str = field(default="", repr=False)  # sent as a bearer token on models_path (vLLM guards /v1/*)


@runtime_checkable
class Engine(Protocol):
    """What an engine plugin's factory builds."""

    name: str

    def command(self, spec: wire.StartShard, ctx: LaunchContext) -> Launch:
        """The command line and environment of one launch; raises :class:`EngineError` when impossible."""

    def readiness(self, spec: wire.StartShard) -> Readiness:
        """How to probe this shard."""

    def load_gauges(self) -> EngineGauges:
        """The engine's ``/metrics`` gauges of running and waiting requests and of its cache configuration
        (:data:`~llmgw.engines.probe.VLLM_GAUGES` for vLLM's; :data:`~llmgw.engines.probe.NO_GAUGES` when it has
        none: a drain then waits for nothing)."""


# -- helpers for engine plugins ---------------------------------------------------------------------------------------


def resolve_executable(engine: str, spec: wire.StartShard, default: str) -> str:
    """The profile's ``engine_bin`` (a path, or a name looked up on PATH), else ``default`` found on PATH."""
    wanted = spec.profile.engine_bin or default
    if os.sep in wanted:
        if os.path.isfile(wanted) and os.access(wanted, os.X_OK):
            return wanted
        raise EngineError(f"engine {engine}: engine_bin {wanted!r} is not an executable file")
    found = shutil.which(wanted)
    if found is None:
        if spec.profile.engine_bin:
            raise EngineError(f"engine {engine}: engine_bin {wanted!r} not found on PATH")
        raise EngineError(f"engine {engine}: executable {wanted!r} not found on PATH; set engine_bin in the profile")
    return found


def served_name(spec: wire.StartShard) -> str:
    """The model name clients ask for (vLLM defaults it to the model path)."""
    return spec.profile.served_model_name or spec.profile.model_path


def is_follower(spec: wire.StartShard) -> bool:
    """A rank other than 0 of a replica spread over several nodes."""
    return spec.node_count > 1 and spec.rank > 0


def openai_server_flags(spec: wire.StartShard, ctx: LaunchContext) -> list[str]:
    """vLLM's flags for address, names, parallelism, LoRA adapters, the scheduling policy and the per-step prefill
    cap (shared by ``vllm`` and ``sim``); the API key is not one of them: it goes in the environment
    (:func:`api_key_env`)."""
    profile = spec.profile
    if not profile.model_path:
        raise EngineError(f"engine {profile.engine or '?'}: profile {profile.name!r} has no model_path")
    flags = ["--host", ctx.host, "--port", str(ctx.http_port), "--served-model-name", served_name(spec),
             "--tensor-parallel-size", str(profile.tp), "--pipeline-parallel-size", str(profile.pp)]
    if profile.lora_adapters:
        flags += ["--enable-lora", "--lora-modules", *(f"{lora.name}={lora.path}" for lora in profile.lora_adapters)]
    if profile.scheduling_policy == "priority":  # else vLLM's default, fcfs: other command lines stay as they were
        flags += ["--scheduling-policy", "priority"]
    if profile.long_prefill_token_threshold:  # 0: vLLM's default, no cap per request and step
        flags += ["--long-prefill-token-threshold", str(profile.long_prefill_token_threshold)]
    if profile.sleep_mode:
        flags.append("--enable-sleep-mode")
    return flags


SLEEP_ENDPOINTS_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM serves /sleep, /wake_up and /is_sleeping only with it set


def sleep_mode_env(spec: wire.StartShard) -> dict[str, str]:
    """``VLLM_SERVER_DEV_MODE=1`` for a profile with ``sleep_mode``: the agent's sleep and wake-up calls need
    vLLM's development endpoints (nothing otherwise)."""
    return {SLEEP_ENDPOINTS_ENV: "1"} if spec.profile.sleep_mode else {}


API_KEY_ENV = "VLLM_API_KEY"  # vLLM's API server (and the simulator) read it when there is no --api-key


def api_key_env(spec: wire.StartShard) -> dict[str, str]:
    """The engine API key as ``VLLM_API_KEY`` (nothing when the profile sets none)."""
    return {API_KEY_ENV: spec.engine_api_key} if spec.engine_api_key else {}


KV_HASH_ALGO = "sha256_cbor"  # the engine's --prefix-caching-hash-algo when the router keys by engine hashes
KV_HASH_SEED = "0"  # its PYTHONHASHSEED: with both, the router's `vllm` block keys equal the engine's hashes


def wants_kv_events(spec: wire.StartShard, ctx: LaunchContext) -> bool:
    """The profile asks for KV events and the agent gave this launch its endpoints."""
    return bool(spec.profile.kv_events) and ctx.kv_events_endpoint is not None


def engine_hash_keys(spec: wire.StartShard, ctx: LaunchContext) -> bool:
    """KV events followed with the engine's own hashes as keys (the model's ``key_function: vllm``): the engine
    must then hash as the router does. With content keys (the default) its hashing is left at its defaults."""
    return wants_kv_events(spec, ctx) and spec.profile.kv_key_mode == "engine"


def kv_events_flags(spec: wire.StartShard, ctx: LaunchContext) -> list[str]:
    """``--kv-events-config`` when the profile wants KV events and the agent gave their endpoints (else
    nothing), and ``--prefix-caching-hash-algo sha256_cbor`` when the router keys by the engine's hashes.

    The endpoints are ``ipc://`` paths in the agent's private socket
    directory (:mod:`llmgw.agent.kv_sockets`): the engine binds both its PUB
    (vLLM binds an ``ipc://`` endpoint) and its replay socket there, and the
    agent connects. The hash algorithm (with ``PYTHONHASHSEED``,
    :func:`kv_events_env`) makes the engine's block hashes the router's
    ``vllm`` keys; content keys need neither.
    """
    if not wants_kv_events(spec, ctx):
        return []
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ctx.kv_events_endpoint, "topic": "kv"}
    if ctx.kv_replay_endpoint is not None:
        config["replay_endpoint"] = ctx.kv_replay_endpoint
    flags = ["--kv-events-config", json.dumps(config, separators=(",", ":"))]
    return flags + ["--prefix-caching-hash-algo", KV_HASH_ALGO] if engine_hash_keys(spec, ctx) else flags


def kv_events_env(spec: wire.StartShard, ctx: LaunchContext) -> dict[str, str]:
    """``PYTHONHASHSEED`` fixed when the router keys by the engine's hashes (vLLM seeds its block-hash chain with
    it)."""
    return {"PYTHONHASHSEED": KV_HASH_SEED} if engine_hash_keys(spec, ctx) else {}


def gpu_env(spec: wire.StartShard, ctx: LaunchContext) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` pinning the shard to its GPUs: by UUID when the placement named them, else by index.

    A shard given no GPUs sees none (an empty value), rather than every GPU of the machine.
    """
    uuids = [u for u in spec.gpu_uuids if u]
    if uuids and len(uuids) == len(spec.gpu_uuids):
        devices = uuids
    else:
        devices = [str(i) for i in ctx.gpu_indices]
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices)}


def cpu_threads_env(spec: wire.StartShard) -> dict[str, str]:
    """Thread limits when the StartShard sets ``cpu_threads`` (nothing otherwise: the engine's defaults stand)."""
    if spec.cpu_threads <= 0:
        return {}
    # vLLM's CPU backend binds its OpenMP threads to cores itself ("auto") and would ignore the
    # thread count; "nobind" leaves the count to OMP_NUM_THREADS.
    return {"OMP_NUM_THREADS": str(spec.cpu_threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def engine_env(spec: wire.StartShard, ctx: LaunchContext) -> dict[str, str]:
    """The environment every engine gets: unbuffered Python output, GPU pinning, thread limits, then the profile's
    own ``env`` (it may override any of those), with ``PYTHONHASHSEED`` fixed when the router keys by the
    engine's hashes; and last the engine API key (the one the probes and the router send)."""
    return {"PYTHONUNBUFFERED": "1", **gpu_env(spec, ctx), **cpu_threads_env(spec), **kv_events_env(spec, ctx),
            **sleep_mode_env(spec), **spec.profile.env, **api_key_env(spec)}
