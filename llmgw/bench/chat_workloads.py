"""Synthetic chat workloads for routing experiments, and what the engines said about them.

Two shapes, both deterministic for a seed (the engines' replies too, when
every simulator runs with the same ``--seed``, since a reply depends only on
its prompt):

- :func:`run_multi_turn`: conversations, each with its own system prompt,
  advanced one turn per round, rounds in a shuffled order, every turn
  carrying the replies the engine gave before (so turn *t+1* extends turn *t*);
- :func:`run_shared_prefix`: independent questions under one system prompt.

Every request streams with ``include_usage``; a :class:`ChatResult` records
the replica that served it (``x-llmgw-replica``), the engine-reported
``prompt_tokens`` and ``cached_tokens``, the time to first content and the
total time. :func:`summarize` turns results into hit rate, TTFT percentiles
and per-replica counts.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import httpx
import trio

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact be have do say get make go know take see come think look "
         "want give use find tell ask seem feel try leave call good new first last long great little own other "
         "old right big high different small large next early young important few public bad same able").split()


@dataclass
class ChatResult:
    replica: str
    status: int
    prompt_tokens: int
    cached_tokens: int
    ttft: float  # seconds to the first content chunk
    latency: float  # seconds to the end of the stream
    reply: str
    completion_tokens: int = 0  # engine-reported output tokens
    itl: list[float] = field(default_factory=list)  # seconds between successive content chunks (per token)
    retry_after: str | None = None  # a refusal's Retry-After header
    error: str = ""  # a refusal's body (its first 500 characters)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choices(WORDS, k=count))


def new_client(concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0))


async def send_chat(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
                    on_head: Callable[[], None] | None = None, *, headers: dict[str, str] | None = None,
                    extra_body: dict | None = None) -> ChatResult:
    """One streamed chat completion through ``url`` (the gateway's base URL); ``headers`` (an API key) and
    ``extra_body`` (``ignore_eos``) go with it."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **(extra_body or {})}
    started = time.perf_counter()
    ttft = None
    last = 0.0
    gaps: list[float] = []
    reply: list[str] = []
    usage: dict = {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response:
        if on_head is not None:
            on_head()
        replica = response.headers.get("x-llmgw-replica", "")
        if response.status_code != 200:
            refusal = (await response.aread())[:500].decode(errors="replace")
            return ChatResult(replica, response.status_code, 0, 0, 0.0, time.perf_counter() - started, "",
                              retry_after=response.headers.get("retry-after"), error=refusal)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - started
                    else:
                        gaps.append(now - last)
                    last = now
                    reply.append(content)
            if chunk.get("usage"):
                usage = chunk["usage"]
    latency = time.perf_counter() - started
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ChatResult(replica, 200, usage.get("prompt_tokens", 0), cached, latency if ttft is None else ttft,
                      latency, "".join(reply), usage.get("completion_tokens", 0), gaps)


async def _run_limited(jobs: list[Callable], concurrency: int) -> None:
    limiter = trio.CapacityLimiter(concurrency)

    async def run(job):
        async with limiter:
            await job()

    async with trio.open_nursery() as nursery:
        for job in jobs:
            nursery.start_soon(run, job)


async def run_multi_turn(url: str, model: str, *, conversations: int, turns: int, system_words: int,
                         user_words: int, max_tokens: int, concurrency: int, seed: int) -> list[ChatResult]:
    """Conversations advanced round by round (shuffled order; up to ``concurrency`` requests at once)."""
    rng = random.Random(seed)
    histories = [[{"role": "system", "content": f"Conversation {c}. " + words(rng, system_words)}]
                 for c in range(conversations)]
    questions = [[words(rng, user_words) for _ in range(turns)] for _ in range(conversations)]
    results: list[ChatResult] = []
    async with new_client(concurrency) as client:
        for turn in range(turns):
            order = list(range(conversations))
            rng.shuffle(order)

            def job(c: int):
                async def send():
                    history = histories[c]
                    history.append({"role": "user", "content": questions[c][turn]})
                    result = await send_chat(client, url, model, list(history), max_tokens)
                    history.append({"role": "assistant", "content": result.reply})
                    results.append(result)
                return send

            await _run_limited([job(c) for c in order], concurrency)
    return results


async def run_shared_prefix(url: str, model: str, *, requests: int, system_words: int, user_words: int,
                            max_tokens: int, concurrency: int, seed: int) -> list[ChatResult]:
    """Independent questions under one system prompt, up to ``concurrency`` at once."""
    rng = random.Random(seed)
    system = {"role": "system", "content": words(rng, system_words)}
    bodies = [[system, {"role": "user", "content": f"Question {i}: " + words(rng, user_words)}]
              for i in range(requests)]
    results: list[ChatResult] = []
    async with new_client(concurrency) as client:
        def job(messages):
            async def send():
                results.append(await send_chat(client, url, model, messages, max_tokens))
            return send

        await _run_limited([job(m) for m in bodies], concurrency)
    return results


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1), nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def summarize(results: list[ChatResult]) -> dict:
    ok = [r for r in results if r.status == 200]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_replica = Counter(r.replica for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": 1000 * percentile([r.ttft for r in ok], 0.5),
        "ttft_p90_ms": 1000 * percentile([r.ttft for r in ok], 0.9),
        "latency_p50_ms": 1000 * percentile([r.latency for r in ok], 0.5),
        "per_replica": dict(sorted(per_replica.items())),
    }
