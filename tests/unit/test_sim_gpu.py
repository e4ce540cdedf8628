"""GPU profiles: the roofline step time, KV capacity from memory, tensor parallel, profile names."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from llmgw.sim.cache import KVCacheManager
from llmgw.sim.config import SimArgumentError, SimConfig
from llmgw.sim.core import StepLoop
from llmgw.sim.profiles import GIB, GPUS, MODELS, ProfileError, profile
from llmgw.sim.scheduler import Scheduler, Sequence
from llmgw.sim.timing import ConstantTiming, GpuTiming, StepWork

# Datasheet figures, written out here so the test checks the module's arithmetic rather than reusing it
A100_BW, A100_FLOPS, A100_MEM_GIB = 1.555e12, 312e12, 39.4
LLAMA8B_PARAMS, LLAMA8B_KV_BYTES_PER_TOKEN = 8.03e9, 32 * 8 * 128 * 2 * 2  # 128 KiB


def decode_step_seconds(name: str, batch: int, prompt_len: int) -> float:
    """The modelled length of a pure decode step of ``batch`` requests whose prompts are ``prompt_len`` long."""
    timing = GpuTiming(profile(name))
    scheduler = Scheduler(KVCacheManager(20000, 16, enable_caching=False), max_num_batched_tokens=prompt_len * batch)
    for i in range(batch):
        scheduler.add(Sequence(f"r{i}", [16] * prompt_len, [17] * 10))
    scheduler.update(scheduler.schedule())  # one step prefills them all and samples their first tokens
    step = scheduler.schedule()
    assert step.decode_requests == batch and step.prefill_tokens == 0
    return timing.step_seconds(step.work)


def test_decode_step_time_grows_with_the_batch_context_as_the_roofline_says():
    one = decode_step_seconds("a100-40gb-llama-3.1-8b", 1, 4000)
    forty = decode_step_seconds("a100-40gb-llama-3.1-8b", 40, 4000)
    gpu = GPUS["a100-40gb"]
    bandwidth = A100_BW * gpu.bandwidth_efficiency
    fixed = gpu.step_overhead_ms / 1000 + LLAMA8B_PARAMS * 2 / bandwidth

    attention_flops_per_pair = 4 * 32 * 32 * 128  # QK^T and AV over 32 layers of 32 heads of 128

    def predicted(n: int) -> float:  # each request reads its 4000 prompt tokens and its first output token
        return (fixed + n * gpu.seq_overhead_us / 1e6 + n * 4001 * LLAMA8B_KV_BYTES_PER_TOKEN / bandwidth
                + n * 4001 * attention_flops_per_pair / (A100_FLOPS * gpu.flops_efficiency))

    assert one == pytest.approx(predicted(1), rel=1e-9)
    assert forty == pytest.approx(predicted(40), rel=1e-9)
    assert forty / one == pytest.approx(predicted(40) / predicted(1), rel=1e-9)
    assert forty / one > 2.0  # 40 x 4000 tokens x 128 KiB = 21 GB of KV, more than the 16 GB of weights


def test_one_request_decodes_near_the_bandwidth_ceiling():
    """The issue's figure: one request on an A100 40GB decodes at about 75 tokens/s (77% of the ceiling)."""
    step = decode_step_seconds("a100-40gb-llama-3.1-8b", 1, 1024)
    ceiling = A100_BW / (LLAMA8B_PARAMS * 2)  # 96.8 tokens/s
    assert 0.7 < (1 / step) / ceiling < 0.85


def test_prefill_is_compute_bound_and_decode_tokens_ride_along():
    timing = GpuTiming(profile("h100-llama-3.1-8b"))
    prefill = timing.step_seconds(StepWork(prefill_tokens=2048, context_tokens=2048, attention_pairs=2048 * 2049 // 2,
                                           sequences=1))
    gpu = GPUS["h100"]
    flops = gpu.bf16_flops * gpu.flops_efficiency
    assert prefill > 2 * LLAMA8B_PARAMS * 2048 / flops  # the matrix products alone
    assert prefill < 1.1 * (2 * LLAMA8B_PARAMS * 2048 / flops) + 0.005
    # a decode request added to a compute-bound step costs its FLOPs and KV read, not another weight read
    mixed = timing.step_seconds(StepWork(prefill_tokens=2048, decode_tokens=1, context_tokens=2048 + 100,
                                         attention_pairs=2048 * 2049 // 2 + 100, sequences=2))
    assert mixed - prefill < timing.weights_s / 10


def test_kv_capacity_comes_from_memory():
    config = SimConfig(profile="a100-40gb-llama-3.1-8b").resolve()
    free = A100_MEM_GIB * 0.9 * GIB - LLAMA8B_PARAMS * 2 - MODELS["llama-3.1-8b"].activation_gib * GIB
    assert config.num_blocks == int(free // (LLAMA8B_KV_BYTES_PER_TOKEN * 16))
    assert 8000 < config.num_blocks < 10000  # ~18 GiB: ~145k tokens
    assert config.max_model_len == 131072  # the model's context, which the cache holds
    less = SimConfig(profile="a100-40gb-llama-3.1-8b", gpu_memory_utilization=0.6).resolve()
    assert less.num_blocks < config.num_blocks
    assert SimConfig(profile="a100-40gb-llama-3.1-8b", num_blocks=100).resolve().num_blocks == 100  # explicit wins
    assert config.max_num_batched_tokens == 2048 and SimConfig(profile="h100-llama-3.1-8b").resolve() \
        .max_num_batched_tokens == 8192  # vLLM's API-server budget below / above 70 GiB


def test_tensor_parallel_splits_weights_kv_and_flops():
    one, four = profile("h100-llama-3.1-70b"), profile("h100-llama-3.1-70b-tp4")
    assert four.tp == 4 and four.name == "h100-llama-3.1-70b-tp4"
    with pytest.raises(ProfileError):  # 141 GB of weights do not fit one H100
        one.num_blocks(16, 0.9)
    model = MODELS["llama-3.1-70b"]
    per_gpu_free = 79.1 * 0.9 * GIB - model.parameters * 2 / 4 - model.activation_gib * GIB
    assert four.num_blocks(16, 0.9) == int(per_gpu_free // (model.kv_bytes_per_token * 16 / 4))
    t1, t4 = GpuTiming(one), GpuTiming(four)
    assert t4.weights_s == pytest.approx(t1.weights_s / 4)
    assert t4.linear_s_per_token == pytest.approx(t1.linear_s_per_token / 4)
    decode = StepWork(decode_tokens=1, context_tokens=1000, attention_pairs=1000, sequences=1)
    # all-reduces: 160 of them (2 per layer), at least their fixed latency each
    assert t4.step_seconds(decode) - (t1.step_seconds(decode) - t1.weights_s - 1000 * t1.kv_s_per_token) \
        > t4.weights_s + 1000 * t4.kv_s_per_token + 160 * 10e-6
    assert t4.step_seconds(decode) < t1.step_seconds(decode) / 2
    assert profile("h100-llama-3.1-70b", tensor_parallel_size=8).tp == 8


def test_profile_names():
    assert profile("l4-qwen2.5-0.5b").gpu.name == "l4"
    assert profile("a100-80gb-llama-3.1-8b").gpu.name == "a100-80gb"
    for bad in ("h100", "h100-llama-3.1-9b", "tpu-llama-3.1-8b", "h100-llama-3.1-8b-tp0", ""):
        with pytest.raises(ProfileError):
            profile(bad)
    with pytest.raises(SimArgumentError, match="unknown profile"):
        SimConfig(profile="h100-gpt-5").resolve()
    with pytest.raises(SimArgumentError, match="constant"):  # the constant model's rates mean nothing to a GPU
        SimConfig(profile="h100-llama-3.1-8b", decode_ms_per_step=5).resolve()
    with pytest.raises(SimArgumentError, match="no KV cache"):
        SimConfig(profile="l4-llama-3.1-70b").resolve()
    constant = SimConfig().resolve()
    assert (constant.num_blocks, constant.prefill_tokens_per_s, constant.decode_ms_per_step) == (1024, 20000, 20)
    assert isinstance(StepLoop(Scheduler(KVCacheManager(8, 16)), timing=constant.timing()).timing, ConstantTiming)


works = st.builds(StepWork, prefill_tokens=st.integers(0, 8192), decode_tokens=st.integers(0, 512),
                  context_tokens=st.integers(0, 2_000_000), attention_pairs=st.integers(0, 10**9),
                  sequences=st.integers(0, 512))


@given(works, st.sampled_from(["h100-llama-3.1-8b", "a100-40gb-llama-3.1-8b", "l4-qwen2.5-0.5b",
                               "h100-llama-3.1-70b-tp4", "mi300x-llama-3.1-70b"]),
       st.sampled_from(["prefill_tokens", "decode_tokens", "context_tokens", "attention_pairs", "sequences"]),
       st.integers(1, 10_000))
def test_step_time_is_monotone_in_every_kind_of_work(work, name, field, more):
    timing = GpuTiming(profile(name))
    bigger = StepWork(**{**{f: getattr(work, f) for f in work.__slots__}, field: getattr(work, field) + more})
    assert timing.step_seconds(bigger) >= timing.step_seconds(work) > 0
