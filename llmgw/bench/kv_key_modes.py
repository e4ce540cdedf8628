"""The two KV key modes side by side: engine hashes (``key_function: vllm``) against content keys (``content``).

Run: ``python -m llmgw.bench.kv_key_modes [--repeats 15] [--blocks 50000] [--json PATH]`` (about 30 s here).

What each mode costs, measured in one run with the arms interleaved (so the other processes' load hits both):

- *decision*: µs per ``kv_index`` pick of a 2,048-token token-id prompt (128 blocks of 16) among 4 replicas
  whose indexes hold ``--blocks`` keys each (one of them the prompt's first half), through the whole tier
  (plan, hashing, the index walk, the rule, the prediction): *cold* a prompt never seen (the ``vllm`` memo
  misses), *warm* the same prompt again (its memo hits);
- *mirror*: bytes per mirrored block and µs per stored block in the :class:`~llmgw.kv.mirror.EngineMirror`
  that follows one engine (the agent's, or the gateway's for a static replica), fed ``--blocks`` blocks as
  chains of 8-block stores like an engine publishes them; content keys add the engine-hash -> key map;
- *index*: bytes per block in the router's :class:`~llmgw.kv.index.KvIndex` (the same 64-bit ints in both
  modes, measured once per mode to show it).
"""

from __future__ import annotations

import gc
import platform
import random
import sys
import time
import tracemalloc
from collections.abc import Callable

import trio

from llmgw.bench.common import bench_parser, finish
from llmgw.kv.changes import BlockChanges, KvChangeKind
from llmgw.kv.events import BlockStored
from llmgw.kv.index import KvIndex
from llmgw.kv.keys import ContentChainKeys, VllmBlockKeys
from llmgw.kv.mirror import EngineMirror
from llmgw.metrics import Metrics
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.replica import Replica
from llmgw.router.router import Router
from llmgw.router.tier import RouteRequest

BLOCK = 16
PROMPT_TOKENS = 2048
VOCAB = 32_000
REPLICAS = 4
STORE_BLOCKS = 8  # blocks per BlockStored: a prefill of 128 tokens


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(count)]


def _key_function(mode: str) -> Callable[[list[int]], list[int]]:
    keys = VllmBlockKeys("sha256_cbor", "0", memo_size=0) if mode == "vllm" else ContentChainKeys()
    return lambda tokens: keys.keys(tokens, BLOCK)


def _stores(count: int, seed: int = 3) -> list[BlockStored]:
    """``count`` blocks as chains of ``STORE_BLOCKS``-block stores, hashed as a stock engine would (sha256)."""
    rng = random.Random(seed)
    engine = VllmBlockKeys("sha256", None, memo_size=0)
    stores: list[BlockStored] = []
    while sum(len(s.block_hashes) for s in stores) < count:
        tokens = _tokens(rng, 4 * STORE_BLOCKS * BLOCK)  # one request of 4 stores
        hashes = engine.keys(tokens, BLOCK)
        parent = None
        for first in range(0, len(hashes), STORE_BLOCKS):
            part: list[int | bytes] = list(hashes[first:first + STORE_BLOCKS])
            stores.append(BlockStored(block_hashes=part, parent_block_hash=parent,
                                      token_ids=tokens[first * BLOCK:(first + len(part)) * BLOCK], block_size=BLOCK,
                                      medium="GPU", extra_keys=[None] * len(part), group_idx=0,
                                      kv_cache_spec_kind="full_attention"))
            parent = part[-1]
    return stores


def mirror_cost(mode: str, stores: list[BlockStored]) -> dict[str, float]:
    """Bytes per block the mirror holds and µs per stored block it spends, in ``mode`` (engine or content)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mirror = EngineMirror(key_mode=mode)
    mirror.apply_events(stores)
    mirror.take_delta()
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    blocks = len(mirror)
    timed = EngineMirror(key_mode=mode)
    start = time.perf_counter()
    timed.apply_events(stores)
    seconds = time.perf_counter() - start
    return {"bytes_per_block": used / blocks, "us_per_stored_block": seconds / blocks * 1e6}


def index_bytes_per_block(mode: str, blocks: int, seed: int = 4) -> float:
    """The router index's bytes per block, its keys made by ``mode``'s key function from random prompts."""
    rng = random.Random(seed)
    key = _key_function(mode)
    keys: list[int] = []
    while len(keys) < blocks:
        keys += key(_tokens(rng, PROMPT_TOKENS))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = KvIndex()
    index.apply("r", BlockChanges(KvChangeKind.FULL, BLOCK, keys[:blocks]))
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / blocks


def _router(mode: str, blocks: int, rng: random.Random, held: list[int]) -> tuple[Router, list[Replica]]:
    router = Router(build_registry(make_plugin_manager(())), Metrics())
    router.configure_model("m", "kv_index", {"key_function": mode, "seed": 7})
    replicas = [Replica(name=f"r{i}", model="m", url=f"http://127.0.0.1:{9000 + i}") for i in range(REPLICAS)]
    key = _key_function(mode)
    for i, replica in enumerate(replicas):
        router.add_replica(replica)
        own: list[int] = []
        while len(own) < blocks:
            own += key(_tokens(rng, PROMPT_TOKENS))
        router.kv_index.apply(replica.name, BlockChanges(KvChangeKind.FULL, BLOCK,
                                                         (held if i == 0 else []) + own[:blocks - len(held)]))
    return router, replicas


async def decision_us(modes: tuple[str, ...], blocks: int, repeats: int, picks: int = 50,
                      seed: int = 5) -> dict[str, float]:
    """µs per pick, cold and warm, per mode: the fastest of ``repeats`` rounds of ``picks`` picks, the modes'
    rounds alternating."""
    rng = random.Random(seed)
    shared = _tokens(rng, PROMPT_TOKENS)
    routers = {}
    for mode in modes:
        held = _key_function(mode)(shared[:PROMPT_TOKENS // 2])
        routers[mode] = _router(mode, blocks, rng, held)[0]
    best = {f"{mode}_{kind}": float("inf") for mode in modes for kind in ("cold", "warm")}

    def request(tokens: list[int]) -> RouteRequest:
        return RouteRequest("m", "/v1/completions", {"model": "m", "prompt": tokens, "max_tokens": 1})

    for _ in range(repeats):
        fresh = [shared[:PROMPT_TOKENS // 2] + _tokens(rng, PROMPT_TOKENS // 2) for _ in range(picks)]
        for mode, router in routers.items():
            for kind, prompts in (("cold", fresh), ("warm", fresh)):  # warm: the same prompts, again
                start = time.perf_counter()
                for tokens in prompts:
                    await router.pick(request(tokens))
                best[f"{mode}_{kind}"] = min(best[f"{mode}_{kind}"], (time.perf_counter() - start) / picks * 1e6)
    return best


def run(repeats: int, blocks: int) -> dict:
    modes = ("vllm", "content")
    stores = _stores(blocks)
    mirror: dict[str, dict[str, float]] = {"engine": {}, "content": {}}
    for _ in range(3):  # interleaved; the smallest of each
        for mode in mirror:
            cost = mirror_cost(mode, stores)
            for name, value in cost.items():
                mirror[mode][name] = min(mirror[mode].get(name, value), value)
    decisions = trio.run(decision_us, modes, blocks, repeats)
    return {
        "command": "python -m llmgw.bench.kv_key_modes",
        "python": platform.python_version(),
        "setup": {"block_size": BLOCK, "prompt_tokens": PROMPT_TOKENS, "replicas": REPLICAS,
                  "blocks_per_replica": blocks, "repeats": repeats},
        "decision_us": {name: round(us, 1) for name, us in decisions.items()},
        "mirror": {mode: {name: round(value, 2) for name, value in cost.items()} for mode, cost in mirror.items()},
        "index_bytes_per_block": {mode: round(index_bytes_per_block(mode, blocks), 1) for mode in modes},
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=15, help="rounds of the decision timing (the fastest kept)")
    parser.add_argument("--blocks", type=int, default=50_000, help="blocks per replica index and in the mirror")
    args = parser.parse_args(argv)
    report = run(args.repeats, args.blocks)
    d, m, i = report["decision_us"], report["mirror"], report["index_bytes_per_block"]
    print(f"KV key modes (Python {report['python']}; {PROMPT_TOKENS}-token prompts, block size {BLOCK}, "
          f"{REPLICAS} replicas x {args.blocks:,} blocks; fastest of {args.repeats})")
    print("| | engine hashes (`vllm`) | content keys (`content`) |")
    print("|---|---|---|")
    print(f"| decision, cold prompt (µs) | {d['vllm_cold']:.0f} | {d['content_cold']:.0f} |")
    print(f"| decision, warm prompt (µs) | {d['vllm_warm']:.0f} | {d['content_warm']:.0f} |")
    print(f"| mirror, bytes per block | {m['engine']['bytes_per_block']:.0f} | {m['content']['bytes_per_block']:.0f} |")
    print(f"| mirror, µs per stored block | {m['engine']['us_per_stored_block']:.2f} | "
          f"{m['content']['us_per_stored_block']:.2f} |")
    print(f"| router index, bytes per block | {i['vllm']:.0f} | {i['content']:.0f} |")
    return finish(args, report)


if __name__ == "__main__":
    sys.exit(main())
