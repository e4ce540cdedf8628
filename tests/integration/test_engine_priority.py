"""The engine serves the interactive class first (issue 31, vLLM's priority scheduling): a gateway in front of a
simulator that runs one sequence at a time, with the gateway's own queue off, so that every request waits in the
engine, and only the engine's order decides. The order is the engine's own (``GET /debug/first_tokens``: the
order its requests got their first token, with the priority each carried), never the gateway's counters.
"""

from __future__ import annotations

import logging

import httpx
import pytest
import trio

from llmgw.logfields import FIELDS_ATTRIBUTE
from llmgw.testing.sims import start_sims

pytestmark = pytest.mark.slow

BATCH, CHAT, TRUSTED = "sk-batch-000000001", "sk-chat-0000000002", "sk-trust-000000003"
SLOW = ("--max-num-seqs", "1", "--decode-ms-per-step", "20", "--output-tokens", "20:20", "--debug-routes")


def config(url: str, policy: str) -> str:
    return (f"models:\n  - name: tiny\n    replicas:\n      - url: {url}\n        name: a\n"
            f"        scheduling_policy: {policy}\n"
            f"api_keys:\n  - {{key: {BATCH}, name: batch, priority: batch}}\n"
            f"  - {{key: {CHAT}, name: chat, priority: interactive}}\n"
            f"  - {{key: {TRUSTED}, name: trusted, priority: batch, priority_header: true}}\n"
            "flow:\n  enabled: false\n  classes:\n    - {name: interactive, rank: 0, max_wait: 60s}\n"
            "    - {name: batch, rank: 2, max_wait: 60s, engine_priority: 7}\n  default_class: batch\n"
            "health:\n  interval: 1s\nlog_level: warning\naccess_log: true\n")


async def chat(client: httpx.AsyncClient, url: str, key: str, ids: dict[str, str], name: str,
               body: dict | None = None) -> None:
    """One request that must be answered 200; ``ids[engine request id] = name``."""
    answer = await client.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"model": "tiny", "messages": [{"role": "user", "content": name}],
                                     "max_tokens": 20, **(body or {})}, timeout=120)
    assert answer.status_code == 200, answer.text
    ids[answer.json()["id"].removeprefix("chatcmpl-")] = name


async def engine_waiting(client: httpx.AsyncClient, sim_url: str) -> int:
    probe = await client.post(sim_url + "/debug/prefix_hit", json={"model": "tiny", "prompt": "x"})
    return probe.json()["waiting"]


async def served_order(gw_url: str, sim_url: str, late: list[tuple[str, str, dict]]) -> list[dict]:
    """Four batch requests the engine queues (one runs, three wait in it), then the ``late`` ones (key, name,
    body extras); the engine's first tokens in its order, each with its name."""
    ids: dict[str, str] = {}
    async with httpx.AsyncClient() as client:
        async with trio.open_nursery() as requests:
            for i in range(4):
                requests.start_soon(chat, client, gw_url, BATCH, ids, f"batch-{i}")
            with trio.fail_after(30):
                while await engine_waiting(client, sim_url) < 3:
                    await trio.sleep(0.01)
            for key, name, extra in late:
                requests.start_soon(chat, client, gw_url, key, ids, name, extra)
        first_tokens = (await client.get(sim_url + "/debug/first_tokens")).json()["first_tokens"]
    return [{**token, "name": ids[token["request_id"]]} for token in first_tokens if token["request_id"] in ids]


def logged_priorities(caplog) -> list[int | None]:
    """The ``engine_priority`` field of every access line, in their order."""
    return [getattr(record, FIELDS_ATTRIBUTE)["engine_priority"] for record in caplog.records
            if record.name == "llmgw.access"]


async def test_an_interactive_request_overtakes_the_batch_requests_waiting_in_the_engine(gateway_in_process,
                                                                                          nursery, caplog):
    caplog.set_level(logging.INFO, "llmgw.access")
    [sim] = await start_sims(nursery, 1, num_blocks=512, extra=(*SLOW, "--scheduling-policy", "priority"))
    gw = await gateway_in_process(config(sim.url, "priority"))
    served = await served_order(gw.url, sim.url, [(CHAT, "chat", {})])
    names = [token["name"] for token in served]
    # after the batch request running when it came, before the three waiting (the batch ones arrive in any order)
    assert names[1] == "chat" and sorted(names[:1] + names[2:]) == [f"batch-{i}" for i in range(4)], names
    assert {token["name"]: token["priority"] for token in served} == {
        "chat": 0, **{f"batch-{i}": 7 for i in range(4)}}  # its class's rank; batch's engine_priority
    assert await gw.metric("llmgw_engine_priority_requests_total", 'class="interactive"') == 1
    assert await gw.metric("llmgw_engine_priority_requests_total", 'class="batch"') == 4
    assert sorted(logged_priorities(caplog)) == [0, 7, 7, 7, 7]


async def test_without_priority_scheduling_the_same_request_waits_its_turn(gateway_in_process, nursery, caplog):
    """The control arm: the same engine and load in fcfs; the gateway sends no priority (vLLM would refuse it)."""
    caplog.set_level(logging.INFO, "llmgw.access")
    [sim] = await start_sims(nursery, 1, num_blocks=512, extra=SLOW)
    gw = await gateway_in_process(config(sim.url, "fcfs"))
    served = await served_order(gw.url, sim.url, [(CHAT, "chat", {})])
    names = [token["name"] for token in served]
    assert sorted(names[:4]) == [f"batch-{i}" for i in range(4)] and names[4] == "chat", names
    assert {token["priority"] for token in served} == {0}
    assert await gw.metric("llmgw_engine_priority_requests_total") == 0
    assert logged_priorities(caplog) == [None] * 5


async def test_a_clients_own_priority_counts_only_if_its_key_may_raise_and_never_above_its_class(
        gateway_in_process, nursery):
    [sim] = await start_sims(nursery, 1, num_blocks=512, extra=(*SLOW, "--scheduling-policy", "priority"))
    gw = await gateway_in_process(config(sim.url, "priority"))
    served = await served_order(gw.url, sim.url, [
        (BATCH, "batch-asks-first", {"priority": -100}),  # may not raise: replaced by its class's 7
        (TRUSTED, "trusted-asks-first", {"priority": -100}),  # may raise, but not above its class: 7
        (TRUSTED, "trusted-lowers", {"priority": 9}),  # a lower priority it may ask for: kept
        (CHAT, "chat-asks-last", {"priority": 50}),  # may not change it: its class's 0
    ])
    priorities = {token["name"]: token["priority"] for token in served}
    assert priorities["batch-asks-first"] == priorities["trusted-asks-first"] == 7
    assert priorities["trusted-lowers"] == 9 and priorities["chat-asks-last"] == 0
    names = [token["name"] for token in served]
    assert names[0].startswith("batch-") and names[1] == "chat-asks-last" and names[-1] == "trusted-lowers", names
