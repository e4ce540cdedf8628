"""The engine loop's timing model, on Trio's mock clock (no sockets)."""

from __future__ import annotations

import math

import pytest
import trio

from llmgw.kv.keys import event_int
from llmgw.sim.blockhash import BlockHashing
from llmgw.sim.cache import KVCacheManager
from llmgw.sim.core import StepLoop
from llmgw.sim.scheduler import Scheduler, Sequence

RATE, DECODE_S = 1000.0, 0.010


def make_engine(time_scale: float = 1.0, events_out=None, budget: int = 2048, chunked: bool = True) -> StepLoop:
    cache = KVCacheManager(200, 16, to_event=event_int)
    return StepLoop(Scheduler(cache, max_num_batched_tokens=budget, chunked_prefill=chunked), prefill_tokens_per_s=RATE,
                  decode_ms_per_step=DECODE_S * 1000, time_scale=time_scale, events_out=events_out)


HASHING = BlockHashing(16, "sha256", "0", event_int)


def request(n_prompt: int, n_out: int, start: int = 20, rid: str = "r") -> Sequence:
    return Sequence(rid, list(range(start, start + n_prompt)), list(range(50, 50 + n_out)),
                    hashes=HASHING.for_request())


async def run_one(engine: StepLoop, seq: Sequence) -> tuple[float, float]:
    """(time to first token, time to finish) of ``seq``."""
    t0 = trio.current_time()
    engine.submit(seq)
    await seq.wait_for_tokens(0)
    first = trio.current_time() - t0
    await seq.wait_finished()
    return first, trio.current_time() - t0


async def test_step_times_and_cache_hit_saving(autojump_clock):
    engine = make_engine()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run)
        ttft, total = await run_one(engine, request(200, 5, rid="a"))
        assert ttft == pytest.approx(200 / RATE + DECODE_S)
        assert total == pytest.approx(200 / RATE + 5 * DECODE_S)
        ttft2, _ = await run_one(engine, request(200, 5, rid="b"))
        cached = 199 // 16 * 16
        assert ttft2 == pytest.approx((200 - cached) / RATE + DECODE_S)
        assert ttft - ttft2 == pytest.approx(cached / RATE)
        nursery.cancel_scope.cancel()


async def test_chunked_prefill_takes_several_steps(autojump_clock):
    engine = make_engine(budget=64)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run)
        ttft, _ = await run_one(engine, request(200, 1))
        assert ttft == pytest.approx(200 / RATE + math.ceil(200 / 64) * DECODE_S)
        nursery.cancel_scope.cancel()


async def gaps_while_a_long_prefill_arrives(engine: StepLoop) -> float:
    """The longest gap between a decoding request's tokens while a 1,024-token prompt is prefilled."""
    decoding = request(16, 40, start=900, rid="decoding")
    arrivals = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run)
        engine.submit(decoding)
        seen = 0
        while not decoding.finished:
            await decoding.wait_for_tokens(seen)
            seen = decoding.num_output_tokens
            arrivals.append(trio.current_time())
            if seen == 5:
                engine.submit(request(1024, 1, start=2000, rid="long"))
        nursery.cancel_scope.cancel()
    return max(b - a for a, b in zip(arrivals, arrivals[1:]))


async def test_chunked_prefill_keeps_running_requests_decoding(autojump_clock):
    """With chunking a long prompt costs a decoding request at most one budget's worth of prefill per token;
    without it, the whole prefill at once (vLLM's --no-enable-chunked-prefill)."""
    chunked = await gaps_while_a_long_prefill_arrives(make_engine(budget=128))
    assert chunked == pytest.approx((128 - 1) / RATE + DECODE_S)  # the decode token shares the step's budget
    whole = await gaps_while_a_long_prefill_arrives(make_engine(budget=2048, chunked=False))
    assert whole == pytest.approx(1024 / RATE + DECODE_S)


async def test_time_scale_and_idle_engine_sleeps(autojump_clock):
    engine = make_engine(time_scale=0.5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run)
        _, total = await run_one(engine, request(100, 3))
        assert total == pytest.approx((100 / RATE + 3 * DECODE_S) * 0.5)
        steps = engine.scheduler.stats.steps
        await trio.sleep(3600)  # idle: no steps run (and the autojump clock would spin if the loop polled)
        assert engine.scheduler.stats.steps == steps
        nursery.cancel_scope.cancel()


async def test_batches_published_after_their_step(autojump_clock):
    send, receive = trio.open_memory_channel(math.inf)
    engine = make_engine(events_out=send)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run)
        await run_one(engine, request(40, 20))  # prompt: 2 blocks; decode fills block 2
        batches = []
        while True:
            try:
                batches.append(receive.receive_nowait())
            except trio.WouldBlock:
                break
        assert [len(b.events[0].block_hashes) for b in batches] == [2, 1]  # 59 tokens computed: 3 full blocks
        assert all(b.data_parallel_rank == 0 for b in batches)
        assert engine.reset_prefix_cache()
        assert type(receive.receive_nowait().events[0]).__name__ == "AllBlocksCleared"
        nursery.cancel_scope.cancel()


async def test_suppressed_event_types_are_never_published_and_spend_no_sequence(autojump_clock):
    send, receive = trio.open_memory_channel(math.inf)
    engine = make_engine(events_out=send)
    engine.suppress_events = frozenset({"AllBlocksCleared"})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run)
        await run_one(engine, request(40, 20))
        published = engine.batches_published
        assert engine.reset_prefix_cache() and engine.cache.pool.num_cached_blocks == 0
        assert engine.batches_published == published and engine.events_suppressed == 1
        while True:
            try:
                batch = receive.receive_nowait()
            except trio.WouldBlock:
                break
            assert all(type(ev).__name__ != "AllBlocksCleared" for ev in batch.events)
        nursery.cancel_scope.cancel()


async def test_abort_frees_and_wakes(autojump_clock):
    engine = make_engine()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run)
        seq = request(100, 1000)
        engine.submit(seq)
        await seq.wait_for_tokens(3)
        engine.abort(seq)
        await seq.wait_finished()
        assert seq.finish_reason == "abort" and engine.cache.usage == 0.0
        nursery.cancel_scope.cancel()


async def test_a_request_whose_step_raises_fails_alone_and_the_engine_keeps_running(autojump_clock):
    """A salt CBOR cannot encode (a lone surrogate) raises while block 0 is hashed, inside the engine loop."""
    engine = make_engine()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run)
        neighbour = request(40, 30, rid="neighbour")
        engine.submit(neighbour)
        await neighbour.wait_for_tokens(1)
        poison = Sequence("poison", list(range(20, 30)), list(range(50, 60)),
                          hashes=BlockHashing(16, "sha256_cbor", "0", event_int).for_request(cache_salt="\ud800"))
        engine.submit(poison)  # 10 prompt tokens: block 0 is hashed when decoding fills it, in a step
        await poison.wait_finished()
        assert poison.finish_reason == "error" and "UnicodeEncodeError" in poison.error
        assert engine.scheduler.stats.failed == 1
        assert poison not in engine.scheduler.running and not poison.blocks
        await neighbour.wait_finished()
        assert neighbour.finish_reason == "length" and len(neighbour.output_ids) == 30
        _, _ = await run_one(engine, request(50, 3, rid="after"))  # the loop still runs
        assert engine.cache.usage == 0.0
        nursery.cancel_scope.cancel()


async def test_the_api_answers_an_engine_failure_with_a_500_and_a_stream_with_an_error_event(autojump_clock):
    """Past the HTTP layer's checks (called in-process), a salt CBOR cannot encode fails in the engine."""
    import json

    from llmgw.sim.api import SimApi
    from llmgw.sim.app import Simulator
    from llmgw.sim.config import SimConfig

    sim = Simulator(SimConfig(served_model_names=["tiny"], prefix_caching_hash_algo="sha256_cbor", num_blocks=64,
                              output_tokens=(30, 30)), environ={})
    api = SimApi(sim)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "\ud800",
            "max_tokens": 30}
    prompt = [20, 21, 22]  # shorter than a block: block 0 is hashed inside a step, once decoding fills it
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sim.core.run)
        answer = await api._generate(dict(body), "tiny", None, prompt, chat=True)
        assert answer.status == 500
        error = json.loads(answer.body)["error"]
        assert error["type"] == "InternalServerError" and "UnicodeEncodeError" in error["message"]
        streamed = await api._generate({**body, "stream": True}, "tiny", None, prompt, chat=True)
        chunks = [chunk async for chunk in streamed.body]
        assert chunks[-1] == b"data: [DONE]\n\n"
        assert json.loads(chunks[-2][len(b"data: "):])["error"]["code"] == 500
        assert sim.core.scheduler.stats.failed == 2
        fine = await api._generate({"model": "tiny", "messages": []}, "tiny", None, prompt, chat=True)
        assert fine.status == 200  # the engine still runs
        nursery.cancel_scope.cancel()


async def test_prefill_time_is_first_step_to_first_token_as_vllm_exports_it(autojump_clock):
    """vLLM's ``vllm:request_prefill_time_seconds``: each request's time from its first step to its first token
    (a chunked prefill's several steps), in the histogram ``/metrics`` renders."""
    from llmgw.sim import metrics

    engine = make_engine(budget=64)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run)
        await run_one(engine, request(200, 3, rid="a"))
        nursery.cancel_scope.cancel()
    stats = engine.scheduler.stats
    assert stats.prefill.count == 1
    assert stats.prefill.total == pytest.approx(200 / RATE + math.ceil(200 / 64) * DECODE_S)
    text = metrics.render(engine, "m").decode()
    assert f'vllm:request_prefill_time_seconds_sum{{engine="0",model_name="m"}} {stats.prefill.total!r}' in text
    assert 'vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 1.0' in text
    assert 'vllm:request_prefill_time_seconds_bucket{engine="0",model_name="m",le="0.3"} 1.0' in text
    assert 'vllm:request_prefill_time_seconds_bucket{engine="0",model_name="m",le="+Inf"} 1.0' in text
