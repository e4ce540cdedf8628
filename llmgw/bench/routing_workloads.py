"""Seeded request sets for the routing benchmark: sessions of chat turns, the same for every arm.

A workload is a list of :class:`Session`. A session's turns are sent one after the other
(turn *t+1* once turn *t* is answered); with ``carry`` each turn adds its user message to the
conversation so far, engine replies included, as a chat client does (the simulators' replies
depend only on the prompt and their common ``--seed``, so every arm sends the same bodies).
Sessions run side by side, C at a time (closed loop), in a seeded shuffled order.

Shapes (:data:`WORKLOADS`): ``grouped`` (G system prompts of 6-8k characters, each shared by
U users holding T-turn conversations), ``multiturn`` (conversations with their own system
prompt: sharing only within a conversation), ``zipf`` (one-turn questions under 16 system
prompts whose popularity follows Zipf's law), ``low-sharing`` (the control: every prompt
distinct from its first block) and ``trace:FILE`` (JSONL a user brings, :func:`load_trace`);
and the ones where knowing the engines' caches exactly should pay, each with what it asks of
the run (:class:`Needs`: a KV capacity, slower replicas, a cache reset, output lengths, its
own concurrency): ``pressure``, ``restart``, ``hetero``, ``long-output``, ``burst``, ``cold``.
Every workload has goodput objectives (:class:`Objectives`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from math import ceil
from pathlib import Path

from ..sim import tokenizer
from .chat_workloads import words

MAX_TRACE_LINES = 100_000
MAX_TRACE_LINE_BYTES = 4 << 20


@dataclass
class Turn:
    id: str
    messages: list[dict]  # with carry: this turn's new messages; without: the whole conversation to send
    max_tokens: int


@dataclass
class Session:
    turns: list[Turn] = field(default_factory=list)
    carry: bool = True


class TraceError(ValueError):
    pass


def text(rng: random.Random, chars: int, head: str = "") -> str:
    """``head`` then random words, cut to ``chars`` characters (the simulators' tokenizer: one token each)."""
    body = head
    while len(body) < chars:
        body += words(rng, 64) + " "
    return body[:chars]


def _user(rng: random.Random, label: str) -> dict:
    return {"role": "user", "content": f"{label}: " + words(rng, rng.randint(8, 24))}


def grouped(seed: int, *, groups: int = 8, users: int = 4, turns: int = 4, system_chars: tuple[int, int] = (6000, 8000),
            max_tokens: int = 64) -> list[Session]:
    rng = random.Random(seed)
    systems = [text(rng, rng.randint(*system_chars), f"Group {g} instructions. ") for g in range(groups)]
    sessions = []
    for g in range(groups):
        for u in range(users):
            session = Session()
            for t in range(turns):
                new = [_user(rng, f"user {u} turn {t}")]
                if t == 0:
                    new.insert(0, {"role": "system", "content": systems[g]})
                session.turns.append(Turn(f"g{g}-u{u}-t{t}", new, max_tokens))
            sessions.append(session)
    rng.shuffle(sessions)
    return sessions


def multiturn(seed: int, *, conversations: int = 16, turns: int = 6, system_chars: tuple[int, int] = (1500, 2500),
              max_tokens: int = 64) -> list[Session]:
    rng = random.Random(seed)
    sessions = []
    for c in range(conversations):
        system = {"role": "system", "content": text(rng, rng.randint(*system_chars), f"Conversation {c}. ")}
        turns_ = [Turn(f"c{c}-t{t}", ([system] if t == 0 else []) + [_user(rng, f"turn {t}")], max_tokens)
                  for t in range(turns)]
        sessions.append(Session(turns_))
    rng.shuffle(sessions)
    return sessions


def zipf(seed: int, *, groups: int = 16, requests: int = 128, exponent: float = 1.1,
         system_chars: tuple[int, int] = (3000, 5000), max_tokens: int = 64) -> list[Session]:
    rng = random.Random(seed)
    systems = [{"role": "system", "content": text(rng, rng.randint(*system_chars), f"Topic {g} guide. ")}
               for g in range(groups)]
    weights = [1 / (rank + 1) ** exponent for rank in range(groups)]
    picks = rng.choices(range(groups), weights=weights, k=requests)
    return [Session([Turn(f"z{i}-g{g}", [systems[g], _user(rng, f"question {i}")], max_tokens)], carry=False)
            for i, g in enumerate(picks)]


def low_sharing(seed: int, *, requests: int = 96, chars: tuple[int, int] = (2000, 3000),
                max_tokens: int = 64) -> list[Session]:
    rng = random.Random(seed)
    return [Session([Turn(f"l{i}", [{"role": "user", "content": text(rng, rng.randint(*chars), f"{i:05d} ")}],
                          max_tokens)], carry=False)
            for i in range(requests)]


def load_trace(path: str | Path, *, max_tokens: int = 64) -> list[Session]:
    """JSONL: one request per line, ``{"messages": [...], "session": "id"?, "max_tokens": n?, "id": "..."?}``.

    Lines of one ``session`` are sent in file order, one after the other; other lines run side by
    side. Messages are sent as written (no replies are carried in). Errors name the line.
    """
    sessions: dict[str, Session] = {}
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            if number > MAX_TRACE_LINES:
                raise TraceError(f"{path}: more than {MAX_TRACE_LINES} lines")
            if len(raw) > MAX_TRACE_LINE_BYTES:
                raise TraceError(f"{path}, line {number}: longer than {MAX_TRACE_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            try:
                item = json.loads(raw)
            except ValueError as exc:
                raise TraceError(f"{path}, line {number}: not JSON ({exc})") from None
            if not isinstance(item, dict) or not isinstance(item.get("messages"), list) or not item["messages"] \
                    or not all(isinstance(m, dict) for m in item["messages"]):
                raise TraceError(f"{path}, line {number}: needs 'messages', a non-empty list of objects")
            try:
                tokenizer.encode_chat(item["messages"])
            except tokenizer.TokenizerError as exc:
                raise TraceError(f"{path}, line {number}: 'messages': {exc}") from None
            limit = item.get("max_tokens", max_tokens)
            if type(limit) is not int or not 1 <= limit <= 65536:
                raise TraceError(f"{path}, line {number}: 'max_tokens' must be an integer in 1..65536")
            key = str(item.get("session", f"line-{number}"))
            session = sessions.setdefault(key, Session(carry=False))
            session.turns.append(Turn(str(item.get("id", f"line-{number}")), item["messages"], limit))
    if not sessions:
        raise TraceError(f"{path}: no requests")
    ids = [turn.id for s in sessions.values() for turn in s.turns]
    if len(set(ids)) != len(ids):
        raise TraceError(f"{path}: request ids repeat")
    return list(sessions.values())


def pressure(seed: int, *, fleet_tokens: int, ratio: float = 2.5, visits: int = 3, exponent: float = 0.8,
             system_chars: tuple[int, int] = (3000, 5000), max_tokens: int = 64) -> list[Session]:
    """Many groups whose system prompts add up to ``ratio`` x the fleet's KV cache (``fleet_tokens``).

    Every group is asked at least once, the rest of the ``visits`` x groups questions pick groups
    by Zipf popularity, in a shuffled order. No router can keep the working set cached: the engines
    evict, and an approximate tree, which never sees an eviction, keeps sending a group to the
    replica that held it, where it is now cold; a router that follows the engines' KV events knows
    which groups are still held, and where nothing is, it is free to balance the load.
    """
    rng = random.Random(seed)
    mean_chars = sum(system_chars) / 2
    groups = max(2, ceil(ratio * fleet_tokens / mean_chars))  # the tokenizer: one token a character
    systems = [{"role": "system", "content": text(rng, rng.randint(*system_chars), f"Manual {g}. ")}
               for g in range(groups)]
    weights = [1 / (rank + 1) ** exponent for rank in range(groups)]
    picks = list(range(groups)) + rng.choices(range(groups), weights=weights, k=(visits - 1) * groups)
    rng.shuffle(picks)
    return [Session([Turn(f"p{i}-g{g}", [systems[g], _user(rng, f"question {i}")], max_tokens)], carry=False)
            for i, g in enumerate(picks)]


def restart(seed: int, *, groups: int = 8, users: int = 4, turns: int = 3, max_tokens: int = 64) -> list[Session]:
    """Grouped conversations; the bench resets replica 0's prefix cache part-way (:attr:`Needs.reset_after`).

    After the reset the groups replica 0 held are gone from it, while their conversations go on. A
    prefix tree built from its own past decisions still believes replica 0 holds them and sends
    their turns there to be computed again behind each other; the engine's ``AllBlocksCleared``
    event tells a KV-index router the truth at once.
    """
    return grouped(seed, groups=groups, users=users, turns=turns, system_chars=(3000, 5000), max_tokens=max_tokens)


def hetero(seed: int, *, groups: int = 8, users: int = 4, turns: int = 3, max_tokens: int = 128) -> list[Session]:
    """Grouped conversations on replicas of different speeds (:attr:`Needs.slow_replicas`: one A100 among H100s).

    A router that spreads groups evenly gives the slow replica as many as the others and its
    requests wait; one that sees the engines' queues, their caches and their speed can give the
    slow replica less, and move a group off it only where the prefix is also held elsewhere.
    """
    return grouped(seed, groups=groups, users=users, turns=turns, system_chars=(3000, 5000), max_tokens=max_tokens)


def long_output(seed: int, *, groups: int = 4, requests: int = 24, max_tokens: int = 4096,
                system_chars: tuple[int, int] = (400, 800)) -> list[Session]:
    """Decode-dominated: one-turn questions under a few system prompts, answers of 1k-4k tokens.

    The simulators draw each answer's length in :attr:`Needs.output_tokens`. Nearly all the time is
    decode, whose step grows with the batch and its context on a GPU profile: piling the
    requests that share a prompt on its holder saves a short prefill but slows every token of
    every sequence there, so exact knowledge of what each replica is running (and holds) is what
    lets a router trade the one against the other.
    """
    rng = random.Random(seed)
    systems = [{"role": "system", "content": text(rng, rng.randint(*system_chars), f"Writer {g}. ")}
               for g in range(groups)]
    picks = [i % groups for i in range(requests)]
    rng.shuffle(picks)
    return [Session([Turn(f"o{i}-g{g}", [systems[g], _user(rng, f"essay {i}")], max_tokens)], carry=False)
            for i, g in enumerate(picks)]


def burst(seed: int, *, requests: int = 40, system_chars: int = 190, max_tokens: int = 512) -> list[Session]:
    """The issue's opening case: ``requests`` streamed questions at once, sharing one ~190-token system prompt.

    Run at :attr:`Needs.concurrency` 40, so they all arrive together. Caching says: send them all to
    the replica that holds the short prefix; decode says: 40 sequences on one GPU make every step
    slower while the other replicas idle. The prefix is cheap to compute again, so the right spread
    is set by decode cost and the running batches, which only the engines know exactly.
    """
    rng = random.Random(seed)
    system = {"role": "system", "content": text(rng, system_chars, "You are the support assistant. ")}
    return [Session([Turn(f"b{i}", [system, _user(rng, f"ticket {i}")], max_tokens)], carry=False)
            for i in range(requests)]


def cold(seed: int, *, groups: int = 12, users: int = 4, system_chars: tuple[int, int] = (2000, 3000),
         max_tokens: int = 64) -> list[Session]:
    """Fresh engines, more prompt groups than replicas, every group's first question near the start.

    Sessions are ordered user by user (every group's user 0, then every group's user 1...), so
    new prefixes arrive together on empty caches. Nothing is cached yet: a router must deal the
    groups out so that replicas end even and never move a group once placed; a KV-index router
    sees each group's blocks land and can follow them, where a tree only knows its own choices.
    """
    rng = random.Random(seed)
    systems = [{"role": "system", "content": text(rng, rng.randint(*system_chars), f"Team {g} charter. ")}
               for g in range(groups)]
    order = list(range(groups))
    rng.shuffle(order)
    return [Session([Turn(f"c{g}-u{u}", [systems[g], _user(rng, f"user {u}")], max_tokens)], carry=False)
            for u in range(users) for g in order]


@dataclass(frozen=True)
class Objectives:
    """Goodput's service-level objectives per request, in the engines' modelled time (x ``--time-scale``).

    A request meets them when its time to first token and its mean gap between streamed tokens
    (vLLM's TPOT, as ``vllm bench serve --goodput`` judges it) are both within them.
    """

    ttft_ms: float = 1000.0
    itl_ms: float = 50.0


@dataclass(frozen=True)
class Needs:
    """What a workload asks of the simulators and of the run, beside its requests."""

    num_blocks: int | None = None  # each replica's KV cache (vLLM's count, null block included); None: the run's
    output_tokens: tuple[int, int] | None = None  # the simulators' natural output lengths (``--output-tokens``)
    slow_replicas: int = 0  # the first N replicas run a slower kind of GPU
    reset_after: float | None = None  # share of the requests answered when replica 0's prefix cache is reset
    concurrency: int | None = None  # the clients the workload is defined at, whatever ``--concurrency`` says
    objectives: Objectives = Objectives()


@dataclass(frozen=True)
class Workload:
    builder: Callable[..., list[Session]]
    quick: dict = field(default_factory=dict)  # its sizes for ``--quick``
    needs: Needs = Needs()
    sized_by_capacity: bool = False  # the builder takes ``fleet_tokens``: the fleet's KV cache in tokens


WORKLOADS: dict[str, Workload] = {
    "grouped": Workload(grouped, {"groups": 4, "users": 2, "turns": 2}),
    "multiturn": Workload(multiturn, {"conversations": 6, "turns": 3}),
    "zipf": Workload(zipf, {"requests": 24}),
    "low-sharing": Workload(low_sharing, {"requests": 24}),
    # 1,024 usable blocks of 16 tokens each (the benchmark's 16,384-token context), whatever the profile
    "pressure": Workload(pressure, {"visits": 2}, Needs(num_blocks=1025), sized_by_capacity=True),
    "restart": Workload(restart, {"groups": 6, "users": 3, "turns": 3}, Needs(reset_after=0.4)),
    "hetero": Workload(hetero, {"groups": 6, "users": 3, "turns": 2}, Needs(slow_replicas=1)),
    "long-output": Workload(long_output, {"requests": 12}, Needs(output_tokens=(1024, 4096),
                                                                 objectives=Objectives(2000.0, 25.0))),
    "burst": Workload(burst, {"max_tokens": 256}, Needs(output_tokens=(128, 512), concurrency=40,
                                                        objectives=Objectives(500.0, 25.0))),
    "cold": Workload(cold, {"groups": 8, "users": 3}),
}
TRACE_NEEDS = Needs()


def needs(name: str) -> Needs:
    """What workload ``name`` (or ``trace:FILE``) asks of the run."""
    return TRACE_NEEDS if name.startswith("trace:") else WORKLOADS[name].needs


def build(name: str, seed: int, *, quick: bool = False, fleet_tokens: int | None = None) -> list[Session]:
    """The sessions of workload ``name`` (or ``trace:FILE``); ``fleet_tokens``: the replicas' KV cache in all,
    for a workload sized by it (without it: as with 4 replicas of its :attr:`Needs.num_blocks`)."""
    if name.startswith("trace:"):
        return load_trace(name[len("trace:"):])
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose {', '.join(WORKLOADS)} or trace:FILE")
    workload = WORKLOADS[name]
    sizes = dict(workload.quick if quick else {})
    if workload.sized_by_capacity:
        blocks = workload.needs.num_blocks or 1025
        sizes["fleet_tokens"] = fleet_tokens if fleet_tokens is not None else 4 * (blocks - 1) * 16
    return workload.builder(seed, **sizes)
