"""The simulator's paged KV cache and scheduler: hits, reference counts, LRU eviction, events."""

from __future__ import annotations

import hashlib

import cbor2
import pytest

from llmgw.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from llmgw.kv.keys import event_int
from llmgw.sim.blockhash import BlockHashing
from llmgw.sim.cache import KVCacheManager
from llmgw.sim.scheduler import Scheduler, Sequence, Status

B = 4  # tokens per block


def make_cache(num_blocks: int = 9, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, B, to_event=event_int, **kw)


HASHING = BlockHashing(B, "sha256_cbor", "0", event_int)


def seq(tokens, output=(100,), rid="r", **kw) -> Sequence:
    return Sequence(rid, list(tokens), list(output), hashes=HASHING.for_request(**kw))


def reference_chain(tokens, seed="0", extras=None):
    """sha256_cbor chain recomputed with cbor2 and hashlib only."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for i in range(len(tokens) // B):
        extra = extras[i] if extras else None
        parent = hashlib.sha256(cbor2.dumps((parent, tuple(tokens[i * B:(i + 1) * B]), extra),
                                            canonical=True)).digest()
        out.append(event_int(parent))
    return out


def admit(cache: KVCacheManager, s: Sequence) -> int:
    """Admit ``s`` for its whole prompt as the scheduler would; returns the cached tokens."""
    hits = cache.computed_blocks(s)
    assert cache.allocate_slots(s, len(s.token_ids) - len(hits) * B, hits)
    s.num_computed_tokens = len(s.token_ids)
    return len(hits) * B


def stored_minus_removed(events) -> int:
    count = 0
    for ev in events:
        if isinstance(ev, BlockStored):
            count += len(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            count -= len(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            count = 0
    return count


def test_store_event_shape_and_hashes():
    cache = make_cache()
    tokens = list(range(20, 30))  # 2 full blocks + 2 tokens
    s = seq(tokens)
    assert admit(cache, s) == 0
    [ev] = cache.pool.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == reference_chain(tokens)
    assert ev.parent_block_hash is None
    assert ev.token_ids == tokens[:8]
    assert (ev.block_size, ev.medium, ev.group_idx, ev.kv_cache_spec_kind) == (B, "GPU", 0, "full_attention")
    assert ev.extra_keys == [None, None]
    assert ev.lora_id is None and ev.lora_name is None
    assert len(s.blocks) == 3  # the partial block is allocated but not cached
    assert cache.pool.num_cached_blocks == 2


def test_hit_rule_never_covers_last_token():
    cache = make_cache()
    tokens = list(range(40, 48))  # exactly 2 blocks
    first = seq(tokens, rid="a")
    admit(cache, first)
    cache.free(first)
    cache.pool.take_events()
    again = seq(tokens, rid="b")
    # floor((8 - 1) / 4) = 1 block may hit; the last block is recomputed into a new physical block.
    assert admit(cache, again) == B
    [ev] = cache.pool.take_events()
    assert ev.block_hashes == reference_chain(tokens)[1:]
    assert ev.parent_block_hash == reference_chain(tokens)[0]
    assert len(cache.pool.cached[again.hashes.digests[1]]) == 2  # two physical blocks, same hash


def test_refcounts_and_shared_prefix():
    cache = make_cache()
    prefix = list(range(50, 58))
    a = seq(prefix + [1, 2, 3, 4, 5], rid="a")
    b = seq(prefix + [6, 7, 8, 9, 10], rid="b")
    admit(cache, a)
    assert admit(cache, b) == 8
    shared = a.blocks[:2]
    assert b.blocks[:2] == shared
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    cache.free(a)
    assert [blk.ref_cnt for blk in shared] == [1, 1]
    assert all(blk.block_id not in cache.pool.free for blk in shared)
    cache.free(b)
    assert all(blk.ref_cnt == 0 and blk.block_id in cache.pool.free for blk in shared)
    assert cache.usage == 0.0


def test_lru_eviction_order_and_removed_events():
    cache = make_cache(num_blocks=5)  # 4 usable blocks
    a = seq(range(20, 28), rid="a")  # 2 blocks
    b = seq(range(60, 68), rid="b")  # 2 blocks
    admit(cache, a)
    admit(cache, b)
    cache.free(a)
    cache.free(b)
    stored = cache.pool.take_events()
    a_hashes, b_hashes = stored[0].block_hashes, stored[1].block_hashes
    # Free queue: a's blocks (tail first), then b's. A new 1-block request evicts a's last block.
    c = seq(range(100, 104), rid="c")
    assert admit(cache, c) == 0
    events = cache.pool.take_events()
    assert isinstance(events[0], BlockRemoved) and events[0].block_hashes == [a_hashes[1]]
    assert (events[0].medium, events[0].group_idx) == ("GPU", 0)
    # a's first block is still a hit; its second is gone.
    d = seq(range(20, 28), rid="d")
    assert [blk.block_id for blk in cache.computed_blocks(d)] == [1]
    cache.free(c)
    e = seq(range(200, 216), rid="e")  # 4 blocks: evicts everything cached, oldest first
    admit(cache, e)
    removed = [ev.block_hashes[0] for ev in cache.pool.take_events() if isinstance(ev, BlockRemoved)]
    assert removed == [a_hashes[0], b_hashes[1], b_hashes[0], reference_chain(list(range(100, 104)))[0]]


def test_allocation_failure_leaves_state_untouched():
    cache = make_cache(num_blocks=3)  # 2 usable blocks
    a = seq(range(20, 28), rid="a")
    admit(cache, a)
    b = seq(range(30, 35), rid="b")
    assert not cache.allocate_slots(b, 5, [])
    assert b.blocks == [] and cache.pool.num_free_blocks == 0


def test_usage_is_blocks_in_use_and_cached_gauge_matches_events():
    cache = make_cache(num_blocks=9)  # 8 usable blocks
    seqs = [seq(range(10 * i + 20, 10 * i + 29), rid=str(i)) for i in range(6)]  # 3 blocks each, 2 full
    events = []
    admit(cache, seqs[0])
    admit(cache, seqs[1])
    assert cache.usage == pytest.approx(6 / 8)  # in use, partial blocks included
    for s in seqs[:2]:
        cache.free(s)
    assert cache.usage == 0.0  # vLLM's gauge ignores cached-but-free blocks
    events += cache.pool.take_events()
    for s in seqs[2:]:
        admit(cache, s)
        events += cache.pool.take_events()
        assert stored_minus_removed(events) == cache.pool.num_cached_blocks
        cache.free(s)
    assert any(isinstance(ev, BlockRemoved) for ev in events)
    assert cache.pool.num_cached_blocks == stored_minus_removed(events) <= 8


def test_reset_refused_while_in_use_then_clears():
    cache = make_cache()
    a = seq(range(20, 28))
    admit(cache, a)
    assert not cache.reset_prefix_cache()
    cache.free(a)
    cache.pool.take_events()
    assert cache.reset_prefix_cache()
    assert cache.pool.take_events() == [AllBlocksCleared()]
    assert cache.pool.num_cached_blocks == 0
    assert cache.computed_blocks(seq(range(20, 28))) == []


def test_lora_and_salt_extra_keys():
    cache = make_cache()
    tokens = list(range(20, 28))
    s = Sequence("l", tokens, [100], hashes=HASHING.for_request(("sql", "/adapters/sql"), "salty"),
                 lora_id=1, lora_name="sql")
    admit(cache, s)
    [ev] = cache.pool.take_events()
    extras = [(("lora", "sql", "/adapters/sql"), ("cache_salt", "salty")), (("lora", "sql", "/adapters/sql"),)]
    assert ev.block_hashes == reference_chain(tokens, extras=extras)
    assert ev.extra_keys == [["sql", "salty"], ["sql"]]
    assert (ev.lora_id, ev.lora_name) == (1, "sql")
    plain = seq(tokens, rid="p")
    assert cache.computed_blocks(plain) == []  # different hashes: no hit across adapters


def test_prefix_caching_off_emits_nothing():
    cache = make_cache(enable_caching=False)
    s = Sequence("x", list(range(20, 28)), [100])
    assert cache.allocate_slots(s, 8)
    assert cache.pool.take_events() == [] and cache.computed_blocks(s) == []


# ---------------------------------------------------------------- scheduler


def run_to_completion(sched: Scheduler, limit: int = 1000) -> list:
    steps = []
    for _ in range(limit):
        if not sched.has_work():
            return steps
        step = sched.schedule()
        sched.update(step)
        steps.append(step)
    raise AssertionError("did not finish")


def test_scheduler_decode_blocks_are_cached():
    cache = make_cache(num_blocks=20)
    sched = Scheduler(cache, max_num_batched_tokens=64)
    s = seq(range(20, 26), output=list(range(30, 37)))  # 6 prompt + 7 output = 13 tokens
    sched.add(s)
    steps = run_to_completion(sched)
    assert s.status is Status.FINISHED and s.finish_reason == "length"
    assert s.output_ids == list(range(30, 37))
    stored = [ev for step in steps for ev in step.events if isinstance(ev, BlockStored)]
    # prompt: block 0 at prefill; decode fills block 1 (tokens 4..7) and block 2 (8..11).
    assert [len(ev.block_hashes) for ev in stored] == [1, 1, 1]
    all_tokens = list(range(20, 26)) + list(range(30, 37))
    assert [h for ev in stored for h in ev.block_hashes] == reference_chain(all_tokens[:12])
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    assert steps[0].prefill_tokens == 6 and all(st.decode_requests == 1 for st in steps[1:])


def test_scheduler_chunked_prefill_and_budget():
    cache = make_cache(num_blocks=40)
    sched = Scheduler(cache, max_num_batched_tokens=10)
    s = seq(range(20, 45), output=[50, 51])  # 25 prompt tokens -> chunks 10, 10, 5
    sched.add(s)
    steps = run_to_completion(sched)
    assert [st.prefill_tokens for st in steps[:3]] == [10, 10, 5]
    assert s.output_ids == [50, 51]
    assert s.num_cached_tokens == 0


def test_scheduler_waits_when_cache_full_and_preempts():
    cache = make_cache(num_blocks=5)  # 4 usable blocks = 16 tokens
    sched = Scheduler(cache, max_num_batched_tokens=64)
    a = seq(range(20, 27), output=list(range(60, 66)), rid="a")  # grows to 13 tokens: 4 blocks
    b = seq(range(30, 37), output=list(range(60, 66)), rid="b")
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert len(step.scheduled) == 2  # 2 blocks each
    sched.update(step)
    run_to_completion(sched)
    assert sched.stats.preemptions >= 1
    assert a.output_ids == list(range(60, 66)) and b.output_ids == list(range(60, 66))
    assert cache.usage == 0.0


def test_scheduler_max_num_seqs():
    cache = make_cache(num_blocks=40)
    sched = Scheduler(cache, max_num_seqs=2)
    for i in range(3):
        sched.add(seq(range(20 + i * 10, 25 + i * 10), output=[60, 61], rid=str(i)))
    step = sched.schedule()
    assert len(step.scheduled) == 2 and len(sched.waiting) == 1


def test_abort_frees_blocks():
    cache = make_cache(num_blocks=10)
    sched = Scheduler(cache)
    s = seq(range(20, 30), output=[60, 61, 62])
    sched.add(s)
    sched.update(sched.schedule())
    assert cache.usage > 0
    sched.abort(s)
    assert s.finish_reason == "abort" and cache.usage == 0.0 and not sched.has_work()


def test_identical_requests_share_prompt_blocks_but_store_decode_blocks_twice():
    cache = make_cache(num_blocks=20)
    sched = Scheduler(cache)
    tokens = list(range(20, 29))  # 2 full blocks + 1
    out = list(range(60, 67))
    a, b = seq(tokens, out, rid="a"), seq(tokens, out, rid="b")
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    # vLLM caches blocks when it schedules them: b, admitted after a in the same step, hits them.
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    stored = [ev for ev in step.events if isinstance(ev, BlockStored)]
    assert len(stored) == 1
    sched.update(step)
    steps = [step] + run_to_completion(sched)
    decode_stores = [ev for st in steps for ev in st.events if isinstance(ev, BlockStored) and ev.parent_block_hash]
    # Both decode the same tokens, so block 2 exists twice: two physical blocks, two BlockStored.
    assert len(decode_stores) == 2 and decode_stores[0].block_hashes == decode_stores[1].block_hashes
    block2 = a.hashes.digests[2]
    assert len(cache.pool.cached[block2]) == 2 and cache.pool.num_cached_blocks == 4
    big = seq(range(100, 100 + 19 * B - 1), rid="big")  # needs every block: evicts all four
    sched.add(big)
    step = sched.schedule()
    removed = [ev.block_hashes[0] for ev in step.events if isinstance(ev, BlockRemoved)]
    h = stored[0].block_hashes + decode_stores[0].block_hashes
    assert sorted(removed) == sorted(h + decode_stores[0].block_hashes)
