"""The client of ``llmgw bench limits`` and what it sends: bursts, steady open-loop load, a closed loop for latency,
and the exact limiters its counts are judged against.

Every request is one small non-streamed chat completion with a fixed prompt and ``max_tokens`` (the simulators run
with ``--output-tokens`` above every ``max_tokens`` sent, so each answer's usage is exactly the prompt's tokens plus
``max_tokens``: a request's tokens and money are known before it is sent). Request *i* goes to gateway *i mod N*
(:class:`~.routing_arms.Spread`). An answer is *admitted* when it is not a 429 (the same counting for every arm);
a request that got no HTTP answer at all is an error, not admitted.

What a limiter should have admitted is what an exact limiter of its own kind admits for the same requests, each
decided when its answer came back (the latest it can have been decided, :func:`decided`), at the same costs
(:func:`expected`): a token bucket of ``limit`` refilled at ``limit`` per minute (llmgw's rpm and
tpm), or a window of ``limit`` per calendar minute (LiteLLM's). Admitted over that is overshoot; under it, the
part of the limit that was not usable.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import httpx
import trio

from ..sim.protocol import chat_prompt_ids
from ..testing.sims import MODEL
from .chat_workloads import percentile
from .routing_arms import Spread

BUCKET, WINDOW = "bucket", "window"  # the kinds of exact limiter an arm's counts are judged against
PROMPT = "Say something about rate limits, tokens per minute, budgets and the gateways that keep them."
REQUEST_TIMEOUT = 60.0


@dataclass(frozen=True)
class Lane:
    """Where one workload's requests go: the bearer key and the model name the client sends."""

    name: str
    key: str
    model: str = MODEL


@dataclass(frozen=True)
class Answer:
    """One request as the client saw it; times in seconds on the wall clock (``time.time()``)."""

    sent: float
    done: float
    status: int  # 0: no HTTP answer (connection refused, timeout)
    gateway: int
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def admitted(self) -> bool:
        return self.status not in (0, 429)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def latency(self) -> float:
        return self.done - self.sent


def chat_body(model: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens}


def request_tokens(max_tokens: int) -> int:
    """The tokens one request of this client uses: its prompt's (the simulators' own count) plus ``max_tokens``."""
    return len(chat_prompt_ids(chat_body(MODEL, max_tokens))) + max_tokens


def prompt_tokens() -> int:
    return request_tokens(0)


def new_http(connections: int = 256) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT))


@dataclass
class Client:
    """Sends chat requests to ``urls`` (the arm's gateways' base URLs), request *i* to gateway *i mod N*."""

    http: httpx.AsyncClient
    urls: list[str]
    spread: Spread = field(init=False)

    def __post_init__(self) -> None:
        self.spread = Spread(len(self.urls))

    async def send(self, lane: Lane, max_tokens: int) -> Answer:
        gateway = self.spread.next()
        sent = time.time()
        try:
            response = await self.http.post(self.urls[gateway] + "/v1/chat/completions",
                                            json=chat_body(lane.model, max_tokens),
                                            headers={"authorization": f"Bearer {lane.key}"})
        except httpx.HTTPError:
            return Answer(sent, time.time(), 0, gateway)
        done = time.time()
        usage: dict = {}
        if response.status_code == 200:
            try:
                usage = response.json().get("usage") or {}
            except ValueError:
                usage = {}
        return Answer(sent, done, response.status_code, gateway, int(usage.get("prompt_tokens") or 0),
                      int(usage.get("completion_tokens") or 0))


async def burst(client: Client, lane: Lane, count: int, max_tokens: int) -> list[Answer]:
    """``count`` requests at once (each on a connection of its own), spread over the gateways."""
    answers: list[Answer] = []

    async def one() -> None:
        answers.append(await client.send(lane, max_tokens))

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    return sorted(answers, key=lambda a: a.sent)


async def steady(client: Client, lane: Lane, rate: float, seconds: float, max_tokens: int) -> list[Answer]:
    """Open loop: request *i* sent at ``i / rate`` seconds from now whatever the earlier ones got, for ``seconds``;
    every answer waited for."""
    answers: list[Answer] = []
    count = max(1, int(rate * seconds))

    async def one() -> None:
        answers.append(await client.send(lane, max_tokens))

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(count):
            await trio.sleep_until(start + i / rate)
            nursery.start_soon(one)
    return sorted(answers, key=lambda a: a.sent)


async def closed_loop(client: Client, lanes: Sequence[Lane], requests: int, concurrency: int,
                      max_tokens: int) -> dict[str, list[Answer]]:
    """``concurrency`` clients, each sending one request after the other, the lanes taken in turn, until
    ``requests`` per lane were sent; each lane's answers."""
    answers: dict[str, list[Answer]] = {lane.name: [] for lane in lanes}
    order = [lane for _ in range(requests) for lane in lanes]

    async def worker() -> None:
        while order:
            lane = order.pop()
            answers[lane.name].append(await client.send(lane, max_tokens))

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return answers


# -- the exact limiters --------------------------------------------------------------------------------------------

class TokenBucket:
    """Holds ``limit`` at first, refilled at ``limit`` per minute up to ``limit``; admits a cost it holds."""

    def __init__(self, limit: float):
        self.limit = self.level = float(limit)
        self.at: float | None = None

    def take(self, at: float, cost: float) -> bool:
        if self.at is not None:
            self.level = min(self.limit, self.level + (at - self.at) * self.limit / 60.0)
        self.at = at
        if cost > self.level:
            return False
        self.level -= cost
        return True


class MinuteWindow:
    """``limit`` per calendar minute (UTC), counted from the minute's start; admits a cost that still fits."""

    def __init__(self, limit: float):
        self.limit = limit
        self.minute: int | None = None
        self.used = 0.0

    def take(self, at: float, cost: float) -> bool:
        minute = int(at // 60)
        if minute != self.minute:
            self.minute, self.used = minute, 0.0
        if self.used + cost > self.limit:
            return False
        self.used += cost
        return True


def exact_limiter(kind: str, limit: float) -> TokenBucket | MinuteWindow:
    if kind == BUCKET:
        return TokenBucket(limit)
    if kind == WINDOW:
        return MinuteWindow(limit)
    raise ValueError(f"unknown limiter kind {kind!r}")


def expected(kind: str, limit: float, times: Sequence[float], cost: float = 1.0) -> list[bool]:
    """Which of the requests decided at ``times`` (wall-clock seconds, any order) an exact limiter of ``kind``
    admits, each costing ``cost`` (1 for requests, its tokens for tokens); in the order of ``times``."""
    limiter = exact_limiter(kind, limit)
    admits = [False] * len(times)
    for i in sorted(range(len(times)), key=times.__getitem__):
        admits[i] = limiter.take(times[i], cost)
    return admits


def decided(answers: Sequence[Answer]) -> list[float]:
    """The latest each request can have been decided: when its answer came (a burst sent at once reaches the
    limiter over the time the gateways take to read it, and a bucket refills meanwhile)."""
    return [a.done for a in answers]


# -- what a workload's answers say ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Count:
    """One workload's answers against what the exact limiter admits for the same sends."""

    offered: int
    admitted: int
    expected: int
    errors: int  # no HTTP answer, or a 5xx

    @property
    def over(self) -> int:
        return max(0, self.admitted - self.expected)

    @property
    def usable(self) -> float | None:
        """The part of what the exact limiter admits that was admitted (capped at 1: more is overshoot)."""
        return None if self.expected == 0 else min(self.admitted, self.expected) / self.expected

    def as_dict(self) -> dict:
        return {"offered": self.offered, "admitted": self.admitted, "expected": self.expected,
                "errors": self.errors, "over": self.over, "usable": self.usable}


def count(answers: Sequence[Answer], admits: Sequence[bool]) -> Count:
    return Count(len(answers), sum(a.admitted for a in answers), sum(admits),
                 sum(a.status == 0 or a.status >= 500 for a in answers))


def count_in(answers: Sequence[Answer], admits: Sequence[bool], start: float, end: float) -> Count:
    """:func:`count` of the requests sent in ``[start, end)``."""
    inside = [(a, e) for a, e in zip(answers, admits, strict=True) if start <= a.sent < end]
    return count([a for a, _ in inside], [e for _, e in inside])


def most_in_flight(answers: Sequence[Answer]) -> int:
    """The most admitted requests in flight at once, as the client saw them (from send to answer)."""
    edges = sorted([(a.sent, 1) for a in answers if a.admitted] + [(a.done, -1) for a in answers if a.admitted],
                   key=lambda edge: (edge[0], edge[1]))
    most = level = 0
    for _, step in edges:
        level += step
        most = max(most, level)
    return most


def latency_ms(answers: Sequence[Answer]) -> dict:
    """p50 and p99 in milliseconds of the answers that were 200, and how many were not, by status."""
    values = [a.latency for a in answers if a.status == 200]
    others = Counter(str(a.status) for a in answers if a.status != 200)
    return {"requests": len(values), "p50_ms": 1000 * percentile(values, 0.5),
            "p99_ms": 1000 * percentile(values, 0.99), "not_ok": dict(sorted(others.items()))}


def fits(budget: float, cost: float) -> int:
    """How many requests of ``cost`` a budget holds whole."""
    return 0 if cost <= 0 else math.floor(budget / cost)
