"""The paged KV cache: vLLM's block pool and prefix caching, and the KV events they produce.

It follows vLLM v1 (``block_pool.py``, ``kv_cache_manager.py``) where a router
can observe the difference:

- ``num_blocks`` blocks, block 0 reserved as vLLM's null block, so
  ``num_blocks - 1`` are usable and ``usage`` = blocks in use / (num_blocks - 1);
- a free queue in LRU order; freed blocks go to its tail (a request's blocks
  in reverse, so its tail blocks are evicted first); allocation takes the
  head, evicting that block's cached hash (one ``BlockRemoved`` per block);
- cached blocks keyed by their full digest; two physical blocks may carry the
  same hash (identical prefixes computed concurrently, or a fully cached prompt
  whose last block is recomputed), each with its own store and removal event;
- a hit is the longest run of cached leading blocks, at most
  ``(num_tokens - 1) // block_size`` blocks (the last token is always computed);
  hit blocks are reference counted and leave the free queue while in use;
- full blocks are cached when a step schedules their last token (prompt and
  generated tokens alike); each request's newly cached run in a step is one
  ``BlockStored`` whose parent is the block before the run (nil at block 0);
- ``reset_prefix_cache`` succeeds only when no block is in use, and then emits
  ``AllBlocksCleared``.

Events accumulate in :attr:`BlockPool.events` until the engine takes them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Callable, Protocol

from llmgw.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

from .blockhash import SequenceHashes

MEDIUM = "GPU"
SPEC_KIND = "full_attention"


class Block:
    """One physical KV block."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class CachedSequence(Protocol):
    """What the cache needs to know about a request."""

    token_ids: list[int]  # prompt and generated tokens so far
    num_computed_tokens: int
    hashes: SequenceHashes | None  # None when prefix caching is off
    blocks: list[Block]
    num_cached_blocks: int
    lora_id: int | None
    lora_name: str | None


class BlockPool:
    """The physical blocks, the LRU free queue and the hash -> blocks map."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_events: bool = True,
                 to_event: Callable[[bytes], int | bytes] = bytes):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is vLLM's reserved null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[bytes, dict[int, Block]] = {}
        self.num_cached_blocks = 0  # physical blocks holding a hash: stored minus removed
        self.enable_events = enable_events
        self.to_event = to_event
        self.events: list[KVEvent] = []

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: share of usable blocks referenced by requests (0..1)."""
        return 1.0 - len(self.free) / (self.num_blocks - 1)

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def cached_block(self, digest: bytes) -> Block | None:
        blocks = self.cached.get(digest)
        return next(iter(blocks.values())) if blocks else None

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on hit blocks (removing free ones from the free queue)."""
        free = self.free
        for block in blocks:
            if block.ref_cnt == 0:
                del free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, count: int) -> list[Block]:
        """``count`` blocks from the head of the free queue, evicting their cached hashes."""
        if count > len(self.free):
            raise ValueError(f"cannot allocate {count} blocks, {len(self.free)} free")
        out = []
        popitem = self.free.popitem
        for _ in range(count):
            block = popitem(last=False)[1]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        digest = block.block_hash
        assert digest is not None  # only cached blocks are evicted
        same = self.cached[digest]
        del same[block.block_id]
        if not same:
            del self.cached[digest]
        block.block_hash = None
        self.num_cached_blocks -= 1
        if self.enable_events:
            self.events.append(BlockRemoved([self.to_event(digest)], medium=MEDIUM, group_idx=0))

    def release(self, blocks) -> None:
        """Drop one reference from each block, in order; unreferenced blocks join the free queue's tail."""
        free = self.free
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block

    def cache(self, blocks: list[Block], digests: list[bytes]) -> None:
        """Mark newly full ``blocks`` as cached under ``digests``."""
        cached = self.cached
        for block, digest in zip(blocks, digests):
            block.block_hash = digest
            same = cached.get(digest)
            if same is None:
                cached[digest] = {block.block_id: block}
            else:
                same[block.block_id] = block
        self.num_cached_blocks += len(blocks)

    def reset(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if len(self.free) != self.num_blocks - 1:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.block_hash = None
        self.num_cached_blocks = 0
        if self.enable_events:
            self.events.append(AllBlocksCleared())
        return True


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block tables on top of a :class:`BlockPool` (vLLM's ``KVCacheManager``)."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 enable_events: bool = True, to_event: Callable[[bytes], int | bytes] = bytes):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, block_size, enable_events=enable_events and enable_caching,
                              to_event=to_event)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def computed_blocks(self, seq: CachedSequence) -> list[Block]:
        """The longest run of cached leading blocks usable by ``seq`` (never covering its last token)."""
        if not self.enable_caching or seq.hashes is None:
            return []
        limit = (len(seq.token_ids) - 1) // self.block_size
        hits = []
        cached = self.pool.cached
        for digest in seq.hashes.digests[:limit]:
            same = cached.get(digest)
            if not same:
                break
            for block in same.values():  # any physical copy will do
                hits.append(block)
                break
        return hits

    def allocate_slots(self, seq: CachedSequence, num_new_tokens: int,
                       new_computed_blocks: Sequence[Block] = ()) -> bool:
        """Blocks for ``num_new_tokens`` more tokens of ``seq`` (after its hits); False when they do not fit.

        On success, full blocks up to the scheduled tokens are cached (events).
        """
        pool = self.pool
        size = self.block_size
        num_computed = seq.num_computed_tokens + len(new_computed_blocks) * size
        total = num_computed + num_new_tokens
        needed = cdiv(total, size) - len(seq.blocks) - len(new_computed_blocks)
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if needed > len(pool.free) - evictable_hits:
            return False
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            seq.blocks.extend(new_computed_blocks)
            seq.num_cached_blocks = len(seq.blocks)  # hits are not announced again
        if needed > 0:
            seq.blocks.extend(pool.allocate(needed))
        if self.enable_caching and seq.hashes is not None:
            self._cache_full_blocks(seq, seq.hashes, min(total, len(seq.token_ids)))
        return True

    def _cache_full_blocks(self, seq: CachedSequence, hashes: SequenceHashes, num_tokens: int) -> None:
        size = self.block_size
        start, end = seq.num_cached_blocks, num_tokens // size
        if end <= start:
            return
        hashes.extend(seq.token_ids)
        digests = hashes.digests[start:end]
        pool = self.pool
        pool.cache(seq.blocks[start:end], digests)
        seq.num_cached_blocks = end
        if pool.enable_events:
            to_event = pool.to_event
            pool.events.append(BlockStored(
                block_hashes=[to_event(d) for d in digests],
                parent_block_hash=to_event(hashes.digests[start - 1]) if start else None,
                token_ids=seq.token_ids[start * size: end * size],
                block_size=size,
                lora_id=seq.lora_id,
                medium=MEDIUM,
                lora_name=seq.lora_name,
                extra_keys=[hashes.event_extra(i) for i in range(start, end)],
                group_idx=0,
                kv_cache_spec_kind=SPEC_KIND,
            ))

    def free(self, seq: CachedSequence) -> None:
        """Release all of ``seq``'s blocks (tail first, so its last blocks are evicted first)."""
        self.pool.release(reversed(seq.blocks))
        seq.blocks = []
        seq.num_cached_blocks = 0

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset()
