"""The profile fingerprint: a short stable hash of everything that shapes an engine process.

A running shard is adopted only when the fingerprint it was started with
equals the fingerprint of its profile now; any change to how the engine is
started (binary, model, parallelism, arguments, environment, adapters, KV
events, CPU threads, API key) gives a new fingerprint, and the shard is
replaced. Settings that do not touch the process (routing, labels, GPU class,
startup timeout) do not count. The API key enters only as a hash.
"""

from __future__ import annotations

import hashlib
import json

from llmgw.config.schema import Profile

FINGERPRINT_VERSION = 1  # bump when the canonical form changes
FINGERPRINT_LENGTH = 16  # hex digits


def canonical_profile(profile: Profile) -> dict:
    """The fields of ``profile`` that change the engine process, as plain JSON values."""
    return {
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


def profile_fingerprint(profile: Profile) -> str:
    """A short hex digest of :func:`canonical_profile` (environment keys in any order give the same one)."""
    text = json.dumps(canonical_profile(profile), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_LENGTH]
