"""Overload control in the product (issue 31): a gateway in front of simulators that saturate quickly (one or two
sequences at a time, slow decoding), with keys of different priority classes.

Each test first has the engine say it is full (a warm-up burst the engine queues), so the room has learnt the
replica's capacity; from then on the gateway holds what the engine cannot take. Asserted: orders, counts, statuses
and headers, never durations: an interactive request held behind batch requests is dispatched before them; two
tenants of one class both backlogged get the same tokens within one request's; a request waiting past its
deadline is answered 429 with ``Retry-After``; a full queue sheds; two gateways on one Redis admit as one.
"""

from __future__ import annotations

import json
import logging
import time
from functools import partial

import coredis
import httpx
import pytest
import trio

from llmgw.logfields import FIELDS_ATTRIBUTE
from llmgw.testing.metrics import scrape_value
from llmgw.testing.shared_state import state_section
from llmgw.testing.sims import start_sims

pytestmark = pytest.mark.slow

BATCH, CHAT, OTHER = "sk-batch-000000001", "sk-chat-0000000002", "sk-other-000000003"
SLOW = ("--decode-ms-per-step", "20", "--output-tokens", "30:30")  # about 0.6 s a request
LONG = ("--decode-ms-per-step", "20", "--output-tokens", "100:100")  # about 2 s a request of 100 tokens


def config(url: str, *, flow: str = "", state: str = "") -> str:
    return (f"models:\n  - name: tiny\n    replicas:\n      - url: {url}\n        name: a\n"
            f"api_keys:\n  - {{key: {BATCH}, name: batch, priority: batch}}\n"
            f"  - {{key: {CHAT}, name: chat, priority: interactive}}\n"
            f"  - {{key: {OTHER}, name: other, priority: batch}}\n"
            "flow:\n  classes:\n    - {name: interactive, rank: 0, max_wait: 60s}\n"
            "    - {name: batch, rank: 2, max_wait: 60s}\n  default_class: batch\n"
            # The capacity stays what the engine runs once it said it is full (never raised: no engine's KV usage is
            # below 0.1%), so that what waits at the gateway stays there until a request ends.
            "  kv_target: 0.001\n" + flow +
            "health:\n  interval: 1s\nlog_level: warning\n" + state)


def auth(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


async def chat(client: httpx.AsyncClient, url: str, key: str, request_id: str, max_tokens: int = 30,
               **headers: str) -> httpx.Response:
    return await client.post(url + "/v1/chat/completions", headers=auth(key, **{"x-request-id": request_id},
                                                                          **headers),
                             json={"model": "tiny", "messages": [{"role": "user", "content": "the same prompt"}],
                                   "max_tokens": max_tokens}, timeout=120)


async def flow_status(gw) -> dict:
    answer = await gw.admin("/admin/flow")
    assert answer.status_code == 200, answer.text
    [model] = answer.json()["models"]
    return model


def queued(model: dict, name: str) -> int:
    return next(c["queued"] for c in model["classes"] if c["class"] == name)


async def until(gw, condition, what: str, timeout: float = 60) -> dict:
    """Poll /admin/flow until ``condition(model)``; that model's status."""
    with trio.fail_after(timeout):
        while True:
            model = await flow_status(gw)
            if condition(model):
                return model
            await trio.sleep(0.02)
    raise AssertionError(what)  # unreachable: fail_after raises


async def answered(client: httpx.AsyncClient, gw, finished: list[str], key: str, request_id: str) -> None:
    """One request that must be answered 200; its id appended to ``finished`` when its answer ended."""
    answer = await chat(client, gw.url, key, request_id)
    assert answer.status_code == 200, answer.text
    finished.append(request_id)


async def learnt(gw, client: httpx.AsyncClient, burst: int = 6, *others) -> int:
    """A burst the engine must queue, so that the room (of ``gw`` and of the ``others`` gateways) learns the
    replica's capacity; then wait until it is drained. The capacity ``gw`` learnt."""
    async with trio.open_nursery() as nursery:
        for i in range(burst):
            nursery.start_soon(chat, client, gw.url, BATCH, f"warm-{i}")
        model = await until(gw, lambda m: m["replicas"][0]["capacity"] is not None, "no capacity learnt")
        for other in others:
            await until(other, lambda m: m["replicas"][0]["capacity"] is not None, "no capacity learnt")
    return model["replicas"][0]["capacity"]


async def test_an_interactive_request_held_behind_batch_requests_is_dispatched_first(gateway_in_process, nursery):
    [sim] = await start_sims(nursery, 1, num_blocks=512, extra=("--max-num-seqs", "1", *SLOW))
    gw = await gateway_in_process(config(sim.url))
    finished: list[str] = []  # request ids, in the order their answers ended

    async with httpx.AsyncClient() as client:
        await learnt(gw, client)
        async with trio.open_nursery() as requests:
            for i in range(8):
                requests.start_soon(answered, client, gw, finished, BATCH, f"batch-{i}")
            await until(gw, lambda m: queued(m, "batch") >= 4, "the batch requests were not held")
            requests.start_soon(answered, client, gw, finished, CHAT, "chat")
            held = await until(gw, lambda m: queued(m, "interactive") == 1 or "chat" in finished,
                               "the interactive request was neither held nor answered")
            assert queued(held, "interactive") == 1, "the interactive request was dispatched before it could be seen"
            behind = queued(held, "batch")  # batch requests held at the gateway while the interactive one waited
        assert behind >= 3
        after = finished[finished.index("chat") + 1:]
        assert len([r for r in after if r.startswith("batch-")]) >= behind, finished
        explained = (await gw.admin("/admin/explain", params={"request_id": "chat"})).json()
        assert (explained["class"], explained["flow"], explained["outcome"]) == ("interactive", "chat", "waited")
        assert explained["ahead_class"] is None  # nothing of its class or above waited: it waited for room alone
        waited = [answer.json() for i in range(8)  # those dispatched at once were not kept (404)
                  if (answer := await gw.admin("/admin/explain", params={"request_id": f"batch-{i}"})).status_code
                  == 200]
        assert len(waited) >= behind and all(w["class"] == "batch" and w["outcome"] == "waited" for w in waited)
        assert max(w["position"] for w in waited) >= 1  # what waited ahead of it in its band as it arrived
    assert await gw.metric("llmgw_flow_admitted_total", 'class="interactive"') == 1


async def test_two_tenants_of_one_class_share_by_tokens_when_both_are_backlogged(gateway_in_process, nursery):
    [sim] = await start_sims(nursery, 1, num_blocks=512,
                             extra=("--max-num-seqs", "2", "--decode-ms-per-step", "10", "--output-tokens", "30:30"))
    gw = await gateway_in_process(config(sim.url))
    finished: list[str] = []  # request ids, in the order their answers ended

    async with httpx.AsyncClient() as client:
        await learnt(gw, client)
        async with trio.open_nursery() as requests:
            for i in range(24):  # a burst of one tenant, held at the gateway
                requests.start_soon(answered, client, gw, finished, BATCH, f"burst-{i}")
            await until(gw, lambda m: queued(m, "batch") >= 12, "the burst was not held")
            for i in range(10):  # then the other tenant of the same class
                requests.start_soon(answered, client, gw, finished, OTHER, f"other-{i}")

    # While both were backlogged (from the other tenant's first answer to its last), each got about as many
    # requests (equal tokens each: the same prompt and max_tokens) as the other: within 10%, give or take the one
    # request start-time fair queueing may let one flow be ahead by.
    first = min(i for i, r in enumerate(finished) if r.startswith("other-"))
    last = max(i for i, r in enumerate(finished) if r.startswith("other-"))
    window = finished[first:last + 1]
    burst, other = sum(r.startswith("burst-") for r in window), sum(r.startswith("other-") for r in window)
    assert other == 10
    assert abs(burst - other) <= 1 + other // 10, finished
    assert finished[-1].startswith("burst-")  # the burst's tail ends last: it did not hold the other back


async def test_a_request_waiting_past_its_deadline_gets_429_with_retry_after(gateway_in_process, nursery):
    [sim] = await start_sims(nursery, 1, num_blocks=512, extra=("--max-num-seqs", "1", *LONG))
    # The interactive class waits 5 ms: a batch request holds the engine for about 2 s, and a batch request
    # waits at the gateway, so no room comes free for it within that (but by a 1-in-400 chance).
    gw = await gateway_in_process(config(sim.url).replace("{name: interactive, rank: 0, max_wait: 60s}",
                                                          "{name: interactive, rank: 0, max_wait: 5ms}"))
    async with httpx.AsyncClient() as client:
        await learnt(gw, client)
        async with trio.open_nursery() as requests:
            for i in range(3):
                requests.start_soon(chat, client, gw.url, BATCH, f"batch-{i}", 100)
            await until(gw, lambda m: queued(m, "batch") >= 1, "the batch requests were not held")
            shed = await chat(client, gw.url, CHAT, "chat")
            # A batch request whose own deadline (Unix time) is sooner than the requests ahead of it can end.
            own = await chat(client, gw.url, BATCH, "own-deadline", **{"x-request-deadline": str(time.time() + 0.2)})
            bad = await chat(client, gw.url, BATCH, "bad-deadline", **{"x-request-deadline": "tomorrow"})
    for answer in (shed, own):
        assert answer.status_code == 429, answer.text
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_exceeded", "queue_timeout")
        assert int(answer.headers["retry-after"]) >= 1
        assert answer.headers["x-request-id"] in ("chat", "own-deadline")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_deadline"
    explained = (await gw.admin("/admin/explain", params={"request_id": "chat"})).json()
    assert explained["outcome"] == "shed" and explained["reason"] in ("expired", "unservable")
    assert explained["retry_after"] == int(shed.headers["retry-after"])
    assert await gw.metric("llmgw_flow_shed_total", 'class="interactive"') >= 1
    health = (await gw.admin("/health")).json()  # told in /health, which stays ok: the engines serve all they can
    assert health["status"] == "ok" and health["overloaded"][0]["model"] == "tiny"
    assert sum(health["overloaded"][0]["shed_last_minute"].values()) >= 2
    # The shed request's charge went back: its key's answers recorded as refused, not as usage.
    assert await gw.metric("llmgw_tenant_settled_total", 'basis="nothing"') >= 2


async def test_a_full_queue_sheds_the_newest_of_the_lowest_class_and_a_header_lowers_a_class(gateway_in_process,
                                                                                           nursery):
    [sim] = await start_sims(nursery, 1, num_blocks=512, extra=("--max-num-seqs", "1", *LONG))
    gw = await gateway_in_process(config(sim.url, flow="  max_queued: 3\n"))
    async with httpx.AsyncClient() as client:
        await learnt(gw, client)
        answers: dict[str, httpx.Response] = {}

        async def send(key: str, request_id: str, **headers: str) -> None:
            answers[request_id] = await chat(client, gw.url, key, request_id, 100, **headers)

        async with trio.open_nursery() as requests:
            sent = 0
            while True:  # one at a time, until three wait at the gateway (those before them were dispatched)
                requests.start_soon(send, BATCH, f"held-{sent}")
                sent += 1
                model = await until(gw, lambda m: queued(m, "batch") + m["replicas"][0]["inflight"] >= sent,
                                    "a batch request was neither dispatched nor held")
                if queued(model, "batch") == 3:
                    break
            await send(BATCH, "overflow")  # the fourth: the newest of the lowest class, shed at once
            # An interactive key's request lowered to batch by its header waits as batch: shed as the newest too.
            await send(CHAT, "lowered", **{"x-llmgw-priority": "batch"})
            # An unknown class in the header: 400 naming it.
            await send(CHAT, "unknown", **{"x-llmgw-priority": "urgent"})
    assert [answers[f"held-{i}"].status_code for i in range(sent)] == [200] * sent
    for name in ("overflow", "lowered"):
        answer = answers[name]
        assert answer.status_code == 429, answer.text
        assert answer.json()["error"]["code"] == "queue_full" and int(answer.headers["retry-after"]) >= 1
    assert answers["unknown"].status_code == 400
    assert "'urgent'" in answers["unknown"].json()["error"]["message"]
    explained = (await gw.admin("/admin/explain", params={"request_id": "lowered"})).json()
    assert (explained["class"], explained["reason"]) == ("batch", "overflow")


async def test_two_gateways_on_one_redis_admit_as_one(gateway_in_process, nursery, redis_url, cluster_name):
    [sim] = await start_sims(nursery, 1, num_blocks=512,
                             extra=("--max-num-seqs", "6", *SLOW))
    text = config(sim.url, state=state_section(redis_url, cluster_name))
    gateways = [await gateway_in_process(text), await gateway_in_process(text, role="gateway")]
    first, second = gateways

    def inflight(gw, own: bool = True) -> int:
        """The gateway's own requests in flight on the replica (``own``), or all gateways' as it sees them."""
        return sum(r.local_inflight if own else r.inflight for r in gw.gateway.replicas)

    async with httpx.AsyncClient() as client:
        # Both rooms know the replica is full before the flood: a room that does not yet never holds back.
        capacity = await learnt(first, client, 18, second)
        samples: list[tuple[int, int]] = []  # (both gateways' requests in flight on the replica, its capacity)
        done = trio.Event()

        async def sample() -> None:
            while not done.is_set():
                learnt_now = first.gateway.flow.room.capacity(next(iter(first.gateway.replicas)))
                samples.append((inflight(first) + inflight(second), learnt_now or capacity))
                await trio.sleep(0.01)

        async with trio.open_nursery() as requests:
            for i in range(20):  # the first gateway fills the replica and holds the rest
                requests.start_soon(chat, client, first.url, BATCH, f"first-{i}")
            await until(first, lambda m: queued(m, "batch") > 0, "the first gateway held nothing")
            with trio.fail_after(10):  # until the second gateway's view counts them (the first's load report)
                while inflight(second, own=False) < capacity:
                    await trio.sleep(0.01)
            requests.start_soon(sample)
            for i in range(20):  # then the second gateway's flood: it must wait for the same room
                requests.start_soon(chat, client, second.url, BATCH, f"second-{i}")
            await until(second, lambda m: queued(m, "batch") > 0, "the second gateway held nothing")
            with trio.fail_after(60):
                while inflight(first) + inflight(second) or \
                        queued(await flow_status(first), "batch") or queued(await flow_status(second), "batch"):
                    await trio.sleep(0.05)
            done.set()
    # Each gateway alone would fill the replica to its capacity: together, without sharing, twice that (measured
    # with the room counting only its own gateway's requests: 12 in flight on a capacity of 6, in two runs). Shared,
    # each keeps to its quota of the capacity: their sum stays within it (measured: 6 on 6 in three runs), give or
    # take the one request a gateway with none in flight may send before the other's next load report.
    peak, most = max(inflight for inflight, _ in samples), max(cap for _, cap in samples)
    assert peak <= most + 1, samples


async def test_a_keys_class_from_the_admin_api_the_header_it_may_raise_with_and_a_reload_of_flow(
        gateway_in_process, nursery, tmp_path):
    [sim] = await start_sims(nursery, 1, num_blocks=512, time_scale=0)
    text = config(sim.url) + f"tenancy: {{store: '{tmp_path / 'keys.sqlite3'}'}}\n"
    gw = await gateway_in_process(text)
    refused = await gw.admin("/admin/keys", "POST", json={"name": "x", "priority": "urgnet"})
    assert refused.status_code == 400, refused.text
    assert "no priority class named 'urgnet' under flow.classes" in refused.json()["error"]["message"]
    made = await gw.admin("/admin/keys", "POST", json={"name": "raiser", "priority": "batch",
                                                       "priority_header": True})
    assert made.status_code == 201 and made.json()["priority_header"] is True, made.text
    raiser = made.json()["key"]
    listed = await gw.admin("/admin/keys/raiser")
    assert listed.json()["priority_header"] is True

    async def admitted(cls: str) -> float:
        return await gw.metric("llmgw_flow_admitted_total", f'class="{cls}"')

    async with httpx.AsyncClient() as client:
        with trio.fail_after(10):
            while (await chat(client, gw.url, raiser, "r-0")).status_code == 401:  # the store's keys, followed
                await trio.sleep(0.05)
        before = await admitted("interactive"), await admitted("batch")
        up = await chat(client, gw.url, raiser, "r-1", **{"x-llmgw-priority": "interactive"})  # allowed to raise
        kept = await chat(client, gw.url, BATCH, "b-1", **{"x-llmgw-priority": "interactive"})  # not allowed
        assert up.status_code == kept.status_code == 200
        assert (await admitted("interactive"), await admitted("batch")) == (before[0] + 1, before[1] + 1)
        # No header on it: the answer has no header of overload control either (nothing changes with room).
        assert not any(name.startswith("x-llmgw-priority") or name == "retry-after" for name in up.headers)

        # A reload applies the flow section: another default class, and then flow control off.
        path = gw.gateway.config.source
        with open(path, "w") as file:
            file.write(text.replace("default_class: batch", "default_class: interactive"))
        assert (await gw.gateway.reload()).refusal is None
        assert gw.gateway.dataplane.flow.settings.default_class == "interactive"
        with open(path, "w") as file:
            file.write(text.replace("default_class: batch", "enabled: false\n  default_class: batch"))
        assert (await gw.gateway.reload()).refusal is None
        counted = await admitted("batch")
        assert (await chat(client, gw.url, BATCH, "b-2")).status_code == 200
        assert await admitted("batch") == counted  # off: not asked of the queue
    status = (await gw.admin("/admin/flow")).json()
    assert status["enabled"] is False
    explained = (await gw.admin("/admin/explain", "POST", json={"model": "tiny", "messages": [
        {"role": "user", "content": "hi"}]})).json()
    assert explained["flow"]["model"] == "tiny" and explained["flow"]["enabled"] is False
    assert [c["class"] for c in explained["flow"]["classes"]] == ["interactive", "batch"]
    assert (await gw.admin("/admin/explain")).status_code == 400  # no request id
    assert (await gw.admin("/admin/explain", params={"request_id": "r-1"})).status_code == 404  # routed at once


# -- What an operator sees of the queue's shedding: its log line, usage row and explain across gateways --


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


async def test_usage_rows_of_two_gateways_tell_a_shed_class_from_a_served_one(gateway_in_process, nursery, redis_url,
                                                                              cluster_name):
    """The usage rows carry the class the queue gave each request: the chat key's interactive request shed at one
    gateway and the one served at the other are summed in one (key, class) row in Redis, apart from the batch
    key's answers, and filtered by class, as either gateway's /admin/usage reads them."""
    [sim] = await start_sims(nursery, 1, num_blocks=512, extra=("--max-num-seqs", "1", *SLOW))
    text = ("tenancy:\n  usage_flush_interval: 0.2s\n" + config(sim.url, state=state_section(redis_url, cluster_name))
            ).replace("{name: interactive, rank: 0, max_wait: 60s}", "{name: interactive, rank: 0, max_wait: 5ms}")
    first, second = await gateway_in_process(text), await gateway_in_process(text, role="gateway")
    async with httpx.AsyncClient() as client:
        await learnt(first, client, 6, second)
        async with trio.open_nursery() as requests:
            for i in range(3):
                requests.start_soon(answered, client, first, [], BATCH, f"batch-{i}")
            await until(first, lambda m: queued(m, "batch") >= 1, "the batch requests were not held")
            shed = await chat(client, first.url, CHAT, "shed-at-first")
            assert shed.status_code == 429, shed.text
        with trio.fail_after(10):  # until the second sees the first's requests ended (its load report): room
            while sum(replica.inflight for replica in second.gateway.replicas):
                await trio.sleep(0.01)
        served = await chat(client, second.url, CHAT, "served-at-second")
        assert served.status_code == 200, served.text

    async def usage(gw, **params: str) -> dict[tuple[str, str], dict]:
        answer = await gw.admin("/admin/usage", params={"group_by": "key,class", **params})
        assert answer.status_code == 200, answer.text
        return {(row["key_name"], row["class"]): row for row in answer.json()["data"]}

    def counted(rows: dict[tuple[str, str], dict]) -> bool:
        chat_rows = rows.get(("chat", "interactive"), {})
        return chat_rows.get("refused_rate") == 1 and chat_rows.get("answers_2xx") == 1 and \
            rows.get(("batch", "batch"), {}).get("answers_2xx") == 9

    with trio.fail_after(30):  # each gateway flushes its rows to Redis every 0.2 s
        while not counted(await usage(second)):
            await trio.sleep(0.1)
    for gw in (first, second):
        rows = await usage(gw)
        assert set(rows) == {("chat", "interactive"), ("batch", "batch")}, rows
        assert rows[("chat", "interactive")]["requests"] == 1 and rows[("batch", "batch")]["refused_rate"] == 0
    assert set(await usage(first, **{"class": "batch"})) == {("batch", "batch")}
    assert await usage(first, **{"class": ""}) == {}
    wrong = await first.admin("/admin/usage", params={"group_by": "key,priority"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "group_by"


async def test_the_output_reserved_is_learnt_from_the_answers_and_learning_may_be_turned_off(gateway_in_process,
                                                                                                nursery):
    """Answers that end at their EOS after 20 tokens of a max_tokens of 200: after 32 of them, a request reserves a
    tenth of its max_tokens (llmgw_flow_output_allowance_ratio); with flow.learn_output false, the whole."""
    [sim] = await start_sims(nursery, 1, num_blocks=512, time_scale=0, extra=("--output-tokens", "20:20"))
    learning = await gateway_in_process(config(sim.url))
    whole = await gateway_in_process(config(sim.url, flow="  learn_output: false\n"))

    async def answers(gw, count: int) -> None:
        async with httpx.AsyncClient() as client:
            for i in range(count):
                answer = await chat(client, gw.url, BATCH, f"learn-{i}", max_tokens=200)
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["completion_tokens"] == 20

    async with trio.open_nursery() as both:
        both.start_soon(answers, learning, 31)
        both.start_soon(answers, whole, 32)
    assert await learning.metric("llmgw_flow_output_allowance_ratio", 'model="tiny"') == 1.0  # 31: not yet
    await answers(learning, 1)
    assert await learning.metric("llmgw_flow_output_allowance_ratio", 'model="tiny"') == 0.1
    assert await learning.metric("llmgw_flow_output_allowance_answers_total", 'model="tiny"') == 32
    assert await whole.metric("llmgw_flow_output_allowance_ratio", 'model="tiny"') == 1.0
    assert await whole.metric("llmgw_flow_output_allowance_answers_total", 'model="tiny"') == 32


async def test_three_gateways_learn_from_their_predictions_misses_and_refuse_on_arrival(gateway_in_process, nursery,
                                                                                        redis_url, cluster_name):
    """Three gateways on one Redis in front of an engine of 2 sequences, at several times what it serves:
    interactive requests (10 tokens, about 0.2 s) with 1.5 s deadlines, round-robin over the gateways, beside batch
    streams (100 tokens, about 2 s) that hold the engine's sequences when they get them. The drain rate predicts
    quick waits that the held room and the other gateways' arrivals belie: the first waiters admitted on it are
    shed while they wait or expire. Each gateway learns from them how far off its predictions run (its factor on
    arrival rises above its floor), and the later refusals are mostly answered on arrival, with Retry-After."""
    [sim] = await start_sims(nursery, 1, num_blocks=512, extra=("--max-num-seqs", "2", *LONG))
    text = config(sim.url, state=state_section(redis_url, cluster_name))
    gateways = [await gateway_in_process(text), await gateway_in_process(text, role="gateway"),
                await gateway_in_process(text, role="gateway")]
    refusals: list[tuple[float, str]] = []  # (when sent, how: on arrival, waiting, expired)
    served = 0

    async def interactive(client: httpx.AsyncClient, i: int, started: float) -> None:
        nonlocal served
        sent = trio.current_time() - started
        answer = await chat(client, gateways[i % 3].url, CHAT, f"i-{i}", max_tokens=10,
                            **{"x-request-deadline": str(time.time() + 1.5)})
        if answer.status_code == 200:
            served += 1
            return
        assert answer.status_code == 429 and int(answer.headers["retry-after"]) >= 1, answer.text
        message = answer.json()["error"]["message"]
        how = "waiting" if "found after it waited" in message else "expired" if "it waited" in message else "arrival"
        refusals.append((sent, how))

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=500)) as client:
        await learnt(gateways[0], client, 6, *gateways[1:])
        async with trio.open_nursery() as requests:
            started = trio.current_time()
            for i in range(150):  # 15 s: 10 interactive requests a second, a batch stream every second
                if i % 10 == 0:
                    requests.start_soon(partial(chat, client, gateways[i // 10 % 3].url, BATCH, f"b-{i}",
                                                max_tokens=100))
                requests.start_soon(interactive, client, i, started)
                await trio.sleep(0.1)
        factors = [await scrape_value(gw.control_url, "llmgw_flow_wait_prediction_factor", 'class="interactive"',
                                      client=client) for gw in gateways]
    assert served > 10 and len(refusals) > 30, (served, refusals)
    assert any(factor is not None and factor > 1 / 0.9 for factor in factors), factors
    # Once the gateways have seen their predictions miss (the second half of the sends). Measured on a 2-core
    # machine under other sessions' load (average 20-25): 79-93% on arrival; with a fixed margin of 10% of the
    # deadline instead of the factor, 64%. Each refusal's letter in the order sent: a(rrival), w(aiting), e(xpired)
    order = "".join(how[0] for _, how in sorted(refusals))
    late = [how for sent, how in refusals if sent >= 7.5]
    assert late.count("arrival") >= 0.6 * len(late), order
