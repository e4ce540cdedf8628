"""``/metrics``: Prometheus text with vLLM's metric names and labels, read from the engine's state.

Labels are vLLM's ``model_name`` (the first served name) and ``engine`` (the
data-parallel rank). Counters carry the ``_total`` suffix, as prometheus_client
exposes vLLM's. ``vllm:kv_cache_usage_perc`` is vLLM's definition: blocks
referenced by requests over usable blocks, so it falls to 0 when the engine is
idle even though cached blocks remain. Those are in the simulator's own
``llmgw_sim_cached_blocks`` gauge, which equals BlockStored minus BlockRemoved
block counts of the event stream (since the last AllBlocksCleared).
``vllm:request_prefill_time_seconds`` is vLLM's histogram (its buckets) of each
request's time from its first step to its first token, on the engine loop's
clock (x ``--time-scale``, as a client measures it).
``vllm:inter_token_latency_seconds`` (each token after a request's first: the
time since its previous one) and ``vllm:request_decode_time_seconds`` (a
finished request's first token to its last) are vLLM's histograms with its
buckets, on the *modelled* clock: the sum of the steps' modelled times
(x ``--time-scale``), what the GPU would take, without this process's own
delays on a loaded host (a real engine's wall clock includes its CPU's, which
on a GPU host is part of what a request waits; here it would be the
simulator's Python, not the GPU it models). vLLM before 0.11 named the first
``vllm:time_per_output_token_seconds`` (0.11 exported both, 0.12 hid the old one, later only the
new name); the simulator exports the new name only.
The text is built by hand: a few dozen lines, cheap enough for the event loop.
"""

from __future__ import annotations

from .core import StepLoop
from .scheduler import Histogram

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

_METRICS = (
    # (name, type, help)
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    ("vllm:prefix_cache_queries", "counter",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens."),
    ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "counter", "Number of generation tokens processed."),
    ("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine."),
    ("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig"),
    ("vllm:request_prefill_time_seconds", "histogram", "Histogram of time spent in PREFILL phase for request."),
    ("vllm:request_decode_time_seconds", "histogram", "Histogram of time spent in DECODE phase for request."),
    ("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds."),
    ("vllm:request_success", "counter", "Count of successfully processed requests."),
    ("llmgw_sim_cached_blocks", "gauge",
     "Physical KV blocks holding a cached hash (BlockStored minus BlockRemoved blocks)."),
    ("llmgw_sim_num_blocks", "gauge", "Usable KV blocks (num_blocks minus vLLM's null block)."),
    ("llmgw_sim_block_size", "gauge", "Tokens per KV block."),
    ("llmgw_sim_engine_steps", "counter", "Engine steps run."),
    ("llmgw_sim_step_seconds", "histogram", "Modelled length of each engine step, times the time scale."),
    ("llmgw_sim_step_overrun_seconds", "histogram",
     "How much later than its modelled length each step ended (the host's own delay)."),
    ("llmgw_sim_prefill_chunks_capped", "counter",
     "Prefill chunks cut to --long-prefill-token-threshold tokens."),
    ("llmgw_sim_request_failures", "counter",
     "Requests the engine failed (answered 500) because their step raised; the engine kept running."),
    ("llmgw_sim_kv_event_batches", "counter",
     "KV event batches handed to the publisher (the last one carries sequence number total - 1)."),
    ("llmgw_sim_kv_event_batches_dropped", "counter", "KV event batches lost because the publisher queue was full."),
    ("llmgw_sim_kv_events_suppressed", "counter", "KV events never published because of --suppress-events."),
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _histogram(histogram: Histogram) -> list[tuple[str, float]]:
    """A histogram's samples as Prometheus exposes them: cumulative buckets (``+Inf`` = the count), sum, count."""
    count = histogram.count
    return ([(f'_bucket|,le="{bound!r}"', n) for bound, n in zip(histogram.bounds, histogram.buckets)]
            + [('_bucket|,le="+Inf"', count), ("_sum|", histogram.total), ("_count|", count)])


def render(engine: StepLoop, model_name: str) -> bytes:
    """The exposition text for one engine."""
    scheduler = engine.scheduler
    stats = scheduler.stats
    pool = scheduler.cache.pool
    labels = f'engine="{engine.data_parallel_rank}",model_name="{_escape(model_name)}"'
    values: dict[str, list[tuple[str, float]]] = {
        "vllm:num_requests_running": [("", len(scheduler.running))],
        "vllm:num_requests_waiting": [("", len(scheduler.waiting))],
        "vllm:kv_cache_usage_perc": [("", pool.usage)],
        "vllm:prefix_cache_queries": [("", stats.prefix_cache_queries)],
        "vllm:prefix_cache_hits": [("", stats.prefix_cache_hits)],
        "vllm:prompt_tokens": [("", stats.prompt_tokens)],
        "vllm:generation_tokens": [("", stats.generation_tokens)],
        "vllm:num_preemptions": [("", stats.preemptions)],
        "vllm:cache_config_info": [(f',block_size="{pool.block_size}",enable_prefix_caching="True",'
                                    f'num_gpu_blocks="{pool.num_usable_blocks + 1}"', 1)],
        "vllm:request_prefill_time_seconds": _histogram(stats.prefill),
        "vllm:request_decode_time_seconds": _histogram(stats.decode),
        "vllm:inter_token_latency_seconds": _histogram(stats.inter_token),
        "vllm:request_success": [(f',finished_reason="{reason}"', count)
                                 for reason, count in stats.finished.items()],
        "llmgw_sim_cached_blocks": [("", pool.num_cached_blocks)],
        "llmgw_sim_num_blocks": [("", pool.num_usable_blocks)],
        "llmgw_sim_block_size": [("", pool.block_size)],
        "llmgw_sim_engine_steps": [("", stats.steps)],
        "llmgw_sim_step_seconds": _histogram(stats.step),
        "llmgw_sim_step_overrun_seconds": _histogram(stats.overrun),
        "llmgw_sim_prefill_chunks_capped": [("", stats.capped_chunks)],
        "llmgw_sim_request_failures": [("", stats.failed)],
        "llmgw_sim_kv_event_batches": [("", engine.batches_published)],
        "llmgw_sim_kv_event_batches_dropped": [("", engine.batches_dropped)],
        "llmgw_sim_kv_events_suppressed": [("", engine.events_suppressed)],
    }
    lines = []
    for name, kind, help_ in _METRICS:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        sample = name + "_total" if kind == "counter" else name
        for extra, value in values[name]:
            suffix, _, extra = extra.rpartition("|")  # a histogram's sample: "_bucket|,le=..." or "_sum|"
            lines.append(f"{sample}{suffix}{{{labels}{extra}}} {float(value)!r}")
    lines.append("")
    return "\n".join(lines).encode()
