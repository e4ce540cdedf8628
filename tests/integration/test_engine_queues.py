"""What an engine's queue waits for, with real processes (llmgw/flow/capacity.py, ``queue_kind``): an ``llmgw sim``
with a small per-step token budget (``--max-num-batched-tokens 32``), so that a long prompt's chunked prefill
takes every step's budget for a while and the requests behind it wait in the engine with seats and KV cache free;
a gateway in this process with flow control, scraping the engine every 100 ms.

Asserted: that queue is counted as one for the budget (``llmgw_flow_engine_queues_total{kind="budget"}``), the
replica's capacity is not cut to what the engine runs, and the gateway holds none of the requests sent meanwhile
(a cut would hold them while the engine has seats and blocks for them); every request is answered. And a request
is counted in the room at its prompt in the engine's tokens (the router's estimate times the learnt ratio), not at
its body's bytes times that ratio: requests the cache holds together are not held at the gateway.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from llmgw.testing.sims import start_sims

pytestmark = pytest.mark.slow

SEATS = 8
# Each word is about 5 prompt tokens in the simulator's tokenizer: 20 words fill a few steps of the budget, 100
# words (~500 tokens) some 16 steps of 20 ms.
SHORT, LONG = 20, 100
WORDS = ("time", "person", "year", "way", "day", "thing", "world", "life", "hand", "part")


def config(url: str) -> str:
    return (f"models:\n  - name: tiny\n    replicas:\n      - url: {url}\n        name: a\n"
            "flow:\n  scrape_interval: 100ms\nhealth:\n  interval: 1s\nlog_level: warning\n")


def prompt(words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(words)) + f" {seed}"


async def chat(client: httpx.AsyncClient, url: str, words: int, seed: int, answers: list[int]) -> None:
    answer = await client.post(url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": prompt(words, seed)}], "max_tokens": 100},
        timeout=120)
    answers.append(answer.status_code)


async def engine_running(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(url + "/metrics")).text
    line = next(line for line in text.splitlines() if line.startswith("vllm:num_requests_running{"))
    return float(line.rsplit(" ", 1)[1])


async def flow_model(gw) -> dict:
    answer = await gw.admin("/admin/flow")
    assert answer.status_code == 200, answer.text
    [model] = answer.json()["models"]
    return model


async def test_a_queue_for_the_steps_token_budget_is_no_reason_to_hold_requests(gateway_in_process, nursery):
    [sim] = await start_sims(nursery, 1, num_blocks=512, extra=(
        "--max-num-seqs", str(SEATS), "--max-num-batched-tokens", "32", "--decode-ms-per-step", "20",
        "--output-tokens", "100:100"))
    gw = await gateway_in_process(config(sim.url))
    answers: list[int] = []
    async with httpx.AsyncClient() as client:
        # The engine is seen running all its seats, one request admitted after another (no queue).
        most = 0.0
        async with trio.open_nursery() as warm:
            for i in range(SEATS):
                warm.start_soon(chat, client, gw.url, SHORT, i, answers)
                await trio.sleep(0.15)
            with trio.fail_after(10):
                while most < SEATS:
                    most = max(most, await engine_running(client, sim.url))
                    await trio.sleep(0.02)
            await trio.sleep(0.3)  # three scrapes of it running them all
        assert (await flow_model(gw))["replicas"][0]["capacity"] is None  # it never queued: nothing learnt
        # Long prompts at once: one prefills a chunk of 32 tokens a step, the others wait behind it in the engine
        # with seats and most of the cache free; more arrive meanwhile (7 in all: never more than the seats).
        held = 0
        async with trio.open_nursery() as long:
            for i in range(5):
                long.start_soon(chat, client, gw.url, LONG, 100 + i, answers)

            async def later() -> None:
                await trio.sleep(1.0)
                for i in range(2):
                    long.start_soon(chat, client, gw.url, LONG, 200 + i, answers)

            long.start_soon(later)
            with trio.move_on_after(3.0):
                while True:
                    model = await flow_model(gw)
                    held = max(held, sum(c["queued"] for c in model["classes"]))
                    await trio.sleep(0.02)
        budget = await gw.metric("llmgw_flow_engine_queues_total", 'model="tiny",kind="budget"')
        full = (await gw.metric("llmgw_flow_engine_queues_total", 'model="tiny",kind="seats"')
                + await gw.metric("llmgw_flow_engine_queues_total", 'model="tiny",kind="blocks"'))
        capacity = (await flow_model(gw))["replicas"][0]["capacity"]
    assert answers == [200] * (SEATS + 7)
    assert held == 0, f"the gateway held {held} requests while the engine had seats and blocks for them"
    assert full == 0 and capacity is None, (budget, full, capacity)
    assert budget >= 1, "the engine never queued for its step's budget: the scenario did not happen"


async def test_a_request_is_counted_at_its_prompt_in_the_engines_tokens_not_its_body_bytes(gateway_in_process,
                                                                                           nursery):
    """A cache of 2,048 tokens; four requests of ~250 prompt tokens and 100 out each fit in it together. Counted at
    their body's bytes scaled by the learnt prompt-token ratio (learnt against characters / 4), each would count
    some 1,100 tokens and the fourth would wait at the gateway."""
    [sim] = await start_sims(nursery, 1, num_blocks=128, extra=(
        "--max-num-seqs", str(SEATS), "--decode-ms-per-step", "20", "--output-tokens", "100:100"))
    gw = await gateway_in_process(config(sim.url))
    answers: list[int] = []
    async with httpx.AsyncClient() as client:
        await chat(client, gw.url, 50, 0, answers)  # an answer's usage teaches the ratio
        ratio = await gw.metric("llmgw_flow_prompt_token_ratio", 'model="tiny"')
        assert ratio > 2, ratio  # the simulator counts about a token per character
        held = 0
        async with trio.open_nursery() as burst:
            for i in range(4):
                burst.start_soon(chat, client, gw.url, 50, 10 + i, answers)
            with trio.move_on_after(1.5):
                while True:
                    model = await flow_model(gw)
                    held = max(held, sum(c["queued"] for c in model["classes"]))
                    await trio.sleep(0.02)
    assert answers == [200] * 5
    assert held == 0, f"the gateway held {held} of 4 requests the engine's cache holds together"
