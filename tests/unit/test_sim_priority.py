"""The simulator's ``--scheduling-policy priority`` against its step model: vLLM's waiting order and preemption
victim, its ``priority`` field's parsing and its 400 under ``fcfs`` (no clock, no sockets)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.sim.cache import KVCacheManager
from llmgw.sim.cli import build_parser, config_from_args
from llmgw.sim.config import SimArgumentError, SimConfig
from llmgw.sim.protocol import PRIORITY_BOUND, ApiError, priority
from llmgw.sim.scheduler import FCFS, PRIORITY, Scheduler, Sequence, Status


def scheduler(policy: str, *, blocks: int = 200, max_num_seqs: int = 256, budget: int = 2048) -> Scheduler:
    return Scheduler(KVCacheManager(blocks, 16, enable_caching=False, enable_events=False),
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy)


def request(rid: str, n_prompt: int, n_out: int, prio: int = 0) -> Sequence:
    return Sequence(rid, list(range(20, 20 + n_prompt)), list(range(50, 50 + n_out)), priority=prio)


def step(sched: Scheduler) -> list[str]:
    """Run one step; the ids it computed tokens for, in its order."""
    planned = sched.schedule()
    sched.update(planned, 0.01)
    return [seq.request_id for seq, _ in planned.scheduled]


def first_token_order(sched: Scheduler) -> list[str]:
    """Step until idle; the ids in the order their first tokens came."""
    order: list[str] = []
    for _ in range(10_000):
        if not sched.has_work():
            return order
        planned = sched.schedule()
        for seq in sched.update(planned, 0.01):
            if seq.num_output_tokens == 1:
                order.append(seq.request_id)
    raise AssertionError("the scheduler never went idle")


def order_behind_a_running_request(policy: str) -> list[str]:
    """One request runs alone (max_num_seqs=1); then two batch requests and two interactive ones arrive."""
    sched = scheduler(policy, max_num_seqs=1)
    sched.add(request("running", 32, 4, prio=2))
    step(sched)
    for rid, prio in (("batch-1", 2), ("batch-2", 2), ("chat-1", 0), ("chat-2", 0)):
        sched.add(request(rid, 32, 4, prio=prio if policy == PRIORITY else 0))
    return first_token_order(sched)


def test_priority_orders_the_waiting_queue_by_priority_then_arrival():
    assert order_behind_a_running_request(FCFS) == ["batch-1", "batch-2", "chat-1", "chat-2"]
    assert order_behind_a_running_request(PRIORITY) == ["chat-1", "chat-2", "batch-1", "batch-2"]


def test_a_waiting_request_does_not_preempt_a_running_one_as_in_vllm():
    """vLLM's waiting loop stops at max_num_seqs whatever the priorities (vllm-project/vllm#40004 is open)."""
    sched = scheduler(PRIORITY, max_num_seqs=1)
    sched.add(request("batch", 32, 5, prio=10))
    step(sched)
    sched.add(request("chat", 16, 1, prio=0))
    for _ in range(4):
        assert step(sched) == ["batch"]
    assert step(sched) == ["chat"]
    assert sched.stats.preemptions == 0


def blocks_run_out(policy: str) -> tuple[Scheduler, Sequence, Sequence, list[str]]:
    """A low-priority request runs; a high-priority one joins it; the next step the high one needs a block that is
    not there (4 usable blocks: 24 + 32 prompt tokens fill them as soon as the second's first token comes)."""
    sched = scheduler(policy, blocks=5)
    low = request("low", 24, 20, prio=10 if policy == PRIORITY else 0)
    high = request("high", 32, 20, prio=0)
    sched.add(low)
    assert step(sched) == ["low"]
    sched.add(high)
    assert step(sched) == ["low", "high"]
    return sched, low, high, step(sched)


def test_fcfs_preempts_the_most_recently_admitted_request():
    sched, low, high, scheduled = blocks_run_out(FCFS)
    assert scheduled == ["low"]
    assert high.status is Status.WAITING and high.num_preemptions == 1 and low.num_preemptions == 0


def test_priority_preempts_the_lowest_priority_and_gives_back_its_tokens_in_this_step():
    sched, low, high, scheduled = blocks_run_out(PRIORITY)
    # "low" was planned first in the step (it needed no new block); preempted for "high", it leaves the plan
    assert scheduled == ["high"]
    assert low.status is Status.WAITING and low.num_preemptions == 1 and low.num_computed_tokens == 0
    assert high.num_preemptions == 0 and sched.stats.preemptions == 1
    assert not low.blocks


def test_priority_preemption_takes_the_latest_arrival_among_equals():
    sched = scheduler(PRIORITY, blocks=5)
    first, second = request("first", 24, 20, prio=3), request("second", 32, 20, prio=3)
    sched.add(first)
    step(sched)
    sched.add(second)
    step(sched)
    # "second" needs a block: the victim is max((priority, arrival)), "second" itself, as fcfs would pick
    assert step(sched) == ["first"]
    assert second.num_preemptions == 1 and first.num_preemptions == 0


def test_a_preempted_request_goes_back_in_priority_order():
    sched = scheduler(PRIORITY, blocks=5)
    low, high = request("low", 24, 20, prio=10), request("high", 32, 20, prio=0)
    sched.add(low)
    step(sched)
    sched.add(high)
    step(sched)
    sched.add(request("later", 16, 2, prio=5))  # arrives after "low" but ranks above it
    step(sched)  # "low" is preempted
    assert [seq.request_id for seq in sched.waiting] == ["later", "low"]


def test_the_scheduler_refuses_an_unknown_policy():
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        scheduler("lifo")


def test_the_priority_field_as_vllm_reads_it():
    assert priority({}, FCFS) == 0
    assert priority({"priority": 0}, FCFS) == 0
    assert priority({"priority": None}, FCFS) == 0
    assert priority({"priority": -3}, PRIORITY) == -3
    with pytest.raises(ApiError, match="Got priority 1 but Priority scheduling is not enabled") as info:
        priority({"priority": 1}, FCFS)
    assert info.value.status == 400 and info.value.param == "priority"
    for bad in (True, 1.5, "1", [1], PRIORITY_BOUND, -PRIORITY_BOUND - 1):
        with pytest.raises(ApiError, match="must be an integer") as info:
            priority({"priority": bad}, PRIORITY)
        assert info.value.status == 400


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                        max_size=3),
                           max_leaves=8)


@settings(max_examples=300)
@given(JSON_VALUES, st.sampled_from([FCFS, PRIORITY]))
def test_any_priority_value_is_an_integer_or_a_400(value, policy):
    try:
        got = priority({"priority": value}, policy)
    except ApiError as exc:
        assert exc.status == 400
        return
    assert type(got) is int and -PRIORITY_BOUND <= got < PRIORITY_BOUND
    assert got == 0 or policy == PRIORITY


def test_the_flag_and_its_check():
    args = build_parser().parse_args(["--scheduling-policy", "priority", "--profile", "constant"])
    assert config_from_args(args).resolve().scheduling_policy == PRIORITY
    assert config_from_args(build_parser().parse_args([])).scheduling_policy == FCFS
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--scheduling-policy", "lifo"])
    with pytest.raises(SimArgumentError, match="--scheduling-policy"):
        SimConfig(scheduling_policy="lifo", profile="constant").resolve()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 80), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=24),
       st.integers(4, 40), st.integers(1, 6))
def test_with_every_priority_0_the_priority_policy_schedules_as_fcfs(arrivals, blocks, max_num_seqs):
    """What lets ``llmgw bench overload`` run its fcfs arms on engines in priority scheduling: requests that carry
    no priority are admitted and preempted exactly as under fcfs (a running request always arrived before every
    waiting one, so the head is its place in arrival order, and the most recently admitted is the latest arrival)."""
    plans = []
    for policy in (FCFS, PRIORITY):
        sched = scheduler(policy, blocks=blocks, max_num_seqs=max_num_seqs, budget=64)
        plan = []
        for i, (n_prompt, n_out, steps_after) in enumerate(arrivals):
            if n_prompt + n_out > (blocks - 1) * 16:
                continue  # could never fit: the engine would refuse it (max_model_len)
            sched.add(request(f"r{i}", n_prompt, n_out))
            for _ in range(steps_after):
                plan.append(step(sched))
        plan.append(first_token_order(sched))
        plans.append((plan, sched.stats.preemptions))
    assert plans[0] == plans[1]
