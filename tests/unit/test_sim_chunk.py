"""The simulator's ``--long-prefill-token-threshold`` (and its ``-adaptive``) against vLLM 0.32's scheduler: a
request computes at most the threshold per step while the engine holds more than one request, running or waiting
alike, the cap applied before the chunked-prefill check (no clock, no sockets)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.sim.cache import KVCacheManager
from llmgw.sim.cli import build_parser, config_from_args
from llmgw.sim.config import SimArgumentError, SimConfig
from llmgw.sim.profiles import profile
from llmgw.sim.scheduler import Scheduler, Sequence
from llmgw.sim.timing import GpuTiming


def scheduler(threshold: int, *, budget: int = 2048, adaptive: bool = False, chunked: bool = True,
              blocks: int = 1000) -> Scheduler:
    return Scheduler(KVCacheManager(blocks, 16, enable_caching=False, enable_events=False),
                     max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
                     adaptive_long_prefill=adaptive, chunked_prefill=chunked)


def request(rid: str, n_prompt: int, n_out: int = 4) -> Sequence:
    return Sequence(rid, list(range(20, 20 + n_prompt)), list(range(50, 50 + n_out)))


def step(sched: Scheduler) -> dict[str, int]:
    """Run one step; the tokens it computed per request."""
    planned = sched.schedule()
    sched.update(planned, 0.01)
    return {seq.request_id: n for seq, n in planned.scheduled}


def test_a_long_prompt_beside_others_is_cut_into_chunks_of_the_threshold():
    sched = scheduler(256)
    sched.add(request("batch", 2100))
    sched.add(request("chat", 110))
    assert step(sched) == {"batch": 256, "chat": 110}  # the short prompt is whole: it is under the threshold
    assert step(sched) == {"batch": 256, "chat": 1}  # chat decodes beside the next chunk
    sched.add(request("chat-2", 110))
    assert step(sched) == {"batch": 256, "chat": 1, "chat-2": 110}


def test_a_lone_request_takes_the_whole_budget():
    """vLLM: with one request held there is nobody to starve, so the threshold does not apply."""
    sched = scheduler(256)
    sched.add(request("batch", 2100))
    assert step(sched) == {"batch": 2048}
    sched.add(request("chat", 110))  # now two are held: the rest of the batch prompt is capped again
    assert step(sched) == {"batch": 52, "chat": 110}


def test_the_waiting_count_too_makes_the_cap_apply():
    sched = scheduler(256, budget=300)
    sched.add(request("a", 1000))
    sched.add(request("b", 1000))
    assert step(sched) == {"a": 256, "b": 44}  # b waited: two held, so a was capped; b got the rest of the budget


def test_without_the_threshold_the_step_is_as_before():
    sched = scheduler(0)
    sched.add(request("batch", 2100))
    sched.add(request("chat", 110))
    assert step(sched) == {"batch": 2048}  # the budget is spent on the batch prompt: chat waits a step
    assert step(sched) == {"batch": 52, "chat": 110}


def test_adaptive_floors_the_cap_at_the_budgets_fair_share():
    sched = scheduler(64, adaptive=True)
    for rid in "abcd":
        sched.add(request(rid, 1000))
    assert step(sched) == {rid: 512 for rid in "abcd"}  # max(64, 2048 // 4)
    assert scheduler(64).chunk_cap() == 0  # nothing held
    sched = scheduler(600, adaptive=True)
    for rid in "abcd":
        sched.add(request(rid, 1000))
    assert sched.chunk_cap() == 600  # a threshold above the fair share stays


def test_the_cap_applies_before_the_chunked_prefill_check_as_in_vllm():
    """vLLM caps a waiting request's tokens first, then refuses a prefill that exceeds the budget without chunked
    prefill: with the threshold a long prompt is admitted in chunks even so."""
    sched = scheduler(256, budget=3000, chunked=False)
    sched.add(request("chat", 110))
    sched.add(request("batch", 2100))
    assert step(sched) == {"chat": 110, "batch": 256}


def test_a_budget_shorter_than_the_threshold_still_bounds_the_step():
    sched = scheduler(1024, budget=300)
    sched.add(request("a", 2100))
    sched.add(request("b", 110))
    assert step(sched) == {"a": 300}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600), st.integers(1, 8), st.integers(0, 3)), min_size=1, max_size=16),
       st.integers(1, 300), st.booleans())
def test_no_request_computes_more_than_the_cap_and_every_one_finishes_the_same(arrivals, threshold, adaptive):
    """Whatever arrives: while more than one request is held none computes more than the step's cap, and every
    request ends with the same output as without the threshold."""
    outputs = []
    for cap in (0, threshold):
        sched = scheduler(cap, budget=512, adaptive=adaptive)
        seqs = []

        def run(steps: int) -> None:
            for _ in range(steps):
                expected = sched.chunk_cap()
                held = len(sched.running) + len(sched.waiting)
                planned = step(sched)
                if cap and held > 1:
                    assert expected >= cap and max(planned.values(), default=0) <= expected
        for i, (n_prompt, n_out, steps_after) in enumerate(arrivals):
            seqs.append(request(f"r{i}", n_prompt, n_out))
            sched.add(seqs[-1])
            run(steps_after)
        for _ in range(10_000):
            if not sched.has_work():
                break
            run(1)
        assert not sched.has_work()
        outputs.append([(s.request_id, s.output_ids, s.finish_reason) for s in seqs])
    assert outputs[0] == outputs[1]


def test_the_step_an_interactive_prompt_shares_with_a_batch_chunk_is_short():
    """The modelled point of the knob on ``h100-llama-3.1-8b``: the step that prefills a 110-token prompt beside a
    2,100-token batch prompt lasts under 2x the step it would have alone (about 9x without the threshold)."""
    timing = GpuTiming(profile("h100-llama-3.1-8b"))
    seconds = {}
    for cap in (0, 256):
        sched = scheduler(cap, budget=8192)
        sched.add(request("batch", 2100))
        sched.add(request("chat", 110))
        seconds[cap] = timing.step_seconds(sched.schedule().work)
    alone = scheduler(0, budget=8192)
    alone.add(request("chat", 110))
    by_itself = timing.step_seconds(alone.schedule().work)
    assert seconds[256] < 2 * by_itself < seconds[0] / 4


def test_the_flags_and_their_checks():
    args = build_parser().parse_args(["--long-prefill-token-threshold", "256",
                                      "--long-prefill-token-threshold-adaptive", "--profile", "constant"])
    config = config_from_args(args).resolve()
    assert (config.long_prefill_token_threshold, config.long_prefill_token_threshold_adaptive) == (256, True)
    assert config_from_args(build_parser().parse_args([])).long_prefill_token_threshold == 0
    with pytest.raises(SimArgumentError, match="--long-prefill-token-threshold"):
        SimConfig(long_prefill_token_threshold=9000, max_model_len=8192, profile="constant").resolve()
    with pytest.raises(SimArgumentError, match="--long-prefill-token-threshold"):
        SimConfig(long_prefill_token_threshold=-1, profile="constant").resolve()
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        scheduler(-1)


def test_the_capped_chunks_and_the_steps_are_counted():
    sched = scheduler(256)
    sched.add(request("batch", 600))
    sched.add(request("chat", 110))
    step(sched)  # 256 of batch (capped), chat whole
    step(sched)  # 256 more (capped), chat decodes
    step(sched)  # the last 88: not cut
    assert sched.stats.capped_chunks == 2
    assert sched.stats.step.count == 3 and sched.stats.step.total == pytest.approx(0.03)
    assert scheduler(0).stats.capped_chunks == 0
