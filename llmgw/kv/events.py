"""Typed vLLM KV-cache events, as decoded from (and encoded to) the engine's ZMQ payloads.

Field names and order are vLLM's (``vllm/distributed/kv_events.py``); fields a
release did not have are None. Hashes stay exactly as they came off the wire
(unsigned int, signed int or raw digest bytes): normalise them with
:func:`llmgw.kv.keys.normalize_hash`. Semantics: ``docs/vllm-notes.md``
section 3.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

BlockHash = int | bytes

# kv_cache_spec_kind values whose blocks hold a plain causal prefix (the ones a prefix index can use).
MAIN_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


@dataclass(slots=True)
class BlockStored:
    """Full blocks newly added to a prefix cache, in chain order."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Blocks evicted from a cache (GPU removals carry one hash per event)."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The source's whole prefix cache was reset (all media, all groups)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    """One published payload: a scheduler step's events.

    ``data_parallel_rank`` is None for 0.9.0 payloads, which lacked it.
    ``skipped`` lists the tags of events of unknown types, in order, so the
    consumer can count them.
    """

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None
    skipped: list[str] = field(default_factory=list)


def is_device_medium(medium: str | None) -> bool:
    """True for the engine's own GPU cache: medium absent (pre-0.10.2) or ``"GPU"`` in any case."""
    return medium is None or medium.upper() == "GPU"


def is_main_attention(ev: KVEvent, main_groups: Container[int] | None = None) -> bool:
    """True when the event concerns a KV group whose blocks a prefix index can use.

    A store says its ``kv_cache_spec_kind`` (0.22+); without it, group 0 (or
    no group at all, pre-0.20) is the main one. A removal carries only its
    group: pass ``main_groups``, the groups seen as main-attention in stores,
    to judge it; otherwise group 0 / no group is assumed main.
    ``AllBlocksCleared`` concerns every group.
    """
    if isinstance(ev, AllBlocksCleared):
        return True
    if isinstance(ev, BlockStored) and ev.kv_cache_spec_kind is not None:
        return ev.kv_cache_spec_kind in MAIN_ATTENTION_KINDS
    if ev.group_idx is None:
        return True
    if main_groups is not None:
        return ev.group_idx in main_groups
    return ev.group_idx == 0


def is_placeholder(ev: KVEvent) -> bool:
    """True for an offload tier's placeholder store (no token ids): useless for token indexing."""
    return isinstance(ev, BlockStored) and not ev.token_ids
