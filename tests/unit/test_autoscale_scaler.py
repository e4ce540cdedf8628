"""The autoscaler's decision core, rule by rule, with explicit times (no sleeps), then its properties (hypothesis)."""

from __future__ import annotations

import dataclasses
import math

from hypothesis import given, settings, strategies as st

from llmgw.autoscale.model import AutoscaleSettings, DeploymentView, ModelSignals, ReplicaCounts
from llmgw.autoscale.scaler import DOWN_FRACTION, TargetScaler, is_idle
from llmgw.config import parse_config

FAST = AutoscaleSettings(min_replicas=1, max_replicas=8, queued_per_replica=4, kv_usage=0.8, scale_up_after=5,
                         scale_down_after=60, idle_to_zero=600)
MANY_GPUS = {None: 1000}


def view(key: str = "a", *, desired: int = 2, ready: int | None = None, starting: int = 0, unplaceable: int = 0,
         queued: int = 0, inflight: int = 0, kv: float | None = None, ttft: float | None = None,
         last_request_at: float | None = None, gpus: int = 1, gpu_class: str | None = None, at: float = 0.0,
         arrivals: float = 0.0, served: float = 0.0, **settings_changes) -> DeploymentView:
    settings_ = dataclasses.replace(FAST, **settings_changes)
    ready = desired - starting - unplaceable if ready is None else ready
    return DeploymentView(
        key=key, model=f"model-{key}", settings=settings_,
        counts=ReplicaCounts(ready=ready, starting=starting, unplaceable=unplaceable), desired=desired,
        gpus_per_replica=gpus, gpu_class=gpu_class,
        signals=ModelSignals(model=f"model-{key}", at=at, queued=queued, inflight=inflight, kv_usage=kv,
                             ttft_attainment=ttft, last_request_at=last_request_at, arrivals_per_s=arrivals,
                             served_per_s=served))


def steps(decisions):
    return [(d.key, d.kind, d.current, d.desired) for d in decisions if d.kind != "hold"]


def holds(decisions):
    return [d.reason for d in decisions if d.kind == "hold"]


# -- targets and windows -------------------------------------------------------------------------------------------


def test_a_queue_over_target_steps_up_after_the_window_straight_to_what_it_needs():
    scaler = TargetScaler()
    busy = view(queued=20, inflight=8, kv=0.5, last_request_at=0, arrivals=5.0, served=2.0)  # 1/s per replica
    first = scaler.decide(0.0, [busy], MANY_GPUS)
    assert steps(first) == [] and "stepping up if it holds for 5 s" in holds(first)[0]
    assert steps(scaler.decide(4.9, [busy], MANY_GPUS)) == []
    up = scaler.decide(5.0, [busy], MANY_GPUS)
    assert steps(up) == [("a", "up", 2, 5)]  # ceil(20 / 4) (and 5 req/s at 1 per replica): not 2 -> 3 -> 4 -> 5
    assert "20 requests queued over 2 provisioned replicas (target 4 per replica) for 5.0 s: 2 -> 5" in up[0].reason
    assert scaler.desired("a", 2) == 5


def test_a_need_that_breaks_off_restarts_its_window():
    scaler = TargetScaler()
    busy, calm = view(queued=20, kv=0.5), view(queued=0, inflight=4, kv=0.5)
    scaler.decide(0.0, [busy], MANY_GPUS)
    assert scaler.decide(3.0, [calm], MANY_GPUS) == []  # steady is not recorded
    assert scaler.decide(6.0, [busy], MANY_GPUS) == []  # nor the same wait again while a signal flickers
    assert steps(scaler.decide(11.0, [busy], MANY_GPUS)) == [("a", "up", 2, 5)]


def test_the_same_wait_is_recorded_again_after_a_quiet_minute():
    scaler = TargetScaler()
    busy, calm = view(queued=20, kv=0.5), view(queued=0, inflight=4, kv=0.5)
    assert len(holds(scaler.decide(0.0, [busy], MANY_GPUS))) == 1
    scaler.decide(1.0, [calm], MANY_GPUS)
    scaler.decide(61.0, [calm], MANY_GPUS)
    assert len(holds(scaler.decide(62.0, [busy], MANY_GPUS))) == 1


def test_a_new_scaler_adopts_the_count_running_and_forgets_a_deployment_no_longer_autoscaled():
    scaler = TargetScaler({"a": FAST})
    assert scaler.decide(0.0, [view(desired=5, kv=0.5, inflight=10)], MANY_GPUS) == []
    assert scaler.desired("a", 1) == 5  # not min, not the config's count: what runs
    scaler.decide(1.0, [view(desired=5, min_replicas=2, max_replicas=2)], MANY_GPUS)
    assert scaler.desired("a", 2) == 2


def test_kv_usage_over_target_asks_for_what_brings_it_under():
    scaler = TargetScaler()
    hot = view(desired=2, kv=0.95, inflight=10)
    scaler.decide(0.0, [hot], MANY_GPUS)
    up = scaler.decide(5.0, [hot], MANY_GPUS)
    assert steps(up) == [("a", "up", 2, 3)]  # ceil(2 x 0.95 / 0.8)
    assert "KV usage 0.95 over 2 ready replicas > target 0.8" in up[0].reason


def test_ttft_attainment_under_target_asks_for_one_more():
    scaler = TargetScaler()
    slow = view(desired=2, kv=0.5, inflight=4, ttft=0.80, ttft_slo=1.0, attainment=0.95)
    scaler.decide(0.0, [slow], MANY_GPUS)
    up = scaler.decide(5.0, [slow], MANY_GPUS)
    assert steps(up) == [("a", "up", 2, 3)] and "TTFT attainment 80.0% of 1 s < target 95%" in up[0].reason
    ignored = TargetScaler()  # no ttft_slo: attainment is not a target
    for now in (0.0, 10.0):
        assert steps(ignored.decide(now, [view(desired=2, kv=0.5, inflight=4, ttft=0.5)], MANY_GPUS)) == []


def test_the_step_is_capped_at_max_and_says_so_once_at_max():
    scaler = TargetScaler()
    flood = view(desired=2, queued=400, max_replicas=4)
    scaler.decide(0.0, [flood], MANY_GPUS)
    assert steps(scaler.decide(5.0, [flood], MANY_GPUS)) == [("a", "up", 2, 4)]
    at_max = view(desired=4, queued=400, max_replicas=4)
    first = scaler.decide(6.0, [at_max], MANY_GPUS)
    assert holds(first) == ["400 requests queued over 4 provisioned replicas (target 4 per replica): 100 replicas "
                            "needed, capped at max 4"]
    assert scaler.decide(7.0, [at_max], MANY_GPUS) == []  # the same hold is not recorded again


# -- pending-awareness ---------------------------------------------------------------------------------------------


def test_replicas_starting_count_toward_the_queue_target():
    scaler = TargetScaler()
    pending = view(desired=3, ready=1, starting=2, queued=12)  # 12 queued over 3 provisioned: on target
    for now in (0.0, 10.0, 20.0):
        assert steps(scaler.decide(now, [pending], MANY_GPUS)) == []


def test_signals_of_the_ready_replicas_do_not_step_again_while_a_step_is_in_flight():
    scaler = TargetScaler()
    slow = {"kv": 0.5, "inflight": 10, "ttft": 0.5, "ttft_slo": 1.0}  # TTFT under target: one more each time
    scaler.decide(0.0, [view(desired=2, **slow)], MANY_GPUS)
    assert steps(scaler.decide(5.0, [view(desired=2, **slow)], MANY_GPUS)) == [("a", "up", 2, 3)]
    not_yet_placed = view(desired=2, **slow)  # the control plane has not started the third yet
    assert steps(scaler.decide(6.0, [not_yet_placed], MANY_GPUS)) == []
    starting = view(desired=3, ready=2, starting=1, **slow)
    waiting = scaler.decide(7.0, [starting], MANY_GPUS)
    assert steps(waiting) == [] and "but a step is in flight (1 starting, 3 of 3 provisioned)" in holds(waiting)[0]
    for now in (10.0, 60.0, 600.0):  # an engine that takes minutes: never a cascade
        assert scaler.decide(now, [starting], MANY_GPUS) == []
    ready = view(desired=3, **slow)  # ready and still slow: the window starts over
    scaler.decide(601.0, [ready], MANY_GPUS)
    assert steps(scaler.decide(606.0, [ready], MANY_GPUS)) == [("a", "up", 3, 4)]


def test_a_queue_that_proves_more_steps_while_a_step_is_in_flight():
    scaler = TargetScaler()
    starting = view(desired=3, ready=2, starting=1, queued=40, kv=0.99, arrivals=9.0, served=2.0)
    scaler.decide(0.0, [starting], MANY_GPUS)
    assert steps(scaler.decide(5.0, [starting], MANY_GPUS)) == [("a", "up", 3, 8)]  # min(ceil(40 / 4), max 8)


# -- down, hysteresis ----------------------------------------------------------------------------------------------


def test_steps_down_one_replica_after_the_down_window_when_one_fewer_stays_under_target():
    scaler = TargetScaler()
    quiet = view(desired=4, kv=0.2, inflight=3, last_request_at=0)  # 0.2 x 4 / 3 = 0.27 < 0.7 x 0.8
    first = scaler.decide(0.0, [quiet], MANY_GPUS)
    assert "stepping down to 3 if it holds for 60 s" in holds(first)[0]
    assert steps(scaler.decide(59.0, [quiet], MANY_GPUS)) == []
    down = scaler.decide(60.0, [quiet], MANY_GPUS)
    assert steps(down) == [("a", "down", 4, 3)]
    three = view(desired=3, kv=0.2, inflight=3, last_request_at=60)
    assert steps(scaler.decide(61.0, [three], MANY_GPUS)) == []  # another full window after the last step
    assert steps(scaler.decide(120.0, [three], MANY_GPUS)) == []
    assert steps(scaler.decide(121.0, [three], MANY_GPUS)) == [("a", "down", 3, 2)]


def test_hysteresis_holds_when_one_fewer_would_be_near_the_target():
    scaler = TargetScaler()
    # 0.45 x 2 / 1 = 0.9: one fewer would be over 70% of 0.8, though 0.45 is well under the target itself
    for now in (0.0, 100.0, 1000.0):
        assert steps(scaler.decide(now, [view(desired=2, kv=0.45, inflight=3, last_request_at=now)],
                                   MANY_GPUS)) == []
    queue = TargetScaler()  # 6 queued: fine for 2 replicas (target 4 each), over 70% of the target for 1
    for now in (0.0, 100.0, 1000.0):
        assert steps(queue.decide(now, [view(desired=2, queued=6, kv=0.1, last_request_at=now)], MANY_GPUS)) == []


def test_no_kv_reading_steps_a_busy_deployment_down_never_and_an_idle_one_by_the_window():
    scaler = TargetScaler()
    for now in (0.0, 100.0, 1000.0):
        assert steps(scaler.decide(now, [view(desired=3, inflight=5, last_request_at=now)], MANY_GPUS)) == []
    idle = TargetScaler()
    idle.decide(0.0, [view(desired=3, last_request_at=0.0)], MANY_GPUS)
    assert steps(idle.decide(60.0, [view(desired=3, last_request_at=0.0)], MANY_GPUS)) == [("a", "down", 3, 2)]


def test_never_below_min_by_a_step_down():
    scaler = TargetScaler()
    for now in (0.0, 100.0, 200.0):
        assert steps(scaler.decide(now, [view(desired=2, kv=0.0, inflight=1, last_request_at=now, min_replicas=2)],
                                   MANY_GPUS)) == []


def test_a_replica_starting_holds_a_step_down_back():
    scaler = TargetScaler()
    for now in (0.0, 100.0, 200.0):
        assert steps(scaler.decide(now, [view(desired=3, ready=2, starting=1, kv=0.1, inflight=1,
                                              last_request_at=now)], MANY_GPUS)) == []


# -- from zero, to zero --------------------------------------------------------------------------------------------


def test_a_request_for_a_model_with_no_replica_starts_one_at_once():
    scaler = TargetScaler()
    cold = view(desired=0, queued=1, min_replicas=0)
    decided = scaler.decide(0.0, [cold], MANY_GPUS)
    assert steps(decided) == [("a", "from_zero", 0, 1)]
    assert decided[0].reason == "1 request waiting for model-a, which has no replica: starting one at once"
    assert scaler.desired("a", 0) == 1


def test_idle_for_idle_to_zero_returns_to_min():
    scaler = TargetScaler()
    idle = view(desired=2, kv=0.0, last_request_at=100.0, min_replicas=0, idle_to_zero=600, scale_down_after=3600)
    assert steps(scaler.decide(100.0, [idle], MANY_GPUS)) == []
    assert steps(scaler.decide(699.0, [idle], MANY_GPUS)) == []
    to_zero = scaler.decide(700.0, [idle], MANY_GPUS)
    assert steps(to_zero) == [("a", "to_zero", 2, 0)]
    assert "no request for model-a for 600 s (idle_to_zero 600 s): back to min 0" in to_zero[0].reason
    with_min = TargetScaler()
    at_three = view(desired=3, kv=0.0, last_request_at=0.0, min_replicas=2, scale_down_after=900)
    assert steps(with_min.decide(600.0, [at_three], MANY_GPUS)) == [("a", "down", 3, 2)]


def test_idle_counts_from_the_last_step_too():
    scaler = TargetScaler()
    idle = view(desired=2, kv=0.0, last_request_at=0.0, min_replicas=0, idle_to_zero=600)
    scaler.decide(0.0, [idle], MANY_GPUS)
    assert steps(scaler.decide(60.0, [idle], MANY_GPUS)) == [("a", "down", 2, 1)]  # the down window came first
    one = view(desired=1, kv=0.0, last_request_at=0.0, min_replicas=0, idle_to_zero=600)
    assert steps(scaler.decide(600.0, [one], MANY_GPUS)) == []
    assert steps(scaler.decide(660.0, [one], MANY_GPUS)) == [("a", "to_zero", 1, 0)]


def test_a_deployment_never_called_counts_idle_from_when_the_scaler_first_saw_it():
    scaler = TargetScaler()
    never = view(desired=1, min_replicas=0, idle_to_zero=600, scale_down_after=3600)
    assert steps(scaler.decide(1000.0, [never], MANY_GPUS)) == []
    assert steps(scaler.decide(1600.0, [never], MANY_GPUS)) == [("a", "to_zero", 1, 0)]


def test_the_config_bounds_clamp_a_count_outside_them():
    scaler = TargetScaler({"a": dataclasses.replace(FAST, min_replicas=2, max_replicas=4)})
    assert scaler.desired("a", 9) == 4 and scaler.desired("a", 0) == 2 and scaler.desired("other", 7) == 7
    clamped = scaler.decide(0.0, [view(desired=6, max_replicas=4, kv=0.5, inflight=2)], MANY_GPUS)
    assert steps(clamped) == [("a", "down", 6, 4)] and "outside the config's 1..4" in clamped[0].reason


def test_from_config_knows_the_bounds_before_any_decision_and_keeps_the_configured_history():
    config = parse_config("""
agents: {token: t}
autoscale: {history: 10}
profiles: [{name: chat, engine: sim, model_path: tiny}, {name: fixed, engine: sim, model_path: tiny}]
deployments: [{profile: chat, replicas: {min: 1, max: 3}}, {profile: fixed, replicas: 5}]
""")
    scaler = TargetScaler.from_config(config)
    assert scaler.desired("chat", 7) == 3 and scaler.desired("fixed", 5) == 5
    for i in range(12):
        scaler.decide(float(i), [view(f"m{i}", desired=0, queued=1, min_replicas=0)], MANY_GPUS)
    assert len(scaler.history()) == 10


def test_a_deployment_not_autoscaled_is_left_alone():
    scaler = TargetScaler()
    fixed = view(desired=2, queued=100, min_replicas=2, max_replicas=2)
    assert scaler.decide(0.0, [fixed], MANY_GPUS) == [] and scaler.decide(10.0, [fixed], MANY_GPUS) == []
    assert scaler.desired("a", 2) == 2


# -- free GPUs and moves across models -----------------------------------------------------------------------------


def test_a_step_takes_only_what_the_free_gpus_hold():
    scaler = TargetScaler()
    busy = view(desired=2, queued=40, gpus=2)
    scaler.decide(0.0, [busy], {None: 5})
    up = scaler.decide(5.0, [busy], {None: 5})
    assert steps(up) == [("a", "up", 2, 4)]
    assert up[0].reason.endswith(": 2 -> 4 replicas (8 needed; only 2 more fit the free GPUs)")


def test_gpu_classes_are_counted_apart():
    scaler = TargetScaler()
    busy = view(desired=1, queued=8, gpu_class="h100")
    scaler.decide(0.0, [busy], {"a100": 4, None: 4})
    nothing = scaler.decide(5.0, [busy], {"a100": 4, None: 4})
    assert steps(nothing) == [] and "0 free GPUs of class h100" in holds(nothing)[0]
    assert steps(scaler.decide(6.0, [busy], {"a100": 4, "h100": 1, None: 5})) == [("a", "up", 1, 2)]


def test_a_higher_priority_takes_a_replica_from_a_lower_priority_one_never_below_its_min():
    scaler = TargetScaler()
    urgent = view("chat", desired=2, queued=20, priority=10)
    batch = view("batch", desired=3, queued=30, kv=0.7, priority=0, min_replicas=2)
    scaler.decide(0.0, [urgent, batch], {None: 0})
    moved = scaler.decide(5.0, [urgent, batch], {None: 0})
    assert steps(moved) == [("chat", "take", 2, 3), ("batch", "give", 3, 2)]
    take, give = moved
    assert take.taken_from == "batch" and "taking one from batch (priority 0 < 10)" in take.reason
    assert "gives a replica to chat" in give.reason and "drained first" in give.reason
    assert scaler.desired("chat", 2) == 3 and scaler.desired("batch", 3) == 2
    # one move at a time: nothing more while chat's new replica starts; batch is at its min anyway
    starting = view("chat", desired=3, ready=2, starting=1, queued=40, priority=10)
    at_min = view("batch", desired=2, queued=30, kv=0.7, priority=0, min_replicas=2)
    assert steps(scaler.decide(11.0, [starting, at_min], {None: 0})) == []  # the up window starts over
    later = scaler.decide(16.0, [starting, at_min], {None: 0})
    assert steps(later) == []
    assert any("another move between deployments (batch -> chat) is in flight" in r for r in holds(later))
    assert steps(scaler.decide(30.0, [starting, at_min], {None: 0})) == []


def test_at_equal_priority_a_replica_comes_only_from_an_idle_deployment_the_idlest_first():
    scaler = TargetScaler()
    busy = view("a", desired=1, queued=12)
    other_busy = view("b", desired=2, queued=4, kv=0.6)
    idle = view("c", desired=2, last_request_at=0.0, kv=0.0)
    for now in (0.0, 5.0):
        decided = scaler.decide(now, [busy, other_busy, idle], {None: 0})
    assert steps(decided) == [("a", "take", 1, 2), ("c", "give", 2, 1)]
    assert "taking one from c (idle)" in decided[0].reason
    alone = TargetScaler()
    for now in (0.0, 5.0):
        decided = alone.decide(now, [busy, other_busy], {None: 0})
    assert steps(decided) == [] and "no idle or lower-priority deployment" in holds(decided)[0]


def test_the_larger_backlog_per_gpu_gets_the_free_gpus_first_at_equal_priority():
    scaler = TargetScaler()
    light = view("light", desired=4, queued=20)  # 20 / 4 GPUs
    heavy = view("heavy", desired=1, queued=12)  # 12 / 1 GPU
    for now in (0.0, 5.0):
        decided = scaler.decide(now, [light, heavy], {None: 2})
    assert steps(decided) == [("heavy", "up", 1, 3)]
    assert any("0 free GPUs" in reason for reason in holds(decided))


def test_a_giver_must_free_enough_gpus_for_one_replica_of_the_taker():
    scaler = TargetScaler()
    big = view("big", desired=1, queued=12, gpus=4, priority=5)
    small = view("small", desired=2, last_request_at=0.0, kv=0.0, gpus=1)
    for now in (0.0, 5.0):
        decided = scaler.decide(now, [big, small], {None: 2})
    assert steps(decided) == []
    decided = scaler.decide(10.0, [big, small], {None: 3})
    assert steps(decided) == [("big", "take", 1, 2), ("small", "give", 2, 1)]


def test_the_move_ends_when_the_takers_replica_is_ready():
    scaler = TargetScaler()
    urgent, lazy = view("u", desired=1, queued=12, priority=1), view("l", desired=3, last_request_at=0.0, kv=0.0)
    for now in (0.0, 5.0):
        scaler.decide(now, [urgent, lazy], {None: 0})
    ready = view("u", desired=2, queued=12, priority=1)
    lazy2 = view("l", desired=2, last_request_at=0.0, kv=0.0)
    for now in (10.0, 15.0):
        decided = scaler.decide(now, [ready, lazy2], {None: 0})
    assert steps(decided) == [("u", "take", 2, 3), ("l", "give", 2, 1)]


# -- history and status ---------------------------------------------------------------------------------------------


def test_status_says_what_each_deployment_waits_for_and_the_move_in_flight():
    scaler = TargetScaler()
    urgent, lazy = view("u", desired=1, queued=12, priority=1), view("l", desired=3, last_request_at=0.0, kv=0.0)
    scaler.decide(0.0, [urgent, lazy], {None: 0})
    assert scaler.status(2.0)["deployments"]["u"] == {
        "desired": 1, "waiting": "up_pending", "up_need_for": 2.0, "down_need_for": None, "since_last_step": None,
        "busy": None}
    scaler.decide(5.0, [urgent, lazy], {None: 0})
    status = scaler.status(7.0)
    assert status["move"] == {"taker": "u", "giver": "l", "target": 2}
    assert status["deployments"]["l"]["desired"] == 2 and status["deployments"]["l"]["since_last_step"] == 2.0
    assert status["deployments"]["l"]["waiting"] is None




def test_history_is_bounded_newest_last_and_filtered_by_deployment():
    scaler = TargetScaler(history_size=3)
    for i in range(5):
        scaler.decide(float(i), [view(f"m{i}", desired=0, queued=1, min_replicas=0)], MANY_GPUS)
    assert [d.key for d in scaler.history()] == ["m2", "m3", "m4"]
    assert [d.key for d in scaler.history("m4")] == ["m4"]


# -- properties ----------------------------------------------------------------------------------------------------

SIGNALS = st.fixed_dictionaries({
    "queued": st.integers(0, 200), "inflight": st.integers(0, 50),
    "kv": st.none() | st.floats(0.0, 1.0), "ttft": st.none() | st.floats(0.0, 1.0)})
BOUNDS = st.tuples(st.integers(0, 6), st.integers(1, 12)).filter(lambda b: b[0] < b[1])


def run(scaler: TargetScaler, bounds, ticks, *, start: int, ready_after: float, signal_of):
    """Drive ``scaler`` tick by tick; a step's replicas become ready ``ready_after`` seconds after it, a step down
    at once. Yields each tick's time, desired, ready and decisions."""
    low, high = bounds
    desired = ready = start
    since = float("-inf")
    for now, signals in ticks:
        if now - since >= ready_after or desired < ready:
            ready = desired
        current = view(desired=desired, ready=ready, starting=desired - ready, min_replicas=low, max_replicas=high,
                       ttft_slo=1.0, last_request_at=now if signals["queued"] or signals["inflight"] else None,
                       **signal_of(signals))
        decisions = scaler.decide(now, [current], MANY_GPUS)
        for decision in decisions:
            if decision.desired != desired:
                desired, since = decision.desired, now
        yield now, desired, ready, decisions


def as_view_signals(signals):
    return {"queued": signals["queued"], "inflight": signals["inflight"], "kv": signals["kv"], "ttft": signals["ttft"]}


# A load in segments: each segment's signals held for a few ticks, as a real load holds for a while.
SEGMENTS = st.lists(st.tuples(SIGNALS, st.integers(1, 12)), min_size=1, max_size=6)


def timeline(segments, gaps):
    now, ticks, gaps = 0.0, [], iter(gaps * 100)
    for signals, repeat in segments:
        for _ in range(repeat):
            now += next(gaps)
            ticks.append((now, signals))
    return ticks


@settings(max_examples=200, deadline=None)
@given(bounds=BOUNDS, start=st.integers(0, 12), segments=SEGMENTS,
       gaps=st.lists(st.floats(0.1, 400.0), min_size=1, max_size=10))
def test_property_never_below_min_nor_above_max(bounds, start, segments, gaps):
    scaler = TargetScaler()
    for _, desired, _, decisions in run(scaler, bounds, timeline(segments, gaps),
                                        start=min(max(start, bounds[0]), bounds[1]), ready_after=30.0,
                                        signal_of=as_view_signals):
        assert bounds[0] <= desired <= bounds[1]
        assert all(bounds[0] <= d.desired <= bounds[1] for d in decisions)


@settings(max_examples=200, deadline=None)
@given(bounds=BOUNDS, segments=SEGMENTS, gaps=st.lists(st.floats(0.1, 30.0), min_size=1, max_size=10))
def test_property_no_second_step_in_flight_unless_the_queue_proves_it(bounds, segments, gaps):
    scaler = TargetScaler()
    ticks = timeline(segments, gaps)
    queued_at = {now: signals["queued"] for now, signals in ticks}
    for _, _, ready, decisions in run(scaler, bounds, ticks, start=max(1, bounds[0]), ready_after=1e9,
                                      signal_of=as_view_signals):
        for d in decisions:
            if d.kind in ("up", "take") and d.current > ready:  # a step while another is in flight
                assert d.desired <= max(-(-queued_at[d.at] // FAST.queued_per_replica), d.current), d


@settings(max_examples=200, deadline=None)
@given(bounds=BOUNDS, start=st.integers(1, 12), signals=SIGNALS, ticks=st.integers(2, 60),
       gap=st.floats(0.5, 120.0))
def test_property_no_reversal_within_the_windows_under_constant_signals(bounds, start, signals, ticks, gap):
    scaler = TargetScaler()
    moves = []
    for _, _, _, decisions in run(scaler, bounds, [(i * gap, signals) for i in range(ticks)],
                                  start=min(max(start, bounds[0]), bounds[1]), ready_after=0.0,
                                  signal_of=as_view_signals):
        moves += [(d.at, d.desired - d.current) for d in decisions if d.desired != d.current]
    for (t1, step1), (t2, step2) in zip(moves, moves[1:]):
        if (step1 > 0) != (step2 > 0):  # a reversal: only after both windows
            assert t2 - t1 >= min(FAST.scale_down_after, FAST.idle_to_zero), moves


def test_down_fraction_is_the_documented_one():
    assert DOWN_FRACTION == 0.7


HOSTILE = st.one_of(st.integers(-10**12, 10**12), st.floats(allow_nan=True, allow_infinity=True))


@settings(max_examples=200, deadline=None)
@given(queued=st.integers(-10**12, 10**12), inflight=st.integers(-10**12, 10**12), kv=st.none() | HOSTILE,
       ttft=st.none() | HOSTILE, last=st.none() | st.floats(allow_nan=True, allow_infinity=True),
       ready=st.integers(-5, 20), starting=st.integers(-5, 20), desired=st.integers(-5, 20), bounds=BOUNDS)
def test_property_signals_from_anyone_never_break_a_decision(queued, inflight, kv, ttft, last, ready, starting,
                                                            desired, bounds):
    """A load report is written by other processes: whatever it says, the decisions stay within the bounds."""
    scaler = TargetScaler()
    hostile = view(desired=desired, ready=ready, starting=starting, queued=queued, inflight=inflight, kv=kv,
                   ttft=ttft, last_request_at=last, ttft_slo=1.0, min_replicas=bounds[0], max_replicas=bounds[1])
    for now in (0.0, 10.0, 400.0, 1000.0):
        for decision in scaler.decide(now, [hostile], MANY_GPUS):
            assert bounds[0] <= decision.desired <= bounds[1] and decision.reason


def test_a_nan_kv_reading_is_no_reading():
    scaler = TargetScaler()
    busy = view(desired=3, kv=float("nan"), inflight=8, last_request_at=0.0)
    for now in (0.0, 100.0, 1000.0):  # busy without a KV reading: never stepped down
        assert steps(scaler.decide(now, [busy], MANY_GPUS)) == []


FLEET_MEMBER = st.fixed_dictionaries({
    "desired": st.integers(0, 6), "queued": st.integers(0, 60), "inflight": st.integers(0, 20),
    "kv": st.none() | st.floats(0.0, 1.0), "priority": st.integers(0, 3), "gpus": st.integers(1, 4),
    "gpu_class": st.sampled_from([None, "h100", "l4"]), "bounds": BOUNDS})


@settings(max_examples=200, deadline=None)
@given(fleet=st.lists(FLEET_MEMBER, min_size=2, max_size=5), free=st.integers(0, 8), ticks=st.integers(1, 8))
def test_property_across_models_steps_fit_the_free_gpus_and_moves_keep_every_min(fleet, free, ticks):
    scaler = TargetScaler()
    free_gpus = {None: free, "h100": free // 2, "l4": free - free // 2}
    members = {f"d{i}": m for i, m in enumerate(fleet)}
    desired = {key: min(max(m["desired"], m["bounds"][0]), m["bounds"][1]) for key, m in members.items()}

    def view_of(key):
        m = members[key]
        return view(key, desired=desired[key], queued=m["queued"], inflight=m["inflight"], kv=m["kv"],
                    gpus=m["gpus"], gpu_class=m["gpu_class"], priority=m["priority"], min_replicas=m["bounds"][0],
                    max_replicas=m["bounds"][1], last_request_at=0.0)

    for tick in range(ticks):
        views = [view_of(key) for key in members]
        decisions = scaler.decide(tick * 5.0, views, free_gpus)
        by_key = {v.key: v for v in views}
        ups = [d for d in decisions if d.kind in ("up", "from_zero") and d.desired > d.current]
        for gpu_class in (None, "h100", "l4"):
            used = sum((d.desired - d.current) * by_key[d.key].gpus_per_replica for d in ups
                       if gpu_class is None or by_key[d.key].gpu_class == gpu_class)
            assert used <= free_gpus[gpu_class]
        takes, gives = [d for d in decisions if d.kind == "take"], [d for d in decisions if d.kind == "give"]
        assert len(takes) == len(gives) <= 1
        for take, give in zip(takes, gives):
            taker, giver = by_key[take.key], by_key[give.key]
            assert take.taken_from == give.key != take.key and give.desired == give.current - 1
            assert give.desired >= giver.settings.min_replicas
            assert is_idle(giver) or giver.settings.priority < taker.settings.priority
            assert taker.gpu_class is None or giver.gpu_class == taker.gpu_class
        for d in decisions:
            key_settings = by_key[d.key].settings
            assert key_settings.min_replicas <= d.desired <= key_settings.max_replicas
            desired[d.key] = d.desired


# -- no cascade from zero: a backlog proves what serves the arrivals, plus one -------------------------------------


def test_a_backlog_piling_up_during_a_cold_start_starts_one_replica_then_what_the_arrivals_need_plus_one():
    scaler = TargetScaler()
    settings_ = {"min_replicas": 0, "max_replicas": 8}
    assert steps(scaler.decide(0.0, [view(desired=0, queued=1, **settings_)], MANY_GPUS)) == \
        [("a", "from_zero", 0, 1)]
    for now in (1.0, 10.0, 30.0, 59.0):  # 3 requests/s pile up while the first replica takes a minute
        starting = view(desired=1, ready=0, starting=1, queued=int(3 * now), arrivals=3.0, **settings_)
        assert steps(scaler.decide(now, [starting], MANY_GPUS)) == []
    assert scaler.desired("a", 0) == 1  # not ceil(177 / 4) capped at 8
    ready = view(desired=1, ready=1, queued=180, arrivals=3.0, served=2.0, **settings_)  # 2/s per replica
    scaler.decide(60.0, [ready], MANY_GPUS)
    up = scaler.decide(65.0, [ready], MANY_GPUS)
    assert steps(up) == [("a", "up", 1, 3)]  # ceil(3 / 2) serve the arrivals, one more drains the 180
    assert "3.00 requests/s arriving at 2.00/s per ready replica need 2 replicas, plus one to drain the backlog" \
        in up[0].reason


def test_without_a_measured_drain_rate_the_backlogs_count_stands():
    scaler = TargetScaler()
    busy = view(desired=2, queued=40, arrivals=9.0)  # nothing finished yet: no rate to bound it by
    scaler.decide(0.0, [busy], MANY_GPUS)
    assert steps(scaler.decide(5.0, [busy], MANY_GPUS)) == [("a", "up", 2, 8)]


def cold_start(arrivals: float, per_replica: float, high: int, ready_after: float, ticks: int, gap: float):
    """A model called at a steady ``arrivals`` per second from zero: its replicas are ready ``ready_after`` after
    each step, serve ``per_replica`` a second each, and the backlog grows while they cannot keep up. Yields each
    decision with the replicas the arrivals need."""
    scaler = TargetScaler()
    desired, started, queued = 0, [], 0.0
    for tick in range(ticks):
        now = tick * gap
        ready = sum(1 for at in started if now - at >= ready_after)
        capacity = ready * per_replica
        served = min(capacity, arrivals + queued / gap) if ready else 0.0
        queued = max(0.0, queued + (arrivals - served) * gap)
        current = view(desired=desired, ready=ready, starting=len(started) - ready, queued=math.ceil(queued),
                       inflight=ready, arrivals=arrivals, served=served, min_replicas=0, max_replicas=high,
                       scale_up_after=2 * gap, last_request_at=now)
        for decision in scaler.decide(now, [current], MANY_GPUS):
            if decision.desired > desired:
                started += [now] * (decision.desired - desired)
            elif decision.desired < desired:
                started = started[:decision.desired]
            desired = decision.desired
            yield decision


@settings(max_examples=200, deadline=None)
@given(arrivals=st.floats(0.1, 50.0), per_replica=st.floats(0.2, 20.0), high=st.integers(1, 16),
       ready_after=st.floats(5.0, 300.0), ticks=st.integers(10, 200), gap=st.floats(0.1, 10.0))
def test_property_a_backlog_growing_during_a_start_never_provisions_more_than_need_plus_one(
        arrivals, per_replica, high, ready_after, ticks, gap):
    need = math.ceil(arrivals / per_replica)
    for decision in cold_start(arrivals, per_replica, high, ready_after, ticks, gap):
        assert decision.desired <= min(high, need + 1), decision


def test_arrivals_over_what_the_saturated_replicas_serve_step_up_before_the_backlog_piles_up():
    scaler = TargetScaler()
    overloaded = view(desired=2, queued=3, arrivals=8.3, served=6.6)  # 3.3/s each: 8.3/s need 3
    scaler.decide(0.0, [overloaded], MANY_GPUS)
    up = scaler.decide(5.0, [overloaded], MANY_GPUS)
    assert steps(up) == [("a", "up", 2, 3)]  # 3 queued alone (target 4 per replica) would ask for nothing
    assert "8.30 requests/s arriving, over the 3.30/s a ready replica serves (a backlog of 3 requests)" \
        in up[0].reason
    at_capacity = view(desired=2, queued=1, arrivals=6.7, served=6.6)  # within the rates' noise: no step
    assert steps(scaler.decide(10.0, [at_capacity], MANY_GPUS)) == []
    assert steps(scaler.decide(20.0, [at_capacity], MANY_GPUS)) == []


def test_the_drain_rate_per_ready_replica_second_bounds_the_need_when_the_source_measures_it():
    scaler = TargetScaler()
    just_ready = dataclasses.replace(
        view(desired=2, queued=3, arrivals=4.0, served=3.0), signals=ModelSignals(
            model="model-a", at=0.0, queued=3, arrivals_per_s=4.0, served_per_s=3.0, served_per_replica_s=3.0))
    scaler.decide(0.0, [just_ready], MANY_GPUS)  # 3/s over 2 ready would say 1.5 each and ask for 3
    assert steps(scaler.decide(5.0, [just_ready], MANY_GPUS)) == []  # 4/s at 3 each: the 2 running
