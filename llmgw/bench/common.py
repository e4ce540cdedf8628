"""Helpers the benchmarks share."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio


def cell(value: float | None, spec: str) -> str:
    """A table cell: ``value`` formatted with ``spec``, or ``-`` when there is none."""
    return "-" if value is None else format(value, spec)


def rounds_us(calls: dict[str, Callable[[], object]], count: int, rounds: int) -> dict[str, list[float]]:
    """Per label, µs per call in each of ``rounds`` rounds of ``count`` calls; the labels' rounds alternate, so
    that the other processes sharing the cores disturb them all alike."""
    times: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(rounds):
        for label, call in calls.items():
            started = time.perf_counter()
            for _ in range(count):
                call()
            times[label].append((time.perf_counter() - started) / count * 1e6)
    return times


def spread_us(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per label of :func:`rounds_us`: the median µs per call of its rounds, and its fastest and slowest round."""
    return {label: {"median": statistics.median(us), "min": min(us), "max": max(us)} for label, us in times.items()}


def print_spread(title: str, spread: dict[str, dict[str, float]]) -> None:
    """``title``, then one line per label of :func:`spread_us`: its median, [fastest - slowest round]."""
    print(title)
    width = max(map(len, spread), default=0)
    for label, us in spread.items():
        print(f"  {label:{width}s} {us['median']:7.2f}  [{us['min']:.2f} - {us['max']:.2f}]")


def write_json(path: str | Path, report: dict) -> None:
    """Write ``report`` as indented JSON to ``path``, making its folder first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def finish(args: argparse.Namespace, report: dict) -> int:
    """Write ``report`` where ``--json`` says (if it does); the exit code."""
    if args.json:
        write_json(args.json, report)
    return 0


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: described by the first line of ``doc``, with ``--json PATH``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return parser


def print_and_save(report: dict, markdown: str, json_path: str | Path | None) -> int:
    """Print a benchmark's Markdown table and, with ``--json``, write the report with it; the exit status."""
    print(markdown)
    if json_path:
        write_json(json_path, {**report, "markdown": markdown})
    return 0


def chosen_names(parser: argparse.ArgumentParser, text: str, known: Sequence[str], what: str = "arms") -> list[str]:
    """The comma-separated names in ``text``, each one of ``known`` (else the parser's error naming the others)."""
    names = [name for name in text.split(",") if name]
    unknown = set(names) - set(known)
    if unknown:
        parser.error(f"unknown {what}: {', '.join(sorted(unknown))}")
    return names


def numbers(text: str, kind: Callable[[str], float] = int) -> list:
    """The comma-separated numbers in ``text`` (``"1,3"``), each read with ``kind``."""
    return [kind(n) for n in text.split(",") if n]


def run_in_workdir(name: str, run: Callable[..., Any], args: argparse.Namespace, *rest: Any) -> Any:
    """``trio.run(run, args, root, *rest)``: ``root`` the ``--workdir`` given (``args.workdir``), else a temporary
    folder (``llmgw-bench-NAME-*``) removed afterwards."""
    with contextlib.ExitStack() as stack:
        root = Path(args.workdir) if args.workdir else \
            Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"llmgw-bench-{name}-")))
        return trio.run(run, args, root, *rest)
