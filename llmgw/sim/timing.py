"""How long an engine step lasts: the constant model, or a GPU's roofline.

:class:`ConstantTiming` is the simulator's original model: uncached prompt
tokens at a fixed rate plus a fixed cost per step, whatever the batch.

:class:`GpuTiming` follows what a GPU does in one vLLM step, per GPU of a
tensor-parallel group (weights, KV cache, FLOPs and bandwidth all split over
``tp`` GPUs):

- the matrix products read every weight once and do 2 x parameters FLOPs per
  token computed (prefill and decode tokens alike): they last the longer of
  the two (the roofline: a decode batch is bandwidth-bound, a prefill chunk
  compute-bound);
- attention reads the KV cache of every scheduled sequence's context
  (context tokens x KV bytes per token, at the same bandwidth) and does
  4 x layers x hidden FLOPs per (query, key) pair, including a chunk's
  causal attention over itself;
- tensor parallelism adds two all-reduces per layer of the step's
  activations (ring: 2 (tp-1)/tp of the bytes over the link, plus a fixed
  latency each);
- a fixed overhead per step (scheduling, launches) and one per scheduled
  request (input preparation, sampling, output processing: CPU work that
  grows with the batch and shows most on small models).

Bandwidth and FLOPs are the datasheet's times an achieved fraction
(:mod:`llmgw.sim.profiles`). A request also waits the frontend's
``request_overhead`` (HTTP, tokenization) before it reaches the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .profiles import GpuProfile


@dataclass(frozen=True, slots=True)
class StepWork:
    """What a step computes, as the timing models need it."""

    prefill_tokens: int = 0  # tokens computed except single decode tokens
    decode_tokens: int = 0  # one per decoding request
    context_tokens: int = 0  # KV entries read: every scheduled sequence's context, its new tokens included
    attention_pairs: int = 0  # (query, key) pairs: new tokens x the context they attend to
    sequences: int = 0  # requests scheduled in the step


class Timing(Protocol):
    request_overhead_s: float

    def step_seconds(self, work: StepWork) -> float:
        """Modelled length of a step, before the time scale."""
        ...

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prefill throughput of one long cold prompt (for ``/debug/prefix_hit``)."""
        ...

    @property
    def decode_ms_per_step(self) -> float:
        """A one-request decode step with no context (for ``/debug/prefix_hit``)."""
        ...


class ConstantTiming:
    """``prefill_tokens / prefill_tokens_per_s + decode_ms_per_step``: no batch or context cost."""

    request_overhead_s = 0.0

    def __init__(self, prefill_tokens_per_s: float = 20000.0, decode_ms_per_step: float = 20.0):
        if prefill_tokens_per_s <= 0 or decode_ms_per_step < 0:
            raise ValueError("prefill_tokens_per_s must be > 0 and decode_ms_per_step >= 0")
        self._prefill_tokens_per_s = prefill_tokens_per_s
        self._decode_ms_per_step = decode_ms_per_step

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._prefill_tokens_per_s

    @property
    def decode_ms_per_step(self) -> float:
        return self._decode_ms_per_step

    def step_seconds(self, work: StepWork) -> float:
        return work.prefill_tokens / self._prefill_tokens_per_s + self._decode_ms_per_step / 1000.0


class GpuTiming:
    """The roofline of one profile (see the module docstring)."""

    def __init__(self, profile: GpuProfile):
        self.profile = profile
        gpu, model, tp = profile.gpu, profile.model, profile.tp
        bandwidth = gpu.hbm_bytes_per_s * gpu.bandwidth_efficiency
        flops = gpu.bf16_flops * gpu.flops_efficiency
        self.weights_s = model.weights_bytes / tp / bandwidth
        self.kv_s_per_token = model.kv_bytes_per_token / tp / bandwidth
        self.linear_s_per_token = 2.0 * model.parameters / tp / flops
        self.attention_s_per_pair = 4.0 * model.layers * model.attention_heads * model.head_dim / tp / flops
        self.overhead_s = gpu.step_overhead_ms / 1000.0
        self.seq_overhead_s = gpu.seq_overhead_us / 1e6
        self.request_overhead_s = gpu.request_overhead_ms / 1000.0
        self.allreduce_fixed_s = self.allreduce_s_per_token = 0.0
        if tp > 1:
            allreduces = 2 * model.layers
            self.allreduce_fixed_s = allreduces * gpu.allreduce_latency_us / 1e6
            self.allreduce_s_per_token = (allreduces * 2 * (tp - 1) / tp * model.hidden_size * model.dtype_bytes
                                          / gpu.link_bytes_per_s)

    def step_seconds(self, work: StepWork) -> float:
        tokens = work.prefill_tokens + work.decode_tokens
        if tokens == 0:
            return self.overhead_s
        linear = max(self.weights_s, tokens * self.linear_s_per_token)
        attention = work.context_tokens * self.kv_s_per_token + work.attention_pairs * self.attention_s_per_pair
        allreduce = self.allreduce_fixed_s + tokens * self.allreduce_s_per_token if self.profile.tp > 1 else 0.0
        return self.overhead_s + work.sequences * self.seq_overhead_s + linear + attention + allreduce

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.linear_s_per_token

    @property
    def decode_ms_per_step(self) -> float:
        return self.step_seconds(StepWork(decode_tokens=1, context_tokens=1, sequences=1)) * 1000.0


def causal_attention_pairs(context_before: int, new_tokens: int) -> int:
    """(query, key) pairs of ``new_tokens`` appended after ``context_before`` cached ones (causal)."""
    return new_tokens * context_before + new_tokens * (new_tokens + 1) // 2
