"""Micro-benchmark of what recording an answer's usage costs the data plane: µs of the event loop per request.

Run: ``llmgw bench usage [--rounds 15] [--calls 20000] [--keys 100] [--json PATH]`` (a few seconds). In-process:
``UsageAggregator.record`` of answers spread over ``--keys`` keys of 10 teams, alone, with the Prometheus counters
(``llmgw_tenant_*``), with the journal (one ``os.write`` of a line per answer to a file in a temporary folder: the
page cache, no fsync), and with both as a gateway runs it. Then one flush of the rows an interval gathers into the
SQLite store. Printed: the median of ``--rounds`` rounds (each ``--calls`` calls) and the fastest and slowest
round (the spread of a machine shared with other work).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import trio

from llmgw.bench.common import bench_parser, print_and_save
from llmgw.tenancy.interfaces import UsageRecord
from llmgw.tenancy.model import Usage
from llmgw.tenancy.usage import UsageAggregator
from llmgw.tenancy.usage_journal import UsageJournal
from llmgw.tenancy.usage_metrics import UsageMetrics
from llmgw.tenancy.usage_store import Batch, SqliteUsageStore


def records(keys: int) -> list[UsageRecord]:
    now = time.time()
    return [UsageRecord(f"k-{index:04x}", f"app-{index}", f"team-{index % 10}", "llama-3-8b",
                        Usage(812, 120, 256, 1_234_000), 200, now) for index in range(keys)]


def rounds_us(record: Callable[[UsageRecord], None], answers: list[UsageRecord], calls: int, rounds: int
              ) -> list[float]:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for index in range(calls):
            record(answers[index % len(answers)])
        times.append((time.perf_counter() - started) / calls * 1e6)
    return times


def summary(times: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(times), 3), "min": round(min(times), 3), "max": round(max(times), 3)}


def sink_with(metrics: bool, journal_dir: Path | None) -> tuple[UsageAggregator, UsageJournal | None]:
    sink = UsageAggregator()
    if metrics:
        sink.on_row.append(UsageMetrics(None).note)
    journal = None
    if journal_dir is not None:
        journal = UsageJournal(journal_dir, rotate_bytes=1 << 40)
        journal.open()
        sink.on_row.append(journal.append)
    return sink, journal


async def flush_ms(directory: Path, rows: int, rounds: int) -> list[float]:
    store = SqliteUsageStore(directory / "bench.sqlite3")
    sink = UsageAggregator()
    for answer in records(rows):
        sink.record(answer)
    batch = sink.take()
    times = []
    for offset in range(1, rounds + 1):
        started = time.perf_counter()
        await store.apply(Batch("bench", offset, batch))
        times.append((time.perf_counter() - started) * 1e3)
    await store.close()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=100)
    args = parser.parse_args(argv)
    answers = records(args.keys)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-usage-") as folder:
        for label, metrics, journaled in (("aggregate only", False, False), ("+ Prometheus counters", True, False),
                                          ("+ journal", False, True), ("as a gateway runs it (all)", True, True)):
            sink, journal = sink_with(metrics, Path(folder) / label.replace(" ", "_") if journaled else None)

            def record(answer: UsageRecord, sink: UsageAggregator = sink) -> None:
                sink.record(answer)
                if sink.pending_rows > 10_000:
                    sink.take()

            results[label] = summary(rounds_us(record, answers, args.calls, args.rounds))
            if journal is not None:
                journal.close()
        flush = summary(trio.run(flush_ms, Path(folder), args.keys, args.rounds))
    lines = [f"Usage recorded per answer ({args.keys} keys, {args.rounds} rounds of {args.calls} calls): µs per call",
             "", "| what | median | fastest round | slowest round |", "|---|---:|---:|---:|"]
    lines += [f"| {label} | {value['median']:.2f} | {value['min']:.2f} | {value['max']:.2f} |"
              for label, value in results.items()]
    lines += ["", f"One flush of {args.keys} rows into SQLite: median {flush['median']:.2f} ms "
                  f"(fastest {flush['min']:.2f}, slowest {flush['max']:.2f}; in a worker thread, off the loop)"]
    report = {"keys": args.keys, "calls": args.calls, "rounds": args.rounds, "record_us": results,
              "sqlite_flush_ms": flush}
    return print_and_save(report, "\n".join(lines), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
