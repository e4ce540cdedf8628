"""The agent's mirror of one engine's (one data-parallel rank's) GPU prefix cache, and its net changes.

:class:`EngineMirror` applies decoded KV events and keeps the set of block
keys the engine holds, **reference counted**: vLLM does not de-duplicate
identical blocks, so two requests computing the same prefix at once store the
same hash twice and remove it twice; a key leaves the set only when its count
reaches zero. Only blocks a prefix index can use enter the set: device medium
(``GPU`` or absent), main-attention groups, stores with token ids
(placeholders of offload tiers have none). The others are counted by reason
in :attr:`EngineMirror.ignored`, as are removals of blocks the mirror never
saw.

What it emits (:class:`~llmgw.kv.changes.BlockChanges`; the agent sends them up its stream as
:class:`llmgw.wire.KvChanges`, a static replica's subscription applies them to the router's index):

- **net changes** (:meth:`take_delta`, :meth:`flush`): what changed since the
  last flush, so a block stored and removed again within one flush window
  (the agent flushes every 20-50 ms) is no change at all;
- a **full copy** (:meth:`full_messages`) whenever the stream (re)connects,
  and at the next flush after :meth:`request_full` (the router found the
  index drifting: :func:`resync`);
- a **reset** (:meth:`reset`) when the subscription says the engine's cache
  is empty or unknown (restart, ``AllBlocksCleared``, a gap replay could not
  fill); the reset goes out before the changes that followed it.

Keys. ``key_mode="content"`` (the default) re-keys every stored block with
:class:`~llmgw.kv.keys.ContentChainKeys` from the event's ``token_ids``
(chained from the parent block's key, extra keys included in their event
form), keeping an engine-hash -> key map to apply removals: independent of
the engine's hash algorithm and seed (a stock vLLM works at its defaults),
and cheaper to compute on the router, at the cost of the map (about 90 more
bytes per mirrored block: ``docs/benchmarks/kv.md``). A store whose parent the
mirror never saw cannot be re-keyed in that mode and is counted as
``unknown_parent``. ``key_mode="engine"`` forwards the engine's own block
hashes, normalised to unsigned 64-bit ints, for the router's ``vllm`` key
function to recompute from token ids: only right when the engine's
``--prefix-caching-hash-algo``, ``PYTHONHASHSEED`` and block size are the
ones the router is told (the agent starts vLLM with ``sha256_cbor`` and
``PYTHONHASHSEED=0``).

Unusable keys, never silent (:attr:`EngineMirror.problem`, set once, kept until the mirror ends):

- hash parity: with ``verify_keys`` (the router's key function, e.g.
  ``VllmBlockKeys("sha256_cbor", "0")``) an engine-mode mirror recomputes the
  first ``verify_samples`` stores that start a chain (parent nil, no extra
  keys) and compares them with the engine's hashes (counted:
  ``llmgw_kv_hash_parity_checks_total``); a mismatch (another algorithm, seed
  or block size: the router would never match) is a problem;
- a content-mode mirror given device stores without ``token_ids`` cannot
  compute a key (counted as ignored ``no_token_ids``): a problem.

A problem is logged once with its fix and makes every FULL copy (one is sent
at once, and one replaces each RESET) carry it
(:func:`~llmgw.kv.changes.unusable_keys_reason`), so the router's index
state of the replica reads ``unusable_keys``, with the fix, in ``/admin/kv``,
``llmgw status`` and ``llmgw_kv_index_state``.
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import trio

from .changes import BlockChanges, KvChangeKind, unusable_keys_reason
from .drift import RESYNC_RESET
from .events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    is_device_medium,
    is_main_attention,
)
from .keys import BlockKeyFunction, ContentChainKeys, normalize_hash

if TYPE_CHECKING:
    from .subscriber import EngineSubscription

log = logging.getLogger(__name__)

KEY_MODES = ("content", "engine")
DEFAULT_KEY_MODE = "content"
MAX_KEYS_PER_MESSAGE = 65536  # one KvChanges carries at most this many keys (about 600 KB of msgpack)


def key_mode_of(key_function: str) -> str:
    """The mirror's key mode for the router's block-key function: ``content`` for ``content`` keys, else
    ``engine`` (the router recomputes the engine's own hashes)."""
    return "content" if key_function == "content" else "engine"


def _tupled(value: object) -> object:
    """msgpack gives lists; the hash input needs tuples (as :func:`llmgw.kv.keys.request_extra_keys` builds)."""
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value


class EngineMirror:
    """Reference-counted device blocks of one engine rank, with net-change tracking. Not thread-safe."""

    def __init__(self, *, key_mode: str = DEFAULT_KEY_MODE, content_keys: ContentChainKeys | None = None,
                 on_ignored: Callable[[str, int], None] | None = None, verify_keys: BlockKeyFunction | None = None,
                 verify_samples: int = 8, on_parity: Callable[[bool], None] | None = None, name: str = "") -> None:
        if key_mode not in KEY_MODES:
            raise ValueError(f"key_mode must be one of {', '.join(KEY_MODES)}, not {key_mode!r}")
        self.key_mode = key_mode
        self._content = (content_keys or ContentChainKeys()) if key_mode == "content" else None
        self._counts: dict[int, int] = {}  # key -> physical blocks holding it
        self._before: dict[int, bool] = {}  # key -> whether it was present at the last flush (touched keys only)
        self._engine_to_key: dict[int, int] = {}  # content mode: engine hash -> content key
        self._pending_reset: str | None = None
        self._full_requested: str | None = None
        self._main_groups: set[int] = set()  # groups seen as main attention in stores (kv_cache_spec_kind given)
        self._on_ignored = on_ignored  # callable(reason, count), e.g. SourceMetrics.ignored
        self.block_size: int | None = None
        self.ignored: Counter[str] = Counter()
        self.stored_blocks = 0  # device blocks stored / removed, as applied (before netting)
        self.removed_blocks = 0
        self.resets: Counter[str] = Counter()
        # hash parity: the router's key function recomputed on a few stores, compared with the engine's hashes
        self._verify = verify_keys if key_mode == "engine" else None
        self._verify_left = verify_samples
        self._on_parity = on_parity  # callable(ok: bool), e.g. SourceMetrics.parity
        self.name = name
        self.parity_checked = 0
        self.parity_failed = 0
        self.problem: str | None = None  # why this mirror's keys can never match the router's, and the fix

    # -- reading --------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._counts)

    def __contains__(self, key: int) -> bool:
        return key in self._counts

    def refcount(self, key: int) -> int:
        return self._counts.get(key, 0)

    def keys(self) -> list[int]:
        return list(self._counts)

    @property
    def pending(self) -> bool:
        """Something would go out at the next :meth:`flush`."""
        return self._pending_reset is not None or self._full_requested is not None or bool(self._before)

    # -- applying events ------------------------------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> None:
        for event in batch.events:
            self.apply_event(event)

    def apply_events(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply_event(event)

    def apply_event(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._stored(event)
        elif isinstance(event, BlockRemoved):
            self._removed(event)
        elif isinstance(event, AllBlocksCleared):
            self.reset("cleared")

    def _ignore(self, reason: str, count: int) -> None:
        if count:
            self.ignored[reason] += count
            if self._on_ignored is not None:
                self._on_ignored(reason, count)

    def _stored(self, ev: BlockStored) -> None:
        hashes = ev.block_hashes
        if not is_device_medium(ev.medium):
            self._ignore("medium", len(hashes))
            return
        if not is_main_attention(ev):
            self._ignore("group", len(hashes))
            return
        if not ev.token_ids or ev.block_size <= 0:
            if self._content is not None and ev.block_size > 0 and hashes:
                self._ignore("no_token_ids", len(hashes))
                self._unusable("the engine's KV events carry no token_ids, so the router cannot key its blocks "
                               "by content; fix: set the model's routing_options key_function: vllm with "
                               "hash_algo and hash_seed equal to the engine's --prefix-caching-hash-algo and "
                               "PYTHONHASHSEED")
            else:
                self._ignore("placeholder", len(hashes))
            return
        if ev.kv_cache_spec_kind is not None and ev.group_idx is not None:
            self._main_groups.add(ev.group_idx)
        block_size = ev.block_size
        if self.block_size != block_size:
            if self.block_size is not None and self._counts:
                log.warning("engine block size changed from %d to %d with %d blocks mirrored", self.block_size,
                            block_size, len(self._counts))
            self.block_size = block_size
        if self._content is None:
            keys = [normalize_hash(h) for h in hashes]
            if self._verify is not None and self._verify_left > 0 and ev.parent_block_hash is None:
                self._check_parity(ev, keys)
        else:
            content_keys = self._content_keys(ev)
            if content_keys is None:
                return
            keys = content_keys
        counts, before = self._counts, self._before
        for key in keys:
            count = counts.get(key, 0)
            if not count and key not in before:
                before[key] = False
            counts[key] = count + 1
        self.stored_blocks += len(keys)

    @property
    def parity(self) -> bool | None:
        """Whether the router's key function reproduces this engine's hashes (None: not checked yet)."""
        if self.parity_failed:
            return False
        return True if self.parity_checked else None

    def _check_parity(self, ev: BlockStored, keys: list[int]) -> None:
        """Recompute a chain that starts at block 0 with the router's key function; log a mismatch once.

        Only stores without extra keys are checked (LoRA paths and multimodal
        identifiers are not in events), so a mismatch means a different hash
        algorithm, ``PYTHONHASHSEED`` or block size: the router would never
        match this engine's blocks (0% hits, silently).
        """
        if ev.extra_keys is not None and any(item is not None for item in ev.extra_keys):
            return
        if ev.lookahead_token_ids or len(ev.token_ids) != len(keys) * ev.block_size:
            return
        assert self._verify is not None  # checked only with a key function to check against
        self._verify_left -= 1
        self.parity_checked += 1
        try:
            expected = self._verify.keys(ev.token_ids, ev.block_size)
        except (TypeError, ValueError):
            return
        ok = expected == keys
        if self._on_parity is not None:
            self._on_parity(ok)
        if not ok:
            self.parity_failed += 1
            self._unusable(f"the engine's block hashes differ from the router's {self._verify!r} (another "
                           "--prefix-caching-hash-algo, PYTHONHASHSEED or block size); fix: drop key_function: "
                           "vllm from the model's routing_options (content keys, the default, work with any "
                           "algorithm and seed), or set hash_algo and hash_seed to the engine's")

    def _unusable(self, problem: str) -> None:
        """This mirror's keys can never match the router's: say so once, and in every FULL copy from now on."""
        if self.problem is not None:
            return
        self.problem = problem
        log.warning("%s: KV index unusable: %s", self.name or "engine", problem)
        self.request_full("unusable")

    def _content_keys(self, ev: BlockStored) -> list[int] | None:
        assert self._content is not None  # content key mode
        hashes, size = ev.block_hashes, ev.block_size
        if len(ev.token_ids) != len(hashes) * size:
            self._ignore("token_mismatch", len(hashes))  # e.g. sliding-window groups skipping null blocks
            return None
        parent = None
        if ev.parent_block_hash is not None:
            parent = self._engine_to_key.get(normalize_hash(ev.parent_block_hash))
            if parent is None:
                self._ignore("unknown_parent", len(hashes))
                return None
        extras: list[Any] | None = None
        if ev.extra_keys is not None:
            extras = [None if item is None else _tupled(item) for item in ev.extra_keys]
            if len(extras) < len(hashes):
                extras += [None] * (len(hashes) - len(extras))
        elif ev.lora_name is not None:  # vLLM 0.14-0.16: the adapter's name, before extra_keys carried it
            extras = [(ev.lora_name,)] * len(hashes)
        elif ev.lora_id is not None:  # before 0.14: a server-local adapter id, which no request names
            self._ignore("lora_without_name", len(hashes))
            return None
        try:
            keys = self._content.keys(ev.token_ids, size, extras, parent=parent)
        except (TypeError, ValueError):
            self._ignore("bad_tokens", len(hashes))
            return None
        table = self._engine_to_key
        for engine_hash, key in zip(hashes, keys):
            table[normalize_hash(engine_hash)] = key
        return keys

    def _removed(self, ev: BlockRemoved) -> None:
        hashes = ev.block_hashes
        if not is_device_medium(ev.medium):
            self._ignore("medium", len(hashes))
            return
        if not is_main_attention(ev, self._main_groups or None):
            self._ignore("group", len(hashes))
            return
        counts, before = self._counts, self._before
        table = self._engine_to_key if self._content is not None else None
        unknown = 0
        for raw in hashes:
            engine_hash = normalize_hash(raw)
            key = engine_hash if table is None else table.get(engine_hash)
            count = counts.get(key, 0) if key is not None else 0
            if key is None or not count:
                unknown += 1
                continue
            if count == 1:
                if key not in before:
                    before[key] = True
                del counts[key]
                if table is not None:
                    del table[engine_hash]
            else:
                counts[key] = count - 1
            self.removed_blocks += 1
        self._ignore("unknown_block", unknown)

    def reset(self, reason: str) -> None:
        """The engine's cache is empty or unknown from here on: forget everything, send a RESET next."""
        self._counts.clear()
        self._before.clear()
        self._engine_to_key.clear()
        self._pending_reset = reason
        self.resets[reason] += 1

    # -- what goes up the stream ----------------------------------------------------------------------------------

    def take_delta(self) -> tuple[list[int], list[int]]:
        """``(stored, removed)``: keys that appeared and disappeared since the last take (net), then forget them."""
        counts = self._counts
        stored, removed = [], []
        for key, was_present in self._before.items():
            if key in counts:
                if not was_present:
                    stored.append(key)
            elif was_present:
                removed.append(key)
        self._before.clear()
        return stored, removed

    def request_full(self, reason: str = "resync") -> None:
        """Send a FULL copy at the next :meth:`flush` instead of the net changes."""
        self._full_requested = reason

    def take_reset(self) -> str | None:
        reason, self._pending_reset = self._pending_reset, None
        return reason

    def full_copy(self) -> list[int]:
        """Every key held now (sorted); reading it changes nothing."""
        return sorted(self._counts)

    def flush(self, *, max_keys: int = MAX_KEYS_PER_MESSAGE) -> list[BlockChanges]:
        """The changes to send now, in order: a RESET if one is pending, then the net DELTA (may be none); or a
        FULL copy when one was requested."""
        if self._full_requested is not None or (self.problem is not None and self._pending_reset is not None):
            return self.full_messages(reason=self._full_requested or "reset", max_keys=max_keys)
        out = []
        block_size = self.block_size or 0
        reason = self.take_reset()
        if reason is not None:
            out.append(BlockChanges(KvChangeKind.RESET, block_size, reason=reason))
        stored, removed = self.take_delta()
        for start in range(0, max(len(stored), len(removed)), max_keys):
            out.append(BlockChanges(KvChangeKind.DELTA, block_size, stored[start:start + max_keys],
                                    removed[start:start + max_keys]))
        return out

    def full_messages(self, *, reason: str = "connect",
                      max_keys: int = MAX_KEYS_PER_MESSAGE) -> list[BlockChanges]:
        """A FULL copy for a (re)connected stream: supersedes any pending delta or reset.

        More than ``max_keys`` keys go as one FULL followed by DELTAs storing the rest. With a :attr:`problem`
        the FULL's reason is that problem (:func:`~llmgw.kv.changes.unusable_keys_reason`).
        """
        if self.problem is not None:
            reason = unusable_keys_reason(self.problem)
        self._before.clear()
        self._pending_reset = None
        self._full_requested = None
        keys = self.full_copy()
        block_size = self.block_size or 0
        out = [BlockChanges(KvChangeKind.FULL, block_size, keys[:max_keys], reason=reason)]
        for start in range(max_keys, len(keys), max_keys):
            out.append(BlockChanges(KvChangeKind.DELTA, block_size, keys[start:start + max_keys]))
        return out


def resync(mode: str, mirror: EngineMirror, subscription: EngineSubscription) -> None:
    """Answer the router's resync request for one engine rank (``llmgw.kv.drift``): ``full`` sends a FULL copy
    of the mirror at the next flush; ``reset`` drops the mirror through the subscription (counted as a reset
    with reason ``resync``; a RESET goes up) so the index relearns from the engine's next events."""
    if mode == RESYNC_RESET:
        subscription.reset("resync")
    else:
        mirror.request_full("resync")


DEFAULT_FLUSH_INTERVAL = 0.025


async def flush_loop(mirror: EngineMirror, send: Callable[[BlockChanges], Awaitable[None] | None], *,
                     interval: float = DEFAULT_FLUSH_INTERVAL, full_first: bool = True,
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Send the mirror's changes every ``interval`` seconds through ``send(changes)`` (sync or async), forever.

    With ``full_first`` a FULL copy goes first: run one of these per stream
    connection (cancel it when the stream drops, start a new one when it is
    back), so every (re)connect starts with a full copy. Nothing is sent when
    nothing changed.
    """
    async def deliver(batch: list[BlockChanges]) -> None:
        for changes in batch:
            result = send(changes)
            if inspect.isawaitable(result):
                await result

    if full_first:
        await deliver(mirror.full_messages())
    task_status.started()
    while True:
        await trio.sleep(interval)
        if mirror.pending:
            await deliver(mirror.flush())
