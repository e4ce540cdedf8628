"""Micro-benchmark of the ``kv_index`` tier's routing cost per request: µs of the event loop per ``pick``.

Run: ``python -m llmgw.bench.kv_pick_cost [--tokens 3000] [--replicas 4] [--held 20000] [--rounds 15]
[--picks 50] [--json PATH]`` (a few seconds). In-process, no socket: a router with a ``kv_index`` model (content
keys, block size 16) over ``--replicas`` replicas whose indexes hold ``--held`` block keys each, and a tokenizer
source that parses a real ``/tokenize`` answer of ``--tokens`` ids (the bytes vLLM sends, fed in 64 KiB pieces
to :class:`~llmgw.kv.tokenize_answer.TokenizeAnswerReader`, as the ``replica`` source does) for chat prompts
of about as many tokens (a new system prompt each, as in ``llmgw.bench.kv_ingest_wave``'s cold waves).

Printed, each as the fastest of ``--rounds`` rounds of ``--picks`` calls, in µs per call: the whole ``pick``,
then its parts on the same prompt: the answer's parsing, :func:`llmgw.kv.tokenize.plan`, the block keys,
``KvIndex.match_detail``, ``KvIndex.predict``, the decision rule (``_decide``: the prefix tier's ``decide``, its
cost model and scorers, as the tier's ``_decide`` calls it) and the prefix tree's part (the tokenize replica's
choice, ``learn``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import trio

from llmgw.bench.common import bench_parser, finish
from llmgw.bench.kv_index_ops import _best_us as best_us  # µs per call, the fastest round, labels alternating
from llmgw.hookspecs import hookimpl
from llmgw.kv.index import KvIndex
from llmgw.kv.tokenize import plan
from llmgw.kv.tokenize_answer import TokenizeAnswerReader
from llmgw.metrics import Metrics
from llmgw.plugins_manager import build_registry, make_plugin_manager
from llmgw.router.replica import Replica
from llmgw.router.router import Router
from llmgw.router.tier import RouteRequest
from llmgw.wire import KvChangeKind, KvChanges

MODEL = "m"
BLOCK = 16
PIECE = 64 * 1024  # the answer's bytes per piece, as a socket hands them


def answer_bytes(ids: Sequence[int]) -> bytes:
    """A ``/tokenize`` answer as vLLM sends it."""
    return json.dumps({"count": len(ids), "max_model_len": 131072, "tokens": list(ids), "token_strs": None},
                      separators=(",", ":")).encode()


def parse_answer(answer: bytes, max_ids: int) -> list[int]:
    reader = TokenizeAnswerReader(max_ids)
    for start in range(0, len(answer), PIECE):
        if reader.feed(answer[start:start + PIECE]):
            return reader.ids
    return reader.finish()


class AnswerTokenizer:
    """A tokenizer source that parses a prepared ``/tokenize`` answer per call (new ids each time: no cache)."""

    def __init__(self, answers: list[bytes], max_ids: int):
        self.answers, self.max_ids, self.calls = answers, max_ids, 0

    async def tokenize(self, replica: Replica, body: bytes) -> list[int]:
        self.calls += 1
        return parse_answer(self.answers[self.calls % len(self.answers)], self.max_ids)


class _Plugin:
    def __init__(self, tokenizer: AnswerTokenizer):
        self.tokenizer = tokenizer

    @hookimpl
    def register_tokenizer_sources(self):
        return {"answers": lambda options: self.tokenizer}


def chat(rng: random.Random, tokens: int, tag: str) -> RouteRequest:
    words = " ".join(f"w{rng.randrange(10_000)}" for _ in range(tokens // 2))  # ~2 tokens per word
    return RouteRequest(MODEL, "/v1/chat/completions",
                        {"model": MODEL, "max_tokens": 16, "messages": [{"role": "system", "content": f"{tag} {words}"},
                                                                         {"role": "user", "content": "go on"}]})


def run(tokens: int, replicas: int, held: int, rounds: int, picks: int) -> dict:
    rng = random.Random(7)
    answers = [answer_bytes([rng.randrange(128_000) for _ in range(tokens)]) for _ in range(8)]
    tokenizer = AnswerTokenizer(answers, 131072 + 64)
    router = Router(build_registry(make_plugin_manager((_Plugin(tokenizer),))), Metrics())
    route = router.configure_model(MODEL, "kv_index", {"tokenizer": "answers", "block_size": BLOCK})
    names = [f"r{i}" for i in range(replicas)]
    pool = [Replica(name=name, model=MODEL, url=f"http://127.0.0.1:{9000 + i}") for i, name in enumerate(names)]
    for replica in pool:
        router.add_replica(replica)
    tier: Any = route.tier  # the kv_index tier (a plugin: reached through the router, never imported)
    assert tier.name == "kv_index" and isinstance(tier.index, KvIndex)
    for name in names:
        tier.index.apply(name, KvChanges(kind=KvChangeKind.FULL, stored=[rng.getrandbits(64) for _ in range(held)],
                                         block_size=BLOCK))
    requests = [chat(rng, tokens, f"P{i}") for i in range(rounds * picks + 1)]
    served = iter(requests)
    sample = requests[0]
    ids = parse_answer(answers[0], tokenizer.max_ids)
    keys = tier.keys.keys(ids, BLOCK, None)
    loop_rng = random.Random(1)

    async def measure() -> dict[str, float]:
        now = tier.clock()

        def pick() -> None:
            coroutine = router.pick(next(served))
            try:
                coroutine.send(None)  # the tokenizer never blocks: pick runs to its end in one send
            except StopIteration:
                return
            raise RuntimeError("pick blocked")

        def tree_part() -> None:
            tier._tokenize_replica(sample, pool, now)
            tier.tree.learn(tier.tree.prompt_text(sample), names[0], "miss", now)

        return best_us({
            "pick": pick,
            "answer parse": lambda: parse_answer(answers[0], tokenizer.max_ids),
            "plan": lambda: plan(sample.path, sample.body, base_models=tier.base_models, loras=tier.loras,
                                 max_chars=tier.options.tokenize_chars),
            "block keys": lambda: tier.keys.keys(ids, BLOCK, None),
            "match_detail": lambda: tier.index.match_detail(keys, names),
            "predict": lambda: tier.index.predict(names[0], keys, 0.0),
            "_decide": lambda: tier.tree.decide(sample, pool, prompt_units=1 << 20, matched=[0] * len(pool),
                                                now=now, rng=loop_rng, prompt_tokens=tokens,
                                                cached_tokens=[0] * len(pool)),
            "tree (tokenize replica, learn)": tree_part,
        }, picks, rounds)

    return {"tokens": tokens, "blocks": len(keys), "replicas": replicas, "held": held, "rounds": rounds,
            "picks": picks, "us": trio.run(measure)}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=3000, help="prompt tokens (ids in the /tokenize answer)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--held", type=int, default=20_000, help="block keys each replica's index holds")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--picks", type=int, default=50, help="calls per round")
    args = parser.parse_args(argv)
    report = run(args.tokens, args.replicas, args.held, args.rounds, args.picks)
    print(f"kv_index pick, {report['tokens']}-token prompt ({report['blocks']} blocks), {args.replicas} replicas "
          f"of {args.held} blocks: µs per call (fastest of {args.rounds} rounds)")
    for label, us in report["us"].items():
        print(f"  {label:32s} {us:9.1f}")
    return finish(args, report)


if __name__ == "__main__":
    raise SystemExit(main())
