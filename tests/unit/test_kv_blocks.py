"""BlockIndex alone: slots, DELTA/FULL/RESET of confirmed keys, and the leading-run walk against a set-based model."""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from llmgw.kv.blocks import BlockIndex


def test_slots_are_given_on_first_sight_and_the_lowest_free_one_is_reused():
    index = BlockIndex()
    assert [index.bit(name) for name in "abc"] == [1, 2, 4]
    assert index.bit("a") == 1 and index.replicas() == ["a", "b", "c"]
    index.remove("b")
    index.remove("a")
    assert "a" not in index and index.replicas() == ["c"]
    assert index.bit("d") == 1 and index.bit("e") == 2 and index.bit("f") == 8


def test_update_replace_clear_and_what_the_readers_say():
    index = BlockIndex()
    index.update("a", [1, 2, 3], [], block_size=16)
    index.update("a", [4], [2, 9])  # removing a key it lacks is nothing; no block size keeps the last one
    assert index.keys("a") == {1, 3, 4} and index.blocks("a") == 3 and index.block_size("a") == 16
    assert index.holds("a", 4) and not index.holds("a", 2) and not index.holds("b", 4)
    assert index.changes("a") == 3 + 3
    assert sorted(index.replace("a", [3, 4, 5, 5])) == [1]  # the keys it no longer holds
    assert index.keys("a") == {3, 4, 5} and index.changes("a") == 6 + 3
    index.update("b", [5], [])
    index.clear("a", block_size=32)
    assert index.keys("a") == set() and "a" in index and index.block_size("a") == 32
    assert index.sizes() == {"a": 0, "b": 1}
    assert index.match_detail([5], ["a", "b"]) == {"a": (0, 0), "b": (1, 1)}
    assert (index.blocks("x"), index.block_size("x"), index.keys("x"), index.changes("x")) == (0, None, set(), 0)


def test_the_predicted_masks_given_extend_the_run_past_the_confirmed_one():
    index = BlockIndex()
    index.update("a", [1, 2], [])
    index.update("b", [1], [])
    predicted = {3: index.bit("a"), 2: index.bit("b") | index.bit("c")}
    assert index.match_detail([1, 2, 3, 4], ["a", "b", "c", "z"], predicted) == \
        {"a": (2, 3), "b": (1, 2), "c": (0, 0), "z": (0, 0)}
    assert index.match_detail([1, 2, 3, 4], ["a", "b"]) == {"a": (2, 2), "b": (1, 1)}
    assert index.match_detail([1, 2, 3], ["a"], {}) == {"a": (2, 2)}


# -- against a model: one set of keys per replica -------------------------------------------------------------------

KEY = st.integers(0, 7)
KEYS = st.lists(KEY, max_size=5)
REPLICA = st.sampled_from("abc")


class BlocksModel(RuleBasedStateMachine):
    """Every change and every walk against plain sets: a replica's run is how many leading keys its set holds (and
    its set plus its predicted keys, for the second figure)."""

    def __init__(self):
        super().__init__()
        self.index = BlockIndex()
        self.held: dict[str, set[int]] = {}
        self.predicted: dict[str, set[int]] = {}

    @rule(replica=REPLICA, stored=KEYS, removed=KEYS)
    def update(self, replica, stored, removed):
        self.index.update(replica, stored, removed)
        self.held[replica] = (self.held.get(replica, set()) - set(removed)) | set(stored)

    @rule(replica=REPLICA, keys=KEYS)
    def replace(self, replica, keys):
        gone = self.index.replace(replica, keys)
        before = self.held.get(replica, set())
        assert sorted(gone) == sorted(before - set(keys))
        self.held[replica] = set(keys)

    @rule(replica=REPLICA)
    def clear(self, replica):
        self.index.clear(replica)
        self.held[replica] = set()

    @rule(replica=REPLICA)
    def remove(self, replica):
        self.index.remove(replica)
        self.held.pop(replica, None)
        self.predicted.pop(replica, None)

    @rule(replica=REPLICA, keys=KEYS)
    def guess(self, replica, keys):
        self.index.bit(replica)  # a predicted replica has a slot, as KvIndex.predict gives it
        self.held.setdefault(replica, set())
        self.predicted[replica] = set(keys)

    @rule(prompt=st.lists(KEY, max_size=8), names=st.lists(st.sampled_from("abcd"), min_size=1, unique=True))
    def walk(self, prompt, names):
        masks: dict[int, int] = {}
        for replica, keys in self.predicted.items():
            for key in keys:
                masks[key] = masks.get(key, 0) | self.index.bit(replica)

        def run(keys):
            count = 0
            while count < len(prompt) and prompt[count] in keys:
                count += 1
            return count

        expected = {}
        for name in names:
            held = self.held.get(name, set())
            expected[name] = (run(held), run(held | self.predicted.get(name, set())))
        assert self.index.match_detail(prompt, names, masks) == expected

    @invariant()
    def readers_agree_with_the_model(self):
        assert sorted(self.index.replicas()) == sorted(self.held)
        assert self.index.sizes() == {name: len(keys) for name, keys in self.held.items()}
        for name, keys in self.held.items():
            assert self.index.keys(name) == keys
        bits = [self.index.bit(name) for name in self.held]
        assert len(set(bits)) == len(bits) and all(bit & (bit - 1) == 0 for bit in bits)  # one distinct bit each


TestBlocksModel = BlocksModel.TestCase
TestBlocksModel.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
