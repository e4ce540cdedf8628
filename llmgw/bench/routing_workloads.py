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
distinct from its first block) and ``trace:FILE`` (JSONL a user brings, :func:`load_trace`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
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


# name -> (builder, its sizes for --quick)
WORKLOADS: dict[str, tuple[Callable[..., list[Session]], dict[str, int]]] = {
    "grouped": (grouped, {"groups": 4, "users": 2, "turns": 2}),
    "multiturn": (multiturn, {"conversations": 6, "turns": 3}),
    "zipf": (zipf, {"requests": 24}),
    "low-sharing": (low_sharing, {"requests": 24}),
}


def build(name: str, seed: int, *, quick: bool = False) -> list[Session]:
    """The sessions of workload ``name`` (or ``trace:FILE``)."""
    if name.startswith("trace:"):
        return load_trace(name[len("trace:"):])
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose {', '.join(WORKLOADS)} or trace:FILE")
    builder, small = WORKLOADS[name]
    return builder(seed, **(small if quick else {}))
