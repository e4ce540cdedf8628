"""What an operator sees of the gateway queue's shedding (issue 31), through a gateway in front of a simulator that
runs one sequence at a time: a request that cannot be served before its deadline is answered 429 on arrival (not at
its deadline), its access line has its class, its wait and the reason, and its key's usage counts it among the
429s; another gateway of the cluster explains it, and believes no record without the cluster secret. Asserted:
statuses, reasons, fields and counts, never durations."""

from __future__ import annotations

import json
import logging
import time

import coredis
import httpx
import pytest
import trio
from test_overload import BATCH, CHAT, LONG, SLOW, chat, config, learnt, queued, until

from llmgw.logfields import FIELDS_ATTRIBUTE
from llmgw.testing.shared_state import state_section
from llmgw.testing.sims import start_sims

pytestmark = pytest.mark.slow


def access_lines(caplog) -> dict[str, dict]:
    """The access lines by request id: some of their fields."""
    lines = {}
    for record in caplog.records:
        if record.name == "llmgw.access":
            fields = getattr(record, FIELDS_ATTRIBUTE)
            lines[fields["request_id"]] = {name: fields[name]
                                           for name in ("class", "queue_wait_ms", "shed", "status", "key")}
    return lines


async def test_a_request_that_cannot_be_served_in_time_is_shed_on_arrival_logged_and_counted(
        gateway_in_process, nursery, caplog):
    caplog.set_level(logging.INFO, "llmgw.access")
    [sim] = await start_sims(nursery, 1, num_blocks=512, extra=("--max-num-seqs", "1", *SLOW))
    gw = await gateway_in_process("access_log: true\ntenancy:\n  usage_flush_interval: 0.2s\n" + config(sim.url))
    async with httpx.AsyncClient() as client:
        await learnt(gw, client)
        async with trio.open_nursery() as requests:
            # A backlog of interactive requests (about 0.6 s each, one at a time) long enough for the drain rate
            # to be measured and trusted (two half-second samples): wait for 4 of them to be dispatched.
            for i in range(12):
                requests.start_soon(chat, client, gw.url, CHAT, f"ahead-{i}")
            await until(gw, lambda m: queued(m, "interactive") >= 6, "the interactive requests were not held")
            await until(gw, lambda m: m["drain_tokens_per_s"] is not None and 4 <= queued(m, "interactive") <= 7,
                        "no drain rate measured while requests waited")
            # Several requests wait ahead of it, each about 0.6 s: it cannot be served within 0.5 s.
            shed = await chat(client, gw.url, CHAT, "hopeless", **{"x-request-deadline": str(time.time() + 0.5)})
            # A batch request waits behind the interactive band.
            requests.start_soon(chat, client, gw.url, BATCH, "patient")
    assert shed.status_code == 429, shed.text
    assert shed.json()["error"]["code"] == "queue_timeout" and int(shed.headers["retry-after"]) >= 1
    explained = (await gw.admin("/admin/explain", params={"request_id": "hopeless"})).json()
    assert (explained["outcome"], explained["reason"], explained["waited_ms"]) == ("shed", "unservable", 0.0)
    assert explained["position"] >= 1 and explained["retry_after"] == int(shed.headers["retry-after"])

    lines = access_lines(caplog)
    assert lines["hopeless"] == {"class": "interactive", "queue_wait_ms": 0.0, "shed": "unservable", "status": 429,
                                 "key": "chat"}
    assert lines["patient"]["class"] == "batch" and lines["patient"]["shed"] is None
    assert lines["patient"]["status"] == 200 and lines["patient"]["queue_wait_ms"] > 0
    waited = [line for name, line in lines.items() if name.startswith("ahead-") and line["queue_wait_ms"]]
    assert waited and all(line["class"] == "interactive" and line["shed"] is None for line in waited)

    # Its key's usage counts the shed among its 429s (its reservation went back: nothing was used).
    async def chat_usage() -> dict:
        answer = await gw.admin("/admin/usage", params={"group_by": "key"})
        assert answer.status_code == 200, answer.text
        return next((row for row in answer.json()["data"] if row["key_name"] == "chat"), {})

    with trio.fail_after(30):
        while (await chat_usage()).get("refused_rate") != 1:
            await trio.sleep(0.1)
    assert (await chat_usage())["answers_2xx"] == 12


async def test_explain_finds_a_request_another_gateway_shed_and_refuses_a_forged_record(
        gateway_in_process, nursery, redis_url, cluster_name):
    [sim] = await start_sims(nursery, 1, num_blocks=512, extra=("--max-num-seqs", "1", *LONG))
    # The interactive class waits 5 ms: behind the batch requests holding the engine, it is shed at the first.
    text = config(sim.url, state=state_section(redis_url, cluster_name)).replace(
        "{name: interactive, rank: 0, max_wait: 60s}", "{name: interactive, rank: 0, max_wait: 5ms}")
    first, second = await gateway_in_process(text), await gateway_in_process(text, role="gateway")
    async with httpx.AsyncClient() as client:
        await learnt(first, client, 6, second)
        async with trio.open_nursery() as requests:
            for i in range(3):
                requests.start_soon(chat, client, first.url, BATCH, f"batch-{i}", 100)
            await until(first, lambda m: queued(m, "batch") >= 1, "the batch requests were not held")
            shed = await chat(client, first.url, CHAT, "shed-at-first")
            assert shed.status_code == 429, shed.text
            requests.cancel_scope.cancel()
    here = (await first.admin("/admin/explain", params={"request_id": "shed-at-first"})).json()
    with trio.fail_after(10):  # written within 2 s, off the request's path
        while (answer := await second.admin("/admin/explain", params={"request_id": "shed-at-first"})).status_code \
                == 404:
            await trio.sleep(0.1)
    assert answer.status_code == 200, answer.text
    there = answer.json()
    assert there.pop("gateway") == first.gateway.shared.origin
    assert there == here and there["outcome"] == "shed" and there["class"] == "interactive"
    assert await first.metric("llmgw_flow_explain_shared_total", 'result="written"') >= 1
    assert await second.metric("llmgw_flow_explain_lookups_total", 'result="found"') == 1

    # Whoever writes to Redis without the cluster secret: a made-up record, and the true one moved to another
    # request's id, are both refused (404), counted and logged.
    key = first.gateway.flow.explained.key
    redis = coredis.Redis.from_url(redis_url, decode_responses=False)
    async with redis:
        true_record = await redis.get(key("shed-at-first"))
        made_up = {**here, "request_id": "made-up", "reason": "overflow"}
        await redis.set(key("made-up"), json.dumps({"r": json.dumps(made_up), "s": "00" * 32}).encode())
        await redis.set(key("moved"), true_record)
    for request_id in ("made-up", "moved"):
        answer = await second.admin("/admin/explain", params={"request_id": request_id})
        assert answer.status_code == 404, answer.text
    assert await second.metric("llmgw_flow_explain_lookups_total", 'result="refused"') == 2
    assert (await second.admin("/admin/explain", params={"request_id": "nobody"})).status_code == 404
    assert await second.metric("llmgw_flow_explain_lookups_total", 'result="missing"') == 1
