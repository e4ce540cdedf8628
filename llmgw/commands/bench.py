"""``llmgw bench NAME [options]``: run one of llmgw's benchmarks (a table of names to modules under llmgw.bench).

Each benchmark module exposes ``main(argv) -> int``, prints a table and
writes JSON with ``--json FILE``; ``llmgw bench NAME --help`` shows its options (its parser takes the
program's name, ``llmgw bench NAME``, from ``sys.argv[0]``, which :func:`main` sets while the benchmark runs).
The benchmarks live in the source tree only (the wheel leaves ``llmgw/bench`` out):
installed from a wheel, the command says how to get them.
"""

from __future__ import annotations

import importlib
import sys

from ..cli import table_usage

BENCHES: dict[str, tuple[str, str]] = {
    "autoscale": ("llmgw.bench.autoscale", "replicas that follow demand on 2 simulated nodes x 4 H100s: a step, a "
                                           "diurnal trace, two models swapping, a model idle then called; the "
                                           "autoscaler beside a fixed max and a fixed min fleet: time to serving, "
                                           "dropped requests, reversals, TTFT SLO, replica-seconds vs an oracle"),
    "chaos": ("llmgw.bench.chaos", "a schedule of faults (Redis frozen and restarted empty, the leader frozen and "
                                   "killed, a forged lease, a partition, the agent and an engine killed) under "
                                   "load over 2 candidates, gateways and a remote agent: failed requests per "
                                   "gateway, time to routable again, engine restarts, terms (--soak MINUTES: "
                                   "RSS, fds and Trio tasks over time)"),
    "cluster-events": ("llmgw.bench.cluster_events", "several gateways on Redis: from an engine's BlockStored to "
                                                     "every gateway's index holding the blocks, p50/p99"),
    "fault": ("llmgw.bench.fault", "kill an engine, the agent and the control plane under a steady load: "
                                   "failed requests by kind, time to routable again, engine restarts "
                                   "(--gateways N: a gateway, then Redis, in a cluster)"),
    "hot-start": ("llmgw.bench.hot_start", "a model at zero called again on a simulated H100: its replica woken "
                                           "from sleep (sleep_mode, keep_warm) against started cold, seconds to "
                                           "the first token, alternated"),
    "limits": ("llmgw.bench.limits", "per-key rpm, tpm, concurrency and budgets across N gateways (and workers) "
                                     "beside LiteLLM's proxy on one Redis: admitted over the limit, the largest "
                                     "overshoot, usable share under steady load, added latency, a Redis kill"),
    "overload": ("llmgw.bench.overload", "open-loop Poisson arrivals at 0.5x to 4x the fleet's capacity, two "
                                         "interactive tenants and a batch one, through 1 and 3 gateways: llmgw "
                                         "with and without flow control beside vllm-router's queue; TTFT, "
                                         "goodput, shed and expired per class, KV usage while requests wait"),
    "proxy": ("llmgw.bench.proxy", "the data plane's overhead: llmgw, the upstream called directly and vllm-router "
                                   "under wrk: added p50, requests/s and streams/s, CPU µs per request"),
    "redis-writers": ("llmgw.bench.redis_writers", "load reports beside a busy /admin/explain writer on one Redis, "
                                                   "the writer on the reports' link or its own: the reports' "
                                                   "interval (Redis' clock) and send-to-read delay"),
    "room": ("llmgw.bench.room", "overload control's learnt room on one simulated H100 under a standing backlog, "
                                 "against no admission: the engine's KV usage, queue and preemptions, throughput"),
    "routing": ("llmgw.bench.routing", "routing tiers, an oracle and vllm-router on the same simulators: "
                                       "engine-reported cache hits, TTFT p90, output tokens/s, the load knee"),
    "sim-calibration": ("llmgw.bench.sim_calibration", "the simulator's GPU profiles against published vLLM "
                                                       "sweeps: TTFT and ITL by concurrency, relative error"),
    "usage": ("llmgw.bench.usage_record", "what recording an answer's usage costs per request: the aggregate, "
                                          "the llmgw_tenant_* counters, the kill -9 journal; a SQLite flush"),
    "workers": ("llmgw.bench.workers", "llmgw serve --workers 2 against one process on one core: CPU per "
                                       "request, added p50 latency, each worker's share and efficiency"),
}


NOT_INSTALLED = """llmgw bench: the benchmarks are not in this installation of llmgw: they live in the source tree
(llmgw/bench/), which the wheel leaves out. Run them from a checkout of the llmgw repository:
    pip install -e '.[bench]'    # in the checkout (or ./dev, which makes .venv)
    llmgw bench {name} --help"""


def usage() -> str:
    return table_usage("llmgw bench", "benchmark", BENCHES)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHES:
        print(f"llmgw bench: unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(BENCHES[name][0])
    except ModuleNotFoundError as exc:
        if exc.name not in ("llmgw.bench", BENCHES[name][0]):
            raise  # a dependency of the benchmark itself is missing: its own message says which
        print(NOT_INSTALLED.format(name=name), file=sys.stderr)
        return 2
    program, sys.argv[0] = sys.argv[0], f"llmgw bench {name}"
    try:  # argparse names the program after sys.argv[0]: each benchmark's --help and errors say llmgw bench NAME
        return int(module.main(rest) or 0)
    finally:
        sys.argv[0] = program
