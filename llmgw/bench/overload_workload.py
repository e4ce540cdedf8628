"""The tenants of ``llmgw bench overload`` and how their requests are sent: a closed loop (the capacity ramp) and an
open loop (Poisson arrivals that never wait for answers).

Three tenants, each with its own API key: two in the ``interactive`` class (short prompts, short streamed answers)
and one in ``batch`` (long prompts, long answers). Every request streams, with ``ignore_eos`` so that an answer is
exactly ``max_tokens`` long (unless the bench's ``--natural-output``: then it ends at its EOS, at most that
long); its prompt is fresh random words (no two requests share a cached prefix). By default
70% of the arrivals are interactive and 30% batch, which makes batch about nine tenths of the tokens.

:func:`open_loop` starts a task per arrival of a Poisson process (the tenants' arrivals are independent Poisson
processes, drawn as one of the summed rate with a class picked per arrival by its share, the class's tenants in
turn: :class:`Picker`); at most ``cap`` are in
flight, arrivals beyond that are counted (``over_cap``) and not sent, so a cap that is hit is reported, never
hidden. Each answer becomes an :class:`Outcome`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import httpx
import trio

from ..testing.sims import MODEL
from .chat_workloads import ChatResult, send_chat, words

INTERACTIVE, BATCH = "interactive", "batch"
CLASSES = (INTERACTIVE, BATCH)
OK, SHED, EXPIRED, ERROR = "ok", "shed", "expired", "error"  # what became of a request


@dataclass(frozen=True)
class Tenant:
    name: str  # also its API key's name
    key: str
    priority: str  # INTERACTIVE or BATCH: its key's class
    share: float  # its share of the arrivals
    prompt_words: int
    max_tokens: int

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}


@dataclass(frozen=True)
class Mix:
    """The tenants' shapes: what ``--interactive`` and ``--batch`` say (prompt words, output tokens)."""

    interactive_words: int = 20  # ~110 prompt tokens with the simulators' tokenizer
    interactive_tokens: int = 32
    batch_words: int = 400  # ~2,100 prompt tokens
    batch_tokens: int = 256
    batch_share: float = 0.3

    def tenants(self) -> tuple[Tenant, ...]:
        each = (1.0 - self.batch_share) / 2
        return (Tenant("interactive-a", "sk-overload-interactive-a", INTERACTIVE, each, self.interactive_words,
                       self.interactive_tokens),
                Tenant("interactive-b", "sk-overload-interactive-b", INTERACTIVE, each, self.interactive_words,
                       self.interactive_tokens),
                Tenant("batch", "sk-overload-batch", BATCH, self.batch_share, self.batch_words, self.batch_tokens))


@dataclass
class Outcome:
    tenant: str
    priority: str
    sent: float  # seconds since the loop started
    kind: str  # OK, SHED, EXPIRED or ERROR
    status: int  # 0: no HTTP answer (a connection error or the client's timeout)
    ttft: float  # seconds to the first token (OK), or to the refusal
    latency: float  # seconds to the end of the answer
    tokens: int = 0  # prompt + completion tokens the engine reported (OK)
    itl: list[float] = field(default_factory=list)
    retry_after: bool = False  # a refusal carried Retry-After
    gateway: int = 0  # which of the urls it was sent through
    reason: str = ""  # a refusal's reason: llmgw's EXPIRED, OVERFLOW or UNSERVABLE (from its message), else ""


EXPIRED_CODES = ("queue_timeout",)  # llmgw's 429 code for a request whose deadline passed (or would) waiting


def kind_of(status: int, body: str) -> str:
    """What an answer means: 200 OK; 408 (vllm-router's queue timeout) or a 429 whose error ``code`` is one of
    :data:`EXPIRED_CODES` EXPIRED; any other 429 SHED (a full queue, or a rate limit); anything else ERROR."""
    if status == 200:
        return OK
    if status == 408 or (status == 429 and any(f'"{code}"' in body for code in EXPIRED_CODES)):
        return EXPIRED
    return SHED if status == 429 else ERROR


# llmgw's 429 messages (llmgw.gateway.flow_gate.shed_response) say why: the request would not have had room in
# time, found while it waited or on arrival (its message names the deadline too, so it is looked for first), the
# queue was full, or the deadline passed while it waited.
REFUSAL_REASONS = (("found after it waited", "unservable_waiting"), ("would not have room", "unservable"),
                   ("is full", "overflow"), ("its deadline (class", "expired"))


def reason_of(status: int, body: str) -> str:
    """Why llmgw refused a request, from its 429's message; "" for anything else."""
    if status != 429:
        return ""
    return next((reason for marker, reason in REFUSAL_REASONS if marker in body), "other")


Send = Callable[[Tenant, random.Random], Awaitable[Outcome]]


def sender(client: httpx.AsyncClient, urls: Sequence[str], timeout: float, model: str = MODEL,
           ignore_eos: bool = True) -> Send:
    """Sends a tenant's request for ``model`` through ``urls`` in turn (an L4 balancer's round robin), fresh words
    each time; with ``ignore_eos`` its answer is exactly ``max_tokens`` long, else it ends at its EOS."""
    turn = 0

    async def send(tenant: Tenant, rng: random.Random) -> Outcome:
        nonlocal turn
        gateway = turn % len(urls)
        url = urls[gateway]
        turn += 1
        messages = [{"role": "user", "content": words(rng, tenant.prompt_words)}]
        started = time.perf_counter()
        result: ChatResult | None = None
        with trio.move_on_after(timeout):
            try:
                result = await send_chat(client, url, model, messages, tenant.max_tokens, headers=tenant.headers,
                                         extra_body={"ignore_eos": ignore_eos})
            except (httpx.HTTPError, ValueError):
                pass
        if result is None:
            elapsed = time.perf_counter() - started
            return Outcome(tenant.name, tenant.priority, 0.0, ERROR, 0, elapsed, elapsed, gateway=gateway)
        return Outcome(tenant.name, tenant.priority, 0.0, kind_of(result.status, result.error), result.status,
                       result.ttft, result.latency, result.prompt_tokens + result.completion_tokens, result.itl,
                       result.retry_after is not None, gateway, reason_of(result.status, result.error))

    return send


class Picker:
    """Which tenant an arrival is: its class drawn by the classes' shares, then the class's tenants in turn, so
    that tenants of one class send equal numbers of requests (their fairness then measures the service, not the
    draw)."""

    def __init__(self, tenants: Sequence[Tenant], rng: random.Random):
        self.rng = rng
        self.classes: dict[str, list[Tenant]] = {}
        for tenant in tenants:
            self.classes.setdefault(tenant.priority, []).append(tenant)
        self.names = list(self.classes)
        self.weights = [sum(t.share for t in self.classes[c]) for c in self.names]
        self.turns = dict.fromkeys(self.names, 0)

    def __call__(self) -> Tenant:
        name = self.rng.choices(self.names, weights=self.weights)[0]
        members = self.classes[name]
        self.turns[name] += 1
        return members[self.turns[name] % len(members)]


@dataclass
class Loop:
    """What a loop sent and got back."""

    outcomes: list[Outcome]
    seconds: float  # of arrivals (the closed loop: until the last answer)
    elapsed: float = 0.0  # from the first arrival to the last answer
    over_cap: int = 0  # open loop: arrivals not sent because ``cap`` requests were in flight
    most_in_flight: int = 0


def poisson_arrivals(tenants: Sequence[Tenant], rate: float, seconds: float,
                     seed: int) -> Iterator[tuple[float, Tenant, random.Random]]:
    """Poisson arrivals at ``rate`` per second for ``seconds``: each one's time, tenant and words' generator."""
    rng = random.Random(seed)
    pick = Picker(tenants, rng)
    at = rng.expovariate(rate)
    while at < seconds:
        yield at, pick(), random.Random(rng.random())
        at += rng.expovariate(rate)


async def send_at(send: Send, arrivals: Iterable[tuple[float, Tenant, random.Random]], seconds: float,
                  cap: int) -> Loop:
    """Each arrival sent at its time (seconds from now, ascending) without waiting for answers, a task each;
    returns once every answer is in."""
    loop = Loop([], seconds)
    in_flight = 0

    async def one(tenant: Tenant, at: float, words_rng: random.Random) -> None:
        nonlocal in_flight
        try:
            outcome = await send(tenant, words_rng)
            outcome.sent = at
            loop.outcomes.append(outcome)
        finally:
            in_flight -= 1

    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        for at, tenant, words_rng in arrivals:
            await trio.sleep_until(start + at)
            if in_flight >= cap:
                loop.over_cap += 1
            else:
                in_flight += 1
                loop.most_in_flight = max(loop.most_in_flight, in_flight)
                nursery.start_soon(one, tenant, at, words_rng)
    loop.elapsed = trio.current_time() - start
    return loop


async def open_loop(send: Send, tenants: Sequence[Tenant], rate: float, seconds: float, cap: int,
                    seed: int) -> Loop:
    """Poisson arrivals at ``rate`` per second for ``seconds``, a task each; returns once every answer is in."""
    return await send_at(send, poisson_arrivals(tenants, rate, seconds, seed), seconds, cap)


async def closed_loop(send: Send, tenants: Sequence[Tenant], concurrency: int, seconds: float, seed: int) -> Loop:
    """``concurrency`` clients, each sending its next request when its last is answered, for ``seconds``."""
    loop = Loop([], seconds, most_in_flight=concurrency)

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        pick = Picker(tenants, rng)
        start = trio.current_time()
        while (at := trio.current_time() - start) < seconds:
            outcome = await send(pick(), rng)
            outcome.sent = at
            loop.outcomes.append(outcome)

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(client, i)
    loop.seconds = loop.elapsed = trio.current_time() - started  # the last answers came after ``seconds``
    return loop
