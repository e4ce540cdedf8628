"""Benchmark: how soon every gateway of a cluster routes on the blocks an engine just stored (Redis shared state).

``llmgw bench cluster-events [--followers 2] [--duration 10] [--rate 10] [--json bench-results/cluster-events.json]``

Real processes on loopback (:mod:`.cluster_rig`): ``--sims`` simulators with KV
events, a private ``redis-server``, a control ``llmgw serve`` that follows the
engines' events and writes the KV changes to Redis, and ``--followers``
``llmgw serve --role gateway`` processes that apply them to their own index.

For ``--duration`` seconds, at ``--rate`` samples per second in all (one
sender per engine, one sample at a time each), a completion with a prompt no
one sent before goes straight to an engine (``max_tokens: 1``), which stores
its full blocks and publishes ``BlockStored``. This process subscribes to each
engine's events itself, so it knows the engine's own timestamp of the batch that
stored the prompt's last block. Once the response is back, every gateway is
asked ``POST /admin/explain`` for the prompt in a tight loop (every
``--poll-interval`` seconds) until that engine's ``confirmed_blocks`` is the
prompt's full blocks. For each gateway the table gives:

- **from BlockStored**: the engine's batch timestamp to the answer of the first
  explain that showed every block (wall clocks of one host; an upper bound,
  off by at most one explain round trip, whose median is shown);
- **from the response**: the end of the engine's response to that answer (0
  when the first explain already showed them: counted as *at first poll*);
- the followers' ``llmgw_cluster_log_delay_seconds`` over the run: from the
  control process writing a log batch to the follower applying it (its own
  histogram; p50/p99 interpolated within the buckets, as Prometheus does).

The control process's row is the engine-to-control part alone; a follower's
adds the Redis hop. Target: a follower's p99 from BlockStored <= 50 ms.
Prints a Markdown table; ``--json`` writes it with every sample.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import trio
import zmq

from ..http.client import UpstreamPool
from ..kv import zmq_trio
from ..kv.codec import EventDecodeError, decode_batch, parse_frames
from ..kv.events import BlockStored
from ..testing.metrics import samples
from ..testing.sims import MODEL, kv_sources
from .chat_workloads import words
from .cluster_rig import ClusterRig, GatewayProcess
from .common import bench_parser, print_and_save

DELAY_METRIC = "llmgw_cluster_log_delay_seconds"
TARGET_P99_MS = 50.0


class EngineEvents:
    """One engine's KV-event batches that stored blocks, as (engine timestamp, blocks stored), in arrival order."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.stored: list[tuple[float, int]] = []
        self.decode_errors = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(self.endpoint)
            sub.getsockopt(zmq.EVENTS)  # let libzmq send the subscription now
            task_status.started()
            while True:
                for frames in await zmq_trio.recv_batch(sub):
                    try:
                        batch = decode_batch(parse_frames(frames)[2])
                    except EventDecodeError:
                        self.decode_errors += 1
                        continue
                    blocks = sum(len(ev.block_hashes) for ev in batch.events if isinstance(ev, BlockStored))
                    if blocks:
                        self.stored.append((batch.ts, blocks))
        finally:
            zmq_trio.close(sub)
            ctx.term()


@dataclass
class Seen:
    """When one gateway's explain first showed every block of a sample."""

    at: float | None  # wall clock when that explain answered (None: not within --sample-timeout)
    polls: int
    rtt_ms: float  # the round trip of the last explain


@dataclass
class Sample:
    engine: str
    blocks: int  # the prompt's full blocks (the explain's count)
    stored: int  # blocks the engine's BlockStored batches named between the send and the end of the polling
    event_ts: float | None  # the engine's timestamp of the last of those batches
    response_at: float  # wall clock when the engine's response was complete
    seen: dict[str, Seen] = field(default_factory=dict)  # gateway name ->

    def from_event_ms(self, gateway: str) -> float | None:
        at = self.seen[gateway].at
        return None if at is None or self.event_ts is None else (at - self.event_ts) * 1000

    def from_response_ms(self, gateway: str) -> float | None:
        at = self.seen[gateway].at
        return None if at is None else max(0.0, at - self.response_at) * 1000


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, nearest rank (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def histogram(text: str, name: str) -> dict[float, float]:
    """The cumulative bucket counts of histogram ``name`` in Prometheus ``text``: upper bound -> count."""
    out = {}
    for key, value in samples(text).items():
        if key.startswith(name + "_bucket{"):
            bound = key.split('le="', 1)[1].split('"', 1)[0]
            out[math.inf if bound == "+Inf" else float(bound)] = value
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear within the bucket the rank falls in (None when empty)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bucket: its bound, as Prometheus answers
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = bound, count
    return lower


class Sampler:
    def __init__(self, rig: ClusterRig, events: list[EngineEvents], args):
        self.rig = rig
        self.events = events
        self.args = args
        self.samples: list[Sample] = []
        self.tag = f"r{random.Random().randrange(10**6)}"  # new prompts even against engines of another run
        self.rng = random.Random(0)
        self.numbers = iter(range(10**9))
        # llmgw's own keep-alive client, far cheaper per request than httpx: the polls must load the machine whose
        # delays they measure as little as they can
        self.pools = {g.name: UpstreamPool("127.0.0.1", g.control_port) for g in rig.gateways}

    async def explain(self, gateway: GatewayProcess, body: bytes) -> dict:
        response = await self.pools[gateway.name].request(
            "POST", "/admin/explain", [(b"content-type", b"application/json")], body, first_byte_timeout=10,
            idle_timeout=10)
        answer = await response.read()
        if response.status != 200:
            raise RuntimeError(f"{gateway.name}: /admin/explain answered {response.status}: {answer[:300]!r}")
        return json.loads(answer)

    async def aclose(self) -> None:
        for pool in self.pools.values():
            await pool.aclose()

    async def one(self, engine: int) -> None:
        name, rig = f"sim-{engine}", self.rig
        body = {"model": MODEL, "prompt": f"{self.tag}-{next(self.numbers)} "
                f"{words(self.rng, self.args.prompt_words)}", "max_tokens": 1}
        encoded = json.dumps(body).encode()
        answers: dict[str, dict] = {}

        async def prime(gateway: GatewayProcess) -> None:  # tokenized now (and cached): the polls time the index
            answers[gateway.name] = await self.explain(gateway, encoded)

        async with trio.open_nursery() as nursery:
            for gateway in rig.gateways:
                nursery.start_soon(prime, gateway)
        blocks = next(iter(answers[rig.control.name]["blocks"].values()))
        mark = len(self.events[engine].stored)
        response = await rig.http.post(rig.sims[engine].url + "/v1/completions", json=body)
        response_at = time.time()
        response.raise_for_status()
        sample = Sample(name, blocks, 0, None, response_at)

        async def poll(gateway: GatewayProcess) -> None:
            polls, deadline, rtt = 0, trio.current_time() + self.args.sample_timeout, 0.0
            while trio.current_time() < deadline:
                started = time.time()
                answer = await self.explain(gateway, encoded)
                polls += 1
                at = time.time()
                rtt = (at - started) * 1000
                if any(r["name"] == name and r["confirmed_blocks"] >= blocks for r in answer["replicas"]):
                    sample.seen[gateway.name] = Seen(at, polls, round(rtt, 3))
                    return
                await trio.sleep(self.args.poll_interval)
            sample.seen[gateway.name] = Seen(None, polls, round(rtt, 3))

        async with trio.open_nursery() as nursery:
            for gateway in rig.gateways:
                nursery.start_soon(poll, gateway)
        stored = self.events[engine].stored[mark:]
        sample.stored = sum(n for _, n in stored)
        sample.event_ts = max((ts for ts, _ in stored), default=None)
        self.samples.append(sample)

    async def sender(self, engine: int, stop_at: float) -> None:
        period = len(self.events) / self.args.rate
        next_at = trio.current_time() + period * engine / len(self.events)
        while True:
            await trio.sleep_until(next_at)
            if trio.current_time() >= stop_at:
                return
            await self.one(engine)
            next_at = max(next_at + period, trio.current_time())


def summarize(sampled: list[Sample], rig_names: list[tuple[str, str]], delays: dict[str, dict[float, float]]) -> dict:
    rows = []
    for gateway, role in rig_names:
        seen = [s.seen[gateway] for s in sampled]
        from_event = [v for s in sampled if (v := s.from_event_ms(gateway)) is not None]
        from_response = [v for s in sampled if (v := s.from_response_ms(gateway)) is not None]
        row: dict = {"gateway": gateway, "role": role, "samples": len(sampled),
                     "missed": sum(x.at is None for x in seen),
                     "at_first_poll": sum(x.at is not None and x.polls == 1 for x in seen),
                     "explain_rtt_p50_ms": round(statistics.median(x.rtt_ms for x in seen), 3) if seen else None}
        for label, values in (("from_event", from_event), ("from_response", from_response)):
            for q, key in ((0.5, "p50"), (0.99, "p99"), (1.0, "max")):
                value = percentile(values, q)
                row[f"{label}_{key}_ms"] = None if value is None else round(value, 2)
        buckets = delays.get(gateway)
        if buckets is not None:
            count = buckets.get(math.inf, 0.0)
            row["log_delay"] = {"batches": int(count), "buckets": {str(k): v for k, v in buckets.items()}}
            for q, key in ((0.5, "p50"), (0.99, "p99")):
                value = histogram_quantile(q, buckets)
                row["log_delay"][f"{key}_ms"] = None if value is None else round(value * 1000, 2)
        rows.append(row)
    followers = [r for r in rows if r["role"] == "gateway"]
    worst = max((r["from_event_p99_ms"] for r in followers if r["from_event_p99_ms"] is not None), default=None)
    return {"gateways": rows, "followers_p99_from_event_ms": worst,
            "target_p99_ms": TARGET_P99_MS,
            "target_met": worst is not None and worst <= TARGET_P99_MS and not any(r["missed"] for r in followers)}


def markdown(summary: dict) -> str:
    def ms(v) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = ["| gateway | role | samples | from BlockStored p50 / p99 / max | from the response p50 / p99 "
             "| at first poll | missed | explain round trip p50 | log delay p50 / p99 (batches) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["gateways"]:
        delay = r.get("log_delay")
        log_cell = "-" if delay is None else \
            f"{ms(delay['p50_ms'])} / {ms(delay['p99_ms'])} ms ({delay['batches']})"
        lines.append(f"| {r['gateway']} | {r['role']} | {r['samples']} "
                     f"| {ms(r['from_event_p50_ms'])} / {ms(r['from_event_p99_ms'])} / {ms(r['from_event_max_ms'])} ms "
                     f"| {ms(r['from_response_p50_ms'])} / {ms(r['from_response_p99_ms'])} ms "
                     f"| {r['at_first_poll']} | {r['missed']} | {ms(r['explain_rtt_p50_ms'])} ms | {log_cell} |")
    worst = summary["followers_p99_from_event_ms"]
    lines.append("")
    lines.append(f"followers' p99 from BlockStored: {ms(worst)} ms (target <= {TARGET_P99_MS:g} ms: "
                 f"{'met' if summary['target_met'] else 'NOT met'})")
    return "\n".join(lines)


async def run(args) -> dict:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-cluster-events-") as workdir:
        async with ClusterRig.open(Path(workdir), followers=args.followers, sims=args.sims,
                                   time_scale=args.time_scale) as rig:
            events = [EngineEvents(kv_sources(sim)[0]) for sim in rig.sims]
            async with trio.open_nursery() as nursery:
                for engine_events in events:
                    await nursery.start(engine_events.run)
                await trio.sleep(0.5)  # the subscriptions reach the engines (a SUB joins late)
                sampler = Sampler(rig, events, args)
                before = {g.name: histogram((await rig.http.get(g.control_url + "/metrics")).text, DELAY_METRIC)
                          for g in rig.followers}
                stop_at = trio.current_time() + args.duration
                try:
                    async with trio.open_nursery() as senders:
                        for engine in range(len(rig.sims)):
                            senders.start_soon(sampler.sender, engine, stop_at)
                finally:
                    with trio.CancelScope(shield=True):
                        await sampler.aclose()
                after = {g.name: histogram((await rig.http.get(g.control_url + "/metrics")).text, DELAY_METRIC)
                         for g in rig.followers}
                nursery.cancel_scope.cancel()
            names = [(g.name, g.role) for g in rig.gateways]
    delays = {name: {bound: count - before[name].get(bound, 0.0) for bound, count in after[name].items()}
              for name in after}
    summary = summarize(sampler.samples, names, delays)
    return {"settings": {k: v for k, v in vars(args).items() if k != "json"},
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "load_average_before": load_before, "load_average_after": os.getloadavg()},
            "event_decode_errors": sum(e.decode_errors for e in events),
            "summary": summary,
            "samples": [asdict(s) for s in sampler.samples]}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.prog = "llmgw bench cluster-events"
    parser.add_argument("--followers", type=int, default=2, help="--role gateway processes (default 2)")
    parser.add_argument("--sims", type=int, default=2, help="simulator engines (default 2)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of sampling (default 10)")
    parser.add_argument("--rate", type=float, default=10.0, help="samples (new prompts) per second (default 10)")
    parser.add_argument("--prompt-words", type=int, default=200,
                        help="words per prompt (default 200: about 900 tokens, 56 blocks)")
    parser.add_argument("--poll-interval", type=float, default=0.001,
                        help="seconds between two explains of one gateway (default 0.001)")
    parser.add_argument("--sample-timeout", type=float, default=5.0,
                        help="seconds a gateway may take to show a sample's blocks before it counts as missed")
    parser.add_argument("--time-scale", type=float, default=0.0,
                        help="the simulators' --time-scale (default 0: no simulated compute time)")
    args = parser.parse_args(argv)
    if not (1 <= args.followers <= 8 and 1 <= args.sims <= 8 and 0 < args.duration <= 120
            and 0 < args.rate <= 50 and 1 <= args.prompt_words <= 4000 and 0 <= args.poll_interval <= 1
            and 0 < args.sample_timeout <= 30 and args.time_scale >= 0):
        parser.error("bounds: 1 <= --followers <= 8, 1 <= --sims <= 8, 0 < --duration <= 120, 0 < --rate <= 50, "
                     "1 <= --prompt-words <= 4000, 0 <= --poll-interval <= 1, 0 < --sample-timeout <= 30")
    report = trio.run(run, args)
    return print_and_save(report, markdown(report["summary"]), args.json)


if __name__ == "__main__":
    sys.exit(main())
