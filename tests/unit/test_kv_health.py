"""IndexHealth alone: states from the kinds of change that arrive, epochs, drift turning an index suspect, the
resyncs it asks and retries, and readers that never write (against a plain model of the states)."""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from llmgw.kv.changes import unusable_keys_reason
from llmgw.kv.drift import DriftPolicy
from llmgw.kv.health import IndexHealth, IndexState

POLICY = DriftPolicy(suspect_after=2, window=10.0, resync_retry=30.0, relapse_window=100.0)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def tracker(asked=None):
    clock = Clock()
    health = IndexHealth(clock=clock, reset_window=5.0)
    if asked is not None:
        health.add_resync_listener(lambda *args: asked.append(args))
    return clock, health


def test_a_replica_never_heard_of_reads_as_new():
    _, health = tracker()
    assert (health.state("x"), health.healthy("x"), health.epoch("x")) == (IndexState.NO_EVENTS, False, 0)
    assert health.resyncs("x") == {"full": 0, "reset": 0}
    assert health.describe("x") == {
        "state": "no_events", "last_reset_reason": None, "resets": 0,
        "drift": {"match": 0, "over": 0, "under": 0, "recent_over": 0, "suspect_reason": None,
                  "resyncs": {"full": 0, "reset": 0}, "last_resync": None, "last_resync_ago": None},
        "problem": None}
    health.remove("x")


def test_the_kinds_of_change_move_the_state_and_full_reset_and_forget_the_epoch():
    clock, health = tracker()
    health.delta("a", stored=False)
    assert health.state("a") is IndexState.HEALTHY and health.epoch("a") == 0
    health.reset("a", "engine restarted")
    assert health.state("a") is IndexState.RESETTING and health.epoch("a") == 1
    health.delta("a", stored=False)  # removals only: still resetting
    assert health.state("a") is IndexState.RESETTING
    health.delta("a", stored=True)
    assert health.state("a") is IndexState.HEALTHY
    health.reset("a", "gap")
    clock.now = 5.0
    assert health.state("a") is IndexState.HEALTHY and health._replicas["a"].state is IndexState.RESETTING
    health.tick()
    assert health._replicas["a"].state is IndexState.HEALTHY
    health.forget("a")
    assert health.state("a") is IndexState.NO_EVENTS and health.epoch("a") == 3
    health.full("a")
    assert health.state("a") is IndexState.HEALTHY and health.epoch("a") == 4
    described = health.describe("a")
    assert (described["last_reset_reason"], described["resets"]) == ("gap", 2)


def test_overs_on_the_current_epoch_make_it_suspect_and_ask_a_full_then_a_reset_on_relapse():
    asked = []
    clock, health = tracker(asked)
    health.full("a")
    assert health.observe("a", "over", epoch=0, policy=POLICY) is None  # a decision on an older index
    assert health.observe("a", "under", epoch=1, policy=POLICY) is None
    assert health.observe("a", "over", epoch=1, policy=POLICY) is None
    clock.now = 11.0  # the first over left the window
    assert health.observe("a", "over", epoch=1, policy=POLICY) is None
    assert health.observe("a", "over", epoch=1, policy=POLICY) == "full"
    assert health.state("a") is IndexState.SUSPECT and asked[0][:2] == ("a", "full")
    assert health.observe("a", "over", epoch=1, policy=POLICY) is None  # suspect already: counted only
    assert health.describe("a")["drift"]["over"] == 5 and health.describe("a")["drift"]["under"] == 1
    clock.now = 41.0
    health.tick()
    health.tick()
    assert [a[1:] for a in asked] == [("full", asked[0][2]), ("full", "no answer to the last resync request")]
    health.full("a")  # the answer; it drifts again soon: the mirror itself is wrong
    health.observe("a", "over", epoch=2, policy=POLICY)
    assert health.observe("a", "over", epoch=2, policy=POLICY) == "reset"
    assert health.resyncs("a") == {"full": 2, "reset": 1}
    assert "again after a full copy" in health.describe("a")["drift"]["suspect_reason"]


def test_a_relapse_counts_from_the_last_full_resync_asked_not_its_retries_nor_a_reset():
    asked = []
    clock, health = tracker(asked)
    health.full("a")
    for _ in range(2):
        health.observe("a", "over", epoch=1, policy=POLICY)
    clock.now = 90.0
    health.tick()  # a retry at 90 s: the relapse window still counts from 0
    health.full("a")
    clock.now = 101.0
    for _ in range(2):
        health.observe("a", "over", epoch=2, policy=POLICY)
    health.full("a")
    for _ in range(2):
        health.observe("a", "over", epoch=3, policy=POLICY)  # within 100 s of the full asked at 101: a reset
    health.full("a")
    for _ in range(2):
        health.observe("a", "over", epoch=4, policy=POLICY)  # the last asked was a reset: a full again
    assert [mode for _, mode, _ in asked] == ["full", "full", "full", "reset", "full"]


def test_a_broken_listener_stops_neither_the_others_nor_the_count():
    asked = []
    _, health = tracker()

    def broken(*args):
        raise RuntimeError("boom")

    health.add_resync_listener(broken)
    health.add_resync_listener(lambda *args: asked.append(args))
    health.full("a")
    for _ in range(2):
        health.observe("a", "over", epoch=1, policy=POLICY)
    assert len(asked) == 1 and health.resyncs("a")["full"] == 1
    health.remove_resync_listener(broken)
    health.remove_resync_listener(broken)


# -- against a model of the states ----------------------------------------------------------------------------------

ONE_OVER = DriftPolicy(suspect_after=1, window=10.0, resync_retry=3.0, relapse_window=8.0)


class HealthModel(RuleBasedStateMachine):
    """States, epochs and resync requests after any sequence of changes, drift checks, ticks and time passing,
    against the rule written plainly (one ``over`` on the current epoch of a healthy index makes it suspect); and
    the readers report the state ``tick`` would store, without storing it."""

    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.asked: list[tuple[str, str, str]] = []
        self.health = IndexHealth(clock=self.clock, reset_window=5.0)
        self.health.add_resync_listener(lambda *args: self.asked.append(args))
        self.state = IndexState.NO_EVENTS
        self.until = 0.0  # when a reset window ends
        self.epoch = 0
        self.modes: list[str] = []  # the resyncs asked, in order
        self.last_full = None  # when the last full resync (not a retry) was asked
        self.retry_at = 0.0

    def effective(self):
        if self.state is IndexState.RESETTING and self.clock.now >= self.until:
            return IndexState.HEALTHY
        return self.state

    @rule(stored=st.booleans())
    def delta(self, stored):
        self.health.delta("a", stored)
        if self.state is IndexState.NO_EVENTS or (self.state is IndexState.RESETTING and stored):
            self.state = IndexState.HEALTHY

    @rule(kind=st.sampled_from(["full", "reset", "forget"]))
    def new_index(self, kind):
        if kind == "full":
            self.health.full("a")
            self.state = IndexState.HEALTHY
        elif kind == "reset":
            self.health.reset("a", "r")
            self.state, self.until = IndexState.RESETTING, self.clock.now + 5.0
        else:
            self.health.forget("a")
            self.state = IndexState.NO_EVENTS
        self.epoch += 1

    @rule(result=st.sampled_from(["match", "over", "under"]), stale=st.booleans())
    def observe(self, result, stale):
        epoch = self.epoch - 1 if stale else self.epoch
        mode = self.health.observe("a", result, epoch=epoch, policy=ONE_OVER)
        expected = None
        if result == "over" and not stale and self.effective() is IndexState.HEALTHY:
            now = self.clock.now
            expected = "reset" if self.last_full is not None and now - self.last_full < 8.0 else "full"
            self.state, self.retry_at = IndexState.SUSPECT, now + 3.0
            self.modes.append(expected)
            self.last_full = now if expected == "full" else None
        assert mode == expected

    @rule()
    def tick(self):
        self.health.tick()
        if self.effective() is not self.state:
            self.state = self.effective()
        elif self.state is IndexState.SUSPECT and self.clock.now >= self.retry_at:
            self.modes.append(self.modes[-1])
            self.retry_at = self.clock.now + 3.0

    @rule(seconds=st.sampled_from([1.0, 3.0, 6.0]))
    def wait(self, seconds):
        self.clock.now += seconds

    @invariant()
    def follows_the_model(self):
        before = (self.health.state("a"), self.health.describe("a"), self.health.resyncs("a"))
        assert self.health.state("a") is self.effective() and self.health.epoch("a") == self.epoch
        assert (self.health.state("a"), self.health.describe("a"), self.health.resyncs("a")) == before
        assert [mode for _, mode, _ in self.asked] == self.modes
        assert self.health.resyncs("a") == {"full": self.modes.count("full"), "reset": self.modes.count("reset")}


TestHealthModel = HealthModel.TestCase
TestHealthModel.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)


def test_a_full_copy_of_unusable_keys_makes_the_index_unusable_until_a_usable_copy_or_a_reset():
    _, health = tracker()
    health.full("a", unusable_keys_reason("the engine hashes otherwise; fix: this"))
    assert health.state("a") is IndexState.UNUSABLE_KEYS and not health.healthy("a")
    assert health.describe("a")["problem"] == "the engine hashes otherwise; fix: this"
    health.delta("a", stored=True)  # its changes keep coming: still unusable
    assert health.state("a") is IndexState.UNUSABLE_KEYS
    health.full("a", "connect")
    assert health.state("a") is IndexState.HEALTHY and health.describe("a")["problem"] is None
    health.full("a", unusable_keys_reason("again"))
    health.forget("a")
    assert health.state("a") is IndexState.NO_EVENTS and health.describe("a")["problem"] is None
