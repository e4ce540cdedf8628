"""Benchmark of the KV hot paths: block-key cost per prompt and event-decoder throughput.

Run: ``python -m llmgw.bench.kv_codec [--json out.json] [--repeats 25]``.

Key functions are timed on 2048-token prompts of random ids from a 32k
vocabulary with 16-token blocks (128 blocks), as the mean over a set of
prompts, minimum over repeats. The decoder is timed on realistic batches of
vLLM 0.34's map layout: a BlockStored of 1-4 blocks plus 1-3 single-hash
BlockRemoved events, as a busy engine publishes per scheduler step. Variants
run interleaved, so load from other processes hits them alike and the ratios
hold even when absolute numbers are noisy.
"""

from __future__ import annotations

import hashlib
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence

import cbor2
import msgpack

from llmgw.bench.common import bench_parser, write_json
from llmgw.kv.codec import decode_batch, encode_batch
from llmgw.kv.events import BlockRemoved, BlockStored, EventBatch
from llmgw.kv.keys import ContentChainKeys, VllmBlockKeys, none_hash

PROMPT_TOKENS = 2048
VOCAB = 32_000
BLOCK_SIZE = 16

TimedRun = Callable[[int], float]  # repeat index -> seconds or µs


def _interleaved_min(runs: dict[str, TimedRun], repeats: int) -> dict[str, float]:
    """Run every variant once per repeat, in turn, and keep each one's minimum."""
    best = dict.fromkeys(runs, float("inf"))
    for repeat in range(repeats):
        for name, run in runs.items():
            best[name] = min(best[name], run(repeat))
    return best


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]


def _per_prompt_us(key: Callable[[Sequence[int]], object], prompt_sets: list[list[list[int]]]) -> TimedRun:
    """Times repeat ``r``'s prompt set: mean µs per prompt."""

    def run(repeat: int) -> float:
        prompts = prompt_sets[repeat]
        start = time.perf_counter()
        for prompt in prompts:
            key(prompt)
        return (time.perf_counter() - start) / len(prompts) * 1e6

    return run


def _reference_sha256_cbor(prompt: Sequence[int], root: bytes = none_hash("sha256_cbor", "0")) -> list[int]:
    """The spec written plainly: cbor2 on the whole triple per block."""
    parent, keys = root, []
    for i in range(len(prompt) // BLOCK_SIZE):
        block = tuple(prompt[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        parent = hashlib.sha256(cbor2.dumps((parent, block, None), canonical=True)).digest()
        keys.append(int.from_bytes(parent[-8:], "big"))
    return keys


def bench_key_functions(repeats: int, prompts_per_repeat: int, seed: int = 1) -> dict[str, float]:
    rng = random.Random(seed)
    # Distinct prompts per repeat, so "cold" runs never hit a memo filled by an earlier repeat.
    fresh = [[_prompt(rng) for _ in range(prompts_per_repeat)] for _ in range(repeats)]
    same = [fresh[0]] * repeats

    no_memo = VllmBlockKeys("sha256_cbor", "0", memo_size=0)
    cold_memo = VllmBlockKeys("sha256_cbor", "0", memo_size=1 << 20)
    warm_memo = VllmBlockKeys("sha256_cbor", "0")
    for prompt in fresh[0]:
        warm_memo.keys(prompt, BLOCK_SIZE)
    pickle_keys = VllmBlockKeys("sha256", "0", memo_size=0)
    content = ContentChainKeys()
    assert no_memo.keys(fresh[0][0], BLOCK_SIZE) == _reference_sha256_cbor(fresh[0][0])

    runs = {
        "reference_cbor2_whole_triple": _per_prompt_us(_reference_sha256_cbor, fresh),
        "vllm_sha256_cbor_cold_no_memo": _per_prompt_us(lambda p: no_memo.keys(p, BLOCK_SIZE), fresh),
        "vllm_sha256_cbor_cold_memo_miss": _per_prompt_us(lambda p: cold_memo.keys(p, BLOCK_SIZE), fresh),
        "vllm_sha256_cbor_warm_memo": _per_prompt_us(lambda p: warm_memo.keys(p, BLOCK_SIZE), same),
        "vllm_sha256_pickle_cold_no_memo": _per_prompt_us(lambda p: pickle_keys.keys(p, BLOCK_SIZE), fresh),
        "content_chain": _per_prompt_us(lambda p: content.keys(p, BLOCK_SIZE), fresh),
    }
    return _interleaved_min(runs, repeats)


def realistic_batches(count: int, seed: int = 2) -> list[EventBatch]:
    """Batches like a busy vLLM 0.34 engine publishes: one store of 1-4 blocks and 1-3 removals."""
    rng = random.Random(seed)
    batches = []
    for step in range(count):
        blocks = rng.randint(1, 4)
        stored = BlockStored(
            block_hashes=[rng.getrandbits(64) for _ in range(blocks)],
            parent_block_hash=rng.getrandbits(64) if rng.random() < 0.8 else None,
            token_ids=[rng.randrange(VOCAB) for _ in range(blocks * BLOCK_SIZE)],
            block_size=BLOCK_SIZE,
            medium="GPU",
            extra_keys=[None] * blocks,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        removed = [BlockRemoved([rng.getrandbits(64)], "GPU", 0) for _ in range(rng.randint(1, 3))]
        batches.append(EventBatch(1.7e9 + step * 0.01, [stored, *removed], 0))
    return batches


def _decode_all(decode: Callable[[bytes], object], payloads: list[bytes]) -> TimedRun:
    """Times one pass over every payload, in seconds."""

    def run(repeat: int) -> float:
        start = time.perf_counter()
        for payload in payloads:
            decode(payload)
        return time.perf_counter() - start

    return run


def _unpack_only(payload: bytes) -> object:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def bench_decoder(repeats: int, batch_count: int = 2000) -> dict:
    batches = realistic_batches(batch_count)
    events = sum(len(batch.events) for batch in batches)
    map_payloads = [encode_batch(batch, layout="map", fields=15) for batch in batches]
    array_payloads = [encode_batch(batch, layout="array", fields=11) for batch in batches]
    assert decode_batch(map_payloads[0]) == batches[0]

    best = _interleaved_min(
        {
            "map_layout": _decode_all(decode_batch, map_payloads),
            "array_layout": _decode_all(decode_batch, array_payloads),
            "msgpack_unpack_only_map": _decode_all(_unpack_only, map_payloads),
        },
        repeats,
    )
    report: dict = {
        "batches": batch_count,
        "events_per_batch": round(events / batch_count, 2),
        "payload_bytes_mean": round(sum(map(len, map_payloads)) / batch_count),
    }
    for name, seconds in best.items():
        report[name] = {"events_per_s": round(events / seconds), "us_per_batch": round(seconds / batch_count * 1e6, 2)}
    return report


def run(repeats: int = 25, prompts_per_repeat: int = 10) -> dict:
    return {
        "command": "python -m llmgw.bench.kv_codec",
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.platform()}",
        "repeats": repeats,
        "key_function_setup": {"tokens": PROMPT_TOKENS, "vocab": VOCAB, "block_size": BLOCK_SIZE},
        "key_functions_us_per_2048_token_prompt": {
            name: round(us, 1) for name, us in bench_key_functions(repeats, prompts_per_repeat).items()
        },
        "decoder": bench_decoder(repeats),
    }


def _print_report(report: dict) -> None:
    print(f"KV codec benchmark (Python {report['python']}, {report['machine']}, min of {report['repeats']})")
    print(f"block keys, µs per {PROMPT_TOKENS}-token prompt ({VOCAB} vocab, block size {BLOCK_SIZE}):")
    for name, us in report["key_functions_us_per_2048_token_prompt"].items():
        print(f"  {name:36s} {us:9.1f}")
    decoder = report["decoder"]
    print(
        f"event decoder, {decoder['batches']} batches of {decoder['events_per_batch']} events "
        f"({decoder['payload_bytes_mean']} bytes on average):"
    )
    for name in ("map_layout", "array_layout", "msgpack_unpack_only_map"):
        result = decoder[name]
        print(f"  {name:36s} {result['events_per_s']:9d} events/s  {result['us_per_batch']:7.2f} µs/batch")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=25, help="repeats per measurement (the minimum is kept)")
    parser.add_argument("--prompts", type=int, default=10, help="prompts per repeat for the key functions")
    args = parser.parse_args(argv)
    report = run(args.repeats, args.prompts)
    _print_report(report)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
