"""The simulator's GPU and model data, from public specifications: the one place profiles are defined.

A profile name is ``<gpu>-<model>`` with an optional ``-tp<N>`` (tensor parallel
over N GPUs): ``h100-llama-3.1-8b``, ``a100-40gb-llama-3.1-8b``,
``h100-llama-3.1-70b-tp4``. Every GPU goes with every model; :func:`profile`
refuses a combination whose weights do not fit. ``constant`` is the timing
model without physics (``--prefill-tokens-per-s``, ``--decode-ms-per-step``).

GPU figures are the vendors' datasheets (dense BF16 tensor FLOPs, without
sparsity; HBM bandwidth; memory as CUDA reports it, a little under the nominal
size). Model figures are the Hugging Face ``config.json`` of each model.
The efficiencies and overheads are what a real vLLM reaches on that GPU; they
are calibrated against published measurements (``docs/simulator.md``,
``python -m llmgw.bench.sim_calibration``), not datasheet values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 1024 ** 3


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator, and what vLLM achieves on it."""

    name: str
    memory_gib: float  # total device memory as CUDA reports it
    hbm_bytes_per_s: float  # datasheet memory bandwidth
    bf16_flops: float  # datasheet dense BF16 tensor throughput
    link_bytes_per_s: float  # one direction of the GPU-to-GPU link (NVLink, or PCIe without it)
    bandwidth_efficiency: float  # share of the bandwidth a decode step's reads reach
    flops_efficiency: float  # share of the FLOPs a prefill's matrix products reach
    step_overhead_ms: float  # per engine step: scheduling, kernel launches
    seq_overhead_us: float  # per request in a step: input preparation, sampling, output processing (host CPU)
    request_overhead_ms: float  # per request before it reaches the scheduler: HTTP, tokenization
    allreduce_latency_us: float = 10.0  # fixed cost of one all-reduce (tensor parallel only)


@dataclass(frozen=True)
class ModelSpec:
    """A dense transformer's shape (Hugging Face ``config.json``)."""

    name: str
    parameters: float
    layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype_bytes: int = 2  # BF16 weights and KV cache
    activation_gib: float = 2.0  # what vLLM's profiling run keeps out of the KV cache (activations, CUDA graphs)

    @property
    def weights_bytes(self) -> float:
        return self.parameters * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer: layers x KV heads x head size x 2 x dtype bytes."""
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes


GPUS: dict[str, GpuSpec] = {gpu.name: gpu for gpu in (
    # H100 SXM5 80GB: 3.35 TB/s HBM3, 989 TFLOPs dense BF16, NVLink 4 900 GB/s (450 each way)
    GpuSpec("h100", 79.1, 3.35e12, 989e12, 450e9, bandwidth_efficiency=0.80, flops_efficiency=0.60,
            step_overhead_ms=0.5, seq_overhead_us=20.0, request_overhead_ms=8.0),
    # A100 SXM4 40GB: 1.555 TB/s HBM2, 312 TFLOPs dense BF16, NVLink 3 600 GB/s (300 each way)
    GpuSpec("a100-40gb", 39.4, 1.555e12, 312e12, 300e9, bandwidth_efficiency=0.80, flops_efficiency=0.75,
            step_overhead_ms=0.5, seq_overhead_us=20.0, request_overhead_ms=8.0),
    # A100 SXM4 80GB: 2.039 TB/s HBM2e
    GpuSpec("a100-80gb", 79.2, 2.039e12, 312e12, 300e9, bandwidth_efficiency=0.80, flops_efficiency=0.75,
            step_overhead_ms=0.5, seq_overhead_us=20.0, request_overhead_ms=8.0),
    # L4 24GB: 300 GB/s GDDR6, 121 TFLOPs dense BF16 (242 is with sparsity), PCIe Gen4 x16 (32 GB/s each way)
    GpuSpec("l4", 22.0, 300e9, 121e12, 32e9, bandwidth_efficiency=0.80, flops_efficiency=0.40,
            step_overhead_ms=0.8, seq_overhead_us=50.0, request_overhead_ms=20.0, allreduce_latency_us=30.0),
    # MI300X 192GB: 5.3 TB/s HBM3, 1307 TFLOPs dense BF16, Infinity Fabric 64 GB/s per link x 7
    GpuSpec("mi300x", 191.5, 5.3e12, 1307e12, 448e9, bandwidth_efficiency=0.70, flops_efficiency=0.45,
            step_overhead_ms=1.0, seq_overhead_us=20.0, request_overhead_ms=8.0),
)}

MODELS: dict[str, ModelSpec] = {model.name: model for model in (
    ModelSpec("llama-3.1-8b", 8.03e9, layers=32, hidden_size=4096, attention_heads=32, kv_heads=8, head_dim=128,
              max_position_embeddings=131072, activation_gib=2.5),
    ModelSpec("llama-3.1-70b", 70.6e9, layers=80, hidden_size=8192, attention_heads=64, kv_heads=8, head_dim=128,
              max_position_embeddings=131072, activation_gib=4.0),
    ModelSpec("qwen2.5-7b", 7.62e9, layers=28, hidden_size=3584, attention_heads=28, kv_heads=4, head_dim=128,
              max_position_embeddings=32768, activation_gib=2.5),
    ModelSpec("qwen2.5-0.5b", 0.494e9, layers=24, hidden_size=896, attention_heads=14, kv_heads=2, head_dim=64,
              max_position_embeddings=32768, activation_gib=1.0),
)}

CONSTANT = "constant"
DEFAULT_PROFILE = "h100-llama-3.1-8b"  # llmgw sim's --profile, the demo's and the routing benchmark's
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
_TP = re.compile(r"^(?P<rest>.+)-tp(?P<tp>[1-9][0-9]?)$")


class ProfileError(ValueError):
    """A profile name or combination the simulator cannot run."""


@dataclass(frozen=True)
class GpuProfile:
    """A model served by vLLM on ``tp`` GPUs of one kind."""

    gpu: GpuSpec
    model: ModelSpec
    tp: int = 1

    @property
    def name(self) -> str:
        return f"{self.gpu.name}-{self.model.name}" + (f"-tp{self.tp}" if self.tp > 1 else "")

    def kv_cache_bytes(self, gpu_memory_utilization: float) -> float:
        """Per GPU: its share of memory minus its shard of the weights and the activation reserve (vLLM's rule)."""
        return (self.gpu.memory_gib * gpu_memory_utilization * GIB - self.model.weights_bytes / self.tp
                - self.model.activation_gib * GIB)

    def num_blocks(self, block_size: int, gpu_memory_utilization: float) -> int:
        """KV cache blocks, counted as vLLM's ``num_gpu_blocks`` (its null block included)."""
        per_block = self.model.kv_bytes_per_token * block_size / self.tp  # each GPU holds 1/tp of the KV heads
        free = self.kv_cache_bytes(gpu_memory_utilization)
        if free < per_block * 2:
            raise ProfileError(
                f"profile {self.name}: the weights ({self.model.weights_bytes / self.tp / GIB:.1f} GiB per GPU) and "
                f"activations leave no KV cache in {self.gpu.memory_gib:g} GiB x {gpu_memory_utilization:g}; "
                "use more GPUs (-tpN) or a larger --gpu-memory-utilization")
        return int(free // per_block)


def profile_names() -> list[str]:
    """The single-GPU names, for help texts (any ``-tpN`` suffix may be added)."""
    return [CONSTANT] + [f"{g}-{m}" for g in GPUS for m in MODELS]


def profile(name: str, tensor_parallel_size: int | None = None) -> GpuProfile:
    """The GPU profile ``name`` (``<gpu>-<model>[-tpN]``); ``tensor_parallel_size`` overrides the suffix."""
    tp = 1
    rest = name
    match = _TP.match(name)
    if match:
        rest, tp = match["rest"], int(match["tp"])
    if tensor_parallel_size is not None:
        if tensor_parallel_size < 1:
            raise ProfileError("--tensor-parallel-size must be at least 1")
        tp = tensor_parallel_size
    for gpu_name, gpu in GPUS.items():
        if rest.startswith(gpu_name + "-") and rest[len(gpu_name) + 1:] in MODELS:
            return GpuProfile(gpu, MODELS[rest[len(gpu_name) + 1:]], tp)
    raise ProfileError(f"unknown profile {name!r}: use {CONSTANT!r} or <gpu>-<model>[-tpN] with gpu one of "
                       f"{', '.join(GPUS)} and model one of {', '.join(MODELS)} (e.g. h100-llama-3.1-8b)")
