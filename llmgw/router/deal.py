"""Dealing out new prefixes: where a prompt that no replica holds goes, so that replicas end even and the
gateways of a cluster agree.

The rule (also in ``docs/routing.md``), for a prompt no candidate holds any useful part of, under the cost rule:

1. **Affordable**: the candidates whose cost (:mod:`llmgw.router.cost`) is within ``DEAL_SLACK_PREFILLS``
   times the prompt's own prefill time (its new tokens over the cheapest candidate's throughput) of the
   cheapest, and every near-tie of it. This is the load guard of the deal: a replica whose queue or
   in-flight requests would make the request wait more than that is never dealt to. A gateway of a
   cluster adds the prefill time of what it routed itself in the last ``UNHEARD_WINDOW`` (its peers see
   none of that load yet, and it sees about as little of theirs: without it, in a burst each gateway
   finds its own replicas unaffordable and not the others', and they place the same prompt apart).
2. **Running**: of those, the ones running no more than ``load_margin`` requests (per unit of ``weight``) above
   the least running of them; in a cluster, plus what this gateway routed in the last ``UNHEARD_WINDOW`` (its
   peers count none of it yet). The affordability slack is measured in prefill time, and with the decode charge
   off it does not see that a replica running one or two more requests decodes every one of them slower: without
   this step, 29-40 of low-sharing's 88 new prompts a run went to a busier replica (issue 19).
3. **Dealt**: among those, the ones *holding the least*: each candidate's characters in the model's prefix
   tree (what it was sent and still holds: ``llmgw_prefix_tree_replica_chars``), over its ``weight``. One
   gateway takes the least (``spread`` 0). A gateway in a cluster takes any within ``spread`` characters of
   the least, ``spread`` being what it added to its tree itself in the last ``UNHEARD_WINDOW``
   (:class:`RecentGrowth`): its peers have not heard of that yet, and it has not heard of about as much of
   theirs, so its view and theirs differ by about that much. Between bursts that is 0 and the deal is exact;
   in a burst the gateways' views differ, and the wider set lets them agree by the hash below.
4. One of them: in a cluster, the one the prompt's first characters hash to highest with (rendezvous hashing,
   the same in every gateway); alone, the tier's usual tie-breaks (lower load, fewer in-flight tokens, least
   recently given a new prefix, then at random).

Why a cumulative quantity and not the momentary load alone: a new prefix is a bet on the traffic that will follow
it, and a replica's load at the instant it arrives says little about that. Placing new prefixes on whichever
replica looks least loaded at that instant spreads them unevenly (a replica that happens to be idle when
several groups start collects them, and all their later requests) and, across gateways whose views of the
others' load are a report interval old, differently in each gateway. What the tree holds grows only with
what was routed, is shared between the gateways of a cluster (every decision's route is), and is what the
best approximate routers deal by (SGLang's and vllm-router's ``cache_aware``: the smallest tree). Step 2 deals
among the affordable replicas running the least (``load_margin`` 0 by default: measured, on the H100 profile a
replica running one more request decodes each slower, while the runs still ended even, because a replica rarely
stays the least busy for long); a margin of 1 keeps a replica idle whenever the new prefixes arrive from taking
them all, at the cost of that decode time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .cost import Estimate

DEAL_SLACK_PREFILLS = 2.0  # a new prefix may wait up to two of its own prefills' time to go where the deal says
# What a gateway routed in the last this many seconds may not have reached the others yet: a decision's route took
# 20-90 ms to be applied by the other gateways during a cold burst on a 2-vCPU machine (docs/scaling.md)
UNHEARD_WINDOW = 0.1
UNHEARD_LIMIT = 4096  # routes remembered for that (more within the window: the oldest are forgotten)

CHEAPEST = "cheapest"  # the deal's pick was also a smallest-cost candidate
DEALT = "dealt"  # the deal sent it to an affordable candidate holding less than the cheapest ones
HOW = (CHEAPEST, DEALT)


@dataclass(frozen=True, slots=True)
class Deal:
    """A new prefix dealt out: who could afford it, what each candidate holds, and who may take it."""

    cheapest: list[int]  # the smallest cost and its near-ties
    affordable: list[int]
    held: list[float]  # per candidate: its tree characters over its weight
    running: list[int]  # the affordable candidates running within the margin of the least running of them
    dealt: list[int]  # of those, the ones holding the least (within ``spread``)
    slack: float  # seconds of cost above the cheapest still affordable


def affordable(estimates: Sequence[Estimate], near: Sequence[int], unheard_tokens: int = 0
               ) -> tuple[list[int], float]:
    """The candidates within ``DEAL_SLACK_PREFILLS`` of the prompt's own prefill time, plus that of
    ``unheard_tokens``, of the cheapest (and the near-ties ``near``), and that slack in seconds."""
    costs = [e.cost for e in estimates]
    best = min(costs)
    cheapest = min((e for e, cost in zip(estimates, costs) if cost == best), key=lambda e: e.new_tokens)
    slack = (DEAL_SLACK_PREFILLS * cheapest.new_tokens + unheard_tokens) / cheapest.throughput
    chosen = set(near)
    return [i for i, cost in enumerate(costs) if cost <= best + slack or i in chosen], slack


def running_least(candidates: Sequence[int], loads: Sequence[float], weights: Sequence[int],
                  margin: float | None) -> list[int]:
    """Of ``candidates``, those whose requests running (``loads``) per unit of weight are within ``margin`` of the
    least of them; all of them with ``margin`` None."""
    if margin is None:
        return list(candidates)
    per_weight = {i: loads[i] / max(weights[i], 1) for i in candidates}
    least = min(per_weight.values())
    return [i for i in candidates if per_weight[i] <= least + margin]


def deal(estimates: Sequence[Estimate], near: Sequence[int], held_chars: Mapping[str, int], names: Sequence[str],
         weights: Sequence[int], spread: int = 0, unheard_tokens: int = 0, loads: Sequence[float] | None = None,
         load_margin: float | None = None) -> Deal:
    """Rules 1 to 3 of the module's docstring; ``held_chars`` by replica name (absent: nothing); ``spread`` and
    ``unheard_tokens``: what this gateway added to its tree and routed for prefill in the last
    ``UNHEARD_WINDOW`` (0 alone); ``loads``: each candidate's requests running, kept within ``load_margin`` of
    the least (None: not looked at; the caller adds its unheard routes to the margin)."""
    candidates, slack = affordable(estimates, near, unheard_tokens)
    running = candidates if loads is None else running_least(candidates, loads, weights, load_margin)
    held = [held_chars.get(name, 0) / max(weight, 1) for name, weight in zip(names, weights)]
    least = min(held[i] for i in running)
    return Deal(list(near), candidates, held, running, [i for i in running if held[i] <= least + spread], slack)


class DealCounts:
    """A model's new prefixes dealt so far, by ``how`` (``llmgw_routing_new_prefixes_total``, read at scrape time)."""

    __slots__ = ("counts", "__weakref__")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(HOW, 0)

    def count(self, how: str) -> None:
        self.counts[how] += 1


class RecentGrowth:
    """An amount this gateway added in the last ``UNHEARD_WINDOW`` seconds (to its tree: the ``spread`` of a deal
    in a cluster; prefill tokens routed: its ``unheard_tokens``): bounded to ``UNHEARD_LIMIT`` routes."""

    __slots__ = ("window", "_added", "_total")

    def __init__(self, window: float = UNHEARD_WINDOW, limit: int = UNHEARD_LIMIT) -> None:
        self.window = window
        self._added: deque[tuple[float, int]] = deque(maxlen=limit)
        self._total = 0

    def add(self, now: float, amount: int) -> None:
        if amount > 0:
            if len(self._added) == self._added.maxlen:
                self._total -= self._added[0][1]
            self._added.append((now, amount))
            self._total += amount

    def total(self, now: float) -> int:
        added, cutoff = self._added, now - self.window
        while added and added[0][0] < cutoff:
            self._total -= added.popleft()[1]
        return self._total
