"""New prefixes dealt out (llmgw.router.deal): two gateways of a cluster whose views differ by what they have not
heard of each other yet (a request in flight, a new prefix just dealt) place the same new prompt on the same
replica, and a weighted replica is dealt its share."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from llmgw.plugins.prefix_tree import PrefixTreeTier
from llmgw.router.model import TierModel
from llmgw.router.replica import Replica
from llmgw.router.tier import RouteRequest, TierServices

NAMES = ("sim-0", "sim-1", "sim-2", "sim-3")


class Unheard:
    """A cluster's learning channel in the few ms before anything arrives: published, never delivered."""

    def __init__(self) -> None:
        self.published: list[tuple[str, list[Any]]] = []

    def publish(self, kind: str, payload: list[Any]) -> None:
        self.published.append((kind, payload))

    def subscribe(self, kind: str, handler: Callable[[list[Any]], None]) -> None:
        pass


def gateway() -> tuple[PrefixTreeTier, list[Replica]]:
    tier = PrefixTreeTier(TierModel("m", "prefix_tree", {"seed": 1}),
                          TierServices(model="m", learning=Unheard(), clock=lambda: 1000.0))  # all in one instant
    replicas = [Replica(name=n, model="m", url=f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(NAMES)]
    return tier, replicas


def chat(system: str, question: str = "hello") -> RouteRequest:
    return RouteRequest("m", "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]})


async def test_two_gateways_with_slightly_different_views_deal_the_same_new_prompt_to_the_same_replica():
    first, first_replicas = gateway()
    second, second_replicas = gateway()
    # What both know: one group per replica, each routed by one of them and shared long ago.
    for i, name in enumerate(NAMES):
        for tier in (first, second):
            tier.tree.insert(f"system\x1fGroup {i} charter. " + "rules " * 400, name, tier.clock())
    # What only the first knows yet: it has just dealt three new prompts, their prefills queued where they went.
    # The second hears of none of it for a few tens of ms (their routes, its load report).
    for ticket in range(3):
        decision = await first.pick(chat(f"Team Y{ticket} charter. " + "notes " * 300), first_replicas)
        decision.replica.local_inflight += 1
        decision.replica.queue_prefill(ticket, decision.prefill_tokens, first.clock())
    placed: dict[int, tuple[str, str]] = {}
    for k in range(40):
        request = chat(f"Team {k} charter. " + "duties " * 400)
        placed[k] = (first.explain(request, first_replicas)["pick"], second.explain(request, second_replicas)["pick"])
    assert all(a == b for a, b in placed.values()), placed
    assert len({a for a, _ in placed.values()}) == len(NAMES)  # and they spread over every replica


async def test_one_gateway_deals_new_prefixes_by_weight():
    tier, replicas = gateway()
    tier.learning = None  # one gateway alone: the least held takes it, no hashing
    replicas[0].weight = 2
    picks: Counter[str] = Counter()
    for k in range(15):
        picks[(await tier.pick(chat(f"Team {k} charter. " + "duties " * 400), replicas)).replica.name] += 1
    assert picks == {"sim-0": 6, "sim-1": 3, "sim-2": 3, "sim-3": 3}
