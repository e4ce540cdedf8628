"""Micro-benchmark of what tenancy adds to one request on the data plane: µs of the event loop per request.

Run: ``python -m llmgw.bench.tenancy_path [--rounds 15] [--calls 2000] [--json PATH]`` (a few seconds). In-process,
no socket, the gateway's own objects from a config with two keys (one without limits, one with rpm, tpm and
concurrency far above what the run uses): its key directory, :class:`~llmgw.gateway.tenancy_setup.GatewayTenancy`
(the LocalLimiter, the usage service with its journal in a temporary folder and its Prometheus counters), the data
plane's gate. Each part is timed alone, then the whole of what a request of each key pays: the key's lookup, the
estimate, the admission (limited key), the settlement and the usage record (the journal's line, the counters);
and, for a stream, forcing its usage and filtering a 50-event stream's pieces.

Printed, per part: the median µs per call over ``--rounds`` rounds of ``--calls`` calls, with the fastest and the
slowest round (the spread other processes on the cores cause).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import trio
from prometheus_client import CollectorRegistry

from llmgw.bench.common import bench_parser, finish, rounds_us
from llmgw.config.loading import parse_config
from llmgw.gateway.stream_usage import UsageChunkFilter, usage_forced_body
from llmgw.gateway.tenancy_setup import GatewayTenancy
from llmgw.tenancy.directory import build_directory
from llmgw.tenancy.interfaces import Admission, Refusal
from llmgw.tenancy.local_limiter import LocalLimiter
from llmgw.tenancy.model import Estimate, Tenant

OPEN_KEY, LIMITED_KEY = "sk-bench-open", "sk-bench-limited"
PATH = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi " * 40}], "max_tokens": 64}
STREAM_BODY = {**BODY, "stream": True}
USAGE = {"prompt_tokens": 60, "completion_tokens": 64, "total_tokens": 124, "prompt_tokens_details": {
    "cached_tokens": 16}}
CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,' \
        b'"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
STREAM = [CHUNK] * 50 + [b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m","choices":[],'
                         b'"usage":' + json.dumps(USAGE).encode() + b"}\n\n", b"data: [DONE]\n\n"]


def config_text(directory: Path) -> str:
    return (f"models:\n  - name: m\n    replicas:\n      - url: http://127.0.0.1:9\n"
            f"tenancy:\n  store: {directory / 'tenancy.sqlite3'}\n"
            f"prices:\n  - model: m\n    input: 0.5\n    output: 1.5\n"
            f"api_keys:\n  - key: {OPEN_KEY}\n    name: open\n"
            f"  - key: {LIMITED_KEY}\n    name: limited\n"
            "    limits: {rpm: 100000000, tpm: 100000000000, concurrency: 100000}\n")


def timed(calls: dict[str, Callable[[], object]], count: int, rounds: int) -> dict[str, dict[str, float]]:
    """Per label: µs per call, median of ``rounds`` rounds of ``count`` calls, and the fastest and slowest round."""
    return {label: {"median_us": round(statistics.median(values), 2), "min_us": round(min(values), 2),
                    "max_us": round(max(values), 2)} for label, values in rounds_us(calls, count, rounds).items()}


async def measure(rounds: int, count: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-tenancy-") as folder:
        config = parse_config(config_text(Path(folder)))
        directory = build_directory(config)
        tenancy = GatewayTenancy(config, directory, CollectorRegistry())
        async with trio.open_nursery() as nursery:
            await nursery.start(tenancy.run)  # the usage journal is open, the flusher runs between rounds
            gate = tenancy.gate
            open_auth, limited_auth = f"Bearer {OPEN_KEY}", f"Bearer {LIMITED_KEY}"
            unlimited, limited = directory.lookup(open_auth), directory.lookup(limited_auth)
            assert unlimited is not None and limited is not None and limited.limited
            size = len(json.dumps(BODY))
            limiter = tenancy.limiter
            assert isinstance(limiter, LocalLimiter)  # one process: its admission needs no await to be timed

            def admitted(tenant: Tenant, estimate: Estimate) -> Admission:
                admission = limiter.admit_now(tenant, estimate)
                assert not isinstance(admission, Refusal), admission.message
                return admission

            def open_key_request() -> None:
                tenant = directory.lookup(open_auth)
                assert tenant is not None
                gate.open(tenant, "m", PATH, BODY, size).answered(200, USAGE, None)

            def limited_key_request() -> None:
                tenant = directory.lookup(limited_auth)
                assert tenant is not None
                charge = gate.open(tenant, "m", PATH, BODY, size)
                charge.admission = admitted(tenant, charge.estimate)  # what gate.admit awaits
                charge.answered(200, USAGE, None)

            def admit_and_settle() -> None:
                admitted(limited, gate.estimator.estimate("m", PATH, BODY, size)).settle(None)

            def filtered_stream() -> None:
                strip = UsageChunkFilter()
                for piece in STREAM:
                    strip.feed(piece)

            results = timed({
                "key lookup (SHA-256, dict)": lambda: directory.lookup(open_auth),
                "estimate": lambda: gate.estimator.estimate("m", PATH, BODY, size),
                "admit + settle (LocalLimiter)": admit_and_settle,
                "usage record (sink, journal, counters)": lambda: gate.open(unlimited, "m", PATH, BODY, size)
                .answered(200, USAGE, None),
                "request of a key without limits": open_key_request,
                "request of a limited key": limited_key_request,
                "stream: usage forced (body re-encoded)": lambda: usage_forced_body(PATH, STREAM_BODY),
                "stream: 52 pieces through the usage filter": filtered_stream,
            }, count, rounds)
            nursery.cancel_scope.cancel()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__ or "")
    parser.add_argument("--rounds", type=int, default=15, help="rounds per part (default 15)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per round (default 2000)")
    args = parser.parse_args(argv)
    results = trio.run(measure, args.rounds, args.calls)
    print(f"µs per call: median of {args.rounds} rounds of {args.calls} calls (fastest - slowest round)")
    for label, cell in results.items():
        print(f"  {label:44s} {cell['median_us']:8.2f}   ({cell['min_us']:.2f} - {cell['max_us']:.2f})")
    return finish(args, {"rounds": args.rounds, "calls": args.calls, "results": results})


if __name__ == "__main__":
    raise SystemExit(main())
