"""KV events of static external replicas (``models[].replicas[].kv_events``): the gateway subscribes itself.

An engine llmgw did not start binds its PUB (``tcp://*:5557``) and replay
sockets; the gateway *connects* to them, one :class:`ExternalKv` task per
replica in the gateway's root nursery (cancelled when the replica leaves the
config or its endpoints change). The pipeline is the agent's, minus the
stream: :class:`~llmgw.kv.subscriber.EngineSubscription` ->
:class:`~llmgw.kv.mirror.EngineMirror` -> :func:`~llmgw.kv.mirror.flush_loop`
straight into the router's :class:`~llmgw.kv.index.KvIndex` (a FULL copy
first). With ``content`` keys (the default) the mirror re-keys blocks from the
events' token ids, whatever the engine's hash algorithm and seed; with
``key_function: vllm`` it forwards the engine's hashes and checks their parity
with the model's ``hash_algo``/``hash_seed`` routing options. Keys that cannot
match (parity failed, or no token ids to key by content) turn the replica's
index state ``unusable_keys``, with the fix (:mod:`llmgw.kv.mirror`).

When the router finds the index drifting from what the engine reports
(:mod:`llmgw.kv.drift`), its resync request reaches the mirror directly (a
resync listener on the index): a FULL copy at the next flush, or a reset.

Without ``kv_replay`` lost batches cannot be recovered (RESET ``gap``), and an
engine restart is seen only when its sequence goes back; see
``docs/kv-routing.md``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping, Protocol

import trio
from prometheus_client import CollectorRegistry

from .changes import ChangesFields
from .keys import DEFAULT_KEY_FUNCTION, VllmBlockKeys
from .metrics import KvMetrics
from .mirror import EngineMirror, flush_loop, key_mode_of, resync
from .subscriber import DEFAULT_MAX_MESSAGE_BYTES, EngineSubscription, message_size_setting

log = logging.getLogger(__name__)


class KvSink(Protocol):
    """Where the changes go: the router's :class:`~llmgw.kv.index.KvIndex` (or what stands for it)."""

    def apply(self, replica_id: str, changes: ChangesFields) -> None: ...

    def forget(self, replica_id: str) -> None: ...

    def add_resync_listener(self, listener: Callable[[str, str, str], None]) -> None: ...

    def remove_resync_listener(self, listener: Callable[[str, str, str], None]) -> None: ...


class Plugins(Protocol):
    """Where the event decoder comes from: the plugin registry (``llmgw.plugins_manager.Registry``)."""

    def get(self, kind: str, name: str) -> Callable[..., Any]: ...

NODE_LABEL = "gateway"  # the `node` label of these replicas' event counters


@dataclass(frozen=True)
class ExternalKv:
    """What one external replica's subscription needs; equal settings mean the running task is kept."""

    replica: str
    events: str
    replay: str | None
    model: str = ""
    key_function: str = DEFAULT_KEY_FUNCTION
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = "0"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    @classmethod
    def of(cls, replica: str, spec: Any, routing_options: Mapping[str, Any] | None,
           model: str = "") -> "ExternalKv | None":
        if not getattr(spec, "kv_events", None):
            return None
        options = routing_options or {}
        seed = options.get("hash_seed", "0")
        return cls(replica, spec.kv_events, getattr(spec, "kv_replay", None) or None, model,
                   str(options.get("key_function", DEFAULT_KEY_FUNCTION)), str(options.get("hash_algo", "sha256_cbor")),
                   None if seed is None else str(seed),
                   message_size_setting(options.get("max_event_message_bytes", DEFAULT_MAX_MESSAGE_BYTES)))

    async def run(self, index: KvSink, registry: Plugins, metrics_registry: CollectorRegistry | None, *,
                  interval: float = 0.025) -> None:
        """Follow the engine into ``index`` until cancelled (the sockets are closed then)."""
        source = KvMetrics.for_registry(metrics_registry).source(NODE_LABEL, self.replica, self.model) \
            if metrics_registry is not None else None
        if key_mode_of(self.key_function) == "content":
            mirror = EngineMirror(key_mode="content", on_ignored=source.ignored if source else None,
                                  name=self.replica)
        else:
            try:
                verify = VllmBlockKeys(self.hash_algo, self.hash_seed)
            except ValueError as exc:
                log.warning("replica %s: hash parity not checked (%s)", self.replica, exc)
                verify = None
            mirror = EngineMirror(key_mode="engine", verify_keys=verify, on_ignored=source.ignored if source else None,
                                  on_parity=source.parity if source else None, name=self.replica)
        sub = EngineSubscription(self.events, mode="connect", replay_endpoint=self.replay, topic=b"",
                                 decode=registry.get("event_decoders", "vllm")(), on_batch=mirror.apply,
                                 on_reset=mirror.reset, metrics=source, source=f"{self.replica}/dp0",
                                 max_message_bytes=self.max_message_bytes)
        def on_resync(replica: str, mode: str, reason: str) -> None:
            if replica == self.replica:
                log.info("replica %s: the router asks for a %s KV resync (%s)", replica, mode, reason)
                resync(mode, mirror, sub)

        index.add_resync_listener(on_resync)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(sub.run)
                log.info("replica %s: following its KV events at %s", self.replica, self.events)
                await nursery.start(partial(flush_loop, mirror, partial(index.apply, self.replica), interval=interval))
        finally:
            index.remove_resync_listener(on_resync)
            index.forget(self.replica)  # no stream any more: the tree routes it until a new one sends a FULL
