"""KvIndex: leading-run matching, FULL/DELTA/RESET per replica, health states, predicted entries, gauges."""

from __future__ import annotations

import random
import threading

import trio
import trio.testing
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.kv.changes import BlockChanges, KvChangeKind, sliced
from llmgw.kv.drift import DriftPolicy
from llmgw.kv.index import IndexState, KvIndex, refusal_reason
from llmgw.kv.metrics import KvMetrics
from llmgw.testing.prediction_model import PredictionModel


def delta(stored=(), removed=(), block_size=16):
    return BlockChanges(kind=KvChangeKind.DELTA, stored=list(stored), removed=list(removed), block_size=block_size)


def full(stored=(), block_size=16):
    return BlockChanges(kind=KvChangeKind.FULL, stored=list(stored), block_size=block_size)


def reset(reason="gap"):
    return BlockChanges(kind=KvChangeKind.RESET, reason=reason)


def test_match_counts_leading_blocks_only():
    index = KvIndex()
    index.apply("a", full([10, 11, 12, 13]))
    index.apply("b", full([10, 11, 13, 14]))  # lacks 12: its run stops there
    index.apply("c", full([11, 12, 13]))  # lacks block 0: no leading run at all
    keys = [10, 11, 12, 13, 14]
    assert index.match(keys, ["a", "b", "c", "unknown"]) == {"a": 4, "b": 2, "c": 0, "unknown": 0}
    assert index.match([], ["a"]) == {"a": 0}
    assert index.match(keys[:2], ["a", "b"]) == {"a": 2, "b": 2}
    assert index.match(keys, ["a"]) == {"a": 4}  # only the candidates asked for


def test_match_agrees_with_a_brute_force_reference():
    rng = random.Random(5)
    index = KvIndex()
    held = {}
    for name in "abcdef":
        keys = set(rng.sample(range(60), 40))
        held[name] = keys
        index.apply(name, full(keys))
    for _ in range(300):
        prompt = [rng.randrange(60) for _ in range(rng.randrange(0, 30))]
        names = rng.sample("abcdef", rng.randrange(1, 7))
        expected = {}
        for name in names:
            run = 0
            while run < len(prompt) and prompt[run] in held[name]:
                run += 1
            expected[name] = run
        assert index.match(prompt, names) == expected


def test_delta_full_and_reset_change_only_that_replica():
    index = KvIndex()
    index.apply("a", delta([1, 2, 3]))
    index.apply("b", delta([1, 2, 3]))
    index.apply("a", delta([4], removed=[3]))
    assert index.keys("a") == {1, 2, 4} and index.keys("b") == {1, 2, 3}
    index.apply("a", full([7, 8]))  # replaces a's keys
    assert index.keys("a") == {7, 8} and index.keys("b") == {1, 2, 3}
    assert index.match([1, 2, 3], ["a", "b"]) == {"a": 0, "b": 3}
    index.apply("b", reset("engine_restart"))
    assert index.keys("b") == set() and index.keys("a") == {7, 8}
    assert index.match([7, 8], ["a", "b"]) == {"a": 2, "b": 0}
    assert index.blocks("a") == 2 and index.blocks("b") == 0
    index.apply("a", delta(removed=[99]))  # removing what it does not hold changes nothing
    assert index.keys("a") == {7, 8}


def test_block_size_is_per_replica():
    index = KvIndex()
    index.apply("a", full([1], block_size=16))
    index.apply("b", full([2], block_size=64))
    index.apply("c", reset())
    assert (index.block_size("a"), index.block_size("b"), index.block_size("c")) == (16, 64, None)


async def test_health_states(autojump_clock):
    index = KvIndex(clock=trio.current_time, reset_window=5.0)
    assert index.state("a") is IndexState.NO_EVENTS
    index.apply("a", full([1]))
    assert index.healthy("a")
    index.apply("a", reset("cleared"))
    assert index.state("a") is IndexState.RESETTING
    assert index.describe("a")["last_reset_reason"] == "cleared"
    index.apply("a", delta(removed=[5]))  # no fresh stores: still resetting
    assert index.state("a") is IndexState.RESETTING
    index.apply("a", delta([2]))  # fresh stores: healthy again
    assert index.healthy("a")
    index.apply("a", reset())
    index.apply("a", full([3]))  # a full copy ends it too
    assert index.healthy("a")
    index.apply("a", reset())
    await trio.sleep(4.9)
    assert index.state("a") is IndexState.RESETTING
    await trio.sleep(0.2)  # the window ends: an empty cache is a known state
    assert index.healthy("a")
    index.forget("a")  # the agent's stream was lost
    assert index.state("a") is IndexState.NO_EVENTS and index.blocks("a") == 0
    index.apply("b", delta([1]))  # a first delta counts as the first events
    assert index.healthy("b")


async def test_predicted_entries_count_and_expire(autojump_clock):
    index = KvIndex(clock=trio.current_time)
    index.apply("a", full([1, 2]))
    index.predict("b", [1, 2, 3, 4], ttl=2.0)
    assert index.match([1, 2, 3, 4], ["a", "b"]) == {"a": 2, "b": 4}
    assert index.match([1, 2, 3, 4], ["a", "b"], predicted=False) == {"a": 2, "b": 0}
    assert index.match_detail([1, 2, 3, 4], ["a", "b"]) == {"a": (2, 2), "b": (0, 4)}
    index.predict("a", [1, 2, 3], ttl=2.0)  # a confirmed run extended by a prediction
    assert index.match_detail([1, 2, 3, 4], ["a"]) == {"a": (2, 3)}
    assert index.blocks("b") == 0 and index.predicted_keys == 4  # never in the confirmed sets
    await trio.sleep(1.9)
    assert index.match([1, 2, 3, 4], ["b"]) == {"b": 4}
    await trio.sleep(0.2)
    assert index.match([1, 2, 3, 4], ["a", "b"]) == {"a": 2, "b": 0}
    assert index.predicted_keys == 0


async def test_a_newer_prediction_keeps_a_key_alive(autojump_clock):
    index = KvIndex(clock=trio.current_time, predicted_ttl=2.0)
    index.predict("a", [1, 2])
    await trio.sleep(1.5)
    index.predict("a", [1])
    await trio.sleep(1.0)
    assert index.match([1, 2], ["a"]) == {"a": 1}
    await trio.sleep(1.1)
    assert index.match([1, 2], ["a"]) == {"a": 0}


def test_removed_replica_frees_its_slot_and_predictions():
    index = KvIndex()
    index.apply("a", full([1, 2]))
    index.predict("a", [1, 2, 3])
    index.remove("a")
    assert index.replicas() == [] and index.predicted_keys == 0
    index.apply("b", full([5]))  # reuses the slot: inherits nothing
    assert index.match([1, 2, 3], ["b"]) == {"b": 0}
    assert index.match([5], ["b"]) == {"b": 1}


def test_refusal_reasons():
    changes = delta([1])
    assert refusal_reason(changes, "node-1", "node-1") is None
    assert refusal_reason(changes, "node-1", "node-2") == "foreign_replica"
    assert refusal_reason(changes, "node-1", None) == "unknown_replica"


def test_gauges_read_the_index_at_scrape_time():
    registry = CollectorRegistry()
    metrics = KvMetrics.for_registry(registry)
    assert KvMetrics.for_registry(registry) is metrics  # one per registry
    index = KvIndex()
    metrics.track_index(index)
    metrics.track_index(index)
    index.apply("a", full([1, 2, 3]))
    index.apply("b", reset())
    text = generate_latest(registry).decode()
    assert 'llmgw_kv_index_blocks{model="",replica="a"} 3.0' in text
    assert 'llmgw_kv_index_blocks{model="",replica="b"} 0.0' in text
    assert 'llmgw_kv_index_state{model="",replica="a",state="healthy"} 1.0' in text
    assert 'llmgw_kv_index_state{model="",replica="b",state="resetting"} 1.0' in text


# -- resets drop predicted entries; drift, suspect and resyncs ---------------------------------------------------------

def test_a_reset_or_forget_drops_that_replicas_predicted_entries_only():
    index = KvIndex()
    for name in "ab":
        index.apply(name, full([]))
        index.predict(name, [1, 2, 3])
    index.predict("c", [1, 2])
    assert index.match([1, 2, 3], "abc") == {"a": 3, "b": 3, "c": 2}
    index.apply("a", reset("cleared"))  # /reset_prefix_cache: AllBlocksCleared
    assert index.match([1, 2, 3], "abc") == {"a": 0, "b": 3, "c": 2}
    index.forget("b")  # the stream that fed it is gone
    assert index.match([1, 2, 3], "abc") == {"a": 0, "b": 0, "c": 2}
    index.apply("c", reset("engine_restart"))
    assert index.match([1, 2, 3], "abc") == {"a": 0, "b": 0, "c": 0} and index.predicted_keys == 0


def test_an_eviction_reported_after_the_requests_own_store_drops_its_prediction():
    """Seen with vLLM evicting: a request's blocks predicted, stored, then evicted by a later request must not
    be promised again by the prediction (for up to predicted_ttl) once the engine said they are gone."""
    index = KvIndex()
    for name in "ab":
        index.apply(name, full([]))
        index.predict(name, [1, 2, 3, 4])
    index.apply("a", delta(stored=[1, 2, 3, 4]))  # its prefill's events: the prediction settles
    index.apply("a", delta(removed=[4, 3]))  # evicted, tail first
    assert index.match([1, 2, 3, 4], "ab") == {"a": 2, "b": 4}
    index.apply("a", delta(stored=[3]))  # stored again: confirmed
    assert index.match([1, 2, 3, 4], "ab") == {"a": 3, "b": 4}
    index.apply("b", full([1]))  # a FULL copy keeps the predictions of a request whose events are not in yet
    assert index.match([1, 2, 3, 4], "ab") == {"a": 3, "b": 4}
    assert index.predicted_keys == 4


def test_an_eviction_reported_before_the_requests_own_store_keeps_its_prediction():
    """Seen with vLLM, back to back requests: block 3 was evicted before the engine took request A (A recomputes
    and stores it); the removal reaches the index after A was routed, the store after B was. B is predicted what
    the engine holds when B arrives: the block A stored again."""
    index = KvIndex()
    index.apply("a", full([1, 2, 3]))
    index.predict("a", [1, 2, 3, 4])  # request A: 3 blocks held as far as the index knows
    index.apply("a", delta(removed=[3]))  # an eviction from before A: the engine recomputes block 3 for A
    assert index.match([1, 2, 3, 4], ["a"]) == {"a": 4}  # request B, routed now
    assert index.match_detail([1, 2, 3, 4], ["a"]) == {"a": (2, 4)}
    index.apply("a", delta(stored=[3, 4]))  # A's prefill: confirmed, and A settles
    index.apply("a", delta(removed=[4]))  # an eviction after A: the cache is gone
    assert index.match_detail([1, 2, 3, 4], ["a"]) == {"a": (3, 3)}


def test_a_removal_in_the_same_delta_as_the_settling_store_is_an_eviction():
    index = KvIndex()
    index.apply("a", full([1, 2]))
    index.predict("a", [1, 2, 3])
    index.apply("a", delta(stored=[3], removed=[1]))  # a removal and a store within one flush
    assert index.match([1, 2, 3], ["a"]) == {"a": 0}


def test_a_settled_prediction_lets_a_removal_drop_its_entry():
    """The response showed every predicted block served from cache: nothing of it is stored again, so a removal
    reported now is an eviction."""
    index = KvIndex()
    index.apply("a", full([1, 2, 3]))
    unsettled = index.predict("a", [1, 2, 3])
    settled = index.predict("a", [1, 2])
    index.settle(settled)
    index.apply("a", delta(removed=[2]))
    assert index.match([1, 2, 3], ["a"]) == {"a": 3}  # the first request's events are not in yet
    index.settle(unsettled)
    index.apply("a", delta(removed=[3]))
    assert index.match([1, 2, 3], ["a"]) == {"a": 2}  # 2 stays predicted: the removal came before it settled
    index.settle(unsettled)  # again: nothing
    assert index.match([1, 2, 3], ["a"]) == {"a": 2}


def test_unpredict_drops_one_requests_prediction_and_keeps_the_others():
    index = KvIndex()
    index.apply("a", full([]))
    first = index.predict("a", [1, 2, 3])
    index.predict("a", [1, 2])
    index.unpredict(first)  # its attempt failed before the engine took it
    assert index.match([1, 2, 3], ["a"]) == {"a": 2}
    index.unpredict(first)
    index.unpredict(None)
    assert index.match([1, 2, 3], ["a"]) == {"a": 2} and index.predicted_keys == 2


async def test_predictions_of_one_key_on_two_replicas_expire_each_on_its_own(autojump_clock):
    index = KvIndex(clock=trio.current_time, predicted_ttl=2.0)
    index.predict("a", [1, 2])
    await trio.sleep(1.5)
    index.predict("b", [1, 2])
    await trio.sleep(1.0)
    assert index.match([1, 2], "ab") == {"a": 0, "b": 2}


def test_a_reset_drops_the_predictions_and_their_later_settle_or_unpredict_is_harmless():
    index = KvIndex()
    index.apply("a", full([]))
    old = index.predict("a", [1, 2])
    index.apply("a", reset("cleared"))
    new = index.predict("a", [1])
    index.settle(old)
    index.unpredict(old)
    assert index.match([1, 2], ["a"]) == {"a": 1}
    index.apply("a", delta(removed=[1]))  # the new prediction is unsettled: kept
    assert index.match([1, 2], ["a"]) == {"a": 1}
    index.unpredict(new)
    assert index.predicted_keys == 0


def drifting_index(resync_log):
    clock = trio.testing.MockClock()
    index = KvIndex(clock=clock.current_time)
    index.add_resync_listener(lambda *args: resync_log.append(args))
    index.apply("a", full([1, 2]))
    index.apply("b", full([1, 2]))
    return clock, index


POLICY = DriftPolicy(suspect_after=3, window=60.0, relapse_window=600.0, resync_retry=30.0)


def test_over_drifts_within_the_window_make_only_that_replica_suspect_and_ask_for_a_full_copy():
    asked = []
    clock, index = drifting_index(asked)
    epoch = index.epoch("a")
    for result in ("over", "over", "match", "under", "under"):
        assert index.observe("a", result, epoch=epoch, policy=POLICY) is None
    clock.jump(61)  # the first two have left the window
    assert index.observe("a", "over", epoch=epoch, policy=POLICY) is None
    assert index.observe("a", "over", epoch=epoch, policy=POLICY) is None
    assert index.state("a") is IndexState.HEALTHY and asked == []
    assert index.observe("a", "over", epoch=epoch, policy=POLICY) == "full"
    assert index.state("a") is IndexState.SUSPECT and index.state("b") is IndexState.HEALTHY
    assert asked == [("a", "full", index.describe("a")["drift"]["suspect_reason"])]
    described = index.describe("a")
    assert described["state"] == "suspect" and described["blocks"] == 2
    assert described["drift"]["over"] == 5 and described["drift"]["match"] == 1 and described["drift"]["under"] == 2
    assert described["drift"]["resyncs"] == {"full": 1, "reset": 0} and described["drift"]["last_resync"] == "full"
    assert index.drift_summary()["a"] == {"full": 1, "reset": 0}
    # The FULL copy answers: healthy again, a new epoch; checks of decisions made before it do not count.
    index.apply("a", full([1, 2]))
    assert index.state("a") is IndexState.HEALTHY and index.epoch("a") == epoch + 1
    for _ in range(5):
        assert index.observe("a", "over", epoch=epoch, policy=POLICY) is None
    assert index.state("a") is IndexState.HEALTHY and len(asked) == 1


def test_a_relapse_after_a_full_copy_asks_for_a_reset_and_the_reset_answers_it():
    asked = []
    clock, index = drifting_index(asked)
    for _ in range(3):
        index.observe("a", "over", epoch=index.epoch("a"), policy=POLICY)
    index.apply("a", full([1, 2]))  # the same (wrong) mirror: the engine never published what it dropped
    clock.jump(100)
    for _ in range(3):
        index.observe("a", "over", epoch=index.epoch("a"), policy=POLICY)
    assert [mode for _, mode, _ in asked] == ["full", "reset"] and "again after a full copy" in asked[1][2]
    index.apply("a", reset("resync"))  # the agent dropped its mirror
    assert index.state("a") is IndexState.RESETTING and index.blocks("a") == 0
    index.apply("a", delta(stored=[7]))
    assert index.state("a") is IndexState.HEALTHY
    # Long after (beyond the relapse window) a new suspect episode starts with a full copy again.
    clock.jump(700)
    for _ in range(3):
        index.observe("a", "over", epoch=index.epoch("a"), policy=POLICY)
    assert [mode for _, mode, _ in asked] == ["full", "reset", "full"]


def test_a_suspect_index_asks_again_while_no_answer_comes_and_deltas_do_not_end_it():
    asked = []
    clock, index = drifting_index(asked)
    for _ in range(3):
        index.observe("a", "over", epoch=index.epoch("a"), policy=POLICY)
    index.apply("a", delta(stored=[3]))  # ordinary changes keep flowing: not an answer
    clock.jump(29)
    index.tick()
    assert index.state("a") is IndexState.SUSPECT and len(asked) == 1
    clock.jump(2)
    index.tick()  # the gateway's maintenance task: reading the state asks nothing
    assert index.state("a") is IndexState.SUSPECT and [mode for _, mode, _ in asked] == ["full", "full"]
    assert index.describe("a")["drift"]["resyncs"]["full"] == 2
    index.forget("a")  # the stream dropped: its reconnect sends a FULL anyway
    assert index.state("a") is IndexState.NO_EVENTS


def suspect_and_resetting(asked):
    """``a`` suspect with its retry due, ``b`` resetting with its window over; nothing ticked since."""
    clock, index = drifting_index(asked)
    for _ in range(3):
        index.observe("a", "over", epoch=index.epoch("a"), policy=POLICY)
    index.apply("b", reset("cleared"))
    clock.jump(31)  # past a's resync_retry (30 s) and b's reset_window (5 s)
    return clock, index


def read_everything(index):
    return (index.state("a"), index.state("b"), index.healthy("a"), index.healthy("b"), index.summary(),
            index.describe("a"), index.describe("b"), index.drift_summary(), index.predicted_keys)


def test_readers_never_ask_for_a_resync_nor_change_what_they_read_next():
    asked = []
    _, index = suspect_and_resetting(asked)
    first = read_everything(index)
    for _ in range(3):
        assert read_everything(index) == first
    assert len(asked) == 1 and first[5]["drift"]["resyncs"] == {"full": 1, "reset": 0}
    assert first[:2] == (IndexState.SUSPECT, IndexState.HEALTHY)  # b's window is over: reported, not stored


def test_tick_asks_again_for_each_due_resync_in_its_mode_and_ends_reset_windows():
    asked = []
    clock, index = suspect_and_resetting(asked)
    assert index.health._replicas["b"].state is IndexState.RESETTING
    index.tick()
    index.tick()  # one retry per retry period, however often it ticks
    assert asked[1:] == [("a", "full", "no answer to the last resync request")]
    assert index.health._replicas["b"].state is IndexState.HEALTHY and index.state("b") is IndexState.HEALTHY
    assert index.describe("a")["drift"]["resyncs"] == {"full": 2, "reset": 0}
    index.apply("a", full([1, 2]))  # the answer; then a relapse asks for a reset, retried as a reset
    for _ in range(3):
        index.observe("a", "over", epoch=index.epoch("a"), policy=POLICY)
    clock.jump(29)
    index.tick()
    assert [mode for _, mode, _ in asked] == ["full", "full", "reset"]
    clock.jump(1)
    index.tick()
    assert asked[3:] == [("a", "reset", "no answer to the last resync request")]


def test_tick_drops_expired_predictions():
    clock, index = drifting_index([])
    index.predict("a", [7, 8], ttl=1.0)
    clock.jump(2)
    assert index.predicted_keys == 0 and len(index.predictions._heap) == 1  # counted out by the reader, still there
    index.tick()
    assert index.predictions._heap == [] and index.predictions.masks == {} and index.keys("a") == {1, 2}


async def test_a_scrape_in_a_worker_thread_while_a_resync_is_due_asks_nothing_and_tick_then_does():
    asked = []
    clock, index = suspect_and_resetting(asked)
    threads = []
    index.add_resync_listener(lambda *args: threads.append(threading.get_ident()))
    registry = CollectorRegistry()
    KvMetrics.for_registry(registry).track_index(index)
    summary = await trio.to_thread.run_sync(index.summary)
    text = (await trio.to_thread.run_sync(generate_latest, registry)).decode()
    assert summary == {"a": (2, "suspect"), "b": (0, "healthy")} and len(asked) == 1 and threads == []
    assert 'llmgw_kv_index_resyncs_total{mode="full",model="",replica="a"} 1.0' in text
    index.tick()
    assert len(asked) == 2 and threads == [threading.get_ident()]


async def test_maintain_ticks_until_cancelled(autojump_clock):
    asked = []
    index = KvIndex(clock=trio.current_time)
    index.add_resync_listener(lambda *args: asked.append(args))
    index.apply("a", full([1]))
    for _ in range(3):
        index.observe("a", "over", epoch=index.epoch("a"), policy=POLICY)
    with trio.move_on_after(95):
        await index.maintain(interval=0.25)
    assert [mode for _, mode, _ in asked] == ["full"] * 4  # asked at 0, retried at 30, 60 and 90 s


async def test_the_gateway_runs_the_index_maintenance(gateway_in_process):
    gw = await gateway_in_process("models: []\n")
    index, asked = gw.gateway.kv_index, []
    index.add_resync_listener(lambda *args: asked.append(args))
    index.apply("x", full([1]))
    index.observe("x", "over", epoch=index.epoch("x"), policy=DriftPolicy(suspect_after=1, resync_retry=0.05))
    with trio.fail_after(5):  # real time: the gateway's index runs on time.monotonic
        while len(asked) < 2:
            await trio.sleep(0.05)
    assert asked[1] == ("x", "full", "no answer to the last resync request")


def test_suspect_after_zero_never_suspects_and_a_failing_listener_stops_nothing():
    asked = []
    clock, index = drifting_index(asked)

    def broken(*args):
        raise RuntimeError("boom")

    index.health._listeners.insert(0, broken)
    for _ in range(10):
        index.observe("a", "over", epoch=index.epoch("a"), policy=DriftPolicy(suspect_after=0))
    assert index.state("a") is IndexState.HEALTHY and index.describe("a")["drift"]["over"] == 10
    for _ in range(3):
        index.observe("a", "over", epoch=index.epoch("a"), policy=POLICY)
    assert index.state("a") is IndexState.SUSPECT and len(asked) == 1
    index.remove_resync_listener(broken)
    assert index.observe("unknown", "over", epoch=0, policy=POLICY) is None


def test_the_state_gauge_shows_suspect_and_the_resync_counter():
    registry = CollectorRegistry()
    metrics = KvMetrics.for_registry(registry)
    clock, index = drifting_index([])
    metrics.track_index(index)
    for _ in range(3):
        index.observe("a", "over", epoch=index.epoch("a"), policy=POLICY)
    text = generate_latest(registry).decode()
    assert 'llmgw_kv_index_state{model="",replica="a",state="suspect"} 1.0' in text
    assert 'llmgw_kv_index_resyncs_total{mode="full",model="",replica="a"} 1.0' in text


# -- predicted entries against a model of their rule ------------------------------------------------------------------

KEYS = st.lists(st.integers(1, 6), min_size=1, max_size=4, unique=True)
REPLICA = st.sampled_from("ab")


class PredictionRule(RuleBasedStateMachine):
    """The index's predicted entries against the rule (:mod:`llmgw.kv.predictions`) written plainly
    (:class:`~llmgw.testing.prediction_model.PredictionModel`), through the index: a DELTA's stores and removals,
    a RESET, and ``match``."""

    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.index = KvIndex(clock=lambda: self.now, predicted_ttl=2.0)
        self.confirmed: dict[str, set[int]] = {"a": set(), "b": set()}
        self.model = PredictionModel(ttl=2.0)

    @rule(replica=REPLICA, keys=KEYS)
    def predict(self, replica, keys):
        self.model.predict(replica, keys, self.now, None, self.index.predict(replica, keys))

    @rule(replica=REPLICA, stored=st.lists(st.integers(1, 6), max_size=3, unique=True),
          removed=st.lists(st.integers(1, 6), max_size=3, unique=True))
    def delta(self, replica, stored, removed):
        removed = [k for k in removed if k not in stored]  # the mirror nets a key out of one of the two lists
        self.index.apply(replica, delta(stored, removed))
        self.model.stored(replica, stored, self.now)
        self.model.evicted(replica, removed, self.now)
        self.confirmed[replica] -= set(removed)
        self.confirmed[replica] |= set(stored)

    @rule(replica=REPLICA)
    def reset(self, replica):
        self.index.apply(replica, reset("cleared"))
        self.confirmed[replica].clear()
        self.model.drop(replica, self.now)

    @precondition(lambda self: self.model.predictions)
    @rule(data=st.data(), settle=st.booleans())
    def settle_or_drop(self, data, settle):
        p = data.draw(st.sampled_from(self.model.predictions))
        if settle:
            self.index.settle(p.handle)
            self.model.settle(p, self.now)
        else:
            self.index.unpredict(p.handle)
            self.model.unpredict(p)

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.5]))
    def wait(self, seconds):
        self.now += seconds

    @invariant()
    def matches_the_rule(self):
        for replica in "ab":
            predicted = self.model.held(self.now, replica)
            for key in range(1, 7):
                held = key in self.confirmed[replica] or key in predicted
                assert self.index.match([key], [replica])[replica] == int(held), (replica, key)
        assert self.index.predicted_keys == len(self.model.held(self.now))


TestPredictionRule = PredictionRule.TestCase
TestPredictionRule.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)


def test_prediction_listeners_hear_local_predictions_only():
    index = KvIndex(predicted_ttl=3.0)
    index.apply("a", full([1]))
    heard = []
    index.add_prediction_listener(lambda *args: heard.append(args))
    index.predict("a", [1, 2, 3])
    index.predict("a", [4], ttl=0.5)
    index.predict("a", [])  # nothing to predict: nothing to share
    assert heard == [("a", [1, 2, 3], 3.0), ("a", [4], 0.5)]
    assert index.predict("a", [7, 8], ttl=1.0, remote=True) is not None  # another process's: no echo
    assert len(heard) == 2 and index.match([7, 8], ["a"]) == {"a": 2}


def test_a_failing_prediction_listener_fails_no_prediction():
    index = KvIndex()
    heard = []

    def broken(*args):
        raise RuntimeError("boom")

    index.add_prediction_listener(broken)
    index.add_prediction_listener(lambda *args: heard.append(args))
    assert index.predict("a", [1, 2]) is not None and len(heard) == 1
    index.remove_prediction_listener(broken)
    index.predict("a", [3])
    assert len(heard) == 2


def test_a_remote_prediction_for_an_unknown_replica_creates_no_slot():
    index = KvIndex()
    assert index.predict("ghost", [1, 2], ttl=2.0, remote=True) is None
    assert index.replicas() == [] and index.predicted_keys == 0
    index.predict("local", [1, 2], ttl=2.0)  # a local one does (the tier predicts for replicas it routes to)
    assert index.replicas() == ["local"]


async def test_a_remote_prediction_expires_settles_and_resets_as_a_local_one_and_never_touches_confirmed(
        autojump_clock):
    index = KvIndex(clock=trio.current_time)
    index.apply("a", full([1, 2]))
    index.apply("b", full([]))
    index.predict("b", [1, 2, 3], ttl=1.0, remote=True)
    assert index.match_detail([1, 2, 3], ["a", "b"]) == {"a": (2, 2), "b": (0, 3)}
    await trio.sleep(1.01)
    assert index.match([1, 2, 3], ["b"]) == {"b": 0} and index.keys("a") == {1, 2} and index.blocks("b") == 0
    remote = index.predict("b", [5, 6], ttl=5.0, remote=True)
    index.apply("b", delta(stored=[5]))  # its prefill's events are in: settled, so a removal now drops it
    assert remote is not None and remote.settled
    index.apply("b", delta(removed=[6]))
    assert index.match([5, 6], ["b"]) == {"b": 1}
    index.predict("b", [8, 9], ttl=5.0, remote=True)
    index.apply("b", reset())
    assert index.match([8, 9], ["b"]) == {"b": 0} and index.predicted_keys == 0


key_sets = st.lists(st.integers(0, 200), max_size=60, unique=True)


@given(before=key_sets, kind=st.sampled_from([KvChangeKind.FULL, KvChangeKind.DELTA]), stored=key_sets,
       removed=key_sets, size=st.integers(1, 20))
def test_a_change_applied_in_slices_leaves_the_index_as_the_whole_change(before, kind, stored, removed, size):
    """What a follower applies a slice at a time (llmgw.cluster.follower) ends where the whole change does."""
    removed = [key for key in removed if key not in stored]  # a net delta: no key both stored and removed
    if kind is KvChangeKind.FULL:
        removed = []
    whole, in_slices = KvIndex(), KvIndex()
    for index in (whole, in_slices):
        index.apply("r", BlockChanges(KvChangeKind.FULL, 16, list(before)))
    change = BlockChanges(kind, 16, stored, removed, "why")
    whole.apply("r", change)
    parts = sliced(change, size)
    for part in parts:
        assert len(part.stored) <= size and len(part.removed) <= size
        in_slices.apply("r", part)
    assert in_slices.keys("r") == whole.keys("r")
    assert in_slices.state("r") == whole.state("r")
