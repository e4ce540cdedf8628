"""A rendered example of the Grafana dashboard's main panels, from a real run (no Grafana needed).

Run: ``python -m llmgw.bench.dashboard_example [--out docs/grafana/example.png] [--duration 60]``
(needs ``matplotlib``: ``pip install -e '.[bench]'``).

It starts the demo (``llmgw serve`` without a config: an embedded agent, two
simulators with KV events, the ``kv_index`` tier), drives multi-turn chat
conversations at it in waves, scrapes ``/metrics`` every ``--interval``
seconds, and plots what the dashboard's panels show, computed the way their
PromQL expressions compute them (rates of counter deltas, quantiles of
histogram bucket deltas): requests/s by status, time to first token p50/p90
against time to first byte p90, the prefix-cache hit rate (engines' actual
and the index's predicted), routing decisions by outcome, in-flight requests
per replica and KV events/s. The series are also written as JSON next to the
picture.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from ..testing.processes import start_serve
from .chat_workloads import run_multi_turn

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: Samples, name: str, **match: str) -> float:
    return sum(v for (n, labels), v in samples.items() if n == name
               and all(dict(labels).get(k) == want for k, want in match.items()))


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (n, labels), value in samples.items():
        if n == name:
            out[dict(labels).get(label, "")] += value
    return out


def quantile(before: Samples, after: Samples, name: str, q: float) -> float | None:
    """``histogram_quantile(q, sum by (le) (rate(name_bucket[...])))`` between two scrapes."""
    buckets: dict[float, float] = defaultdict(float)
    for (n, labels), value in after.items():
        if n == name + "_bucket":
            le = float(dict(labels)["le"])
            buckets[le] += value - before.get((n, labels), 0.0)
    if not buckets or buckets[max(buckets)] <= 0:
        return None
    bounds = sorted(buckets)
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if bound == float("inf"):
                return lower_bound
            width = buckets[bound] - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 1.0)
        lower_bound, lower_count = bound, buckets[bound]
    return None


async def drive(url: str, duration: float, seed: int) -> None:
    """Waves of multi-turn conversations (new ones each wave) until ``duration`` has passed."""
    deadline = time.monotonic() + duration
    wave = 0
    while time.monotonic() < deadline:
        await run_multi_turn(url, "tiny", conversations=8, turns=4, system_words=300 + 100 * (wave % 3),
                             user_words=20, max_tokens=24, concurrency=4 + 2 * (wave % 3), seed=seed + wave)
        wave += 1


async def record(control_url: str, interval: float, stop: trio.Event) -> list[tuple[float, Samples]]:
    scrapes: list[tuple[float, Samples]] = []
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            scrapes.append((time.monotonic() - started, parse((await client.get(control_url + "/metrics")).text)))
            with trio.move_on_after(interval):
                await stop.wait()
        scrapes.append((time.monotonic() - started, parse((await client.get(control_url + "/metrics")).text)))
    return scrapes


def panels(scrapes: list[tuple[float, Samples]]) -> dict[str, dict[str, list]]:
    """Each panel's series: {panel: {series: [(t, value), ...]}}."""
    out: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for (t0, before), (t1, after) in zip(scrapes, scrapes[1:]):
        dt, t = t1 - t0, t1

        def rate(name: str, **match: str) -> float:
            return (total(after, name, **match) - total(before, name, **match)) / dt

        for code, value in by_label(after, "llmgw_requests_total", "code").items():
            out["Requests/s by status"][code].append((t, (value - by_label(before, "llmgw_requests_total",
                                                                           "code").get(code, 0.0)) / dt))
        for label, name, q in (("TTFT p50", "llmgw_time_to_first_token_seconds", 0.5),
                               ("TTFT p90", "llmgw_time_to_first_token_seconds", 0.9),
                               ("first byte p90", "llmgw_time_to_first_byte_seconds", 0.9)):
            seconds = quantile(before, after, name, q)
            if seconds is not None:
                out["Time to first token (s)"][label].append((t, seconds))
        prompt = rate("llmgw_prompt_tokens_total")
        if prompt > 0:
            out["Prefix cache hit rate"]["actual (engines)"].append((t, rate("llmgw_cached_tokens_total") / prompt))
            out["Prefix cache hit rate"]["predicted (kv_index)"].append(
                (t, rate("llmgw_route_predicted_cached_tokens_total") / prompt))
        outcomes = by_label(after, "llmgw_routing_decisions_total", "outcome")
        for outcome, value in outcomes.items():
            earlier = by_label(before, "llmgw_routing_decisions_total", "outcome").get(outcome, 0.0)
            out["Routing decisions/s by outcome"][outcome].append((t, (value - earlier) / dt))
        for replica, value in by_label(after, "llmgw_inflight_requests", "replica").items():
            out["In-flight requests by replica"][replica].append((t, value))
        for kind, value in by_label(after, "llmgw_kv_events_total", "type").items():
            earlier = by_label(before, "llmgw_kv_events_total", "type").get(kind, 0.0)
            out["KV events/s"][kind].append((t, (value - earlier) / dt))
    return out


def plot(series: dict[str, dict[str, list]], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = ["Requests/s by status", "Time to first token (s)", "Prefix cache hit rate",
             "Routing decisions/s by outcome", "In-flight requests by replica", "KV events/s"]
    figure, axes = plt.subplots(2, 3, figsize=(16, 8), constrained_layout=True)
    for axis, title in zip(axes.flat, order):
        for name, points in sorted(series.get(title, {}).items()):
            if points:
                axis.plot([p[0] for p in points], [p[1] for p in points], label=name, linewidth=1.6)
        axis.set_title(title, fontsize=11)
        axis.set_xlabel("seconds")
        axis.grid(alpha=0.3)
        if series.get(title):
            axis.legend(fontsize=8, loc="best")
    figure.suptitle("llmgw dashboard, rendered from a demo run (docs/grafana/llmgw.json shows the same series)",
                    fontsize=12)
    figure.savefig(out, dpi=90)


async def main_async(args: argparse.Namespace) -> dict:
    async with trio.open_nursery() as nursery:
        gateway = await start_serve(nursery, None)
        stop = trio.Event()
        result: list = []

        async def recorder():
            result.append(await record(gateway.control_url, args.interval, stop))

        nursery.start_soon(recorder)
        await trio.sleep(args.interval)
        await drive(gateway.url, args.duration, args.seed)
        await trio.sleep(args.interval)
        stop.set()
        while not result:
            await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    return panels(result[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.bench.dashboard_example",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/grafana/example.png", help="the PNG to write (JSON beside it)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between scrapes")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    series = trio.run(main_async, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(series, out)
    out.with_suffix(".json").write_text(json.dumps(series, indent=1))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
