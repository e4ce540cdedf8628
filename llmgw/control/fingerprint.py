"""The profile fingerprint: a short stable hash of everything that shapes an engine process.

A running shard is adopted only when the fingerprint it was started with
equals the fingerprint of its profile now; any change to how the engine is
started (binary, model, parallelism, arguments, environment, adapters, KV
events, CPU threads, API key, and the KV key mode: engine hashes, ``key_function:
vllm``, start the engine with the router's hash algorithm and seed; the scheduling policy) gives a new
fingerprint, and the shard is replaced. Settings that do not touch the process
(the rest of routing, labels, GPU class, startup timeout) do not count. The API
key enters only as a hash; the key mode only when it is ``engine`` and the
scheduling policy only when it is not ``fcfs`` (profiles with the defaults
keep the fingerprints they had before these counted).
"""

from __future__ import annotations

import hashlib
import json

from llmgw.config.schema import Profile
from llmgw.kv.keys import DEFAULT_KEY_FUNCTION
from llmgw.kv.mirror import key_mode_of

FINGERPRINT_VERSION = 1  # bump when the canonical form changes
FINGERPRINT_LENGTH = 16  # hex digits


def canonical_profile(profile: Profile) -> dict:
    """The fields of ``profile`` that change the engine process, as plain JSON values."""
    engine_keys: dict[str, str | bool | int] = \
        {"kv_key_mode": "engine"} if profile_kv_key_mode(profile) == "engine" else {}
    if profile.sleep_mode:  # only when on: the fingerprints of every profile without it stay as they were
        engine_keys["sleep_mode"] = True
    if profile.scheduling_policy != "fcfs":
        engine_keys["scheduling_policy"] = profile.scheduling_policy
    if profile.long_prefill_token_threshold:
        engine_keys["long_prefill_token_threshold"] = profile.long_prefill_token_threshold
    return {**engine_keys,
        "v": FINGERPRINT_VERSION,
        "engine": profile.engine,
        "engine_bin": profile.engine_bin,
        "model_path": profile.model_path,
        "served_model_name": profile.served_model_name,
        "tp": profile.tp,
        "pp": profile.pp,
        "nodes": profile.nodes,
        "gpus_per_node": profile.gpus_per_node or profile.gpus // profile.nodes,
        "args": list(profile.args),
        "env": dict(profile.env),
        "lora_adapters": [[adapter.name, adapter.path] for adapter in profile.lora_adapters],
        "kv_events": profile.kv_events,
        "cpu_threads": profile.cpu_threads,
        "api_key": hashlib.sha256(profile.api_key.encode()).hexdigest() if profile.api_key is not None else None,
    }


def profile_kv_key_mode(profile: Profile) -> str:
    """How the router keys this profile's KV blocks (:func:`llmgw.kv.mirror.key_mode_of` of its ``key_function``)."""
    return key_mode_of(profile.routing_options.get("key_function", DEFAULT_KEY_FUNCTION))


def profile_fingerprint(profile: Profile) -> str:
    """A short hex digest of :func:`canonical_profile` (environment keys in any order give the same one)."""
    text = json.dumps(canonical_profile(profile), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_LENGTH]
