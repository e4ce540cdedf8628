"""What the router's KV index costs in memory: bytes per block and per replica, and a fleet's figure per process.

Builds a :class:`~llmgw.kv.index.KvIndex` with ``--replicas`` replicas of
``--blocks`` block keys each (64-bit ints, a ``--shared`` fraction of them
held by every replica, like a common system prompt), measures what it
allocated with ``tracemalloc``, and extrapolates linearly to ``--fleet``
(replicas x blocks, 64 x 100,000 by default). Every gateway process holds one
copy (docs/scaling.md says what that means for ``--workers``).

    python -m llmgw.bench.kv_memory [--replicas 8] [--blocks 100000] [--shared 0.1] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tracemalloc

from ..kv.changes import BlockChanges, KvChangeKind
from ..kv.index import KvIndex


def measure(replicas: int, blocks: int, shared: float, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    common = [rng.getrandbits(64) for _ in range(int(blocks * shared))]
    own = [[rng.getrandbits(64) for _ in range(blocks - len(common))] for _ in range(replicas)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = KvIndex()
    for i in range(replicas):
        index.apply(f"replica-{i}", BlockChanges(KvChangeKind.FULL, 16, common + own[i]))
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    entries = replicas * blocks
    unique = len(common) + sum(len(keys) for keys in own)
    assert sum(index.blocks(f"replica-{i}") for i in range(replicas)) == entries
    return {"replicas": replicas, "blocks_per_replica": blocks, "shared_fraction": shared, "bytes": used,
            "bytes_per_block_entry": used / entries, "bytes_per_unique_key": used / unique,
            "bytes_per_replica": used / replicas}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.bench.kv_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=100_000, help="block keys per replica")
    parser.add_argument("--shared", type=float, default=0.1, help="fraction of every replica's keys all hold")
    parser.add_argument("--fleet", default="64x100000", help="REPLICASxBLOCKS to extrapolate to")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = measure(args.replicas, args.blocks, args.shared)
    fleet_replicas, fleet_blocks = (int(part) for part in args.fleet.lower().split("x"))
    result["fleet"] = args.fleet
    result["fleet_bytes"] = result["bytes_per_block_entry"] * fleet_replicas * fleet_blocks
    print(f"KvIndex: {args.replicas} replicas x {args.blocks:,} blocks ({args.shared:.0%} shared by all): "
          f"{result['bytes'] / 2**20:.1f} MiB")
    print(f"  {result['bytes_per_block_entry']:.0f} bytes per (replica, block) entry, "
          f"{result['bytes_per_unique_key']:.0f} per distinct key, {result['bytes_per_replica'] / 2**20:.1f} MiB "
          f"per replica")
    print(f"  a fleet of {fleet_replicas} x {fleet_blocks:,}: {result['fleet_bytes'] / 2**20:.0f} MiB per gateway "
          "process")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
