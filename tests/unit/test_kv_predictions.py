"""PredictionOverlay alone: predictions' lives (ttl, settle, unpredict), what the engine's stores and removals do
to them, listeners, and the overlay's masks and count against a plain model of the rule."""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmgw.kv.predictions import PredictionOverlay
from llmgw.testing.prediction_model import PredictionModel

A, B = 1, 2  # the slot bits the block index would give replicas a and b


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def overlay(ttl=2.0):
    clock = Clock()
    return clock, PredictionOverlay(clock=clock, ttl=ttl)


def test_a_prediction_holds_its_keys_under_its_slot_until_its_ttl():
    clock, predictions = overlay()
    assert predictions.predict("a", A, []) is None
    predictions.predict("a", A, [1, 2])
    predictions.predict("b", B, [2], ttl=5.0)
    assert predictions.masks == {1: A, 2: A | B} and predictions.predicted_keys == 2
    clock.now = 2.0
    assert predictions.predicted_keys == 1 and predictions.masks == {1: A, 2: A | B}  # a reader: counted out only
    predictions.expire()
    assert predictions.masks == {2: B}
    clock.now = 5.0
    predictions.expire()
    assert predictions.masks == {} and predictions.predicted_keys == 0


def test_unpredict_drops_at_once_and_twice_is_nothing():
    _, predictions = overlay()
    first = predictions.predict("a", A, [1, 2])
    second = predictions.predict("a", A, [2, 3])
    predictions.unpredict(first)
    predictions.unpredict(first)
    predictions.unpredict(None)
    assert predictions.masks == {2: A, 3: A}
    predictions.settle(first)  # a dropped prediction settles nothing
    predictions.unpredict(second)
    assert predictions.masks == {} and predictions.predicted_keys == 0


def test_a_removal_drops_only_entries_no_unsettled_prediction_holds():
    _, predictions = overlay()
    first = predictions.predict("a", A, [1, 2])
    predictions.evicted("a", [1])  # unsettled: the engine may store it again
    assert predictions.masks == {1: A, 2: A}
    predictions.settle(first)
    later = predictions.predict("a", A, [2])
    predictions.evicted("a", [1, 2, 9])
    assert predictions.masks == {2: A}  # 1 went; 2 is still held by the later, unsettled one
    predictions.stored("a", [2, 7])  # a store of one of its keys settles it
    predictions.evicted("a", [2])
    assert predictions.masks == {} and later.settled
    predictions.evicted("nobody", [1])
    predictions.stored("nobody", [1])


def test_drop_takes_a_replica_s_entries_and_a_later_prediction_starts_afresh():
    clock, predictions = overlay()
    old = predictions.predict("a", A, [1, 2])
    predictions.predict("b", B, [1])
    predictions.drop("a")
    assert predictions.masks == {1: B} and old.settled
    predictions.drop("a")
    predictions.predict("a", 4, [2])  # the replica came back with another slot
    predictions.unpredict(old)  # the old prediction lets go of nothing it no longer counts in
    assert predictions.masks == {1: B, 2: 4}
    clock.now = 10.0
    predictions.expire()
    assert predictions.masks == {}


def test_listeners_hear_shared_predictions_with_their_ttl_and_a_broken_one_fails_nothing():
    _, predictions = overlay(ttl=3.0)
    heard = []

    def broken(*args):
        raise RuntimeError("boom")

    predictions.add_listener(broken)
    predictions.add_listener(lambda *args: heard.append(args))
    predictions.predict("a", A, [1, 2])
    predictions.predict("a", A, [3], ttl=0.5)
    predictions.predict("a", A, [4], share=False)  # another process's: no echo
    predictions.predict("a", A, [])
    assert heard == [("a", [1, 2], 3.0), ("a", [3], 0.5)] and predictions.predicted_keys == 4
    predictions.remove_listener(broken)
    predictions.remove_listener(broken)


# -- against a model of the rule ------------------------------------------------------------------------------------

KEYS = st.lists(st.integers(1, 6), min_size=1, max_size=4, unique=True)
REPLICA = st.sampled_from("ab")
BITS = {"a": A, "b": B}


class OverlayModel(RuleBasedStateMachine):
    """After any sequence of predict, settle, unpredict, stored, evicted, drop and time passing, the overlay's
    count and masks are what the rule written plainly says
    (:class:`~llmgw.testing.prediction_model.PredictionModel`)."""

    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.overlay = PredictionOverlay(clock=self.clock, ttl=2.0)
        self.model = PredictionModel(ttl=2.0)

    @rule(replica=REPLICA, keys=KEYS, ttl=st.sampled_from([None, 1.0, 3.0]))
    def predict(self, replica, keys, ttl):
        self.model.predict(replica, keys, self.clock.now, ttl, self.overlay.predict(replica, BITS[replica], keys, ttl))

    @rule(replica=REPLICA, keys=st.lists(st.integers(1, 6), max_size=3, unique=True))
    def stored(self, replica, keys):
        self.overlay.stored(replica, keys)
        self.model.stored(replica, keys, self.clock.now)

    @rule(replica=REPLICA, keys=st.lists(st.integers(1, 6), max_size=3, unique=True))
    def evicted(self, replica, keys):
        self.overlay.evicted(replica, keys)
        self.model.evicted(replica, keys, self.clock.now)

    @rule(replica=REPLICA)
    def drop(self, replica):
        self.overlay.drop(replica)
        self.model.drop(replica, self.clock.now)

    @precondition(lambda self: self.model.predictions)
    @rule(data=st.data(), settle=st.booleans())
    def settle_or_unpredict(self, data, settle):
        p = data.draw(st.sampled_from(self.model.predictions))
        if settle:
            self.overlay.settle(p.handle)
            self.model.settle(p, self.clock.now)
        else:
            self.overlay.unpredict(p.handle)
            self.model.unpredict(p)

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.5]))
    def wait(self, seconds):
        self.clock.now += seconds

    @invariant()
    def count_and_masks_follow_the_model(self):
        now = self.clock.now
        assert self.overlay.predicted_keys == len(self.model.held(now))
        self.overlay.expire()  # what the next writer does first; then the masks hold only live entries
        masks = {key: 0 for key in self.model.held(now)}
        for replica, bit in BITS.items():
            for key in self.model.held(now, replica):
                masks[key] |= bit
        assert dict(self.overlay.masks) == masks


TestOverlayModel = OverlayModel.TestCase
TestOverlayModel.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
