"""What routing learns is shared: a burst sharing a new prefix, entering three gateway processes, co-locates.

Real processes on loopback: three ``llmgw sim`` engines with KV events and a modelled prefill (2000 prompt
tokens/s: the first request's blocks are stored, and their events seen by the gateways, some 0.4 s after it was
routed), a control ``llmgw serve`` and two ``--role gateway`` followers, a real ``redis-server``. A burst of
requests sharing a 600-word system prompt no engine holds (one every 50 ms, round robin over the three
gateways, all in flight together) is routed before any event says where the prefix is: only the predictions
the gateways share through Redis can bring them together. What is checked is what the engines answered: the
replica (``x-llmgw-replica``) and ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from random import Random
from typing import Callable

import httpx
import pytest
import trio

from llmgw.bench.chat_workloads import words
from llmgw.testing.metrics import metric_value, scrape
from llmgw.testing.processes import Child
from llmgw.testing.sims import MODEL

pytestmark = pytest.mark.slow

GATEWAYS = 3
PER_GATEWAY = 2
# Between two requests of the burst: above the time a prediction takes to reach the other gateways (a few ms) and
# another gateway's load report (at most load_interval, 50 ms), far below the time the engines take to prefill
# the shared prefix and report it (1.6 s).
STAGGER = 0.1
SLOW_PREFILL = ("--prefill-tokens-per-s", "2000")


@dataclass
class Answer:
    order: int
    gateway: int
    replica: str
    cached_tokens: int
    prompt_tokens: int


async def burst(gateways: list[Child], seed: int, count: int = GATEWAYS * PER_GATEWAY, stagger: float = STAGGER,
                question: Callable[[int], str] = "question {}?".format) -> list[Answer]:
    """``count`` chats sharing a new system prompt, sent round robin every ``stagger`` seconds, the ``i``-th asking
    ``question(i)``."""
    system = {"role": "system", "content": words(Random(seed), 600)}  # about 3250 tokens
    answers: list[Answer] = []

    async def ask(http: httpx.AsyncClient, order: int) -> None:
        gateway = order % len(gateways)
        body = {"model": MODEL, "max_tokens": 4,
                "messages": [system, {"role": "user", "content": question(order)}]}
        response = await http.post(gateways[gateway].url + "/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        answers.append(Answer(order, gateway, response.headers["x-llmgw-replica"],
                              usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]))

    async with httpx.AsyncClient(timeout=30) as http:
        with trio.fail_after(60):
            async with trio.open_nursery() as requests:
                for order in range(count):
                    requests.start_soon(ask, http, order)
                    await trio.sleep(stagger)
    return sorted(answers, key=lambda a: a.order)


def cold(answers: list[Answer]) -> list[Answer]:
    """The requests the engines prefilled from scratch."""
    return [a for a in answers if a.cached_tokens == 0]


async def counted_cached_tokens(gateway: Child, served: int) -> tuple[float, float]:
    """A gateway's ``(predicted, actual)`` cached tokens, once its actual count is ``served`` (each response's usage
    is counted as it ends, just after the client has it)."""
    async with httpx.AsyncClient(timeout=10) as http:
        with trio.fail_after(5):
            while True:
                text = await scrape(gateway.control_url, http)
                actual = metric_value(text, "llmgw_route_actual_cached_tokens_total", f'model="{MODEL}"')
                if actual >= served:
                    return metric_value(text, "llmgw_route_predicted_cached_tokens_total", f'model="{MODEL}"'), actual
                await trio.sleep(0.05)


async def shared_predictions(gateway: Child) -> dict[str, float]:
    text = await scrape(gateway.control_url)
    return {direction: metric_value(text, "llmgw_cluster_predictions_total", f'direction="{direction}"')
            for direction in ("sent", "received", "dropped", "ignored")}


async def test_a_burst_sharing_a_new_prefix_across_three_gateways_co_locates_and_is_predicted_exactly(
        shared_cluster):
    engines, control, followers = await shared_cluster(followers=2, sims=3, time_scale=1, sim_extra=SLOW_PREFILL)
    gateways = [control, *followers]
    answers = await burst(gateways, seed=1)
    first = answers[0]
    # Only the very first was prefilled from scratch: every other gateway's first request went where the first
    # one's gateway had predicted its blocks, 1.5 s before the engine reported them.
    assert cold(answers) == [first], answers
    assert {a.replica for a in answers} == {first.replica}, answers
    assert all(a.cached_tokens >= first.prompt_tokens - 64 for a in answers[1:]), answers
    # What each gateway predicted the engine would serve from its cache is what it served, for the followers'
    # requests routed on another gateway's prediction too.
    for i, gateway in enumerate(gateways):
        served = sum(a.cached_tokens for a in answers if a.gateway == i)
        assert await counted_cached_tokens(gateway, served) == (served, served), gateway.name
        assert await shared_predictions(gateway) == {"sent": PER_GATEWAY, "received": (GATEWAYS - 1) * PER_GATEWAY,
                                                     "dropped": 0, "ignored": 0}, gateway.name


async def test_without_shared_predictions_the_same_burst_scatters(shared_cluster):
    engines, control, followers = await shared_cluster(followers=2, sims=3, time_scale=1, sim_extra=SLOW_PREFILL,
                                                       state="  share_learning: false\n")
    answers = await burst([control, *followers], seed=1)
    # Each gateway's first request was routed knowing nothing of the prefix, away from the others' load: each
    # engine prefilled it from scratch; each gateway's next request went where its own first one went.
    assert len(cold(answers)) == GATEWAYS and len({a.replica for a in answers}) == GATEWAYS, answers
    assert all(a.cached_tokens > 0 for a in answers[GATEWAYS:]), answers
    assert (await shared_predictions(control))["sent"] == 0


async def test_the_first_turns_of_a_new_prompt_entering_two_gateways_within_milliseconds_share_one_prefill(
        shared_cluster):
    """Four chats under one new system prompt, through two gateways alternately, 20 ms apart (far less than a
    gateway's load report interval): the first with a long question, so that its prefill queued on the holder is
    a little longer than the others' whole prompt. Each gateway's second request sees that queue (its own, or the
    other's once reported) and replicas that look idle: waiting for the prefill under way answers it about as
    soon as computing the whole prompt elsewhere and saves that prefill, so every one goes to the holder and the
    engine prefills the prompt once. (Before the cost model charged a recompute the GPU time it takes, a replica
    that looked idle won that near-tie: a second copy of the prompt, prefilled from scratch.)"""
    engines, control, (follower,) = await shared_cluster(followers=1, sims=4, time_scale=1, sim_extra=SLOW_PREFILL)
    answers = await burst([control, follower], seed=7, count=4, stagger=0.02,
                          question=lambda order: words(Random(order), 300 if order == 0 else 4))
    assert cold(answers) == [answers[0]], answers
    assert {a.replica for a in answers} == {answers[0].replica}, answers


async def test_a_prefix_routed_by_one_gateways_tree_is_known_to_the_others(shared_cluster):
    """prefix_tree learns only from what it routed (no engine events): shared, the second request of a prompt
    finds the first one's replica whichever gateway it enters, and the engine serves it from its cache."""
    engines, control, (follower,) = await shared_cluster(routing="prefix_tree", sims=4)
    async with httpx.AsyncClient(timeout=30) as http:
        for seed in range(3):
            body = {"model": MODEL, "max_tokens": 4,
                    "messages": [{"role": "user", "content": words(Random(100 + seed), 400)}]}
            first = await http.post(control.url + "/v1/chat/completions", json=body)
            assert first.status_code == 200, first.text
            holder = first.headers["x-llmgw-replica"]
            with trio.fail_after(5):
                while (await http.post(follower.control_url + "/admin/explain", json=body)).json()["pick"] != holder:
                    await trio.sleep(0.02)
            second = await http.post(follower.url + "/v1/chat/completions", json=body)
            assert second.headers["x-llmgw-replica"] == holder
            assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_new_prompts_entering_two_gateways_in_turn_are_dealt_out_evenly(shared_cluster):
    """Eight new system prompts, one after another through two gateways in turn, each answered before the next is
    sent: every replica is idle whenever one arrives, so nothing in the momentary load tells them apart. What
    each replica was dealt (every gateway's routes, shared) does: two per replica, whichever gateway routed them.
    (Before, among replicas that looked alike a new prompt went where its first characters hashed, the same in
    every gateway but as uneven as any hash of eight keys over four replicas.)"""
    engines, control, (follower,) = await shared_cluster(followers=1, sims=4)
    gateways = [control, follower]
    replicas: list[str] = []
    async with httpx.AsyncClient(timeout=30) as http:
        for order in range(8):
            body = {"model": MODEL, "max_tokens": 4, "messages": [
                {"role": "system", "content": words(Random(200 + order), 400)},
                {"role": "user", "content": "hello"}]}
            response = await http.post(gateways[order % 2].url + "/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            replicas.append(response.headers["x-llmgw-replica"])
            await trio.sleep(0.3)  # this gateway's route reaches the other (ms), and leaves its own recent window
    assert sorted(Counter(replicas).values()) == [2, 2, 2, 2], replicas
    dealt = 0.0
    for gateway in gateways:
        text = await scrape(gateway.control_url)
        dealt += sum(metric_value(text, "llmgw_routing_new_prefixes_total", f'model="{MODEL}",how="{how}"')
                     for how in ("cheapest", "dealt"))
    assert dealt == 8
