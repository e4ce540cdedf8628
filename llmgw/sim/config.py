"""The simulator's settings, and vLLM's ``--kv-events-config`` with its endpoint rules.

:class:`SimConfig` is what the CLI parses and what :func:`llmgw.sim.app.run_simulator`
runs, so tests and the demo can build one directly. :class:`KVEventsConfig`
accepts vLLM's JSON (fields and defaults of 0.34) and applies vLLM's rules: the
PUB socket binds when the endpoint has ``*`` or ``::`` or is ``ipc://`` /
``inproc://``, otherwise connects; the replay socket always binds; data
parallel rank r offsets tcp ports by r (never port 0) and suffixes inproc
endpoints with ``_dp<r>``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from llmgw.kv.codec import ARRAY_VARIANTS, MAP_VARIANTS
from llmgw.kv.keys import ALGORITHMS
from llmgw.kv.subscriber import rank_endpoint

from . import profiles
from .profiles import CONSTANT, DEFAULT_GPU_MEMORY_UTILIZATION, GpuProfile, ProfileError
from .scheduler import FCFS, POLICIES
from .timing import ConstantTiming, GpuTiming, Timing


class SimArgumentError(ValueError):
    """A setting the simulator cannot run with."""


@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (``vllm/config/kv_events.py``)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None -> "zmq" when enabled, else "null" (vLLM 0.11.1+)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10000
    hwm: int = 100000
    max_queue_size: int = 100000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SimArgumentError(f"--kv-events-config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise SimArgumentError("--kv-events-config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SimArgumentError(f"--kv-events-config: unknown field(s) {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(known))})")
        config = cls(**raw)
        config.validate()
        return config

    def validate(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise SimArgumentError(f"--kv-events-config: publisher must be 'zmq' or 'null', not {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise SimArgumentError(f"--kv-events-config: {name} must be a non-negative integer")
        if not isinstance(self.topic, str):
            raise SimArgumentError("--kv-events-config: topic must be a string")

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind for wildcard hosts and ipc/inproc, connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank ``rank`` uses (vLLM's per-rank offset)."""
    try:
        return rank_endpoint(endpoint, rank)
    except ValueError:
        if endpoint.startswith("tcp://"):
            raise SimArgumentError(f"KV events endpoint {endpoint!r} has no port") from None
        raise SimArgumentError(f"KV events endpoint {endpoint!r}: only tcp:// and inproc:// support data-parallel "
                          "ranks > 0") from None


@dataclass
class LoraModule:
    """A LoRA adapter the simulator serves as a model (``--lora-modules name=path``)."""

    name: str
    path: str
    lora_id: int


@dataclass
class SimConfig:
    """Everything a simulator needs to run (defaults are the CLI's)."""

    model: str = "sim"
    served_model_names: list[str] = field(default_factory=list)  # empty -> [model]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    block_size: int = 16
    num_blocks: int | None = None  # None -> 1024 (constant profile) or what the GPU profile's memory holds
    max_model_len: int | None = None  # None -> 8192 (the model's for a GPU profile), lowered to what the cache holds
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None -> 2048, or max(max_model_len, 2048) without chunking
    enable_chunked_prefill: bool = True
    scheduling_policy: str = FCFS  # vLLM's --scheduling-policy: fcfs, or priority (a request's ``priority`` orders it)
    long_prefill_token_threshold: int = 0  # vLLM's: tokens one request computes per step at most (0: no cap)
    long_prefill_token_threshold_adaptive: bool = False  # vLLM's: that cap never below the budget's fair share
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    event_layout: str = "map"
    event_fields: int | None = None  # BlockStored field count of the layout; None -> 14 (map) / 11 (array)
    data_parallel_rank: int = 0
    drop_event_seqs: str | None = None
    stream_head_first: bool = False  # a stream's head goes out before its first token (as vLLM's does)
    suppress_events: tuple[str, ...] = ()  # test switch: event types never published (an engine missing events)
    no_event_token_ids: bool = False  # test switch: BlockStored published without token_ids
    debug_routes: bool = False  # test switch: POST /debug/prefix_hit (the routing benchmark's oracle)
    time_scale: float = 1.0
    profile: str = CONSTANT  # "constant" or a GPU profile (llmgw.sim.profiles); the CLI's default: DEFAULT_PROFILE
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION  # GPU profiles: vLLM's share of device memory
    tensor_parallel_size: int | None = None  # GPU profiles: overrides the name's -tpN
    prefill_tokens_per_s: float | None = None  # constant profile only; None -> 20000
    decode_ms_per_step: float | None = None  # constant profile only; None -> 20
    seed: int = 0
    output_tokens: tuple[int, int] = (16, 128)
    lora_modules: list[LoraModule] = field(default_factory=list)
    startup_seconds: float = 0.0  # a cold start's modelled seconds before the server listens (llmgw.sim.startup)
    hot_startup_seconds: float = 0.0  # a wake-up's (sleep mode), modelled seconds
    enable_sleep_mode: bool = False  # vLLM's --enable-sleep-mode: POST /sleep, POST /wake_up, GET /is_sleeping

    DEFAULT_MAX_MODEL_LEN = 8192
    DEFAULT_NUM_BLOCKS = 1024
    DEFAULT_PREFILL_TOKENS_PER_S = 20000.0
    DEFAULT_DECODE_MS_PER_STEP = 20.0

    @property
    def gpu_profile(self) -> GpuProfile | None:
        """The GPU profile, or None for the constant model."""
        if self.profile == CONSTANT:
            return None
        try:
            return profiles.profile(self.profile, self.tensor_parallel_size)
        except ProfileError as exc:
            raise SimArgumentError(str(exc)) from None

    def timing(self) -> Timing:
        gpu = self.gpu_profile
        if gpu is not None:
            return GpuTiming(gpu)
        assert self.prefill_tokens_per_s is not None and self.decode_ms_per_step is not None  # resolve() filled them
        return ConstantTiming(self.prefill_tokens_per_s, self.decode_ms_per_step)

    def _resolve_profile(self) -> tuple[int, int]:
        """Fill the timing settings the profile leaves open; returns the default context length and step budget."""
        gpu = self.gpu_profile
        if gpu is None:
            if self.prefill_tokens_per_s is None:
                self.prefill_tokens_per_s = self.DEFAULT_PREFILL_TOKENS_PER_S
            if self.decode_ms_per_step is None:
                self.decode_ms_per_step = self.DEFAULT_DECODE_MS_PER_STEP
            if self.num_blocks is None:
                self.num_blocks = self.DEFAULT_NUM_BLOCKS
            return self.DEFAULT_MAX_MODEL_LEN, 2048
        if self.prefill_tokens_per_s is not None or self.decode_ms_per_step is not None:
            raise SimArgumentError(f"--prefill-tokens-per-s and --decode-ms-per-step set the constant model; profile "
                                   f"{self.profile} derives its timing from the GPU (use --profile constant)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise SimArgumentError("--gpu-memory-utilization must be in (0, 1]")
        if self.num_blocks is None:
            try:
                self.num_blocks = gpu.num_blocks(self.block_size, self.gpu_memory_utilization)
            except ProfileError as exc:
                raise SimArgumentError(str(exc)) from None
        # vLLM V1's API-server default budget: 8192 tokens on GPUs with at least 70 GiB, 2048 below
        return gpu.model.max_position_embeddings, 8192 if gpu.gpu.memory_gib >= 70 else 2048

    def resolve(self) -> "SimConfig":
        """Fill derived defaults and check the combination; returns self."""
        if not self.served_model_names:
            self.served_model_names = [self.model]
        if self.block_size < 1:
            raise SimArgumentError("--block-size must be positive")
        default_max_model_len, default_budget = self._resolve_profile()
        assert self.num_blocks is not None
        if self.num_blocks < 2:
            raise SimArgumentError("--num-blocks must be at least 2 (vLLM reserves one null block)")
        if self.prefix_caching_hash_algo not in ALGORITHMS:
            raise SimArgumentError(f"--prefix-caching-hash-algo must be one of {', '.join(ALGORITHMS)}")
        if self.event_layout not in ("map", "array"):
            raise SimArgumentError("--event-layout must be 'map' or 'array'")
        if self.event_fields is None:
            self.event_fields = 14 if self.event_layout == "map" else 11
        variants = MAP_VARIANTS if self.event_layout == "map" else ARRAY_VARIANTS
        if self.event_fields not in variants:
            raise SimArgumentError(f"--event-fields for the {self.event_layout} layout must be one of "
                              f"{', '.join(map(str, sorted(variants)))}")
        capacity = (self.num_blocks - 1) * self.block_size
        if self.max_model_len is None:
            self.max_model_len = min(default_max_model_len, capacity)
        elif self.max_model_len > capacity:
            raise SimArgumentError(
                f"--max-model-len {self.max_model_len} needs more KV cache than --num-blocks {self.num_blocks} "
                f"x --block-size {self.block_size} holds ({capacity} tokens; one block is vLLM's null block)")
        if self.max_model_len < 2:
            raise SimArgumentError("--max-model-len must be at least 2")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (default_budget if self.enable_chunked_prefill
                                           else max(self.max_model_len, default_budget))
        elif not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise SimArgumentError(  # vLLM refuses the same: a prompt of max_model_len tokens could never be scheduled
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is smaller than --max-model-len "
                f"({self.max_model_len}): without chunked prefill every prompt must fit in one step")
        if not 0 <= self.long_prefill_token_threshold <= self.max_model_len:
            raise SimArgumentError(  # vLLM's SchedulerConfig refuses the same
                f"--long-prefill-token-threshold ({self.long_prefill_token_threshold}) must be within 0 (no cap) and "
                f"--max-model-len ({self.max_model_len})")
        if self.scheduling_policy not in POLICIES:
            raise SimArgumentError(f"--scheduling-policy must be one of {', '.join(POLICIES)}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise SimArgumentError("--max-num-seqs and --max-num-batched-tokens must be positive")
        constant_rates_bad = self.gpu_profile is None and (
            self.prefill_tokens_per_s is None or self.prefill_tokens_per_s <= 0
            or self.decode_ms_per_step is None or self.decode_ms_per_step < 0)
        if self.startup_seconds < 0 or self.hot_startup_seconds < 0:
            raise SimArgumentError("--startup-seconds and --hot-startup-seconds must be >= 0")
        if self.time_scale < 0 or constant_rates_bad:
            raise SimArgumentError("--time-scale and --decode-ms-per-step must be >= 0, --prefill-tokens-per-s > 0")
        low, high = self.output_tokens
        if not 1 <= low <= high:
            raise SimArgumentError("--output-tokens must be MIN:MAX with 1 <= MIN <= MAX")
        self.kv_events.validate()
        if self.drop_event_seqs:
            parse_drop_seqs(self.drop_event_seqs)
        unknown = set(self.suppress_events) - set(SUPPRESSIBLE_EVENTS)
        if unknown:
            raise SimArgumentError(f"--suppress-events: unknown event type(s) {', '.join(sorted(unknown))}; "
                              f"one of {', '.join(SUPPRESSIBLE_EVENTS)}")
        return self

    @property
    def model_name(self) -> str:
        """The primary served model name (used in metrics and responses by default)."""
        return (self.served_model_names or [self.model])[0]

    @property
    def pub_endpoint(self) -> str:
        return offset_endpoint(self.kv_events.endpoint, self.data_parallel_rank)

    @property
    def replay_endpoint(self) -> str | None:
        ep = self.kv_events.replay_endpoint
        return None if ep is None else offset_endpoint(ep, self.data_parallel_rank)


SUPPRESSIBLE_EVENTS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def parse_drop_seqs(spec: str):
    """``"3,7,9"`` or ``"every:N"`` -> predicate on sequence numbers (dropped from the live PUB only)."""
    spec = spec.strip()
    if spec.startswith("every:"):
        try:
            every = int(spec[len("every:"):])
        except ValueError:
            every = 0
        if every < 1:
            raise SimArgumentError("--drop-event-seqs every:N needs N >= 1")
        return lambda seq: seq > 0 and seq % every == 0
    try:
        seqs = frozenset(int(part) for part in spec.split(",") if part.strip())
    except ValueError:
        raise SimArgumentError("--drop-event-seqs must be a comma list of sequence numbers or every:N") from None
    return seqs.__contains__


def parse_lora_modules(values: list[str]) -> list[LoraModule]:
    """vLLM's ``--lora-modules`` items: ``name=path`` or JSON ``{"name": .., "path": ..}``."""
    out: list[LoraModule] = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                raw = json.loads(value)
                name, path = raw["name"], raw["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SimArgumentError(f"--lora-modules: bad JSON item {value!r}") from None
        elif "=" in value:
            name, path = value.split("=", 1)
        else:
            raise SimArgumentError(f"--lora-modules items are name=path or JSON, got {value!r}")
        out.append(LoraModule(name, path, len(out) + 1))
    return out
