"""Micro-benchmark of the KV index's two hot paths: ``match``/``match_detail`` and ``apply``.

Run: ``python -m llmgw.bench.kv_index_ops [--replicas 4 8] [--blocks 100000] [--rounds 15] [--json PATH]``
(about 30 s on this machine at the defaults).

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
import random
import time
from collections.abc import Callable

from llmgw.bench.common import bench_parser, finish
from llmgw.kv.changes import BlockChanges, KvChangeKind
from llmgw.kv.index import KvIndex

PROMPT_KEYS = 2000
BATCH_KEYS = 1000
BLOCK = 16


def _best_us(call: Callable[[], object], calls: int, rounds: int) -> float:
    """µs per call in the fastest of ``rounds`` rounds of ``calls`` calls (the least disturbed by the other
    processes sharing the cores, as ``timeit`` advises)."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - started) / calls * 1e6)
    return round(min(times), 2)


def _index(replicas: int, blocks: int,
           rng: random.Random) -> tuple[KvIndex, list[str], list[int], dict[str, list[int]]]:
    index = KvIndex(clock=lambda: 0.0, predicted_ttl=1e9)  # a frozen clock: predictions stay live
    names = [f"r{i}" for i in range(replicas)]
    prompt = [rng.getrandbits(64) for _ in range(PROMPT_KEYS)]
    held = {}
    for i, name in enumerate(names):
        leading = prompt if i == 0 else prompt[:PROMPT_KEYS // 2]
        held[name] = leading + [rng.getrandbits(64) for _ in range(blocks - len(leading))]
        index.apply(name, BlockChanges(KvChangeKind.FULL, BLOCK, held[name]))
    return index, names, prompt, held


def bench_match(index: KvIndex, names: list[str], prompt: list[int], rounds: int) -> dict[str, float]:
    miss = [prompt[0] ^ 1] + prompt[1:]
    return {"match_hit_us": _best_us(lambda: index.match(prompt, names), 50, rounds),
            "match_detail_hit_us": _best_us(lambda: index.match_detail(prompt, names), 50, rounds),
            "match_miss_us": _best_us(lambda: index.match(miss, names), 5000, rounds)}


def bench_apply(index: KvIndex, name: str, held: list[int], rng: random.Random, rounds: int,
                predicted: bool) -> float:
    """µs per 1,000-key DELTA; with ``predicted``, each removed key is first predicted (unsettled) there."""
    batches = []
    for _ in range(rounds * 10):
        removed = held[-BATCH_KEYS // 2:]
        del held[-BATCH_KEYS // 2:]
        stored = [rng.getrandbits(64) for _ in range(BATCH_KEYS // 2)]
        held[:0] = stored
        batches.append(BlockChanges(KvChangeKind.DELTA, BLOCK, stored, removed))
    if predicted:
        for batch in batches:
            index.predict(name, batch.removed[:100])
    it = iter(batches)
    return _best_us(lambda: index.apply(name, next(it)), 10, rounds)


def run(replica_counts: list[int], blocks: int, rounds: int) -> dict:
    report: dict = {"blocks_per_replica": blocks, "prompt_keys": PROMPT_KEYS, "batch_keys": BATCH_KEYS,
                    "rounds": rounds, "results": {}}
    for replicas in replica_counts:
        rng = random.Random(replicas)
        index, names, prompt, held = _index(replicas, blocks, rng)
        gc.collect()
        row = bench_match(index, names, prompt, rounds)
        for i in range(BATCH_KEYS // 2):  # 1,000 live predictions of 2,000 keys, none on the prompt's keys
            index.predict(names[i % replicas], [rng.getrandbits(64) for _ in range(2)])
        with_predictions = bench_match(index, names, prompt, rounds)
        row.update({f"{key[:-3]}_predicted_us": value for key, value in with_predictions.items()})
        row["apply_us"] = bench_apply(index, names[1], held[names[1]], rng, rounds, predicted=False)
        row["apply_predicted_us"] = bench_apply(index, names[2 % replicas], held[names[2 % replicas]], rng, rounds,
                                                predicted=True)
        report["results"][str(replicas)] = row
        print(f"{replicas} replicas x {blocks:,} blocks: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    return finish(args, run(args.replicas, args.blocks, args.rounds))


if __name__ == "__main__":
    raise SystemExit(main())
