"""Benchmark of the kv_index tier: decision cost, and event ingestion from engine batches to the router's index.

Run: ``python -m llmgw.bench.kv_routing [--json out.json] [--quick] [--tokens N ...] [--decisions-only]``
(``--tokens 2048 --decisions-only``: the 2k-token decision rows alone, in about a minute).

Decision cost: ``await tier.pick(request, candidates)`` of a ``kv_index`` tier
with 4 candidates whose index holds 50k blocks each, at 2k and 32k prompt
tokens (block size 16: 128 and 2048 blocks), as p50/p99 in µs:

- *token ids*: a completion whose prompt is token ids (no ``/tokenize``);
  *warm* repeats one prompt (the key memo and the index hit: the chosen
  replica holds every block, the run walks them all), *cold* makes every
  prompt new from its first token (every block hashed, a miss at block 0);
- *text + /tokenize*: a string prompt tokenized by a local ``llmgw sim``
  process (another process, on the same 2-core machine) through the tier's
  client; *uncached* makes every prompt new, *cached* repeats one (the
  tokenize LRU answers).
- *chat*: a chat of a system prompt and a new question each, tokenized in the
  router by the local tokenizer source (the simulator's ``tokenizer.json``
  and chat template, :mod:`llmgw.kv.local_tokenizer`) or by ``/tokenize``;
  *memo warm* shares the system prompt (its block keys are memoised), *new
  from its first token* does not.
- *drift check*: ``tier.finished(request, decision, usage)`` of a warm
  decision (the engine's cached tokens compared with the prediction; a re-walk
  of the confirmed run only when it drifted, :mod:`llmgw.kv.drift`), per
  response: one that matched, one that drifted (``over``).

Ingestion, in block changes per second:

- *index.apply*: DELTA messages (64 stored + 64 removed, net) applied to a
  ``KvIndex`` of 8 replicas holding 50k blocks each (the control plane's side);
- *mirror*: decoded batches (a store of 1-4 blocks plus as many evictions of
  older blocks, vLLM 0.34 map layout) applied to an ``EngineMirror`` with a
  ``flush`` every 256 batches (the agent's side), with and without decoding;
- *agent to index*: payload bytes -> ``decode_batch`` -> mirror -> flush ->
  ``index.apply``, all in one thread (the whole path minus ZMQ and the stream);
- *over ZMQ*: the same batches published on a loopback PUB and received by an
  ``EngineSubscription`` into a mirror, in one Trio loop (sequence tracking
  included; the publisher shares the CPU).
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import sys
import tempfile
import time

import trio
import zmq

from llmgw.bench.common import bench_parser, write_json
from llmgw.http.client import UpstreamPool
from llmgw.kv import zmq_trio
from llmgw.kv.codec import decode_batch, encode_batch
from llmgw.kv.drift import DriftPolicy
from llmgw.kv.events import BlockRemoved, BlockStored, EventBatch
from llmgw.kv.index import KvIndex
from llmgw.kv.keys import VllmBlockKeys
from llmgw.kv.mirror import EngineMirror
from llmgw.kv.subscriber import EngineSubscription
from llmgw.metrics import Metrics
from llmgw.plugins_manager import default_registry
from llmgw.router.canonical import render_body
from llmgw.router.replica import Replica
from llmgw.router.router import Router
from llmgw.router.tier import RouteRequest
from llmgw.sim.tokenizer_files import write_tokenizer_files
from llmgw.testing.processes import llmgw_command, start_child
from llmgw.wire import KvChangeKind, KvChanges

BLOCK = 16
VOCAB = 32_000
REPLICAS = 4
BACKGROUND_BLOCKS = 50_000


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_us": round(statistics.median(ordered) * 1e6, 1),
            "p99_us": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e6, 1),
            "n": len(ordered)}


def _tier(sim_url: str | None, **options):
    router = Router(default_registry(), Metrics())
    route = router.configure_model("tiny", "kv_index", {"tokenize_timeout": "5s", "tokenize_cache_tokens": 4_000_000,
                                                        "seed": 1, "tokenizer": "replica", **options})
    replicas = []
    for i in range(REPLICAS):
        url = sim_url or f"http://127.0.0.1:{9000 + i}"
        replica = Replica(name=f"r{i}", model="tiny", url=url)
        replica.pool = UpstreamPool(replica.host, replica.port)
        router.add_replica(replica)
        replicas.append(replica)
    rng = random.Random(9)
    for replica in replicas:
        background = [rng.getrandbits(64) for _ in range(BACKGROUND_BLOCKS)]
        router.kv_index.apply(replica.name, KvChanges(kind=KvChangeKind.FULL, stored=background, block_size=BLOCK))
    return route.tier, replicas


async def _time_picks(tier, candidates, requests: list[RouteRequest]) -> list[float]:
    samples = []
    for request in requests:
        started = time.perf_counter()
        await tier.pick(request, candidates)
        samples.append(time.perf_counter() - started)
    return samples


def _time_drift_checks(tier, request: RouteRequest, decision, cached: int, count: int, result: str) -> dict:
    """``tier.finished`` of one decision with ``cached`` tokens reported, ``count`` times; each check is ``result``."""
    usage = {"prompt_tokens_details": {"cached_tokens": cached}}
    name = decision.replica.name
    before = tier.index.describe(name)["drift"][result]
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        tier.finished(request, decision, usage)
        samples.append(time.perf_counter() - started)
    assert tier.index.describe(name)["drift"][result] == before + count
    return _percentiles(samples)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(16, VOCAB) for _ in range(n)]


async def bench_decisions(sim_url: str, tokens: int, count: int) -> dict[str, dict]:
    rng = random.Random(tokens)
    out = {}
    # token ids, warm: one prompt the first replica holds entirely
    tier, replicas = _tier(sim_url)
    prompt = _ids(rng, tokens)
    keys = VllmBlockKeys("sha256_cbor", "0").keys(prompt, BLOCK)
    tier.index.apply("r0", KvChanges(kind=KvChangeKind.DELTA, stored=keys, block_size=BLOCK))
    tier.index.apply("r1", KvChanges(kind=KvChangeKind.DELTA, stored=keys[:len(keys) // 2], block_size=BLOCK))
    request = lambda body: RouteRequest("tiny", "/v1/completions", body)  # noqa: E731
    warm = [request({"model": "tiny", "prompt": prompt}) for _ in range(count + 5)]
    out["ids_warm"] = _percentiles((await _time_picks(tier, replicas, warm))[5:])
    # the drift check each response with usage costs: one that matched the prediction
    decision = await tier.pick(warm[0], replicas)
    out["drift_check"] = _time_drift_checks(tier, warm[0], decision, decision.detail["predicted_cached_tokens"],
                                            count, "match")
    # ... and of a response that drifted (nothing cached): the confirmed run is walked again to excuse evictions
    tier.drift_policy = DriftPolicy(suspect_after=0)  # counted, never suspect: every sample does the same work
    out["drift_check_over"] = _time_drift_checks(tier, warm[0], decision, 0, count, "over")
    # token ids, cold: every prompt new from its first token
    tier, replicas = _tier(sim_url)
    cold = [request({"model": "tiny", "prompt": [16 + i % 200] + prompt[1:]}) for i in range(count)]
    out["ids_cold"] = _percentiles(await _time_picks(tier, replicas, cold))
    # text + /tokenize on the simulator, every prompt new (tokenize, hash everything)
    tier, replicas = _tier(sim_url)
    text = "".join(chr(97 + rng.randrange(26)) for _ in range(tokens - 1))  # byte tokenizer + BOS: `tokens` ids
    texts = [request({"model": "tiny", "prompt": f"{i:06d}" + text[6:]}) for i in range(count + 5)]
    out["text_tokenize_uncached"] = _percentiles((await _time_picks(tier, replicas, texts))[5:])
    # text, the same prompt again: the tokenize cache answers, keys memoised
    same = [request({"model": "tiny", "prompt": text}) for _ in range(count + 5)]
    out["text_tokenize_cached"] = _percentiles((await _time_picks(tier, replicas, same))[5:])
    # the router's canonical text of a token-id prompt (rendered once per request by the router, whatever
    # the tier: part of the token-id rows above)
    renders = []
    for i in range(count):
        started = time.perf_counter()
        render_body({"prompt": [16 + i % 200] + prompt[1:]})
        renders.append(time.perf_counter() - started)
    out["canonical_text_ids"] = _percentiles(renders)
    # chats: a system prompt of about `tokens` tokens and a new question each (the key memo holds the prefix's
    # blocks), tokenized in the router from the sim's tokenizer files, or by the sim's /tokenize; and chats new
    # from their first token (nothing memoised)
    system = "".join(chr(97 + rng.randrange(26)) for _ in range(tokens - 60))
    def chat(i: int, new_system: bool = False) -> RouteRequest:
        prefix = f"{i:06d}" if new_system else "000000"
        return RouteRequest("tiny", "/v1/chat/completions", {"model": "tiny", "messages": [
            {"role": "system", "content": prefix + system[6:]},
            {"role": "user", "content": f"Question {i:06d}: what does it say?"}]})
    with tempfile.TemporaryDirectory() as directory:
        write_tokenizer_files(directory)
        for key, options, new_system in (("chat_local_warm", {"tokenizer": "local"}, False),
                                         ("chat_local_cold", {"tokenizer": "local"}, True),
                                         ("chat_tokenize_warm", {"tokenizer": "replica"}, False)):
            chat_tier, chat_replicas = _tier(sim_url, tokenizer_path=directory, **options)
            # the first 5 are not timed (the local source checks its first answers against /tokenize)
            samples = await _time_picks(chat_tier, chat_replicas, [chat(i, new_system) for i in range(count + 5)])
            out[key] = _percentiles(samples[5:])
            if options["tokenizer"] == "local":
                assert chat_tier.tokenizer.local is not None and chat_tier.tokenizer.mismatches == 0
            for replica in chat_replicas:
                await replica.pool.aclose()
    # the /tokenize call alone, for reference
    calls = []
    for i in range(count):
        body = json.dumps({"prompt": f"{i:06d}x" + text[7:]}).encode()
        started = time.perf_counter()
        await tier.tokenizer._call(replicas[0], body)
        calls.append(time.perf_counter() - started)
    out["tokenize_call_alone"] = _percentiles(calls)
    for replica in replicas:
        await replica.pool.aclose()
    return out


# --------------------------------------------------------------------------- ingestion


def engine_stream(count: int, seed: int = 3) -> list[EventBatch]:
    """Batches of a full cache: each step stores 1-4 new blocks (chained) and evicts as many of the oldest."""
    rng = random.Random(seed)
    live: list[int | bytes] = [rng.getrandbits(64) for _ in range(4096)]
    batches = []
    for step in range(count):
        n = rng.randint(1, 4)
        new: list[int | bytes] = [rng.getrandbits(64) for _ in range(n)]
        stored = BlockStored(block_hashes=new, parent_block_hash=rng.getrandbits(64),
                             token_ids=[rng.randrange(VOCAB) for _ in range(n * BLOCK)], block_size=BLOCK,
                             medium="GPU", extra_keys=[None] * n, group_idx=0, kv_cache_spec_kind="full_attention")
        evicted = [BlockRemoved([live.pop(0)], "GPU", 0) for _ in range(n)]
        live.extend(new)
        batches.append(EventBatch(1.7e9 + step * 0.01, [stored, *evicted], 0))
    return batches


def _prefill_mirror(batches: list[EventBatch]) -> EngineMirror:
    mirror = EngineMirror(key_mode="engine")  # the batches' random hashes have no parents a content mirror knows
    rng = random.Random(3)
    mirror.apply(EventBatch(0.0, [BlockStored([rng.getrandbits(64) for _ in range(4096)], None,
                                              [0] * 4096 * BLOCK, BLOCK, medium="GPU")], 0))
    mirror.take_delta()
    return mirror


def _changes(batches: list[EventBatch]) -> int:
    return sum(len(e.block_hashes) for b in batches for e in b.events if isinstance(e, (BlockStored, BlockRemoved)))


def bench_index_apply(rounds: int = 2000) -> dict:
    rng = random.Random(4)
    index = KvIndex()
    held = {}
    for r in range(8):
        keys = [rng.getrandbits(64) for _ in range(BACKGROUND_BLOCKS)]
        held[f"r{r}"] = keys
        index.apply(f"r{r}", KvChanges(kind=KvChangeKind.FULL, stored=keys, block_size=BLOCK))
    messages = []
    for i in range(rounds):
        name = f"r{i % 8}"
        keys = held[name]
        removed = keys[:64]
        stored = [rng.getrandbits(64) for _ in range(64)]
        del keys[:64]
        keys.extend(stored)
        messages.append((name, KvChanges(kind=KvChangeKind.DELTA, stored=stored, removed=removed, block_size=BLOCK)))
    started = time.perf_counter()
    for name, message in messages:
        index.apply(name, message)
    elapsed = time.perf_counter() - started
    return {"block_changes_per_s": round(rounds * 128 / elapsed), "us_per_message": round(elapsed / rounds * 1e6, 1)}


def bench_mirror(count: int = 20000) -> dict:
    batches = engine_stream(count)
    payloads = [encode_batch(b) for b in batches]
    changes = _changes(batches)
    out = {}
    mirror = _prefill_mirror(batches)
    started = time.perf_counter()
    for i, batch in enumerate(batches):
        mirror.apply(batch)
        if i % 256 == 255:
            mirror.flush()
    elapsed = time.perf_counter() - started
    out["mirror_apply"] = {"block_changes_per_s": round(changes / elapsed), "batches_per_s": round(count / elapsed)}
    mirror = _prefill_mirror(batches)
    started = time.perf_counter()
    for i, payload in enumerate(payloads):
        mirror.apply(decode_batch(payload))
        if i % 256 == 255:
            mirror.flush()
    elapsed = time.perf_counter() - started
    out["decode_and_mirror"] = {"block_changes_per_s": round(changes / elapsed),
                                "batches_per_s": round(count / elapsed)}
    mirror = _prefill_mirror(batches)
    index = KvIndex()
    for message in mirror.full_messages():
        index.apply("r", message)
    started = time.perf_counter()
    for i, payload in enumerate(payloads):
        mirror.apply(decode_batch(payload))
        if i % 256 == 255:
            for message in mirror.flush():
                index.apply("r", message)
    for message in mirror.flush():
        index.apply("r", message)
    elapsed = time.perf_counter() - started
    assert index.keys("r") == set(mirror.keys())
    out["agent_to_index"] = {"block_changes_per_s": round(changes / elapsed), "batches_per_s": round(count / elapsed)}
    return out


async def bench_zmq(count: int = 20000) -> dict:
    batches = engine_stream(count)
    payloads = [encode_batch(b) for b in batches]
    mirror = _prefill_mirror(batches)
    sub = EngineSubscription("tcp://127.0.0.1:0", on_batch=mirror.apply, on_reset=mirror.reset, idle_probe=None)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    async with trio.open_nursery() as nursery:
        endpoint = await nursery.start(sub.run)
        pub.connect(endpoint)
        with trio.fail_after(10):
            await zmq_trio.recv_multipart(pub)  # subscribed: nothing published from here on is lost
        started = time.perf_counter()
        for seq, payload in enumerate(payloads):
            await zmq_trio.send_multipart(pub, [b"", seq.to_bytes(8, "big"), payload])
        with trio.fail_after(60):
            await sub.wait_for(lambda s: s.last_seq == count - 1)
        elapsed = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    zmq_trio.close(pub)
    ctx.term()
    assert sub.gaps == 0 and not sub.resets
    return {"block_changes_per_s": round(_changes(batches) / elapsed), "batches_per_s": round(count / elapsed)}


DECISION_SIZES = {2048: (300, 60), 32768: (80, 15)}  # prompt tokens -> decision samples (full, --quick)


async def run(quick: bool = False, sizes: list[int] | None = None, ingestion: bool = True) -> dict:
    report: dict = {"machine": {"python": platform.python_version(), "platform": platform.platform()},
                    "decisions": {}, "ingestion": {}}
    argv = llmgw_command("sim", "--port", "0", "--served-model-name", "tiny", "--profile", "constant",
                         "--time-scale", "0",
                         "--max-model-len", "40000", "--num-blocks", "4096")
    async with trio.open_nursery() as nursery:
        child = await start_child(nursery, argv, name="sim")
        for tokens in sizes or DECISION_SIZES:
            full, smoke = DECISION_SIZES.get(tokens, (80, 15))
            report["decisions"][f"{tokens}_tokens"] = await bench_decisions(child.url, tokens, smoke if quick else full)
        nursery.cancel_scope.cancel()
    if not ingestion:
        return report
    report["ingestion"]["index_apply"] = bench_index_apply(500 if quick else 2000)
    report["ingestion"].update(bench_mirror(5000 if quick else 20000))
    report["ingestion"]["over_zmq"] = await bench_zmq(5000 if quick else 20000)
    return report


LABELS = {
    "ids_warm": "token ids, warm (held by one replica, memo hit)",
    "ids_cold": "token ids, cold (new prompt, every block hashed)",
    "text_tokenize_uncached": "text + /tokenize to a local sim, new prompt",
    "text_tokenize_cached": "text, tokenize cache hit",
    "tokenize_call_alone": "the /tokenize call alone",
    "chat_local_warm": "chat, local tokenizer, shared system prompt (memo warm)",
    "chat_local_cold": "chat, local tokenizer, new from its first token",
    "chat_tokenize_warm": "chat, /tokenize, shared system prompt (memo warm)",
    "canonical_text_ids": "router's canonical text of the ids (in rows 1-2)",
    "drift_check": "drift check of a warm response (finished())",
    "drift_check_over": "drift check of a drifted response (run re-walked)",
}


def _print_report(report: dict) -> None:
    print("decision cost, µs (p50 / p99), 4 candidates, block size 16")
    sizes = list(report["decisions"])
    print(f"| {'path':<56} |" + "".join(f" {size.replace('_', ' '):>19} |" for size in sizes))
    for key, label in LABELS.items():
        cells = (report["decisions"][size][key] for size in sizes)
        print(f"| {label:<56} |" + "".join(f" {c['p50_us']:>8} / {c['p99_us']:>8} |" for c in cells))
    if not report["ingestion"]:
        return
    print()
    print("ingestion, block changes/s")
    for key, value in report["ingestion"].items():
        print(f"| {key:<20} | {value['block_changes_per_s']:>12,} |")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--tokens", type=int, action="append", metavar="N",
                        help="prompt tokens of the decision rows (repeatable; default: 2048 and 32768)")
    parser.add_argument("--decisions-only", action="store_true", help="skip the ingestion rows")
    args = parser.parse_args(argv)
    report = trio.run(run, args.quick, args.tokens, not args.decisions_only)
    _print_report(report)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
