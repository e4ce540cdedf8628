"""The approximate prefix tree: insert, match, eviction by size and by age, and bounded memory."""

from __future__ import annotations

import random

import pytest

from llmgw.router.radix import RadixTree


def test_match_reports_per_replica_how_much_of_the_text_it_holds():
    tree = RadixTree()
    tree.insert("system: be brief|user: hello", "a", now=0)
    tree.insert("system: be brief|user: goodbye", "b", now=0)
    assert tree.match("system: be brief|user: hello", now=1) == {"a": 28, "b": 23}
    assert tree.match("system: be brief|user: help me", now=1) == {"a": 26, "b": 23}
    assert tree.match("system: be", now=1) == {"a": 10, "b": 10}  # ends inside an edge
    assert tree.match("other", now=1) == {}
    assert tree.match("", now=1) == {}
    tree.check_invariants()


def test_edges_are_compressed_and_split_only_where_texts_diverge():
    tree = RadixTree()
    tree.insert("abcdef", "a", now=0)
    assert (tree.node_count, tree.char_count) == (1, 6)
    tree.insert("abcxyz", "b", now=0)  # splits "abcdef" into "abc" + "def", adds "xyz"
    assert (tree.node_count, tree.char_count) == (3, 9)
    assert tree.replica_chars == {"a": 6, "b": 6}
    tree.insert("abcdef", "b", now=0)  # b now also owns "def"
    assert tree.replica_chars == {"a": 6, "b": 9}
    assert tree.node_count == 3
    tree.check_invariants()


def test_inserting_a_prefix_of_an_existing_text_splits_the_edge():
    tree = RadixTree()
    tree.insert("hello world", "a", now=0)
    tree.insert("hello", "b", now=0)
    assert tree.match("hello world", now=0) == {"a": 11, "b": 5}
    assert tree.replica_chars == {"a": 11, "b": 5}
    tree.check_invariants()


def test_size_eviction_drops_the_least_recently_used_texts_of_that_replica_only():
    tree = RadixTree(max_chars_per_replica=100)
    tree.insert("A" * 40, "a", now=1)
    tree.insert("B" * 40, "a", now=2)
    tree.insert("C" * 40, "b", now=3)
    tree.insert("A" * 40, "a", now=4)  # refreshes A: B is now a's oldest
    tree.insert("D" * 40, "a", now=5)  # 120 > 100 characters: B goes
    assert tree.match("B" * 40, now=5) == {}
    assert tree.match("A" * 40, now=5) == {"a": 40}
    assert tree.match("D" * 40, now=5) == {"a": 40}
    assert tree.match("C" * 40, now=5) == {"b": 40}  # another replica's entries are not touched
    assert tree.replica_chars["a"] == 80 and tree.evicted_for_size == 1
    tree.check_invariants()


def test_size_eviction_trims_a_long_conversation_from_its_newest_unshared_tail():
    tree = RadixTree(max_chars_per_replica=50)
    tree.insert("s" * 20 + "x" * 20, "a", now=1)
    tree.insert("s" * 20 + "y" * 20, "a", now=2)  # 60 characters: the older branch "x..." goes, the shared root stays
    assert tree.match("s" * 20 + "x" * 20, now=2) == {"a": 20}
    assert tree.match("s" * 20 + "y" * 20, now=2) == {"a": 40}
    tree.check_invariants()


def test_age_eviction_ignores_then_removes_entries_older_than_the_ttl():
    tree = RadixTree(ttl=10)
    tree.insert("old conversation", "a", now=0)
    tree.insert("old conv", "b", now=8)
    assert tree.match("old conversation", now=9) == {"a": 16, "b": 8}
    assert tree.match("old conversation", now=15) == {"b": 8}  # a's entry is too old to count
    tree.insert("something else", "c", now=15)  # every insert sweeps expired entries
    assert tree.match("old conversation", now=15) == {"b": 8}
    assert "a" not in tree.replica_chars and tree.evicted_for_age == 2  # a owned two nodes: "old conv", "ersation"
    tree.insert("something else", "c", now=30)
    assert tree.match("old conversation", now=30) == {}
    assert tree.node_count == 1 and tree.char_count == len("something else")
    tree.check_invariants()


def test_remove_replica_forgets_everything_it_owned():
    tree = RadixTree()
    tree.insert("shared prefix, then a", "a", now=0)
    tree.insert("shared prefix, then b", "b", now=0)
    tree.remove_replica("a")
    assert tree.match("shared prefix, then a", now=0) == {"b": 20}
    assert "a" not in tree.replica_chars
    tree.check_invariants()


def chat_like_workload(rng: random.Random, steps: int):
    """Texts with shared system prompts, growing conversations and random one-off prompts."""
    systems = ["".join(rng.choices("abcdef ", k=rng.randint(50, 300))) for _ in range(8)]
    conversations: list[str] = []
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.3 or not conversations:
            conversations.append(rng.choice(systems) + "".join(rng.choices("ghijkl", k=rng.randint(10, 200))))
            text = conversations[-1]
        elif roll < 0.8:
            i = rng.randrange(len(conversations))
            conversations[i] += "".join(rng.choices("mnopqr", k=rng.randint(10, 200)))
            text = conversations[i]
        else:
            text = "".join(rng.choices("uvwxyz", k=rng.randint(1, 500)))
        if len(conversations) > 200:
            conversations.pop(0)
        yield text


@pytest.mark.parametrize("seed", [1, 2])
def test_memory_stays_bounded_under_a_long_random_workload(seed):
    rng = random.Random(seed)
    replicas = ["r0", "r1", "r2", "r3"]
    max_chars, max_nodes = 20_000, 300
    tree = RadixTree(max_chars_per_replica=max_chars, max_nodes_per_replica=max_nodes, ttl=500)
    peak_nodes = peak_chars = 0
    for step, text in enumerate(chat_like_workload(rng, 20_000)):
        tree.insert(text, rng.choice(replicas), now=step * 0.1)
        assert all(chars <= max_chars for chars in tree.replica_chars.values())
        assert all(nodes <= max_nodes for nodes in tree.replica_nodes.values())
        peak_nodes, peak_chars = max(peak_nodes, tree.node_count), max(peak_chars, tree.char_count)
        if step % 2_000 == 0:
            tree.check_invariants()
    tree.check_invariants()
    assert peak_chars <= len(replicas) * max_chars and peak_nodes <= len(replicas) * max_nodes
    assert tree.evicted_for_size > 1_000  # the bound was reached and held, not just never approached
    for heap in tree._leaves.values():  # the eviction heaps do not grow without bound either
        assert len(heap) <= 2 * max_nodes + 1024 + 1
    # Past the TTL with no new traffic, one sweep empties the tree.
    tree.evict(now=20_000 * 0.1 + 501)
    assert (tree.node_count, tree.char_count) == (0, 0)
    tree.check_invariants()


def test_a_text_longer_than_the_limit_does_not_break_the_bound():
    tree = RadixTree(max_chars_per_replica=10)
    tree.insert("x" * 25, "a", now=0)
    assert tree.replica_chars.get("a", 0) <= 10
    tree.check_invariants()


def test_limits_must_be_positive():
    with pytest.raises(ValueError):
        RadixTree(max_chars_per_replica=0)
    with pytest.raises(ValueError):
        RadixTree(ttl=0)
