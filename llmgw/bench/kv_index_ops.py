"""Micro-benchmark of the KV index's two hot paths: ``match``/``match_detail`` and ``apply``.

Run: ``python -m llmgw.bench.kv_index_ops [--replicas 4 8] [--blocks 100000] [--rounds 15] [--baseline INDEX_PY]
[--json PATH]`` (about 5 s on this machine at the defaults; twice that with ``--baseline``). ``--baseline`` times
another version of ``llmgw/kv/index.py`` too (``git show main:llmgw/kv/index.py > /tmp/index_main.py``), built
with the same keys, its rounds alternating with this version's: a before/after on the same machine at the same
moment.

Per replica count, a :class:`~llmgw.kv.index.KvIndex` whose replicas hold ``--blocks`` block keys each (FULL
copies), then, each as the fastest of ``--rounds`` rounds, in µs per call:

- *match*: ``match`` and ``match_detail`` of a 2,000-key prompt that one replica holds entirely and the
  others hold half of (the walk visits every key), with no live prediction and with 1,000 live predicted
  entries of 2,000 keys in the overlay (the predicted lookups on);
- *miss*: the same with a prompt no replica holds (one lookup);
- *apply*: a DELTA of 1,000 keys (500 stored + 500 removed, so the replica's size stays), on a replica with no
  prediction and on one with live unsettled predictions of the blocks it removes (the overlay's path).
"""

from __future__ import annotations

import gc
import importlib.util
import random
import sys
from collections.abc import Callable

from llmgw.bench.common import bench_parser, finish, rounds_us
from llmgw.kv.changes import BlockChanges, KvChangeKind
from llmgw.kv.index import KvIndex

PROMPT_KEYS = 2000
BATCH_KEYS = 1000
BLOCK = 16


def _best_us(calls: dict[str, Callable[[], object]], count: int, rounds: int) -> dict[str, float]:
    """Per label, µs per call in the fastest of ``rounds`` rounds of ``count`` calls (the least disturbed by the
    other processes sharing the cores, as ``timeit`` advises); the labels' rounds alternate."""
    return {label: round(min(values), 2) for label, values in rounds_us(calls, count, rounds).items()}


class Setup:
    """One index class's index, filled with the same keys as every other's (one seed)."""

    def __init__(self, index_class: type, replicas: int, blocks: int):
        self.rng = random.Random(replicas)
        self.index = index_class(clock=lambda: 0.0, predicted_ttl=1e9)  # a frozen clock: predictions stay live
        self.names = [f"r{i}" for i in range(replicas)]
        self.prompt = [self.rng.getrandbits(64) for _ in range(PROMPT_KEYS)]
        self.miss = [self.prompt[0] ^ 1] + self.prompt[1:]
        self.held = {}
        for i, name in enumerate(self.names):
            leading = self.prompt if i == 0 else self.prompt[:PROMPT_KEYS // 2]
            self.held[name] = leading + [self.rng.getrandbits(64) for _ in range(blocks - len(leading))]
            self.index.apply(name, BlockChanges(KvChangeKind.FULL, BLOCK, self.held[name]))

    def add_predictions(self) -> None:
        """1,000 live predictions of 2,000 keys, none on the prompt's keys."""
        for i in range(BATCH_KEYS // 2):
            self.index.predict(self.names[i % len(self.names)], [self.rng.getrandbits(64) for _ in range(2)])

    def deltas(self, name: str, count: int, predicted: bool) -> Callable[[], None]:
        """The next of ``count`` 1,000-key DELTAs of ``name``, applied; with ``predicted``, 100 of each one's
        removed keys are first predicted (unsettled) there."""
        held, batches = self.held[name], []
        for _ in range(count):
            removed = held[-BATCH_KEYS // 2:]
            del held[-BATCH_KEYS // 2:]
            stored = [self.rng.getrandbits(64) for _ in range(BATCH_KEYS // 2)]
            held[:0] = stored
            batches.append(BlockChanges(KvChangeKind.DELTA, BLOCK, stored, removed))
        if predicted:
            for batch in batches:
                self.index.predict(name, batch.removed[:100])
        it = iter(batches)
        return lambda: self.index.apply(name, next(it))


def run(replica_counts: list[int], blocks: int, rounds: int, index_classes: dict[str, type]) -> dict:
    report: dict = {"blocks_per_replica": blocks, "prompt_keys": PROMPT_KEYS, "batch_keys": BATCH_KEYS,
                    "rounds": rounds, "results": {label: {} for label in index_classes}}
    for replicas in replica_counts:
        setups = {label: Setup(index_class, replicas, blocks) for label, index_class in index_classes.items()}
        rows: dict[str, dict[str, float]] = {label: {} for label in setups}
        gc.collect()

        def measure(name: str, count: int, call: Callable[[Setup], Callable[[], object]]) -> None:
            for label, value in _best_us({label: call(s) for label, s in setups.items()}, count, rounds).items():
                rows[label][name] = value

        for suffix in ("", "_predicted"):
            measure(f"match_hit{suffix}_us", 50, lambda s: lambda: s.index.match(s.prompt, s.names))
            measure(f"match_detail_hit{suffix}_us", 50, lambda s: lambda: s.index.match_detail(s.prompt, s.names))
            measure(f"match_miss{suffix}_us", 5000, lambda s: lambda: s.index.match(s.miss, s.names))
            if not suffix:
                for setup in setups.values():
                    setup.add_predictions()
        measure("apply_us", 10, lambda s: s.deltas(s.names[1], rounds * 10, predicted=False))
        measure("apply_predicted_us", 10, lambda s: s.deltas(s.names[2 % replicas], rounds * 10, predicted=True))
        for label, row in rows.items():
            report["results"][label][str(replicas)] = row
            print(f"{label}: {replicas} replicas x {blocks:,} blocks: " + ", ".join(f"{k} {v}" for k, v in row.items()),
                  flush=True)
    return report


def load_baseline(path: str) -> type:
    """The ``KvIndex`` class of another version of ``llmgw/kv/index.py`` (e.g. ``git show main:llmgw/kv/index.py``),
    loaded as a module of ``llmgw.kv`` so that its relative imports resolve."""
    spec = importlib.util.spec_from_file_location("llmgw.kv._baseline_index", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.KvIndex


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--baseline", metavar="INDEX_PY",
                        help="also time the KvIndex of this file (another version of llmgw/kv/index.py), its rounds "
                             "alternating with this one's: a before/after in one process")
    args = parser.parse_args(argv)
    classes: dict[str, type] = {"current": KvIndex}
    if args.baseline:
        classes = {"baseline": load_baseline(args.baseline), **classes}
    return finish(args, run(args.replicas, args.blocks, args.rounds, classes))


if __name__ == "__main__":
    raise SystemExit(main())
