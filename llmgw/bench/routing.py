"""Routing judged on the engines: llmgw's tiers, an oracle and vllm-router on the same simulators and requests.

``llmgw bench routing [--workload grouped] [--arms ...] [--concurrency 8,24] [--gateways 1,4] [--repeats 3]
[--sim-profile NAME] [--baseline DIR] [--quick] [--json FILE] [--markdown FILE] [--plots DIR]``

For every workload, concurrency C, repeat and arm (:mod:`llmgw.bench.routing_arms`), fresh
simulators (N replicas, every one on ``--sim-profile``'s timing, with what the workload needs: a
given KV capacity, slower replicas, output lengths) and a fresh router are started, and the
workload's sessions (:mod:`llmgw.bench.routing_workloads`) are sent by C
closed-loop clients; each repeat runs the arms in a rotated order, so a busy machine falls on all
of them alike. Every number comes from the client or the engines, never from a router:

- *hit rate*: sum of the engines' ``usage.prompt_tokens_details.cached_tokens`` over the sum of
  their ``prompt_tokens``; *ideal*: the same with, in place of the cached tokens, the leading
  prompt blocks some earlier request of the run had already computed (prompt and reply), on any
  replica: what an infinite cache routed perfectly could have served;
- *cold requests*: requests served with nothing cached although an earlier request had computed
  at least their first block;
- *TTFT*: the client's time from sending the request to its first content chunk (p50, p90, mean);
- *ITL*: the client's gaps between successive content chunks of a stream (one token each), pooled
  over the run's requests as vLLM reports inter-token latency, per token (p50, p90);
- *goodput*: requests per second of wall time that met the workload's objectives
  (:class:`~llmgw.bench.routing_workloads.Objectives`, in the engines' modelled time, so times
  ``--time-scale``): time to first token and mean gap between tokens (vLLM's TPOT) both within them;
- *output tokens/s*: the engines' ``completion_tokens`` over the run's wall time;
- *per replica*: the simulators' own ``vllm:request_success_total``;
- *load CoV*: the coefficient of variation (population standard deviation over mean) across the
  replicas of the requests each engine served (``vllm:request_success_total``); *prefill CoV*: the
  same of the prompt tokens each engine computed (``vllm:prompt_tokens_total`` minus
  ``vllm:prefix_cache_hits_total``): 0 is an even split;
- *router CPU*: user+system CPU seconds of the router processes (llmgw or vllm-router, all N of
  them, and the llmgw cluster's redis-server) during the load, from ``/proc`` (none for the
  oracle, which runs in the benchmark's process);
- *knee*: along the concurrencies measured, the last C before a step on which TTFT p90 more than
  doubles while output tokens/s grows less than 10% (the largest C when no step does).

With ``--gateways 1,4`` every arm also runs as N routers over the same simulators
(:mod:`llmgw.bench.routing_arms`: llmgw as one cluster sharing its state through a private Redis,
vllm-router as N independent instances), the clients' requests spread over them round-robin as an
L4 balancer would (request *i* to gateway *i mod N*); each N is a row of its own and a table puts
every N beside N=1 (hit rate and TTFT p90 as ratios of N=1's).

With ``--baseline DIR`` the arms written ``NAME@baseline`` run the gateway of another checkout
(:data:`~llmgw.bench.routing_arms.BASELINE`) on this checkout's simulators and requests, in the same
rotation as the others: a change judged against the code before it in one run. Both read the same
generated config, which the baseline's own ``llmgw config check`` reads first.

Reported per arm, N and C: medians over the repeats. Output: a Markdown table (printed, and written
with ``--markdown``), everything with ``--json`` (per-request records included), PNG plots of
TTFT p90 against C per arm with ``--plots`` (needs matplotlib: ``pip install llmgw[bench]``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import httpx
import trio

from ..sim import tokenizer
from ..sim.profiles import CONSTANT, DEFAULT_PROFILE, ProfileError, profile
from .calibration import DECISION_FIELDS, DecisionCollector, calibration, calibration_table
from .chat_workloads import ChatResult, new_client, percentile
from .common import write_json
from .proxy import find_vllm_router, process_cpu_seconds, vllm_router_version
from .routing_arms import ARMS, BASELINE, Arm, SimSpec, Target, baseline_omits, block_keys, leading, open_arm
from .routing_workloads import WORKLOADS, Needs, Objectives, Session, TraceError, build, needs

DEFAULT_ARMS = ("round_robin", "prefix_tree", "kv_index", "oracle", "vllm-router-round_robin",
                "vllm-router-cache_aware", "vllm-router-kv_aware")
QUICK_ARMS = ("round_robin", "prefix_tree", "kv_index", "oracle", "vllm-router-cache_aware")
# with --gateways beyond 1: llmgw's tiers on the shared state, vllm-router's cache policies as independent instances
GATEWAY_ARMS = ("round_robin", "prefix_tree", "kv_index", "vllm-router-cache_aware", "vllm-router-kv_aware")
MAX_GATEWAYS = 32
KNEE_P90_GROWTH = 2.0
KNEE_THROUGHPUT_GROWTH = 1.10


@dataclass
class Record:
    """One request as the client saw it and the engine reported it."""

    id: str
    digest: str  # of the body sent: the same for every arm when the requests are the same
    replica: str
    status: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float
    latency_ms: float
    ideal_cached_tokens: int  # leading prompt tokens some earlier request had computed (see the module doc)
    gateway: int = 0  # which of the arm's N gateways it was sent through
    itl_ms: list[float] = field(default_factory=list)  # the stream's gaps between content chunks


@dataclass
class CacheReset:
    """Replica ``replica``'s prefix cache reset once ``after`` requests are answered (running ones preempted, as
    vLLM's ``POST /reset_prefix_cache?reset_running_requests=true``): the ``restart`` workload's event."""

    after: int
    replica: int = 0
    at_s: float | None = None  # when, from the run's start
    success: bool | None = None  # the engine's answer

    async def fire(self, url: str, started: float) -> None:
        self.at_s = time.perf_counter() - started
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(url + "/reset_prefix_cache", params={"reset_running_requests": "true"})
        self.success = response.status_code == 200 and response.json().get("success") is True
        if not self.success:
            print(f"\nthe prefix cache reset of replica {self.replica} failed: {response.status_code} {response.text}",
                  file=sys.stderr)


class Progress:
    """A one-line progress bar on stderr (one line per run when stderr is not a terminal)."""

    def __init__(self, total: int):
        self.total = total
        self.done = 0
        self.label = ""
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()

    def begin(self, label: str) -> None:
        self.label = label
        if not self.tty:
            print(f"[{self.done}/{self.total}] {label}", file=sys.stderr, flush=True)
        self.draw()

    def step(self) -> None:
        self.done += 1
        self.draw()

    def draw(self) -> None:
        if self.tty:
            width = 30
            filled = width * self.done // max(1, self.total)
            elapsed = time.monotonic() - self.started
            print(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} requests, "
                  f"{elapsed:4.0f} s  {self.label:<40.40}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


class IdealCache:
    """Leading blocks of prompts (and replies) already computed somewhere in the run: an infinite shared cache."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.seen: set[int] = set()

    def lookup(self, prompt_ids: list[int]) -> int:
        """Cached leading tokens, capped as an engine caps them (the last prompt token is always computed)."""
        keys = block_keys(prompt_ids, self.block_size)[:(len(prompt_ids) - 1) // self.block_size]
        return leading(keys, self.seen) * self.block_size

    def add(self, ids: list[int]) -> None:
        self.seen.update(block_keys(ids, self.block_size))


async def run_sessions(target: Target, sessions: list[Session], concurrency: int, block_size: int,
                       progress: Progress | None = None, reset: CacheReset | None = None,
                       decisions: DecisionCollector | None = None) -> list[Record]:
    """The sessions through ``target`` by ``concurrency`` closed-loop clients, in order of the list (and
    ``reset`` fired when its count of requests is answered; ``decisions`` told of every answer)."""
    records: list[Record] = []
    ideal = IdealCache(block_size)
    queue = iter(sessions)
    started = time.perf_counter()

    async def client_loop(client: httpx.AsyncClient) -> None:
        for session in queue:
            history: list[dict] = []
            for turn in session.turns:
                messages = history + turn.messages if session.carry else turn.messages
                prompt_ids = tokenizer.encode_chat(messages)
                ideal_hit = ideal.lookup(prompt_ids)
                ideal.add(prompt_ids)
                digest = hashlib.sha256(json.dumps([messages, turn.max_tokens], sort_keys=True).encode()).hexdigest()
                gateway = target.spread.next()
                try:
                    result = await target.sends[gateway](client, messages, turn.max_tokens)
                except (httpx.HTTPError, ValueError) as exc:  # an error of this request, counted; the run goes on
                    print(f"\n{turn.id}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    result = ChatResult("", 0, 0, 0, 0.0, 0.0, "")
                ideal.add(prompt_ids + tokenizer.encode(result.reply, add_special_tokens=False))
                records.append(Record(turn.id, digest[:16], result.replica, result.status, result.prompt_tokens,
                                      result.cached_tokens, result.completion_tokens, 1000 * result.ttft,
                                      1000 * result.latency, ideal_hit, gateway,
                                      [round(1000 * gap, 3) for gap in result.itl]))
                if decisions is not None:
                    decisions.answered()
                if reset is not None and len(records) == reset.after:
                    nursery.start_soon(reset.fire, target.sim_urls[reset.replica], started)
                if session.carry:
                    history = messages + [{"role": "assistant", "content": result.reply}]
                if progress is not None:
                    progress.step()

    async with new_client(concurrency) as client, trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client_loop, client)
    records.sort(key=lambda r: r.id)
    return records


def cov(values: list[float] | list[int]) -> float | None:
    """Coefficient of variation: population standard deviation over the mean (0: all equal; None: no mean)."""
    if not values:
        return None
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean else None


def meets(record: Record, objectives: Objectives) -> bool:
    """Whether a request met the objectives (already in measured time): its TTFT, and its mean gap between
    tokens (a stream of one token has none)."""
    gaps = record.itl_ms
    return record.ttft_ms <= objectives.ttft_ms and (not gaps or sum(gaps) / len(gaps) <= objectives.itl_ms)


def summarize(records: list[Record], wall_s: float, gateways: int = 1,
              objectives: Objectives | None = None) -> dict:
    """A run's numbers (see the module doc); ``objectives``: goodput's, in measured milliseconds."""
    ok = [r for r in records if r.status == 200]
    objectives = objectives or Objectives()
    gaps = [gap for r in ok for gap in r.itl_ms]
    good = sum(1 for r in ok if meets(r, objectives))
    per_gateway = [0] * gateways
    for r in records:
        per_gateway[r.gateway] += 1
    prompt = sum(r.prompt_tokens for r in ok)
    ttfts = [r.ttft_ms for r in ok]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "ideal_hit_rate": sum(min(r.ideal_cached_tokens, r.prompt_tokens) for r in ok) / prompt if prompt else 0.0,
        "cold_requests": sum(1 for r in ok if r.cached_tokens == 0 and r.ideal_cached_tokens > 0),
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p90_ms": percentile(ttfts, 0.9),
        "ttft_mean_ms": statistics.fmean(ttfts) if ttfts else 0.0,
        "output_tokens": sum(r.completion_tokens for r in ok),
        "output_tokens_per_s": sum(r.completion_tokens for r in ok) / wall_s if wall_s else 0.0,
        "itl_p50_ms": percentile(gaps, 0.5),
        "itl_p90_ms": percentile(gaps, 0.9),
        "goodput_requests": good,
        "goodput_rps": good / wall_s if wall_s else 0.0,
        "slo_ttft_ms": objectives.ttft_ms,
        "slo_itl_ms": objectives.itl_ms,
        "wall_s": wall_s,
        "requests_digest": hashlib.sha256("".join(f"{r.id}={r.digest};" for r in records).encode()).hexdigest()[:16],
        "per_gateway": per_gateway,
    }


def counter(text: str, name: str) -> int:
    """The sum of a counter's samples (every label set) in Prometheus text."""
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith(name + "{") or line.startswith(name + " ")))


async def engine_counts(http: httpx.AsyncClient, urls: list[str]) -> dict[str, list[int]]:
    """Per simulator: requests served (``vllm:request_success_total``, all finish reasons) and prompt tokens
    computed (``vllm:prompt_tokens_total`` minus ``vllm:prefix_cache_hits_total``)."""
    served, computed = [], []
    for url in urls:
        text = (await http.get(url + "/metrics")).text
        served.append(counter(text, "vllm:request_success_total"))
        computed.append(counter(text, "vllm:prompt_tokens_total") - counter(text, "vllm:prefix_cache_hits_total"))
    return {"per_replica": served, "prefill_per_replica": computed}


def load_balance(counts: dict[str, list[int]]) -> dict:
    """The engines' counts and their coefficients of variation across the replicas."""
    return {**counts, "load_cov": cov(counts["per_replica"]), "prefill_cov": cov(counts["prefill_per_replica"])}


def routers_cpu_seconds(pids: list[int]) -> float | None:
    """The CPU seconds of all these processes together (None: no process, a router in the benchmark's own)."""
    return sum(process_cpu_seconds(pid) for pid in pids) if pids else None


async def run_once(arm: Arm, spec: SimSpec, sessions: list[Session], concurrency: int, vllm_router: str | None,
                   progress: Progress | None = None, gateways: int = 1, load: Needs | None = None,
                   omit: frozenset[str] = frozenset()) -> dict:
    """One arm (as ``gateways`` routers) at one concurrency on fresh simulators: its summary and per-request
    records. ``load``: what the workload asks of the run (its objectives, a cache reset); ``omit``: config keys
    left out for a baseline that does not read them."""
    load = load or Needs()
    requests = sum(len(s.turns) for s in sessions)
    reset = CacheReset(max(1, round(load.reset_after * requests))) if load.reset_after is not None else None
    async with trio.open_nursery() as nursery:
        target = await open_arm(nursery, arm, spec, vllm_router, gateways, omit)
        cpu_before = routers_cpu_seconds(target.router_pids)
        collector = DecisionCollector(target.decision_urls)
        async with httpx.AsyncClient(timeout=10) as http, trio.open_nursery() as reading:
            reading.start_soon(collector.run, http)
            started = time.perf_counter()
            records = await run_sessions(target, sessions, concurrency, spec.block_size, progress, reset, collector)
            wall = time.perf_counter() - started
            cpu_after = routers_cpu_seconds(target.router_pids)
            reading.cancel_scope.cancel()
        cpu = cpu_after - cpu_before if cpu_after is not None and cpu_before is not None else None
        async with httpx.AsyncClient(timeout=10) as http:
            await collector.read(http)
            counts = await engine_counts(http, target.sim_urls)
        nursery.cancel_scope.cancel()
    summary = summarize(records, wall, gateways, measured(load.objectives, spec.time_scale))
    if reset is not None:
        summary["cache_reset"] = asdict(reset)
    summary.update(load_balance(counts), gateways=gateways, router_cpu_s=cpu, load_average=os.getloadavg(),
                   router_cpu_percent=None if cpu is None else 100 * cpu / wall,
                   router_cpu_ms_per_request=None if cpu is None else 1000 * cpu / max(1, len(records)))
    if target.decision_urls:
        summary.update(decisions_read=len(collector.decisions), decision_rings_turned_over=collector.lost)
    if target.modules:
        summary["gateway_modules"] = target.modules
    return {"summary": summary, "records": [list(asdict(r).values()) for r in records],
            "decisions": collector.decisions}


def measured(objectives: Objectives, time_scale: float) -> Objectives:
    """The objectives in measured time: the engines' modelled milliseconds times the time scale."""
    return Objectives(objectives.ttft_ms * time_scale, objectives.itl_ms * time_scale)


RECORD_FIELDS = [f.name for f in fields(Record)]  # the order of a record's values in the JSON


MEDIAN_KEYS = ("hit_rate", "ideal_hit_rate", "cold_requests", "ttft_p50_ms", "ttft_p90_ms", "ttft_mean_ms",
               "output_tokens_per_s", "itl_p50_ms", "itl_p90_ms", "goodput_rps", "goodput_requests", "errors",
               "load_cov", "prefill_cov", "router_cpu_s", "router_cpu_percent",
               "router_cpu_ms_per_request", "wall_s")


def medians(runs: list[dict]) -> dict:
    out = {}
    for key in MEDIAN_KEYS:
        values = [run["summary"][key] for run in runs if run["summary"].get(key) is not None]
        out[key] = statistics.median(values) if values else None
    for key in ("per_replica", "prefill_per_replica", "per_gateway"):
        lists = [run["summary"][key] for run in runs if key in run["summary"]]
        if lists:
            out[key] = lists[0] if len(lists) == 1 else [statistics.median(v) for v in zip(*lists)]
    out["repeats"] = len(runs)
    return out


def knee(points: dict[int, dict]) -> dict:
    """The last concurrency before TTFT p90 more than doubles while output tokens/s grows less than 10%."""
    levels = sorted(points)
    for low, high in zip(levels, levels[1:]):
        a, b = points[low], points[high]
        if a["ttft_p90_ms"] and b["ttft_p90_ms"] > KNEE_P90_GROWTH * a["ttft_p90_ms"] \
                and b["output_tokens_per_s"] < KNEE_THROUGHPUT_GROWTH * a["output_tokens_per_s"]:
            return {"concurrency": low, "reached": True, "output_tokens_per_s": a["output_tokens_per_s"]}
    top = levels[-1]
    return {"concurrency": top, "reached": False, "output_tokens_per_s": points[top]["output_tokens_per_s"]}


@dataclass
class Plan:
    workloads: list[str]
    arms: list[Arm]
    concurrencies: list[int]
    repeats: int
    seed: int
    quick: bool
    spec: SimSpec
    gateways: list[int] = field(default_factory=lambda: [1])  # N: routers per arm, the clients spread over them
    objectives: Objectives | None = None  # --slo-ttft-ms/--slo-itl-ms over every workload's own (None: theirs)
    config_omits: frozenset[str] = frozenset()  # optional config keys the --baseline does not read: in no config

    def spec_for(self, load: Needs) -> SimSpec:
        """The simulators of a workload: the plan's, with the capacity, slow replicas and output lengths it needs
        (a ``--num-blocks`` given wins over the workload's capacity)."""
        return replace(self.spec, num_blocks=self.spec.num_blocks if self.spec.num_blocks is not None
                       else load.num_blocks, slow_replicas=load.slow_replicas, output_tokens=load.output_tokens)

    def needs(self, name: str) -> Needs:
        load = needs(name)
        return load if self.objectives is None else replace(load, objectives=self.objectives)

    def levels(self, load: Needs) -> list[int]:
        """The concurrencies a workload runs at: its own when it is defined at one (``burst``), else the plan's."""
        return [load.concurrency] if load.concurrency is not None else self.concurrencies

    def units(self) -> list[tuple[Arm, int]]:
        """Every (arm, N) the plan runs, each N of an arm beside the others (so they share the machine's moments)."""
        return [(arm, n) for arm in self.arms for n in self.gateways]

    def key(self, arm: Arm, gateways: int) -> str:
        """The report's name for ``arm`` as ``gateways`` routers: the arm's name when the plan has only N=1."""
        return arm.name if self.gateways == [1] else f"{arm.name} N={gateways}"

    def label(self, arm: Arm, gateways: int) -> str:
        return arm.label if self.gateways == [1] else f"{arm.label}, N={gateways}"


async def run(plan: Plan, vllm_router: str | None) -> dict:
    report: dict = {"record_fields": RECORD_FIELDS, "decision_fields": DECISION_FIELDS, "workloads": {}}
    asks = {name: plan.needs(name) for name in plan.workloads}
    specs = {name: plan.spec_for(load) for name, load in asks.items()}
    loads = {name: build(name, plan.seed, quick=plan.quick, fleet_tokens=specs[name].fleet_tokens())
             for name in plan.workloads}
    per_run = {name: sum(len(s.turns) for s in sessions) for name, sessions in loads.items()}
    units = plan.units()
    progress = Progress(sum(per_run[name] * len(plan.levels(asks[name])) for name in loads) * len(units)
                        * plan.repeats)
    try:
        for name, sessions in loads.items():
            load, spec, levels = asks[name], specs[name], plan.levels(asks[name])
            runs: dict[str, dict[int, list]] = {plan.key(arm, n): {c: [] for c in levels} for arm, n in units}
            for concurrency in levels:
                for repeat in range(plan.repeats):
                    shift = repeat % len(units)  # a rotated order: slow moments of the machine hit every arm
                    for arm, n in units[shift:] + units[:shift]:
                        progress.begin(f"{name} C={concurrency} #{repeat + 1} {plan.label(arm, n)}")
                        runs[plan.key(arm, n)][concurrency].append(
                            await run_once(arm, spec, sessions, concurrency, vllm_router, progress, n, load,
                                           plan.config_omits))
            arms = {}
            for arm, n in units:
                key = plan.key(arm, n)
                points = {c: medians(runs[key][c]) for c in levels}
                arms[key] = {"label": plan.label(arm, n), "arm": arm.name, "arm_label": arm.label, "gateways": n,
                             "kind": arm.kind, "policy": arm.policy, "options": arm.options,
                             "source": None if arm.source is None else str(arm.source),
                             "by_concurrency": {str(c): p for c, p in points.items()}, "knee": knee(points),
                             "runs": {str(c): runs[key][c] for c in levels}}
                if arm.kind == "llmgw":
                    arms[key]["calibration"] = {str(c): calibration(row for run in runs[key][c]
                                                                    for row in run.get("decisions", []))
                                                for c in levels}
            report["workloads"][name] = {
                "requests": per_run[name], "arms": arms, "simulators": asdict(spec),
                "profiles": [spec.replica_profile(i) for i in range(spec.replicas)],
                "objectives": {**asdict(load.objectives), "time_scale": spec.time_scale,
                               "measured": asdict(measured(load.objectives, spec.time_scale))}}
    finally:
        progress.close()
    return report


def _cell(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _ratio(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec) + "x"


def markdown(report: dict) -> str:
    lines = []
    for name, workload in report["workloads"].items():
        arms = workload["arms"]
        levels = list(next(iter(arms.values()))["by_concurrency"])
        head = ["arm"] + [f"C={c} {what}" for c in levels for what in ("hit", "TTFT p90", "out tok/s")] + ["knee C"]
        lines += [f"**{name}** ({workload['requests']} requests per run; medians of "
                  f"{next(iter(arms.values()))['by_concurrency'][levels[0]]['repeats']} repeats)", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for arm in arms.values():
            cells = [arm["label"]]
            for c in levels:
                p = arm["by_concurrency"][c]
                cells += [f"{p['hit_rate']:.3f}", f"{p['ttft_p90_ms'] / 1000:.2f} s", f"{p['output_tokens_per_s']:.0f}"]
            k = arm["knee"]
            cells.append(f"{k['concurrency']}" + ("" if k["reached"] else "+"))
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "| arm | C | ideal hit | TTFT p50 | TTFT mean | cold | errors | requests per replica | "
                      "load CoV | router CPU (% of a core) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for arm in arms.values():
            for c in levels:
                p = arm["by_concurrency"][c]
                replicas = "/".join(f"{n:g}" for n in p["per_replica"])
                lines.append(f"| {arm['label']} | {c} | {p['ideal_hit_rate']:.3f} | {p['ttft_p50_ms'] / 1000:.2f} s | "
                             f"{p['ttft_mean_ms'] / 1000:.2f} s | {p['cold_requests']:g} | {p['errors']:g} | "
                             f"{replicas} | {_cell(p.get('load_cov'), '.3f')} | "
                             f"{_cell(p['router_cpu_percent'], '.1f', 'in-process')} |")
        lines.append("")
        lines += goodput_table(workload, levels)
        lines += calibration_table(workload, levels)
        if any(arm.get("gateways", 1) != 1 for arm in arms.values()):
            lines += gateways_table(arms, levels)
    return "\n".join(lines)


def goodput_table(workload: dict, levels: list[str]) -> list[str]:
    """Per arm and C: hit rate, TTFT and per-token ITL percentiles, output tokens/s and goodput, under the
    workload's objectives."""
    objectives = workload.get("objectives")
    head = "Latency and goodput"
    if objectives:
        head += (f" (objectives: TTFT <= {objectives['ttft_ms']:g} ms and mean ITL <= {objectives['itl_ms']:g} ms "
                 f"modelled, x time scale {objectives['time_scale']:g} = {objectives['measured']['ttft_ms']:g} / "
                 f"{objectives['measured']['itl_ms']:g} ms measured)")
    profiles = workload.get("profiles")
    if profiles:
        head += "; replicas: " + ", ".join(profiles)
    lines = [head, "", "| arm | C | hit | TTFT p50 | TTFT p90 | ITL p50 | ITL p90 | out tok/s | goodput (req/s) | "
                       "met |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in workload["arms"].values():
        for c in levels:
            p = arm["by_concurrency"][c]
            met = p.get("goodput_requests")
            lines.append(f"| {arm['label']} | {c} | {p['hit_rate']:.3f} | {p['ttft_p50_ms']:.1f} ms | "
                         f"{p['ttft_p90_ms']:.1f} ms | {_cell(p.get('itl_p50_ms'), '.2f')} ms | "
                         f"{_cell(p.get('itl_p90_ms'), '.2f')} ms | {p['output_tokens_per_s']:.0f} | "
                         f"{_cell(p.get('goodput_rps'), '.2f')} | "
                         f"{'-' if met is None else format(met, 'g')}/{workload['requests']} |")
    lines.append("")
    return lines


def gateways_table(arms: dict, levels: list[str]) -> list[str]:
    """Each arm at every N beside itself at N=1: hit rate and TTFT p90 as ratios of N=1's, the load's balance."""
    lines = ["Several gateways (N routers, requests spread round-robin; ratios: of the same arm at N=1; "
             "load CoV: of requests per replica, prefill CoV: of prompt tokens computed per replica)", "",
             "| arm | C | N | hit | TTFT p50 | TTFT p90 | out tok/s | load CoV | prefill CoV | hit / N=1 | "
             "TTFT p90 / N=1 | requests per gateway |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    alone = {(arm["arm"], c): arm["by_concurrency"][c] for arm in arms.values() if arm.get("gateways", 1) == 1
             for c in levels}
    for arm in arms.values():  # in the plan's order: the Ns of an arm together
        for c in levels:
            p = arm["by_concurrency"][c]
            base = alone.get((arm.get("arm", ""), c))
            hit_ratio = p["hit_rate"] / base["hit_rate"] if base and base["hit_rate"] else None
            p90_ratio = p["ttft_p90_ms"] / base["ttft_p90_ms"] if base and base["ttft_p90_ms"] else None
            spread = "/".join(f"{n:g}" for n in p.get("per_gateway", []))
            lines.append(f"| {arm.get('arm_label', arm['label'])} | {c} | {arm.get('gateways', 1)} | "
                         f"{p['hit_rate']:.3f} | {p['ttft_p50_ms'] / 1000:.2f} s | {p['ttft_p90_ms'] / 1000:.2f} s | "
                         f"{p['output_tokens_per_s']:.0f} | {_cell(p.get('load_cov'), '.3f')} | "
                         f"{_cell(p.get('prefill_cov'), '.3f')} | {_ratio(hit_ratio, '.3f')} | "
                         f"{_ratio(p90_ratio, '.2f')} | {spread} |")
    lines.append("")
    return lines


def plot(report: dict, directory: Path) -> list[str]:
    """One PNG per workload: TTFT p90 against concurrency, one line per arm."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'llmgw[bench]')", file=sys.stderr)
        return []
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, workload in report["workloads"].items():
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for arm in workload["arms"].values():
            levels = [int(c) for c in arm["by_concurrency"]]
            axes.plot(levels, [arm["by_concurrency"][str(c)]["ttft_p90_ms"] / 1000 for c in levels], marker="o",
                      label=arm["label"])
        axes.set(xlabel="concurrency (closed-loop clients)", ylabel="TTFT p90 (s)", title=f"routing: {name}")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
        path = directory / f"routing-{name.replace(':', '-').replace('/', '_')}.png"
        figure.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(figure)
        written.append(str(path))
    return written


def _known_arm(name: str) -> bool:
    """One of :data:`ARMS`, or ``NAME@LABEL``: a variant of an llmgw arm (its own ``--arm-options``;
    ``NAME@baseline``: run by the ``--baseline`` checkout's gateway)."""
    base, at, label = name.partition("@")
    return base in ARMS and (not at or bool(label) and ARMS[base].kind == "llmgw")


def _arm_options(values: list[str]) -> dict[str, dict]:
    options = {}
    for value in values:
        name, _, text = value.partition("=")
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise SystemExit(f"--arm-options {value!r}: not JSON after '=': {exc}") from None
        base = ARMS.get(name.partition("@")[0])
        if base is None or base.kind != "llmgw" or not isinstance(parsed, dict):
            raise SystemExit(f"--arm-options {value!r}: expected LLMGW_ARM={{json object}} with LLMGW_ARM one of "
                             + ", ".join(n for n, a in ARMS.items() if a.kind == "llmgw")
                             + " (or a variant of one: NAME@LABEL)")
        options[name] = parsed
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="grouped",
                        help=f"comma list of {', '.join(WORKLOADS)}, trace:FILE (default grouped)")
    parser.add_argument("--arms", default=None, help=f"comma list of {', '.join(ARMS)} (default: all; "
                                                     "vllm-router arms are skipped when it is not installed), or "
                                                     "NAME@LABEL: a variant of an llmgw arm, e.g. kv_index@greedy "
                                                     "with --arm-options 'kv_index@greedy={...}'")
    parser.add_argument("--arm-options", action="append", default=[], metavar="ARM=JSON",
                        help="routing_options of an llmgw arm, e.g. 'kv_index={\"predicted_ttl\": \"1s\"}' "
                             "(repeatable)")
    parser.add_argument("--baseline", metavar="DIR", default=None,
                        help="another checkout of llmgw (e.g. git worktree add /tmp/base COMMIT) whose gateway runs "
                             "the arms written NAME@baseline (e.g. kv_index@baseline), on this checkout's simulators "
                             "and requests, interleaved with the other arms; without any NAME@baseline in --arms, "
                             "every llmgw arm gets its @baseline twin")
    parser.add_argument("--concurrency", default="8,24", help="comma list of closed-loop client counts: the "
                                                              "load sweep (default 8,24)")
    parser.add_argument("--gateways", default="1", metavar="N[,N...]",
                        help="comma list of router counts per arm, e.g. 1,4: N gateways over the same simulators, "
                             "request i sent through gateway i mod N (an L4 balancer); llmgw arms as one cluster "
                             "sharing its state through a private Redis, vllm-router as N independent instances "
                             f"(default 1; with more, the default arms are {','.join(GATEWAY_ARMS)})")
    parser.add_argument("--repeats", type=int, default=3, help="runs per arm and concurrency (default 3)")
    parser.add_argument("--replicas", type=int, default=4, help="simulator replicas (default 4)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV cache of each simulator, in 16-token blocks (default: 2861, 45,760 tokens, on the "
                             "constant profile; what the GPU's memory holds on a GPU profile; a workload that needs "
                             "a capacity, pressure, sets its own unless this is given)")
    parser.add_argument("--sim-profile", default=DEFAULT_PROFILE, metavar="NAME",
                        help=f"every simulator's --profile: a GPU profile <gpu>-<model>[-tpN] (default "
                             f"{DEFAULT_PROFILE}; the hetero workload's slow replica: the next slower GPU) or constant "
                             "(8,000 prefill "
                             "tokens/s, 30 ms a step: the settings of the tables recorded before 2026-12-04)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="the simulators' --time-scale (default 1)")
    parser.add_argument("--slo-ttft-ms", type=float, default=None,
                        help="goodput's TTFT objective in modelled ms, for every workload (default: each its own)")
    parser.add_argument("--slo-itl-ms", type=float, default=None,
                        help="goodput's objective on a request's mean inter-token gap in modelled ms, for every "
                             "workload (default: each its own)")
    parser.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help=f"small workloads, arms {','.join(QUICK_ARMS)}, C=8, 1 repeat (under 3 minutes)")
    parser.add_argument("--vllm-router", default=None, help="the vllm-router executable (default: looked up)")
    parser.add_argument("--install-vllm-router", action="store_true",
                        help="install vllm-router 0.1.17 into bench-results/vr-venv when it is missing")
    parser.add_argument("--json", metavar="FILE", help="write everything (per-request records included) here")
    parser.add_argument("--markdown", metavar="FILE", help="write the table here too")
    parser.add_argument("--plots", metavar="DIR", help="write PNG plots (TTFT p90 against concurrency) here")
    return parser


def checkout_commit(folder: Path) -> str | None:
    """The commit a checkout is at (``git rev-parse HEAD``; None where it is no git checkout)."""
    try:
        done = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _with_baseline(names: list[str], baseline: str | None) -> list[str]:
    """The arms with ``--baseline``: as given when some are ``NAME@baseline``, else each llmgw arm followed by
    its ``@baseline`` twin; an error for ``NAME@baseline`` without ``--baseline`` or a folder that is no checkout."""
    tagged = [n for n in names if n.partition("@")[2] == BASELINE]
    if baseline is None:
        if tagged:
            raise SystemExit(f"llmgw bench routing: {', '.join(tagged)} need --baseline DIR (another checkout)")
        return names
    if not (Path(baseline) / "llmgw" / "__main__.py").is_file():
        raise SystemExit(f"llmgw bench routing: --baseline {baseline}: no llmgw checkout there (no llmgw/__main__.py)")
    if tagged:
        return names
    return [twin for n in names for twin in ([n, f"{n}@{BASELINE}"] if ARMS[n.partition("@")[0]].kind == "llmgw"
                                             and "@" not in n else [n])]


def _plan(args: argparse.Namespace) -> Plan:
    try:
        gateways = sorted({int(n) for n in args.gateways.split(",")})
    except ValueError:
        raise SystemExit(f"llmgw bench routing: --gateways {args.gateways!r} is not a list of integers") from None
    if not gateways or gateways[0] < 1 or gateways[-1] > MAX_GATEWAYS:
        raise SystemExit(f"llmgw bench routing: --gateways must be between 1 and {MAX_GATEWAYS}")
    defaults = GATEWAY_ARMS if gateways != [1] else QUICK_ARMS if args.quick else DEFAULT_ARMS
    names = args.arms.split(",") if args.arms else list(defaults)
    unknown = [n for n in names if not _known_arm(n)]
    if unknown or len(set(names)) < len(names):
        raise SystemExit(f"llmgw bench routing: unknown or repeated arm(s) {', '.join(unknown or names)}; choose from "
                         f"{', '.join(ARMS)}, or NAME@LABEL for a variant of an llmgw arm (with --arm-options)")
    names = _with_baseline(names, args.baseline)
    options = _arm_options(args.arm_options)
    source = None if args.baseline is None else Path(args.baseline).resolve()
    arms = [replace(ARMS[n.partition("@")[0]], name=n, options=options.get(n, {}),
                    source=source if n.partition("@")[2] == BASELINE else None) for n in names]
    concurrencies = ["8"] if args.quick and args.concurrency == "8,24" else args.concurrency.split(",")
    try:
        levels = sorted({int(c) for c in concurrencies})
    except ValueError:
        raise SystemExit(f"llmgw bench routing: --concurrency {args.concurrency!r} is not a list of integers") from None
    if not levels or levels[0] < 1 or args.repeats < 1 or args.replicas < 1:
        raise SystemExit("llmgw bench routing: concurrency, --repeats and --replicas must be at least 1")
    spec = SimSpec(replicas=args.replicas, num_blocks=args.num_blocks, time_scale=args.time_scale,
                   profile=args.sim_profile)
    try:
        if spec.profile != CONSTANT:
            profile(spec.profile)
    except ProfileError as exc:
        raise SystemExit(f"llmgw bench routing: --sim-profile: {exc}") from None
    workloads = args.workload.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS and not w.startswith("trace:")]
    if unknown:
        raise SystemExit(f"llmgw bench routing: unknown workload(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(WORKLOADS)} or trace:FILE")
    objectives = None
    if args.slo_ttft_ms is not None or args.slo_itl_ms is not None:
        base = Objectives()
        objectives = Objectives(base.ttft_ms if args.slo_ttft_ms is None else args.slo_ttft_ms,
                                base.itl_ms if args.slo_itl_ms is None else args.slo_itl_ms)
        if objectives.ttft_ms <= 0 or objectives.itl_ms <= 0:
            raise SystemExit("llmgw bench routing: --slo-ttft-ms and --slo-itl-ms must be positive")
    repeats = 1 if args.quick and args.repeats == 3 else args.repeats
    return Plan(workloads, arms, levels, repeats, args.seed, args.quick, spec, gateways, objectives)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = _plan(args)
    for arm in plan.arms:
        omit, problems = baseline_omits(arm, plan.spec) if arm.source is not None else (frozenset(), None)
        if problems:
            print(f"llmgw bench routing: the baseline {arm.source} does not read the config arm {arm.name} runs "
                  f"on (give its options with --arm-options '{arm.name}={{...}}'):\n{problems}", file=sys.stderr)
            return 2
        if omit - plan.config_omits:
            print(f"llmgw bench routing: the baseline {arm.source} does not read {', '.join(sorted(omit))}: left out "
                  "of every llmgw arm's config (the same config for both)", file=sys.stderr)
        plan.config_omits |= omit
    skipped = {}
    executable = None
    if any(arm.kind == "vllm-router" for arm in plan.arms):
        executable, how = find_vllm_router(args.vllm_router, args.install_vllm_router, Path.cwd())
        if executable is None:
            skipped = {arm.name: f"vllm-router {how}" for arm in plan.arms if arm.kind == "vllm-router"}
            plan.arms = [arm for arm in plan.arms if arm.kind != "vllm-router"]
            print(f"vllm-router arms skipped: {how} (pip install 'llmgw[bench]', or --install-vllm-router)",
                  file=sys.stderr)
    try:
        report = trio.run(run, plan, executable)
    except TraceError as exc:
        print(f"llmgw bench routing: {exc}", file=sys.stderr)
        return 2
    report["settings"] = {"workloads": plan.workloads, "arms": [a.name for a in plan.arms], "skipped_arms": skipped,
                          "sim_profile": plan.spec.profile,
                          "baseline": args.baseline and str(Path(args.baseline).resolve()),
                          "baseline_commit": args.baseline and checkout_commit(Path(args.baseline)),
                          "config_omitted": sorted(plan.config_omits),
                          "concurrency": plan.concurrencies, "gateways": plan.gateways, "repeats": plan.repeats,
                          "seed": plan.seed,
                          "quick": plan.quick, "simulators": asdict(plan.spec),
                          "vllm_router": executable and vllm_router_version(executable),
                          "command": "llmgw bench routing " + " ".join(argv if argv is not None else sys.argv[1:])}
    report["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                         "load_average": os.getloadavg(), "platform": platform.platform()}
    text = markdown(report)
    print(text)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text + "\n")
    if args.plots:
        report["plots"] = plot(report, Path(args.plots))
    if args.json:
        write_json(args.json, {**report, "markdown": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
