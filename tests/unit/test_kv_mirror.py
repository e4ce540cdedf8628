"""EngineMirror: reference counts, net deltas, filters, full copies, resets, content re-keying, the flush loop."""

from __future__ import annotations

import trio

from llmgw.kv.changes import KvChangeKind, unusable_keys_problem
from llmgw.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from llmgw.kv.keys import ContentChainKeys, VllmBlockKeys, request_extra_keys
from llmgw.kv.mirror import EngineMirror, flush_loop, resync

B = 4


def stored(hashes, parent=None, *, tokens=None, medium="GPU", group_idx=0, kind="full_attention", block_size=B,
           extra_keys=None):
    if tokens is None:
        tokens = list(range(len(hashes) * block_size))
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=tokens, block_size=block_size,
                       medium=medium, group_idx=group_idx, kv_cache_spec_kind=kind, extra_keys=extra_keys)


def removed(*hashes, medium="GPU", group_idx=0):
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group_idx)


def batch(*events):
    return EventBatch(0.0, list(events), 0)


def test_duplicate_physical_blocks_are_reference_counted():
    mirror = EngineMirror(key_mode="engine")
    mirror.apply(batch(stored([1, 2]), stored([1])))  # block 1 computed twice by concurrent requests
    assert mirror.refcount(1) == 2 and 1 in mirror and len(mirror) == 2
    mirror.apply(batch(removed(1)))
    assert 1 in mirror and mirror.refcount(1) == 1
    mirror.apply(batch(removed(1)))
    assert 1 not in mirror and mirror.full_copy() == [2]
    mirror.apply(batch(removed(1)))  # one removal too many: counted, never negative
    assert mirror.ignored["unknown_block"] == 1 and mirror.refcount(1) == 0


def test_deltas_are_net_over_the_flush_window():
    mirror = EngineMirror(key_mode="engine")
    mirror.apply(batch(stored([1, 2, 3])))
    assert mirror.take_delta() == ([1, 2, 3], [])
    mirror.apply(batch(stored([4]), removed(4)))  # stored and removed within the window: no change
    mirror.apply(batch(removed(2), stored([2])))  # removed and stored again: no change
    mirror.apply(batch(stored([1])))  # a second copy of a present block: no change
    assert mirror.take_delta() == ([], [])
    mirror.apply(batch(removed(3), stored([5])))
    assert mirror.take_delta() == ([5], [3])
    assert mirror.take_delta() == ([], [])
    assert not mirror.pending


def test_hashes_are_normalised_to_unsigned_64_bit_keys():
    mirror = EngineMirror(key_mode="engine")
    mirror.apply(batch(stored([-1, b"\x00" * 24 + (7).to_bytes(8, "big")])))
    assert mirror.full_copy() == [7, 2**64 - 1]
    mirror.apply(batch(removed(2**64 - 1)))  # the same block as -1
    assert mirror.full_copy() == [7]


def test_only_device_main_attention_blocks_with_tokens_are_mirrored():
    mirror = EngineMirror(key_mode="engine")
    mirror.apply(batch(
        stored([1, 2], medium="CPU"),
        stored([3], kind="sliding_window", group_idx=1),
        stored([4], tokens=[], block_size=0, medium="GPU"),  # an offload tier's placeholder
        stored([5], medium=None, group_idx=None, kind=None),  # pre-0.10.2: no medium, no group
        stored([6], medium="gpu"),
    ))
    assert mirror.full_copy() == [5, 6]
    assert mirror.ignored == {"medium": 2, "group": 1, "placeholder": 1}
    mirror.apply(batch(removed(5, medium="CPU"), removed(6, group_idx=1)))  # group 1 is not a main group
    assert mirror.full_copy() == [5, 6]
    assert mirror.ignored["medium"] == 3 and mirror.ignored["group"] == 2


def test_block_size_is_learnt_from_stores():
    mirror = EngineMirror(key_mode="engine")
    assert mirror.block_size is None
    mirror.apply(batch(stored([1], block_size=16, tokens=list(range(16)))))
    assert mirror.block_size == 16
    assert mirror.full_messages()[0].block_size == 16


def test_flush_sends_reset_before_the_changes_that_followed_it():
    mirror = EngineMirror(key_mode="engine")
    mirror.apply(batch(stored([1, 2])))
    mirror.take_delta()
    mirror.reset("gap")
    mirror.apply(batch(stored([3])))
    messages = mirror.flush()
    assert [(m.kind, m.reason, m.stored, m.removed) for m in messages] == [
        (KvChangeKind.RESET, "gap", [], []), (KvChangeKind.DELTA, "", [3], [])]
    assert mirror.flush() == []
    assert mirror.resets == {"gap": 1}


def test_all_blocks_cleared_resets_in_order():
    mirror = EngineMirror(key_mode="engine")
    mirror.apply(batch(stored([1]), AllBlocksCleared(), stored([2])))
    assert mirror.full_copy() == [2]
    assert [m.kind for m in mirror.flush()] == [KvChangeKind.RESET, KvChangeKind.DELTA]
    assert mirror.resets == {"cleared": 1}


def test_full_copy_supersedes_pending_changes_and_is_chunked():
    mirror = EngineMirror(key_mode="engine")
    mirror.apply(batch(stored(list(range(10)))))
    mirror.reset("engine_restart")
    mirror.apply(batch(stored(list(range(100, 105)))))
    messages = mirror.full_messages(max_keys=2)
    assert [m.kind for m in messages] == [KvChangeKind.FULL, KvChangeKind.DELTA, KvChangeKind.DELTA]
    assert sum((m.stored for m in messages), []) == list(range(100, 105))
    assert not mirror.pending and mirror.flush() == []
    mirror.apply(batch(stored(list(range(200, 205)))))
    deltas = mirror.flush(max_keys=2)
    assert [len(m.stored) for m in deltas] == [2, 2, 1]


def test_content_mode_rekeys_from_token_ids_and_removes_through_the_map():
    content = ContentChainKeys()
    vllm = VllmBlockKeys()
    tokens = list(range(1000, 1000 + 5 * B))
    engine = vllm.keys(tokens, B)  # what the engine's events carry
    salt_extras = request_extra_keys(len(tokens), B, cache_salt="s1", style="event")
    mirror = EngineMirror(key_mode="content")
    # the prompt arrives in two stores, the second chained to the first's last block
    mirror.apply(batch(stored(engine[:2], tokens=tokens[:2 * B]),
                       stored(engine[2:], parent=engine[1], tokens=tokens[2 * B:])))
    assert sorted(mirror.full_copy()) == sorted(content.keys(tokens, B))
    # a salted request: the event's extra_keys (lists from msgpack) hash like the router's tuples
    salted = vllm.keys(tokens, B, request_extra_keys(len(tokens), B, cache_salt="s1"))
    mirror.apply(batch(stored(salted[:1], tokens=tokens[:B], extra_keys=[["s1"]])))
    assert content.keys(tokens[:B], B, salt_extras[:1])[0] in mirror
    mirror.apply(batch(removed(engine[4]), removed(salted[0])))
    assert sorted(mirror.full_copy()) == sorted(content.keys(tokens, B)[:4])
    # a store whose parent the mirror never saw cannot be re-keyed
    mirror.apply(batch(stored([99], parent=12345, tokens=list(range(B)))))
    assert mirror.ignored["unknown_parent"] == 1 and len(mirror) == 4


async def test_flush_loop_sends_a_full_copy_then_net_changes(autojump_clock):
    mirror = EngineMirror(key_mode="engine")
    mirror.apply(batch(stored([1, 2])))
    sent = []
    async with trio.open_nursery() as nursery:
        await nursery.start(flush_loop, mirror, sent.append)
        assert [(m.kind, m.stored) for m in sent] == [(KvChangeKind.FULL, [1, 2])]
        await trio.sleep(0.1)
        assert len(sent) == 1  # nothing changed: nothing sent
        mirror.apply(batch(stored([3]), removed(1)))
        await trio.sleep(0.03)
        assert [(m.kind, m.stored, m.removed) for m in sent[1:]] == [(KvChangeKind.DELTA, [3], [1])]
        nursery.cancel_scope.cancel()


def test_hash_parity_is_checked_on_chains_from_block_0():
    tokens = list(range(3 * B))
    engine = VllmBlockKeys("sha256_cbor", "0").keys(tokens, B)
    results = []
    good = EngineMirror(key_mode="engine", verify_keys=VllmBlockKeys("sha256_cbor", "0"), on_parity=results.append)
    assert good.parity is None
    good.apply(batch(stored(engine[:2], tokens=tokens[:2 * B]), stored(engine[2:], parent=engine[1],
                                                                          tokens=tokens[2 * B:])))
    assert good.parity is True and good.parity_checked == 1 and results == [True]  # only the chain start
    other_seed = VllmBlockKeys("sha256_cbor", None).keys(tokens, B)  # an engine without PYTHONHASHSEED
    bad = EngineMirror(key_mode="engine", verify_keys=VllmBlockKeys("sha256_cbor", "0"), verify_samples=1,
                       on_parity=results.append)
    bad.apply(batch(stored(other_seed, tokens=tokens), stored(other_seed, tokens=tokens)))
    assert bad.parity is False and bad.parity_checked == 1 and results[-1] is False
    assert len(bad) == 3  # still mirrored: the check only reports


class RecordingSubscription:
    def __init__(self, mirror):
        self.mirror = mirror
        self.resets = []

    def reset(self, reason):
        self.resets.append(reason)
        self.mirror.reset(reason)


def test_a_full_resync_makes_the_next_flush_a_full_copy_and_a_reset_resync_drops_the_mirror():
    mirror = EngineMirror(key_mode="engine")
    mirror.apply(batch(stored([1, 2])))
    mirror.flush()
    assert not mirror.pending
    subscription = RecordingSubscription(mirror)
    resync("full", mirror, subscription)
    assert mirror.pending
    mirror.apply(batch(stored([3], parent=2)))
    out = mirror.flush()
    assert [(m.kind, m.stored, m.reason) for m in out] == [(KvChangeKind.FULL, [1, 2, 3], "resync")]
    assert mirror.flush() == [] and subscription.resets == []
    resync("reset", mirror, subscription)
    assert subscription.resets == ["resync"] and len(mirror) == 0
    out = mirror.flush()
    assert [(m.kind, m.reason) for m in out] == [(KvChangeKind.RESET, "resync")]


def test_a_parity_failure_goes_out_in_every_full_copy_with_the_fix():
    tokens = list(range(2 * B))
    stock = VllmBlockKeys("sha256", None).keys(tokens, B)  # vLLM's defaults: sha256, no PYTHONHASHSEED
    mirror = EngineMirror(key_mode="engine", verify_keys=VllmBlockKeys("sha256_cbor", "0"), name="r1")
    mirror.flush()
    mirror.apply(batch(stored(stock, tokens=tokens)))
    assert "differ from the router's" in mirror.problem and "key_function" in mirror.problem
    (full,) = mirror.flush()  # at once: a FULL copy saying so
    assert full.kind is KvChangeKind.FULL and full.stored == sorted(stock)
    assert unusable_keys_problem(full.reason) == mirror.problem
    mirror.apply(batch(removed(stock[1])))
    assert [m.kind for m in mirror.flush()] == [KvChangeKind.DELTA]  # deltas as usual
    mirror.reset("engine_restart")  # a RESET would make the index trust the next keys: a FULL says it again
    (again,) = mirror.flush()
    assert (again.kind, again.stored, unusable_keys_problem(again.reason)) == (KvChangeKind.FULL, [], mirror.problem)
    (reconnect,) = mirror.full_messages()
    assert unusable_keys_problem(reconnect.reason) == mirror.problem


def test_content_keys_need_token_ids_and_say_so():
    mirror = EngineMirror(key_mode="content", name="r1")
    mirror.flush()
    mirror.apply(batch(stored([1, 2], tokens=[])))  # a device store without its tokens
    assert len(mirror) == 0 and mirror.ignored == {"no_token_ids": 2}
    assert "no token_ids" in mirror.problem and "key_function: vllm" in mirror.problem
    (full,) = mirror.flush()
    assert full.kind is KvChangeKind.FULL and unusable_keys_problem(full.reason) == mirror.problem
    placeholders = EngineMirror(key_mode="content")  # offload placeholders (no tokens, no block size) are not that
    placeholders.apply(batch(stored([1], tokens=[], block_size=0)))
    assert placeholders.problem is None and placeholders.ignored == {"placeholder": 1}


def test_content_keys_are_the_same_whatever_the_engines_algorithm_and_seed():
    tokens = list(range(3 * B))
    want = ContentChainKeys().keys(tokens, B)
    for algo, seed in (("sha256", None), ("sha256_cbor", "0"), ("xxhash", "1234"), ("sha256", "42")):
        hashes = VllmBlockKeys(algo, seed).keys(tokens, B)
        mirror = EngineMirror()  # content keys by default
        mirror.apply(batch(stored(hashes[:2], tokens=tokens[:2 * B]), stored(hashes[2:], parent=hashes[1],
                                                                              tokens=tokens[2 * B:])))
        assert mirror.key_mode == "content" and mirror.full_copy() == sorted(want) and mirror.problem is None


def test_content_keys_of_adapter_blocks_from_releases_before_extra_keys():
    tokens = list(range(2 * B))
    router = ContentChainKeys().keys(tokens, B, request_extra_keys(len(tokens), B, lora=("sql", "/a/sql"),
                                                                   style="event"))
    named = EngineMirror()  # vLLM 0.14-0.16: lora_name, no extra_keys
    named.apply(batch(BlockStored([1, 2], None, tokens, B, lora_id=3, medium="GPU", lora_name="sql")))
    assert named.full_copy() == sorted(router)
    numbered = EngineMirror()  # before 0.14: only the server's adapter id, which routing cannot know
    numbered.apply(batch(BlockStored([1, 2], None, tokens, B, lora_id=3)))
    assert len(numbered) == 0 and numbered.ignored == {"lora_without_name": 2}
