"""``llmgw sim``: parse vLLM-style flags, run a :class:`~llmgw.sim.app.Simulator` until SIGTERM/SIGINT.

Flags take vLLM's names where vLLM has one, so an engine plugin can start vLLM
and the simulator alike; common vLLM flags that do not matter here are
accepted and ignored (one log line). When ready it prints, flushed, one line
per event socket and then ``llmgw-sim listening on http://HOST:PORT`` to stdout
(the real port when ``--port 0``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

import trio

from ..logsetup import add_logging_arguments, setup_logging
from ..usererrors import run_reporting
from .config import KVEventsConfig, SimArgumentError, SimConfig, parse_lora_modules
from .profiles import CONSTANT, DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_PROFILE, profile_names
from .scheduler import FCFS, POLICIES

log = logging.getLogger("llmgw.sim")

API_KEY_ENV = "VLLM_API_KEY"  # vLLM's API server reads the key from it when there is no --api-key

READY_PREFIX = "llmgw-sim listening on "

# vLLM flags an engine plugin may pass that do not matter to the simulator: (name, takes a value)
IGNORED_FLAGS = (
    ("--pipeline-parallel-size", True), ("-pp", True),
    ("--data-parallel-size", True), ("--dtype", True),
    ("--kv-cache-memory-bytes", True), ("--swap-space", True), ("--tokenizer", True), ("--revision", True),
    ("--download-dir", True), ("--load-format", True), ("--max-loras", True), ("--max-lora-rank", True),
    ("--uvicorn-log-level", True), ("--distributed-executor-backend", True), ("--quantization", True),
    ("--enforce-eager", False), ("--trust-remote-code", False), ("--disable-log-requests", False),
    ("--enable-log-requests", False), ("--disable-log-stats", False), ("--enable-lora", False),
    ("--enable-prompt-tokens-details", False),
    ("--enable-server-load-tracking", False), ("--disable-uvicorn-access-log", False),
)


def _output_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(":", 1))
    except ValueError:
        raise argparse.ArgumentTypeError("expected MIN:MAX, e.g. 16:128") from None
    return low, high


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except SimArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmgw sim", description="A vLLM-like OpenAI server with a simulated paged prefix cache and KV events.")
    vllm = p.add_argument_group("vLLM flags")
    vllm.add_argument("model_tag", nargs="?", help="model path (like `vllm serve MODEL`); default 'sim'")
    vllm.add_argument("--model", help="model path, reported as the model card's root (default 'sim')")
    vllm.add_argument("--served-model-name", nargs="+", default=None, help="name(s) clients use; default: the model")
    vllm.add_argument("--host", default="127.0.0.1")
    vllm.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on stdout)")
    vllm.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (as vLLM); without it, the "
                                        f"environment variable {API_KEY_ENV} (as vLLM)")
    vllm.add_argument("--block-size", type=int, default=16)
    vllm.add_argument("--num-gpu-blocks-override", "--num-blocks", dest="num_blocks", type=int, default=None,
                      help="KV cache size in blocks, including vLLM's reserved null block (default: a GPU profile "
                           "derives it from memory; 1024 with the constant profile)")
    vllm.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                      help="GPU profiles: GPUs the model is split over (overrides the profile's -tpN)")
    vllm.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                      help="GPU profiles: share of device memory for weights, activations and KV cache (default 0.9)")
    vllm.add_argument("--max-model-len", type=int, default=None,
                      help="context length (default 8192, lowered to what the KV cache holds)")
    vllm.add_argument("--max-num-seqs", type=int, default=256, help="running requests per step")
    vllm.add_argument("--max-num-batched-tokens", type=int, default=None,
                      help="token budget per step (default 2048; without chunked prefill max(max-model-len, 2048))")
    vllm.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                      help="split long prefills across steps within the budget, so running requests keep "
                           "decoding (vLLM V1's default)")
    vllm.add_argument("--scheduling-policy", choices=POLICIES, default=FCFS,
                      help="fcfs: waiting requests in arrival order; priority: by each request's 'priority' (lower "
                           "first, then arrival), and blocks running out preempt the lowest priority (vLLM's)")
    vllm.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                      help="while the engine holds more than one request, each computes at most N tokens per step: a "
                           "long prompt's prefill is cut into chunks of N, so the steps it shares with others stay "
                           "short (vLLM's; default 0: no cap)")
    vllm.add_argument("--long-prefill-token-threshold-adaptive", action="store_true",
                      help="that cap never below --max-num-batched-tokens // the requests held (vLLM's)")
    vllm.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    vllm.add_argument("--prefix-caching-hash-algo", default="sha256",
                      choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"))
    vllm.add_argument("--kv-events-config", type=_kv_events_config, default=None,
                      help="vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\"}'")
    vllm.add_argument("--data-parallel-rank", "--engine-id", dest="data_parallel_rank", type=int, default=0,
                      help="rank in events and metrics; offsets event ports as vLLM does")
    vllm.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="LoRA adapters served as models (their requests hash with the adapter)")
    vllm.add_argument("--seed", type=int, default=0, help="seed of the simulated outputs")
    vllm.add_argument("--enable-sleep-mode", action="store_true",
                      help="POST /sleep?level=N, POST /wake_up (taking --hot-startup-seconds), GET /is_sleeping")
    sim = p.add_argument_group("simulator flags")
    sim.add_argument("--event-layout", choices=("map", "array"), default="map",
                     help="payload layout: map (vLLM 0.24+) or array (0.22-0.23)")
    sim.add_argument("--event-fields", type=int, default=None,
                     help="BlockStored fields the layout declares (map 11-15, default 14 = vLLM 0.30-0.32; "
                          "array 5-11, default 11)")
    sim.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME",
                     help=f"timing model: <gpu>-<model>[-tpN], a GPU's roofline (default {DEFAULT_PROFILE}): "
                          + ", ".join(profile_names()[1:]) + f"; or '{CONSTANT}' (the two flags below)")
    sim.add_argument("--time-scale", type=float, default=1.0,
                     help="1 = modelled real time, 0.01 = 100x faster, 0 = no waiting")
    sim.add_argument("--startup-seconds", type=float, default=0.0, metavar="S",
                     help="a cold start: modelled seconds before the server listens (loading the weights; "
                          "times --time-scale)")
    sim.add_argument("--hot-startup-seconds", type=float, default=0.0, metavar="S",
                     help="a hot start: modelled seconds a POST /wake_up takes (with --enable-sleep-mode)")
    sim.add_argument("--prefill-tokens-per-s", type=float, default=None,
                     help="--profile constant: prefill throughput of uncached tokens (default 20000)")
    sim.add_argument("--decode-ms-per-step", type=float, default=None,
                     help="--profile constant: fixed cost of every engine step (default 20)")
    sim.add_argument("--output-tokens", type=_output_range, default=(16, 128), metavar="MIN:MAX",
                     help="range of natural output lengths (ending in EOS) unless ignore_eos or max_tokens")
    sim.add_argument("--drop-event-seqs", default=None, metavar="SEQS",
                     help="test switch: '3,7' or 'every:N' batches kept for replay but not published live")
    sim.add_argument("--stream-head-first", action="store_true",
                     help="send a stream's response head at once and its first token when it is computed, as "
                          "vLLM does (default: head and first token together)")
    sim.add_argument("--suppress-events", default="", metavar="TYPES",
                     help="test switch: comma list of event types never published (BlockStored, BlockRemoved, "
                          "AllBlocksCleared), as an engine that misses events: no sequence gap reveals it")
    sim.add_argument("--no-event-token-ids", action="store_true",
                     help="test switch: publish BlockStored events without their token_ids, as an engine whose "
                          "events lack them (a router cannot key its blocks by content)")
    sim.add_argument("--debug-routes", action="store_true",
                     help="test switch: serve POST /debug/prefix_hit (a prompt's cached leading tokens and the "
                          "queues, read from the engine; for the routing benchmark's oracle) and GET "
                          "/debug/first_tokens (the latest requests in the order they got their first token)")
    add_logging_arguments(sim)
    return p


def _strip_ignored(argv: list[str]) -> tuple[list[str], list[str]]:
    """Remove the ignored vLLM flags (with their values) from ``argv``."""
    takes_value = dict(IGNORED_FLAGS)
    kept, ignored = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in takes_value:
            ignored.append(name)
            if takes_value[name] and "=" not in arg:
                i += 1
        else:
            kept.append(arg)
        i += 1
    return kept, ignored


def config_from_args(args: argparse.Namespace) -> SimConfig:
    model = args.model or args.model_tag or "sim"
    return SimConfig(
        model=model,
        served_model_names=list(args.served_model_name or []),
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduling_policy=args.scheduling_policy,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=args.long_prefill_token_threshold_adaptive,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        kv_events=args.kv_events_config or KVEventsConfig(),
        event_layout=args.event_layout,
        event_fields=args.event_fields,
        data_parallel_rank=args.data_parallel_rank,
        drop_event_seqs=args.drop_event_seqs,
        stream_head_first=args.stream_head_first,
        suppress_events=tuple(t.strip() for t in args.suppress_events.split(",") if t.strip()),
        no_event_token_ids=args.no_event_token_ids,
        debug_routes=args.debug_routes,
        time_scale=args.time_scale,
        profile=args.profile,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_ms_per_step=args.decode_ms_per_step,
        seed=args.seed,
        output_tokens=args.output_tokens,
        lora_modules=parse_lora_modules(args.lora_modules),
        startup_seconds=args.startup_seconds,
        hot_startup_seconds=args.hot_startup_seconds,
        enable_sleep_mode=args.enable_sleep_mode,
    )


async def _exit_on_signal(cancel_scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            cancel_scope.cancel()
            return


async def serve(config: SimConfig) -> None:
    """Run a simulator until SIGTERM/SIGINT, announcing its addresses on stdout."""
    from .app import Simulator

    sim = Simulator(config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_exit_on_signal, nursery.cancel_scope)
        addresses = await nursery.start(sim.run)
        if addresses.kv_events:
            print(f"llmgw-sim kv-events on {addresses.kv_events}", flush=True)
        if addresses.kv_replay:
            print(f"llmgw-sim kv-replay on {addresses.kv_replay}", flush=True)
        print(f"{READY_PREFIX}{addresses.base_url}", flush=True)
        log.info("model %s: profile %s, %d blocks of %d tokens, max_model_len %d, hash %s, events %s",
                 config.model_name, config.gpu_profile.name if config.gpu_profile else CONSTANT, config.num_blocks,
                 config.block_size, config.max_model_len,
                 config.prefix_caching_hash_algo if config.enable_prefix_caching else "off (no prefix caching)",
                 json.dumps(sim.kv_event_sources()) if addresses.kv_events else "off")


def main(argv: list[str]) -> int:
    kept, ignored = _strip_ignored(list(argv))
    parser = build_parser()
    args = parser.parse_args(kept)
    setup_logging(args.log_level, args.log_format)
    if ignored:
        log.info("ignoring vLLM flags that do not apply to the simulator: %s", " ".join(ignored))
    try:
        config = config_from_args(args).resolve()
    except SimArgumentError as exc:
        print(f"llmgw sim: {exc}", file=sys.stderr)
        return 2
    try:
        return run_reporting("llmgw sim", lambda: trio.run(serve, config))
    except KeyboardInterrupt:
        return 0
